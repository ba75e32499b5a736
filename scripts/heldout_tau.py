#!/usr/bin/env python
"""Held-out tau of several drafts (DFlash or EAGLE) for the default target: greedy, bf16, the real engine, on the
prompts of the held-out regenerated split (never trained on). The same prompts and settings for every draft, so
checkpoints of different depths or steps compare directly.

    .venv/bin/python scripts/heldout_tau.py --draft l2@500=runs/snapshots/l2-step-0000500 \
        --draft l5@500=runs/snapshots/l5-step-0000500-resumed --prompts 12 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from blockdraft.config import GenerationConfig
from blockdraft.loading import build_engine, load_target
from blockdraft.train.data import load_packed, read_shards
from blockdraft.train.trainer import prompt_of

HELDOUT = Path("data/work/regen-smollm2/shards-heldout")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", action="append", required=True, metavar="NAME=DIR")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="append the results as JSON lines to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_target(None, "bf16")
    # the regeneration's held-out shards, or their packed copy in a fresh checkout (the same records, same order)
    held = list(read_shards(HELDOUT)) if HELDOUT.is_dir() else load_packed("data/smollm2-regen/heldout.npz")
    prompts = [prompt_of(r) for r in held[: args.prompts]]
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    rows = []
    for spec in args.draft:
        name, _, path = spec.partition("=")
        eng = build_engine(target, Path(path))
        steps = committed = 0
        first = [0, 0]  # accepted / verified at draft position 1
        for p in prompts:
            s = eng.generate(p, cfg).stats
            steps += len(s.accept_lengths)
            committed += sum(s.accept_lengths)
            if s.position_trials:
                first[0] += s.position_accepted[0]
                first[1] += s.position_trials[0]
        row = {"draft": name, "path": path, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
               "tau": committed / max(1, steps), "position1_acceptance": first[0] / max(1, first[1])}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
