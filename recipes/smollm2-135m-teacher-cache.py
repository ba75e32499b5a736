#!/usr/bin/env python
"""Cache the default target's outputs (tapped features, greedy labels, top-k logits) over its regenerated training
records and the held-out split, once, for `blockdraft train --config recipes/smollm2-135m-dflash.yaml`
(train/teacher.py). Resumable.

    .venv/bin/python recipes/smollm2-135m-teacher-cache.py --limit 1920 --threads 2
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from blockdraft.train.data.smollm2_records import heldout_records, regenerated_records

from blockdraft.models.loading import load_target
from blockdraft.train.teacher import build_teacher_cache

LAYERS = [1, 9, 18, 24, 27, 29]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="cache/teacher-smollm2")
    ap.add_argument("--limit", type=int, default=None, help="first N regenerated records only")
    ap.add_argument("--heldout-limit", type=int, default=None)
    ap.add_argument("--layers", default=",".join(map(str, LAYERS)))
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-train", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    target, _ = load_target(None, "bf16")
    layers = [int(x) for x in args.layers.split(",")]
    held = heldout_records()[: args.heldout_limit]
    build_teacher_cache(target, held, Path(args.out) / "heldout", layers, args.topk, args.max_len)
    if not args.skip_train:
        recs = regenerated_records()[: args.limit]
        build_teacher_cache(target, recs, Path(args.out) / "train", layers, args.topk, args.max_len)
    return 0


if __name__ == "__main__":
    sys.exit(main())
