#!/usr/bin/env python
"""Draft cost curve (the paper's Figure 3): wall time to draft N tokens, N = 1..15, on the default target's sizes.

- eagle: the EAGLE-3 drafter, N sequential steps (the first also turns the one newly verified row into cached K/V,
  as every real proposal does);
- dflash-L{1,3,5}: DFlash drafts with 1, 3 and 5 layers, one forward over a block of N+1.
Each drafter sits behind its real proposer (draft forward + the target's LM head + argmax) with `--context`
positions already in its cache. Weights are untrained (timing does not depend on them), bf16, `--threads` torch
threads. Warm-up calls are excluded; the methods are interleaved in a rotating order inside every repeat so machine
drift hits them alike; the median over repeats is reported with the min and max.

    .venv/bin/python experiments/draft_cost_curve.py --threads 1 --repeats 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from blockdraft.config import SamplingParams
from blockdraft.models.draft import DFlashDraftModel
from blockdraft.models.draft_config import DFlashConfig
from blockdraft.models.eagle import EagleConfig, EagleDraftModel
from blockdraft.eval.machine import machine_info
from blockdraft.eval.timing import measure
from blockdraft.models.loading import default_mask_token_id, load_target
from blockdraft.decode.spec import DecodeSpec, build_engine
from blockdraft.decode.tree import Tree

GREEDY = SamplingParams()


class EagleCase:
    """Before each timed call: cache rows 0..ctx-2, one queued verified row (ctx-1), ctx committed + 1 token."""

    def __init__(self, target, ctx: int, max_n: int, tokens: torch.Tensor) -> None:
        draft = EagleDraftModel(EagleConfig.from_target(target.config)).init_from_target(target).to(target.dtype)
        # the proposer `--method eagle` builds, drafting up to max_n tokens
        self.prop = build_engine(target, draft.eval(), DecodeSpec("eagle", block_size=max_n + 1)).proposer
        feats = torch.randn(1, ctx, 3 * target.hidden_size, dtype=target.dtype)
        self.last = feats[:, -1:]
        self.tokens = tokens
        self.prop.start(tokens[:-1], feats)
        self.prop.propose(tokens, 1, GREEDY, None)  # turns the prompt's rows into cached K/V once
        self.ctx = ctx

    def __call__(self, n: int) -> float:
        self.prop.cache.crop(self.ctx - 1)
        self.prop.accept(Tree.chain(self.tokens[-1], self.tokens[:0]), [0], self.last)
        t0 = time.perf_counter()
        out = self.prop.propose(self.tokens, n, GREEDY, None)
        dt = time.perf_counter() - t0
        assert out.num_nodes == n + 1
        return dt


class DFlashCase:
    def __init__(self, target, layers: int, ctx: int, max_n: int, tokens: torch.Tensor) -> None:
        cfg = DFlashConfig.from_target(target.config, num_hidden_layers=layers, block_size=max_n + 1,
                                       mask_token_id=default_mask_token_id(target.tokenizer, target.vocab_size))
        draft = DFlashDraftModel(cfg).init_from_target(target).to(target.dtype).eval()
        # the proposer `--method dflash` builds, on the draft's float weights
        self.prop = build_engine(target, draft, DecodeSpec("dflash", draft_weights="bf16")).proposer
        feats = torch.randn(1, ctx, cfg.num_target_features * target.hidden_size, dtype=target.dtype)
        self.prop.start(tokens[:-1], feats)
        self.tokens = tokens

    def __call__(self, n: int) -> float:
        t0 = time.perf_counter()
        out = self.prop.propose(self.tokens, n, GREEDY, None)
        dt = time.perf_counter() - t0
        assert out.num_nodes == n + 1
        return dt


def write_outputs(out: Path, times: dict, config: dict) -> None:
    summary = {m: {str(n): {"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts),
                            "max_ms": 1e3 * max(ts)} for n, ts in per_n.items()} for m, per_n in times.items()}
    out.mkdir(parents=True, exist_ok=True)
    results = {"config": config, "machine": machine_info(), "summary": summary,
               "samples_ms": {m: {str(n): [1e3 * t for t in ts] for n, ts in per_n.items()}
                              for m, per_n in times.items()}}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    methods = list(times)
    ns = list(next(iter(times.values())))
    lines = ["# Draft cost: wall time to draft N tokens", "",
             f"Target sizes: {config['target']} ({config['dtype']}), {config['context']} cached context positions, "
             f"{config['threads']} torch thread(s), median of {config['repeats']} interleaved repeats "
             f"(warm-up {config['warmup']} excluded), milliseconds [min–max]. Machine: {results['machine']['cpu']}.",
             "", "| N | " + " | ".join(methods) + " |", "|---:|" + "---:|" * len(methods)]
    for n in ns:
        cells = [f"{summary[m][str(n)]['median_ms']:.2f} [{summary[m][str(n)]['min_ms']:.2f}–"
                 f"{summary[m][str(n)]['max_ms']:.2f}]" for m in methods]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "![draft cost](draft_cost.png)", ""]
    (out / "report.md").write_text("\n".join(lines), encoding="utf-8")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        med = [summary[m][str(n)]["median_ms"] for n in ns]
        lo = [med[i] - summary[m][str(n)]["min_ms"] for i, n in enumerate(ns)]
        hi = [summary[m][str(n)]["max_ms"] - med[i] for i, n in enumerate(ns)]
        ax.errorbar(ns, med, yerr=[lo, hi], marker="o", ms=3, capsize=2, label=m)
    ax.set_xlabel("draft tokens N")
    ax.set_ylabel("drafting time (ms, median)")
    ax.set_title(f"draft cost, {config['target']} sizes, {config['threads']} thread(s)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "draft_cost.png", dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--context", type=int, default=256, help="positions already in the drafts' caches")
    ap.add_argument("--max-n", type=int, default=15)
    ap.add_argument("--dflash-layers", default="1,3,5")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/draft-cost")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    target, src = load_target(None, "bf16")
    tokens = torch.randint(0, target.vocab_size, (args.context + 1,))
    cases = {"eagle": EagleCase(target, args.context, args.max_n, tokens)}
    for layers in (int(x) for x in args.dflash_layers.split(",")):
        cases[f"dflash-L{layers}"] = DFlashCase(target, layers, args.context, args.max_n, tokens)
    times = measure(cases, args.max_n, args.repeats, args.warmup)
    config = {"target": src.name, "dtype": "bf16", "context": args.context, "threads": args.threads,
              "repeats": args.repeats, "warmup": args.warmup, "max_n": args.max_n, "seed": args.seed,
              "command": " ".join(["experiments/draft_cost_curve.py"] + sys.argv[1:])}
    write_outputs(Path(args.out), times, config)
    for m, per_n in times.items():
        print(m, " ".join(f"{1e3 * statistics.median(ts):.1f}" for ts in per_n.values()), "ms")
    print(f"wrote {args.out}/results.json, report.md, draft_cost.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
