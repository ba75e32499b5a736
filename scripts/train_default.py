#!/usr/bin/env python
"""Train a DFlash draft for the embedded default target (SmolLM2-135M-Instruct) on this machine's budget.

Data: every regenerated record under data/work/regen-smollm2/shards (target-written answers; in a fresh checkout, the
packed copies in data/smollm2-regen/) plus the original ShareGPT first answers of the *training* prompt set
(decontaminated, held-out split excluded), shuffled together.
Resumable: re-running the same command continues from the newest checkpoint.

    .venv/bin/python scripts/train_default.py --layers 2 --init-layers target --vocab-size 8192 --anchors 64 \
        --steps 4000 --threads 2 --out runs/smollm2-l2t

`--method eagle` trains the EAGLE-3 baseline drafter on the same records instead (train/eagle.py; --layers,
--anchors and the block size do not apply to it, --ttt-steps does).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
from pathlib import Path

import torch

from blockdraft.models.loading import load_target
from blockdraft.train.conversations import conversation_records
from blockdraft.train.data import select_regeneration_prompts, sharegpt_conversations
from blockdraft.train.records import load_packed, read_shards, validate_record
from blockdraft.train.config import TrainConfig
from blockdraft.train.trainer import train

REGEN = Path("data/work/regen-smollm2")  # scripts/regen_default.py's output (not in git)
PACKED = Path("data/smollm2-regen")  # the regenerated records committed, packed (uint16)


def complete_records(directory: Path) -> list[dict]:
    """Records of the shards, skipping a final line still being written by a running regeneration."""
    out = []
    for path in sorted(directory.glob("shard-*.jsonl")):
        with open(path, encoding="utf-8") as f:  # file iteration splits on "\n" only (not on U+2028 in strings)
            lines = list(f)
        for line in lines:
            if line.endswith("\n") and line.strip():
                out.append(validate_record(json.loads(line), str(path)))
    return out


def regenerated_records() -> list[dict]:
    """The regeneration's shards when this checkout ran it, else the packed copies committed in data/smollm2-regen
    (the same records in the same order: train-000, -001, -002 are consecutive slices of the shards)."""
    if (REGEN / "shards").is_dir():
        return complete_records(REGEN / "shards")
    return [r for p in sorted(PACKED.glob("train-*.npz")) for r in load_packed(p)]


def heldout_records() -> list[dict]:
    if (REGEN / "shards-heldout").is_dir():
        return list(read_shards(REGEN / "shards-heldout"))
    return load_packed(PACKED / "heldout.npz")


def training_prompt_ids(tokenizer) -> list[str]:
    """Ids of the training prompt set (written by the regeneration; rebuilt deterministically if absent)."""
    path = REGEN / "prompts-train.jsonl"
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            return [json.loads(line)["id"] for line in f if line.strip()]
    train, _, _ = select_regeneration_prompts(tokenizer)  # regen_default.py's defaults
    return [p.id for p in train]


def build_records(tokenizer, max_len: int, n_raw: int, seed: int, regen_limit: int | None = None) -> list[dict]:
    regen = regenerated_records()
    # the regeneration appends in a fixed order, so the first N records are the same N in every later run: a
    # limit reproduces an earlier run's data while the regeneration goes on
    regen = regen[:regen_limit] if regen_limit is not None else regen
    for r in regen:
        r["input_ids"], r["loss_mask"] = r["input_ids"][:max_len], r["loss_mask"][:max_len]
    train_ids = set()
    for pid in training_prompt_ids(tokenizer):
        if pid.startswith("sharegpt/"):
            train_ids.add(pid.removeprefix("sharegpt/"))
    done = {r["id"].removeprefix("sharegpt/") for r in regen}
    convs = [(cid, m) for cid, m in sharegpt_conversations() if cid in train_ids and cid not in done]
    random.Random(seed).shuffle(convs)
    raw = conversation_records(tokenizer, convs[: n_raw * 2], max_len)[:n_raw]
    for r in raw:
        r["id"] = "raw/" + r["id"]
    recs = regen + raw
    random.Random(seed).shuffle(recs)
    logging.info("training records: %d regenerated + %d original ShareGPT answers", len(regen), len(raw))
    return recs


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
