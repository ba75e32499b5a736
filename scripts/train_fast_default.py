#!/usr/bin/env python
"""Train a DFlash draft for the default target on its teacher cache (scripts/teacher_cache_default.py first), or
compute the two reference predictors on the same held-out anchors.

    .venv/bin/python scripts/train_fast_default.py train --out runs/fast-a --steps 600 --anchors 0 --block-size 16
    .venv/bin/python scripts/train_fast_default.py probes --out benchmarks/smollm2-135m-fast-train/probes.json

Every `train` option is a field of blockdraft.train.fast.FastConfig (--layer-ids 1,27 etc.).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import fields
from pathlib import Path

import torch

from blockdraft.loading import load_target
from blockdraft.train.fast import FastConfig, make_fast_draft, parse_bool, train_fast
from blockdraft.train.batches import DraftHead, valid_anchors
from blockdraft.train.curve import heldout_anchors
from blockdraft.train.probes import probe_samples, train_probe
from blockdraft.train.teacher import TeacherCache

CACHE = "cache/teacher-smollm2"


def add_config_args(ap: argparse.ArgumentParser) -> None:
    for f in fields(FastConfig):
        name = "--" + f.name.replace("_", "-")
        if f.name == "layer_ids":
            ap.add_argument(name, default="1,27")
        elif f.type in ("int", "float", "str") or f.type in (int, float, str):
            typ = {"int": int, "float": float, "str": str}.get(f.type, f.type)
            ap.add_argument(name, type=typ, default=None)
        elif str(f.type) == "bool":
            ap.add_argument(name, type=parse_bool, default=None)
        elif "None" in str(f.type):
            ap.add_argument(name, type=int, default=None)


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train")
    tr.add_argument("--out", required=True)
    tr.add_argument("--resume", action="store_true")
    add_config_args(tr)
    pr = sub.add_parser("probes")
    pr.add_argument("--out", required=True)
    pr.add_argument("--steps", type=int, default=600)
    pr.add_argument("--layer", type=int, default=27)
    pr.add_argument("--threads", type=int, default=2)
    pr.add_argument("--eval-seqs", type=int, default=64)
    pr.add_argument("--eval-anchors", type=int, default=32)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    target, _ = load_target(None, "bf16")
    if args.cmd == "train":
        kw = {f.name: getattr(args, f.name) for f in fields(FastConfig)
              if f.name not in ("layer_ids", "out_dir") and getattr(args, f.name, None) is not None}
        cfg = FastConfig(cache=kw.pop("cache", f"{CACHE}/train"),
                         heldout_cache=kw.pop("heldout_cache", f"{CACHE}/heldout"),
                         out_dir=args.out, layer_ids=[int(x) for x in args.layer_ids.split(",")], **kw)
        print(json.dumps(train_fast(cfg, target, resume=args.resume)))
        return 0
    torch.set_num_threads(args.threads)
    cache, held = TeacherCache(f"{CACHE}/train"), TeacherCache(f"{CACHE}/heldout")
    cfg = FastConfig(cache=f"{CACHE}/train", heldout_cache=f"{CACHE}/heldout", eval_seqs=args.eval_seqs,
                     eval_anchors=args.eval_anchors)
    draft = make_fast_draft(cfg, target, cache)  # only for its draft vocabulary (the same one a run would use)
    head = DraftHead(target, draft)
    hs, ha = heldout_anchors(held, cfg.eval_seqs, cfg.eval_anchors, cfg.max_len, cfg.seed)  # the anchors a learning curve with these settings scores
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
