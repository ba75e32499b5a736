"""The data-scaling curve of this round as a figure: held-out tau (user-* prompts) against the answers trained on,
at decode blocks 4, 8 and 16, the shipped draft as the level to beat. Reads heldout-tau.jsonl beside this file."""

import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = Path(__file__).parent
sizes = {"c2000": 2000, "c8000": 8000, "r11": 30504}
tau: dict = defaultdict(dict)
for line in (here / "heldout-tau.jsonl").read_text().splitlines():
    d = json.loads(line)
    tau[(d["set"], d["block_size"])][d["draft"]] = d["tau"]
fig, axes = plt.subplots(1, 3, figsize=(14, 3.8), sharey=True)
for ax, block in zip(axes, (4, 8, 16)):
    for k, s in enumerate(("user-math", "user-code", "user-chat")):
        row = tau.get((s, block), {})
        xs = [n for d, n in sizes.items() if d in row]
        color = f"C{k}"
        ax.plot(xs, [row[d] for d in sizes if d in row], "o-", color=color, label=s)
        if "shipped" in row:
            ax.axhline(row["shipped"], color=color, ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xticks(list(sizes.values()), [f"{n:,}" for n in sizes.values()])
    ax.minorticks_off()
    ax.set_xlabel("answers trained on (1.13 epochs, continuing the shipped draft)")
    ax.set_title(f"decode block {block} (dotted: the shipped draft)")
    ax.grid(alpha=0.3)
axes[0].set_ylabel("held-out tau (12 prompts x 96 tokens)")
axes[0].legend()
fig.tight_layout()
fig.savefig(here / "curve.png", dpi=110)
print("wrote", here / "curve.png")
