#!/usr/bin/env python
"""Train a DFlash draft for the embedded default target (SmolLM2-135M-Instruct) on this machine's budget.

Data: every regenerated record under data/work/regen-smollm2/shards (target-written answers; in a fresh checkout, the
packed copies in data/smollm2-regen/) plus the original ShareGPT first answers of the *training* prompt set
(decontaminated, held-out split excluded), shuffled together.
Resumable: re-running the same command continues from the newest checkpoint.

    .venv/bin/python recipes/smollm2-135m-train.py --layers 2 --init-layers target --vocab-size 8192 --anchors 64 \
        --steps 4000 --threads 2 --out runs/smollm2-l2t

`--method eagle` trains the EAGLE-3 baseline drafter on the same records instead (train/eagle.py; --layers,
--anchors and the block size do not apply to it, --ttt-steps does).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import torch

from blockdraft.train.data.smollm2_records import REGEN, build_records, heldout_records

from blockdraft.models.loading import load_target
from blockdraft.train.config import TrainConfig
from blockdraft.train.trainer import train

def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--n-raw", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--method", default="dflash", choices=["dflash", "eagle"])
    ap.add_argument("--regen-limit", type=int, default=None,
                    help="use only the first N regenerated records (e.g. 160 = the data of the shipped runs)")
    ap.add_argument("--ttt-steps", type=int, default=3, help="eagle: unrolled training-time-test steps")
    ap.add_argument("--init-layers", default="random", choices=["random", "target"],
                    help="target: start the draft layers as copies of the target's last layers")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="reduced draft vocabulary: the N most frequent response tokens (loss and proposals)")
    ap.add_argument("--target-labels", action="store_true",
                    help="label block rows with the target's own greedy tokens (teacher-forced)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    target, _ = load_target(None, "bf16")
    recs = build_records(target.tokenizer, args.max_len, args.n_raw, args.seed, args.regen_limit)
    held = heldout_records()
    cfg = TrainConfig(data=str(REGEN), out_dir=args.out, num_layers=args.layers, block_size=16,
                      num_target_features=args.layers, anchors=args.anchors, seqs_per_step=args.batch_size,
                      steps=args.steps, max_len=args.max_len, save_every=50, keep_last=2, eval_every=0,
                      eval_prompts=6, eval_max_new_tokens=96, log_every=10, seed=args.seed, precision="bf16",
                      method=args.method, ttt_steps=args.ttt_steps, init=args.init_layers,
                      draft_vocab_size=args.vocab_size or 0, target_labels=args.target_labels)
    summary = train(cfg, target=target, records=recs, heldout=held, resume=args.resume)
    summary.pop("losses", None)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
