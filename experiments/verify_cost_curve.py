#!/usr/bin/env python
"""Verify cost curve: what one target forward over N new tokens costs, relative to N = 1 (N = 1..16), in our engine
and in llama.cpp, on the default target.

Speculative decoding pays off only while verifying N tokens costs little more than decoding one. The two engines
differ most here: llama.cpp's single-token step is fast, its batched step much less so on this CPU; our engine
(PyTorch bf16 GEMMs) is slower per token but nearly flat in N.

- blockdraft: the lean target path (bf16) over N tokens after `--context` cached positions, all N logits, the
  default draft's layers tapped (exactly the engine's verify forward), then the cache cropped back;
- llama.cpp Q4_1 / bf16: llama-cpp-python (`make llamacpp`) on the packaged GGUF and on its bf16 export
  (`blockdraft export --format gguf --out FILE`), logits for all N positions (what a verify reads), after the
  same context, the KV cache cut back between calls. Skipped with a note when llama-cpp-python is missing.
Warm-up calls are excluded; the engines are interleaved in a rotating order inside every repeat; medians over the
repeats with their min and max. Both engines run `--threads` threads.

    .venv/bin/python experiments/verify_cost_curve.py --threads 2 --repeats 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from blockdraft.eval.machine import machine_info
from blockdraft.models.loading import DEFAULT_DRAFTS, load_target, packaged_models_dir
from blockdraft.eval.timing import measure  # the same interleaved measuring loop as the draft cost curve


class EngineCase:
    """Our target's verify forward: `ctx` positions cached, N tokens in, N logits and the tapped features out."""

    def __init__(self, target, ctx: int, tokens: torch.Tensor, layer_ids) -> None:
        target.set_layer_ids(layer_ids)
        self.target, self.ctx, self.tokens = target, ctx, tokens
        self.cache = target.new_decode_cache(ctx + 64)
        target.forward(tokens[:ctx].unsqueeze(0), self.cache, last_only=True, tap=True)

    def __call__(self, n: int) -> float:
        self.cache.crop(self.ctx)
        ids = self.tokens[self.ctx:self.ctx + n].unsqueeze(0)
        t0 = time.perf_counter()
        out = self.target.forward(ids, self.cache, tap=True)
        dt = time.perf_counter() - t0
        assert out.logits.shape[1] == n
        return dt


class LlamaCppCase:
    """llama.cpp (llama-cpp-python) on a GGUF: `ctx` positions evaluated once, then N tokens with all N logits."""

    def __init__(self, gguf: Path, threads: int, ctx: int, tokens: torch.Tensor) -> None:
        from llama_cpp import Llama

        self.llm = Llama(str(gguf), n_ctx=ctx + 64, n_threads=threads, n_threads_batch=threads, logits_all=True,
                         verbose=False)
        self.ctx, self.tokens = ctx, tokens.tolist()
        self.llm.eval(self.tokens[:ctx])

    def __call__(self, n: int) -> float:
        self.llm.n_tokens = self.ctx  # eval() first drops the KV cells past n_tokens
        t0 = time.perf_counter()
        self.llm.eval(self.tokens[self.ctx:self.ctx + n])
        return time.perf_counter() - t0


def write_outputs(out: Path, times: dict, config: dict, notes: list[str]) -> None:
    ns = list(next(iter(times.values())))
    summary = {}
    for m, per_n in times.items():
        one = statistics.median(per_n[1])
        summary[m] = {str(n): {"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts),
                               "max_ms": 1e3 * max(ts), "ratio": statistics.median(ts) / one}
                      for n, ts in per_n.items()}
    out.mkdir(parents=True, exist_ok=True)
    results = {"config": config, "machine": machine_info(), "notes": notes, "summary": summary,
               "samples_ms": {m: {str(n): [1e3 * t for t in ts] for n, ts in per_n.items()}
                              for m, per_n in times.items()}}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    methods = list(times)
    lines = ["# Verify cost: one target forward over N tokens, relative to N = 1", "",
             f"Target: {config['target']}; {config['context']} cached positions, {config['threads']} thread(s), "
             f"median of {config['repeats']} interleaved repeats (warm-up {config['warmup']} excluded). Cells: cost "
             f"ratio (median ms). Machine: {results['machine']['cpu']}. Command: `{config['command']}`.", ""]
    lines += [f"> note: {n}" for n in notes] + ([""] if notes else [])
    lines += ["| N | " + " | ".join(methods) + " |", "|---:|" + "---:|" * len(methods)]
    for n in ns:
        cells = [f"{summary[m][str(n)]['ratio']:.2f}× ({summary[m][str(n)]['median_ms']:.1f} ms)" for m in methods]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "![verify cost](verify_cost.png)", ""]
    (out / "report.md").write_text("\n".join(lines), encoding="utf-8")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        ax.plot(ns, [summary[m][str(n)]["ratio"] for n in ns], marker="o", ms=3, label=m)
    ax.set_xlabel("tokens per target forward N")
    ax.set_ylabel("cost of N / cost of 1 (median)")
    ax.set_title(f"verify cost, {config['target']}, {config['threads']} thread(s)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "verify_cost.png", dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--context", type=int, default=256, help="positions already in the caches")
    ap.add_argument("--max-n", type=int, default=16)
    ap.add_argument("--bf16-gguf", default=None, help="bf16 GGUF of the target (default: exported once, cached)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/verify-cost")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, src = load_target(None, "bf16")
    g = torch.Generator().manual_seed(args.seed)
    # ids from the ordinary vocabulary (above the special tokens); the cost does not depend on which
    tokens = torch.randint(100, target.vocab_size, (args.context + args.max_n,), generator=g)
    draft_cfg = json.loads((packaged_models_dir() / DEFAULT_DRAFTS[src.name] / "config.json").read_text())
    cases = {"blockdraft (bf16)": EngineCase(target, args.context, tokens,
                                             draft_cfg["dflash_config"]["target_layer_ids"])}
    notes: list[str] = []
    from blockdraft.eval.external import llamacpp_available

    why = llamacpp_available()
    if why is None:
        from blockdraft.eval.llamacpp_server import bf16_gguf

        q4 = Path(src.path) / src.gguf_file
        cases["llama.cpp (Q4_1)"] = LlamaCppCase(q4, args.threads, args.context, tokens)
        cases["llama.cpp (bf16)"] = LlamaCppCase(bf16_gguf(None, args.bf16_gguf), args.threads, args.context,
                                                 tokens)
    else:
        notes.append(f"llama.cpp skipped: {why}")
    with torch.no_grad():
        times = measure(cases, args.max_n, args.repeats, args.warmup)
    config = {"target": src.name, "context": args.context, "threads": args.threads, "repeats": args.repeats,
              "warmup": args.warmup, "max_n": args.max_n, "seed": args.seed,
              "command": " ".join(["experiments/verify_cost_curve.py"] + sys.argv[1:])}
    write_outputs(Path(args.out), times, config, notes)
    for m, per_n in times.items():
        one = statistics.median(per_n[1])
        print(f"{m:>18}:", " ".join(f"{statistics.median(ts) / one:.2f}" for ts in per_n.values()))
    for n in notes:
        print("note:", n)
    print(f"wrote {args.out}/results.json, report.md, verify_cost.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
