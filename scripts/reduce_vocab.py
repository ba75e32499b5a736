#!/usr/bin/env python
"""Derive a reduced-vocabulary DFlash draft from a full-vocabulary one: same layers, but it proposes only
among the N most frequent response tokens of the training data (the vLLM `d2t` mapping saved in the checkpoint);
verification stays over the full vocabulary, so decoding stays lossless. The draft's LM-head product shrinks from
V x H to N x H per block row.

It also reports the held-out coverage: the share of response tokens of the held-out answers inside the subset,
an upper bound on how often the reduced draft can still propose the right token.

    .venv/bin/python scripts/reduce_vocab.py --draft runs/smollm2-l2/draft --size 8192 --out runs/smollm2-l2-v8k
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch


from train_default import REGEN, build_records

from blockdraft.models.draft import DFlashDraftModel
from blockdraft.models.draft_config import DFlashConfig
from blockdraft.models.loading import load_target
from blockdraft.train.records import read_shards
from blockdraft.train.live import frequent_tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", required=True)
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--out", required=True)
    ap.add_argument("--regen-limit", type=int, default=160, help="the training records of the draft (see "
                    "scripts/train_default.py)")
    ap.add_argument("--n-raw", type=int, default=4000)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    target, _ = load_target(None, "bf16")
    full = DFlashDraftModel.from_pretrained(args.draft)
    recs = build_records(target.tokenizer, 512, args.n_raw, 0, args.regen_limit)
    ids = frequent_tokens(recs, args.size, target.vocab_size, target.eos_token_ids + (full.mask_token_id,))
    d = full.config.to_hf_dict()
    d["draft_vocab_size"] = args.size
    small = DFlashDraftModel(DFlashConfig.from_hf_dict(d))
    state = {k: v for k, v in full.state_dict().items() if k != "d2t"}
    missing, unexpected = small.load_state_dict(state, strict=False)
    assert not unexpected and missing == ["d2t"], (missing, unexpected)
    small.set_draft_vocab(ids)
    small.save_pretrained(args.out)
    inside = torch.zeros(target.vocab_size, dtype=torch.bool)
    inside[ids] = True
    held = list(read_shards(REGEN / "shards-heldout"))
    toks = torch.cat([torch.tensor(r["input_ids"])[torch.tensor(r["loss_mask"], dtype=torch.bool)] for r in held])
    report = {"draft": args.draft, "size": args.size, "out": args.out, "train_records": len(recs),
              "heldout_tokens": int(toks.numel()), "heldout_coverage": float(inside[toks].float().mean())}
    (Path(args.out) / "reduce_vocab.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
