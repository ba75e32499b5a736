#!/usr/bin/env python
"""How much prompt lookup could add to a draft's position 1, on the held-out teacher cache (teacher-forced, every
response anchor of the first N records): per source (math / ShareGPT) and per lookup match length n (the longest
suffix n-gram found earlier in the text, 0 = none), how often the lookup candidate is the target's next token, how
often the draft's own choice is (its plain head: a copy gate is ignored here), and how often either is. The
"either" figure is the ceiling a gate choosing between the two could reach at position 1.

    .venv/bin/python experiments/copy_ceiling.py --draft models/smollm2-135m-dflash --records 48 \
        --out benchmarks/default-draft/2026-12-01-8eb22f7d/copy_ceiling.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

import numpy as np
import torch

from blockdraft.models.draft import DFlashDraftModel
from blockdraft.models.loading import load_target
from blockdraft.models.ngram import lookup_table
from blockdraft.train.batches import DraftHead, fused_inputs, make_batch, valid_anchors
from blockdraft.train.blockattn import block_forward
from blockdraft.train.teacher import TeacherCache


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", default="models/smollm2-135m-dflash")
    ap.add_argument("--cache", default="cache/teacher-smollm2/heldout")
    ap.add_argument("--records", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_target(None, "bf16")
    held = TeacherCache(args.cache)
    draft = DFlashDraftModel.from_pretrained(args.draft, dtype=torch.float32).eval()
    head, cols = DraftHead(target, draft), held.columns(draft.config.target_layer_ids)
    seqs = [q for q in held.sequences if len(valid_anchors(q, 512))][: args.records]
    c = collections.Counter()
    for s in range(0, len(seqs), 4):
        part = seqs[s:s + 4]
        anchors = [valid_anchors(q, 512) for q in part]
        b = make_batch(part, anchors, 2, draft.mask_token_id, cols, 512, with_topk=False)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = block_forward(draft, fused_inputs(draft, target, b), b.ctx_len, target.embed(b.block_ids),
                                   b.anchors, 2)
            pred = head.ids[head.logits(hidden).float().argmax(-1)].view(len(part), -1, 2)[:, :, 1]
        lab = b.labels.view(len(part), -1, 2)[:, :, 1]
        for i, (q, a) in enumerate(zip(part, anchors)):
            src = "sharegpt" if q.id.startswith("sharegpt") else "math"
            cont, nmatch = lookup_table(np.asarray(q.tokens[:512]), 1)
            for j, p in enumerate(a):
                y, d = int(lab[i, j]), int(pred[i, j])
                if y < 0:
                    continue
                cand, n = int(cont[p, 0]), int(nmatch[p])
                for key in (("all",), (f"n={n}",)):
                    c[(src, *key, "anchors")] += 1
                    c[(src, *key, "draft")] += d == y
                    c[(src, *key, "lookup")] += cand == y
                    c[(src, *key, "either")] += (d == y) or (cand == y)
    out = {}
    for src in ("math", "sharegpt"):
        total = c[(src, "all", "anchors")]
        if not total:
            continue
        rows = {}
        for key in ["all"] + [f"n={n}" for n in range(4)]:
            m = c[(src, key, "anchors")]
            if m:
                rows[key] = {"share": round(m / total, 3), **{f: round(c[(src, key, f)] / m, 3)
                                                             for f in ("draft", "lookup", "either")}}
        out[src] = {"anchors": total, **rows}
        print(src, json.dumps(out[src]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"draft": args.draft, "records": len(seqs), **out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
