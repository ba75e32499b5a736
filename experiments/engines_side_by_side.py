#!/usr/bin/env python
"""The draft's time per step of a DFlash method when other engines share the process, as in `blockdraft bench`:
the given methods' engines built on one target and one loaded draft, run prompt by prompt on the bench's user
prompts, each method's draft / verify seconds per verify step and tau from its own stats. Run it once with one
method and once with several to see what the neighbours cost.

    .venv/bin/python experiments/engines_side_by_side.py --target qwen2.5-coder-1.5b --methods dflash-tree
    .venv/bin/python experiments/engines_side_by_side.py --target qwen2.5-coder-1.5b \
        --methods dflash-tree,dflash-adaptive
"""

from __future__ import annotations

import argparse
import json

import torch

from blockdraft.config import GenerationConfig
from blockdraft.decode.spec import DecodeSpec, build_engine
from blockdraft.models.loading import encode_prompt, load_draft, load_target, resolve_draft
from blockdraft.prompts import load_task


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None, help="DFlash draft directory (default: the target's shipped one)")
    ap.add_argument("--methods", default="dflash-tree", help="comma list, run in this order for every prompt")
    ap.add_argument("--n", type=int, default=3, help="prompts per user-* task")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    target, src = load_target(args.target, "bf16")
    draft = load_draft(resolve_draft(args.draft, src.name), target)
    # keyed by method#position: the same method twice is two engines, as two drafts' engines are in the bench
    engines = {f"{m}#{i}": build_engine(target, draft, DecodeSpec(m)) for i, m in enumerate(args.methods.split(","))}
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    sums = {m: {"steps": 0, "draft_s": 0.0, "verify_s": 0.0, "tokens": 0} for m in engines}
    for task in ("user-code", "user-chat", "user-math"):
        for p in load_task(task, n=args.n, seed=0):
            ids = encode_prompt(target.tokenizer, p.messages)
            for m, eng in engines.items():
                s = eng.generate(ids, cfg).stats
                c = sums[m]
                c["steps"] += len(s.accept_lengths)
                c["draft_s"] += s.draft_seconds
                c["verify_s"] += s.verify_seconds
                c["tokens"] += s.new_tokens
    print(json.dumps({"target": src.name, "methods": args.methods, "per_step": {
        m: {"draft_ms": round(1e3 * c["draft_s"] / c["steps"], 2),
            "verify_ms": round(1e3 * c["verify_s"] / c["steps"], 2),
            "tau": round(c["tokens"] / c["steps"], 3), "steps": c["steps"]} for m, c in sums.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
