#!/usr/bin/env python
"""Regenerate the default target's (SmolLM2-135M-Instruct, bf16) answers to the training prompt set.

Resumable: re-running the same command continues where the previous run stopped (the prompt set is rebuilt
deterministically and ids already in the shards are skipped).

    nohup .venv/bin/python recipes/smollm2-135m-regen.py > data/work/regen-smollm2.log 2>&1 &
    # a fresh checkout: start from the committed packed records (data/smollm2-regen) instead of from zero
    .venv/bin/python recipes/smollm2-135m-regen.py --from-packed data/smollm2-regen --batch-size 64 --threads 2
    .venv/bin/python recipes/smollm2-135m-regen.py --only-task gsm --batch-size 64   # math prompts first
    .venv/bin/python recipes/smollm2-135m-regen.py --bench      # tokens/s for a few batch sizes, ~1 min each
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from blockdraft.train import data as D
from blockdraft.train import records as R


class _Stop(Exception):
    pass


def bench(args) -> None:
    from blockdraft.models.loading import load_hf_target

    model, tok, _ = load_hf_target(args.target, dtype=args.dtype)
    pool = D.sharegpt_prompts()
    import random

    random.Random(123).shuffle(pool)
    prompts = [p for p in pool[:400] if len(D.chat_token_ids(tok, p.messages)) <= args.max_prompt_tokens][:128]
    results = {}
    for bs in args.bench_sizes:
        tmp = Path(tempfile.mkdtemp(prefix=f"bench-bs{bs}-"))
        t0 = time.perf_counter()

        def stop(_records, t0=t0):
            if time.perf_counter() - t0 > args.bench_seconds:
                raise _Stop

        try:
            D.regenerate(model, tok, prompts, tmp, max_new_tokens=args.max_new_tokens, batch_size=bs,
                         max_prompt_tokens=args.max_prompt_tokens, on_batch=stop, progress=False)
        except _Stop:
            pass
        dt = time.perf_counter() - t0
        recs = list(R.read_shards(tmp))
        ntok = sum(sum(r["loss_mask"]) for r in recs)
        results[bs] = ntok / dt
        print(f"batch_size={bs}: {len(recs)} prompts, {ntok} tokens in {dt:.0f} s = {ntok / dt:.1f} tok/s", flush=True)
        shutil.rmtree(tmp)
    print("best:", max(results, key=results.get), json.dumps(results))


def seed_from_packed(packed: Path, out: Path) -> int:
    """Write the committed packed records (train-*.npz in order, heldout.npz) as the regeneration's shards, so that
    a fresh checkout continues the regeneration instead of redoing it. Only into empty shard folders."""
    from blockdraft.train.records import ShardWriter, load_packed

    n = 0
    for sub, files in (("shards", sorted(packed.glob("train-*.npz"))), ("shards-heldout", [packed / "heldout.npz"])):
        d = out / sub
        if d.is_dir() and any(d.glob("shard-*.jsonl")):
            continue  # already seeded or regenerated here: never mix
        w = ShardWriter(d, 1000)
        for f in files:
            recs = load_packed(f)
            w.write(recs)
            n += len(recs)
        w.close()
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "data" / "work" / "regen-smollm2"))
    ap.add_argument("--target", default=None)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--n-sharegpt", type=int, default=6000)
    ap.add_argument("--n-gsm", type=int, default=3000)
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--heldout-fraction", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (leave cores to others)")
    ap.add_argument("--from-packed", default=None,
                    help="seed empty shard folders with these packed records (data/smollm2-regen) first")
    ap.add_argument("--only-task", default=None, choices=("sharegpt", "gsm", "jsonl"),
                    help="regenerate only the training prompts of this task not yet written; a later run "
                         "without it continues with the rest")
    ap.add_argument("--bench", action="store_true", help="measure tokens/s per batch size and exit")
    ap.add_argument("--bench-sizes", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--bench-seconds", type=float, default=60.0)
    args = ap.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    if args.bench:
        bench(args)
        return
    if args.from_packed:
        logging.info("seeded %d records from %s", seed_from_packed(Path(args.from_packed), Path(args.out)),
                     args.from_packed)
    out = D.run_regeneration(
        target=args.target, out_dir=args.out, n_sharegpt=args.n_sharegpt, n_gsm=args.n_gsm,
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, heldout_fraction=args.heldout_fraction,
        seed=args.seed, dtype=args.dtype, max_prompt_tokens=args.max_prompt_tokens, num_threads=args.threads,
        progress_interval=30.0, only_task=args.only_task)
    print(json.dumps({k: vars(r) for k, r in out["results"].items()}, indent=1))


if __name__ == "__main__":
    main()
