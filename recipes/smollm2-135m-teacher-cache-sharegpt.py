#!/usr/bin/env python
"""Teacher-forced training data for the default target at prefill speed: ShareGPT's own first
answers (written by ChatGPT, not by the target) of training-split conversations that the regeneration has not
answered, run through the target once to cache its features, greedy labels and top-k logits (train/teacher.py).

Why this is usable although the text is not the target's: a draft block at anchor p is labelled with the target's
own greedy choices (`greedy`), never with the dataset's tokens. Row 1 (the token after the anchor) is therefore an
exact label at every position; later rows are labelled only where the text between the anchor and them is what the
target would have written (`FastConfig.chain_labels`). Prefill runs ~10x the tokens/s of regeneration here.

Decontamination: the same prompt split as the regeneration (`select_regeneration_prompts`: eval tasks removed,
held-out split excluded); only train-side conversations are used.

    .venv/bin/python recipes/smollm2-135m-teacher-cache-sharegpt.py --limit 3000 --threads 2
    .venv/bin/python recipes/smollm2-135m-teacher-cache-sharegpt.py --skip 3072 --limit 5632 --layers 1,9,18,24,27,29 \
        --out cache/teacher-smollm2/sharegpt-tf6    # the next 2560 records, with the six layers of the regen cache
"""

from __future__ import annotations

import argparse
import logging
import random
import sys

import torch

from blockdraft.train.data.smollm2_records import regenerated_records

from blockdraft.models.loading import load_target
from blockdraft.train.conversations import conversation_record
from blockdraft.train.data import select_regeneration_prompts, sharegpt_conversations
from blockdraft.train.teacher import build_teacher_cache


def teacher_forced_records(tokenizer, max_len: int, seed: int = 0) -> list[dict]:
    """Train-split ShareGPT conversations not regenerated, as records (prompt + the dataset's first answer), in a
    seeded order (so a limit always takes the same first N and a longer run extends a shorter one)."""
    train, _, _ = select_regeneration_prompts(tokenizer, n_sharegpt=10 ** 6, n_gsm=0, heldout=False)
    train_ids = {p.id.removeprefix("sharegpt/") for p in train if p.task == "sharegpt"}
    # every prompt the regeneration will answer (done or not) is left to it, so no prompt is in both sets
    regen, _, _ = select_regeneration_prompts(tokenizer, heldout=False)  # regen_default.py's selection
    regen_ids = {p.id.removeprefix("sharegpt/") for p in regen if p.task == "sharegpt"}
    regen_ids |= {r["id"].removeprefix("sharegpt/") for r in regenerated_records()}
    convs = [(cid, m) for cid, m in sharegpt_conversations() if cid in train_ids and cid not in regen_ids]
    random.Random(seed).shuffle(convs)
    out = []
    for cid, msgs in convs:
        rec = conversation_record(tokenizer, cid, msgs, max_len)
        if rec is not None and sum(rec["loss_mask"]) >= 16:
            rec["id"] = "tf-sharegpt/" + cid
            out.append(rec)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="cache/teacher-smollm2/sharegpt-tf")
    ap.add_argument("--limit", type=int, default=None, help="first N records of the seeded order")
    ap.add_argument("--skip", type=int, default=0, help="start after this many records of the seeded order (a new "
                    "cache of records that an earlier one, built with --limit SKIP, does not hold)")
    ap.add_argument("--layers", default="1,27", help="target layers to store (the default draft reads 1,27)")
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.skip < 0 or (args.limit is not None and args.limit <= args.skip):
        ap.error(f"--limit is a position in the seeded order (first N records), so it must exceed --skip "
                 f"({args.skip}); got --limit {args.limit}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    target, _ = load_target(None, "bf16")
    recs = teacher_forced_records(target.tokenizer, args.max_len)
    logging.info("%d teacher-forced ShareGPT records available", len(recs))
    if args.skip >= len(recs):
        logging.error("--skip %d leaves no record (%d available)", args.skip, len(recs))
        return 2
    build_teacher_cache(target, recs[args.skip: args.limit], args.out, [int(x) for x in args.layers.split(",")], args.topk,
                        args.max_len)
    return 0


if __name__ == "__main__":
    sys.exit(main())
