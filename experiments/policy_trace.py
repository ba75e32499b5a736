#!/usr/bin/env python
"""What `dflash-adaptive`'s width policy prices against what its steps cost: plain decoding and the adaptive chain
on the same user prompts (interleaved per prompt, one seed per prompt), each step timed and grouped by the width the
policy chose, beside the policy's own prices (the calibrated verify cost per width, the draft call's price).

    .venv/bin/python experiments/policy_trace.py --temperature 0.8 --n 4 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

from blockdraft.config import GenerationConfig, SamplingParams
from blockdraft.decode.spec import DecodeSpec, build_engine
from blockdraft.models.loading import encode_prompt, load_draft, load_target, resolve_draft
from blockdraft.prompts import load_task


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None, help="DFlash draft directory (default: the target's shipped one)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--n", type=int, default=4, help="prompts per user-* task")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    target, src = load_target(args.target, "bf16")
    draft = load_draft(resolve_draft(args.draft, src.name), target)
    engines = {"ar": build_engine(target, None, DecodeSpec("ar")),
               "dflash-adaptive": build_engine(target, draft, DecodeSpec("dflash-adaptive"))}
    steps = {k: defaultdict(list) for k in engines}  # method -> chosen width -> [(seconds, committed)]
    prices = {"draft_ms": []}
    for name, eng in engines.items():
        def timed(events, eng=eng, inner=eng._decode_step, name=name):
            row = eng._active[0]
            before = len(row.stats.accept_lengths)
            t0 = time.perf_counter()
            inner(events)
            dt = time.perf_counter() - t0
            if len(row.stats.accept_lengths) > before:
                steps[name][row.width.widths[-1] if row.width.widths else 0].append((dt, row.stats.accept_lengths[-1]))
                if row.width.adaptive:
                    prices["verify_ms"] = [1e3 * row.width.verify_cost.chain(w) for w in range(1, row.block + 1)]
                    prices["draft_ms"].append(1e3 * (row.width.draft_seconds.value or 0.0))
        eng._decode_step = timed
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    for task in ("user-code", "user-chat", "user-math"):
        for i, p in enumerate(load_task(task, n=args.n, seed=0)):
            ids = encode_prompt(target.tokenizer, p.messages)
            for eng in engines.values():
                eng.generate(ids, cfg, SamplingParams(args.temperature, 1.0, 0, 1000 + i))
    out = {"target": src.name, "temperature": args.temperature, "n": args.n,
           "priced_verify_ms_by_width": [round(v, 2) for v in prices.get("verify_ms", [])],
           "priced_draft_ms_median": round(statistics.median(prices["draft_ms"]), 2) if prices["draft_ms"] else None,
           "steps": {}}
    for name, by_width in steps.items():
        secs = sum(d for v in by_width.values() for d, _ in v)
        toks = sum(a for v in by_width.values() for _, a in v)
        out["steps"][name] = {"ms_per_token": round(1e3 * secs / toks, 3), "by_width": {
            g: {"steps": len(v), "mean_ms": round(1e3 * statistics.mean(d for d, _ in v), 2),
                "tokens_per_step": round(statistics.mean(a for _, a in v), 3),
                "ms_per_token": round(1e3 * sum(d for d, _ in v) / sum(a for _, a in v), 3)}
            for g, v in sorted(by_width.items())}}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
