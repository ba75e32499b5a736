#!/usr/bin/env python
"""Training throughput of the live source (online target features, dense block mask: live.sample_loss)
against the cache source (teacher cache, factorised block mask: cached.batch_loss), in one run with the methods
interleaved round by round, same draft (the shipped default), same threads. Block rows/s = (anchors x block size)
per second of forward + backward + optimizer step; padding (anchor slots a shorter sequence leaves empty) is not
counted, so the bucketed variant (train-fast's default) shows what bucketing saves.

    .venv/bin/python experiments/train_throughput.py --threads 2 --rounds 4 --out benchmarks/smollm2-135m-fast-train/throughput.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from blockdraft.models.draft import DFlashDraftModel
from blockdraft.models.loading import load_target
from blockdraft.train.cached import batch_loss
from blockdraft.train.config import TrainConfig
from blockdraft.train.batches import DraftHead, make_batch, valid_anchors
from blockdraft.train.features import OnlineFeatures
from blockdraft.train.teacher import TeacherCache
from blockdraft.train.live import TrainModule, sample_loss


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="models/smollm2-135m-dflash")
    ap.add_argument("--cache", default="cache/teacher-smollm2/train")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per method per round")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_target(None, "bf16")
    draft = DFlashDraftModel.from_pretrained(args.draft, dtype=torch.float32).train()
    cache = TeacherCache(args.cache)
    seqs = [q for q in cache.sequences if len(valid_anchors(q, 512)) >= 64]
    cols = cache.columns(draft.config.target_layer_ids)
    head = DraftHead(target, draft)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-5)
    # the generic trainer as the shipped default was trained: 2 sequences x 64 anchors x 16 rows, online features
    gcfg = TrainConfig(anchors=64, max_len=512, block_size=16, attention="sdpa")
    online = OnlineFeatures(target, draft.config.target_layer_ids)
    module = TrainModule(draft)
    vmap = torch.full((target.vocab_size,), -100, dtype=torch.long)
    vmap[head.ids] = torch.arange(head.ids.numel())
    rng = np.random.default_rng(0)

    def generic(step: int) -> int:
        rows = 0
        for j in range(2):
            q = seqs[(2 * step + j) % len(seqs)]
            rec = {"id": q.id, "input_ids": q.tokens.tolist(), "loss_mask": q.loss_mask.tolist()}
            out = sample_loss(module, target, rec, online, gcfg, draft.config, step * 2 + j, head.ids, vmap,
                              torch.bfloat16)
            out.loss.backward()
            rows += 64 * 16
        return rows

    # the cache source's bucketing (TrainConfig.bucket): a step's sequences are neighbours in (anchors, length) order
    bucketed = sorted(seqs, key=lambda q: (min(len(valid_anchors(q, 512)), 128), min(len(q), 512)))

    def fast(block: int, anchors: int, nseq: int, bucket: bool = False):
        cfg = TrainConfig(cache="-", heldout_cache="-", train_block=block, anchors=anchors, gamma=7.0)

        def run(step: int) -> int:
            if bucket:
                first = int(rng.integers(0, len(bucketed) - nseq + 1))
                pick = bucketed[first:first + nseq]
            else:
                pick = [seqs[(nseq * step + j) % len(seqs)] for j in range(nseq)]
            al = [np.sort(rng.choice(valid_anchors(q, 512), size=min(anchors, len(valid_anchors(q, 512))),
                                     replace=False)) for q in pick]
            b = make_batch(pick, al, block, draft.mask_token_id, cols, 512, with_topk=False)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, _, _ = batch_loss(draft, target, head, b, cfg)
            loss.backward()
            return sum(len(a) for a in al) * block
        return run

    methods = {"generic B16 x64 anchors x2 seqs": generic, "fast B16 x64 anchors x2 seqs": fast(16, 64, 2),
               "fast B4 x128 anchors x4 seqs": fast(4, 128, 4), "fast B4 all anchors x2 seqs": fast(4, 10_000, 2),
               "fast B4 x128 anchors x4 seqs, bucketed": fast(4, 128, 4, bucket=True)}
    rates = {m: [] for m in methods}
    step = 0
    for r in range(args.rounds):
        order = list(methods)[r % len(methods):] + list(methods)[: r % len(methods)]
        for m in order:
            rows, t0 = 0, time.perf_counter()
            for _ in range(args.steps):
                opt.zero_grad(set_to_none=True)
                rows += methods[m](step)
                opt.step()
                step += 1
            rates[m].append(rows / (time.perf_counter() - t0))
            print(f"round {r} {m}: {rates[m][-1]:.0f} block rows/s", flush=True)
    base = statistics.median(rates["generic B16 x64 anchors x2 seqs"])
    res = {m: {"median_rows_per_s": round(statistics.median(v), 1), "vs_generic": round(statistics.median(v) / base, 2),
               "rounds": [round(x, 1) for x in v]} for m, v in rates.items()}
    res["threads"] = args.threads
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
