#!/usr/bin/env python
"""Held-out tau of several drafts (DFlash or EAGLE) for the default target: greedy, bf16, the real engine, on
prompts never trained on. The same prompts and settings for every draft, so checkpoints of different depths or steps
compare directly.

Prompt sets (`--set`):
- `regen` (default, the ship criterion): the prompts of the held-out regenerated split (mostly ShareGPT turns).
- `gsm-unseen`: GSM-style problems from the gsm_symbolic templates that training never uses (the half the math
  benchmark draws from), instantiated with another seed, any question equal to a benchmark item removed. The held-out
  regenerated math shares its templates with training, so it cannot show how a draft does on unseen problem
  wording; this set can, without touching the benchmark's items.

    .venv/bin/python scripts/heldout_tau.py --draft l2@500=runs/snapshots/l2-step-0000500 \
        --draft l5@500=runs/snapshots/l5-step-0000500-resumed --prompts 12 --max-new-tokens 96
    .venv/bin/python scripts/heldout_tau.py --set gsm-unseen --draft old=models/smollm2-135m-dflash --prompts 24
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from blockdraft.config import GenerationConfig
from blockdraft.loading import build_engine, load_target
from blockdraft.train.records import load_packed, read_shards
from blockdraft.train.live import prompt_of

HELDOUT = Path("data/work/regen-smollm2/shards-heldout")
GSM_UNSEEN_SEED = 7  # reasoning-gym seed of the gsm-unseen set: not the benchmark's (0), not training's


def gsm_unseen_prompts(tokenizer, n: int) -> list[list[int]]:
    """n chat-formatted prompts of the gsm-unseen set (see the module docstring)."""
    from blockdraft.eval.tasks.math import gsm_symbolic_items, gsm_template_split, load_all
    from blockdraft.train.data import chat_token_ids

    eval_templates, _ = gsm_template_split()
    bench = {p.messages[-1]["content"].strip() for p in load_all()}
    out = []
    for _, q in gsm_symbolic_items(GSM_UNSEEN_SEED, 4 * n, eval_templates):
        if q.strip() not in bench:
            out.append(chat_token_ids(tokenizer, [{"role": "user", "content": q}]))
        if len(out) == n:
            break
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", action="append", required=True, metavar="NAME=DIR")
    ap.add_argument("--set", default="regen", choices=("regen", "gsm-unseen"), help="prompt set (module docstring)")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="append the results as JSON lines to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_target(None, "bf16")
    if args.set == "gsm-unseen":
        prompts = gsm_unseen_prompts(target.tokenizer, args.prompts)
    else:
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
        row = {"draft": name, "path": path, "set": args.set, "prompts": len(prompts),
               "max_new_tokens": args.max_new_tokens, "tau": committed / max(1, steps),
               "position1_acceptance": first[0] / max(1, first[1])}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
