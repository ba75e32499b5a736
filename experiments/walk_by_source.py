#!/usr/bin/env python
"""Replayed-decoding tau (`walk_tau`, the learning curve's walk) of drafts on the held-out teacher cache, split by
where the records come from: gsm_symbolic math, the other reasoning-gym math generators, ShareGPT turns. The
held-out math shares its gsm_symbolic templates with training (only the benchmark's templates are kept out), so a
draft that learned those templates' wording shows it here and not on the benchmark.

    .venv/bin/python experiments/walk_by_source.py --draft old=models/smollm2-135m-dflash --draft new=runs/x/draft
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from blockdraft.models.draft import DFlashDraftModel
from blockdraft.models.loading import load_target
from blockdraft.train.batches import DraftHead
from blockdraft.train.curve import walk_tau
from blockdraft.train.teacher import TeacherCache

SOURCES = {
    "gsm_symbolic": lambda rid: rid.startswith("gsm/") and "gsm_symbolic" in rid,
    "other-math": lambda rid: rid.startswith("gsm/") and "gsm_symbolic" not in rid,
    "sharegpt": lambda rid: rid.startswith("sharegpt/"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", action="append", required=True, metavar="NAME=DIR")
    ap.add_argument("--cache", default="cache/teacher-smollm2/heldout")
    ap.add_argument("--per-source", type=int, default=24, help="records per source (the first ones in the cache)")
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_target(None, "bf16")
    held = TeacherCache(args.cache)
    for spec in args.draft:
        name, _, path = spec.partition("=")
        draft = DFlashDraftModel.from_pretrained(path, dtype=torch.float32).eval()
        head, cols = DraftHead(target, draft), held.columns(draft.config.target_layer_ids)
        for src, pick in SOURCES.items():
            seqs = [q for q in held.sequences if pick(q.id)][: args.per_source]
            w = walk_tau(draft, target, head, seqs, cols, 512, block=args.block)
            print(json.dumps({"draft": name, "source": src, "records": len(seqs), **w}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
