"""Learning curves of fast-training runs (their curve.jsonl) against the reference predictors (probes.json):
held-out position-1 accuracy and implied tau (decode block 4) vs training minutes and block rows seen, and the
replayed-decoding tau (`walk_tau`) where a run logged it.

    blockdraft plot --probes P.json --run NAME=runs/x/curve.jsonl ... --out curves.png
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


@dataclass(frozen=True)
class PlotConfig:
    """`blockdraft plot`: runs as (name, path of its curve.jsonl) pairs, the image written (out), and the reference
    predictors' probes.json drawn beside them (None: none)."""

    runs: tuple[tuple[str, str], ...]
    out: str
    probes: str | None = None


def run(cfg: PlotConfig) -> int:
    """`blockdraft plot`: the curves of cfg.runs and cfg.probes into the image cfg.out."""
    fig, ax = plt.subplots(1, 4, figsize=(22, 4.8))
    for name, path in cfg.runs:
        rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
        mins = [r["minutes"] for r in rows]
        acc1 = [100 * r["acc"][0] for r in rows]
        ax[0].plot(mins, acc1, marker=".", label=name)
        ax[1].plot([r["rows"] / 1e6 for r in rows], acc1, marker=".", label=name)
        ax[2].plot(mins, [r.get("tau4", float("nan")) for r in rows], marker=".", label=name)
        walk = [(r["rows"] / 1e6, r["walk_tau"]) for r in rows if "walk_tau" in r]
        if walk:
            ax[3].plot(*zip(*walk), marker=".", label=name)
    if cfg.probes:
        pr = json.loads(Path(cfg.probes).read_text())
        for kind, style in (("bigram", ":"), ("feature", "--")):
            best = 100 * max(c["acc1"] for c in pr[kind])
            for a in ax[:2]:
                a.axhline(best, color="gray", linestyle=style, label=f"{kind} probe ({best:.1f}%)")
    ax[0].set(xlabel="training minutes (shared machine; threads in the table)",
              ylabel="held-out position-1 accuracy (%)")
    ax[1].set(xlabel="block rows seen (millions)", ylabel="held-out position-1 accuracy (%)")
    ax[2].set(xlabel="training minutes", ylabel="implied tau at decode block 4")
    ax[3].set(xlabel="block rows seen (millions)", ylabel="replayed greedy decoding tau (walk, block 4)")
    for a in ax:
        a.grid(alpha=0.3)
    ax[0].legend(fontsize=7)
    fig.tight_layout()
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(cfg.out, dpi=110)
    return 0
