#!/usr/bin/env python
"""The two reference predictors of a learning curve, on the held-out anchors a training run with the same settings
scores: a bigram table (the last token alone) and a linear probe of one tapped target layer (train/probes.py).

    .venv/bin/python experiments/reference_probes.py --cache cache/teacher-smollm2/train \
        --heldout-cache cache/teacher-smollm2/heldout --layer 27 --out benchmarks/smollm2-135m-fast-train/probes.json

Training a draft is `blockdraft train --config recipes/<target>.yaml`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from blockdraft.models.loading import load_target
from blockdraft.train.batches import DraftHead, valid_anchors
from blockdraft.train.cached import frequent_greedy_tokens
from blockdraft.train.config import TrainConfig
from blockdraft.train.curve import heldout_anchors
from blockdraft.train.probes import probe_samples, train_probe
from blockdraft.train.teacher import TeacherCache
from blockdraft.train.trainer import make_draft


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="the teacher caches' target (default: the packaged one)")
    ap.add_argument("--cache", required=True, help="teacher cache of the training records")
    ap.add_argument("--heldout-cache", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--layer", type=int, required=True, help="the tapped target layer the feature probe reads")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-seqs", type=int, default=64)
    ap.add_argument("--eval-anchors", type=int, default=32)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    target, _ = load_target(args.target, "bf16")
    torch.set_num_threads(args.threads)
    cache, held = TeacherCache(args.cache), TeacherCache(args.heldout_cache)
    cfg = TrainConfig(cache=args.cache, heldout_cache=args.heldout_cache, eval_seqs=args.eval_seqs,
                      eval_anchors=args.eval_anchors, layer_ids=[args.layer], init="random")
    # only for its draft vocabulary (the one a run would use)
    draft = make_draft(cfg, target, lambda n: frequent_greedy_tokens(cache, n, target.vocab_size,
                                                                     target.eos_token_ids))
    head = DraftHead(target, draft)
    # the anchors a learning curve with these settings scores
    hs, ha = heldout_anchors(held, cfg.eval_seqs, cfg.eval_anchors, cfg.max_len, cfg.seed)
    ts = [q for q in cache.sequences if len(valid_anchors(q, cfg.max_len))]
    ta = [valid_anchors(q, cfg.max_len) for q in ts]
    col = cache.columns([args.layer])
    out = {"train_records": len(ts), "heldout_anchors": int(sum(len(a) for a in ha)), "layer": args.layer}
    for kind in ("bigram", "feature"):
        curve = train_probe(kind, target, head, probe_samples(ts, ta, col, kind), probe_samples(hs, ha, col, kind),
                            steps=args.steps)
        out[kind] = curve
        logging.info("%s probe: %s", kind, curve[-1])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
