#!/usr/bin/env python
"""Serving benchmark: throughput and per-request latency of the batched engine at several concurrency levels,
plain decoding (`ar`) vs a DFlash draft, on the default SmolLM2 target. One process, in-process scheduler (the
same worker thread and BatchedEngine the HTTP server uses, without the HTTP layer).

For each method and concurrency c: c client threads submit greedy chat requests back to back (prompts taken in
turn from a fixed list) until `--requests` (default max(c, --min-requests)) have completed. Reported: total
completion tokens / wall seconds, mean and max request latency (submit -> done), mean time to first token, and
the mean tau (tokens committed per target forward).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/serve_bench.py --out runs/serve_bench.md

Draft choice (--draft auto): models/smollm2-135m-dflash if present, else the newest runs/smollm2-l2/draft (copied
first: a trainer may be rewriting it), else an untrained 2-layer draft (what `blockdraft init-draft --layers 2`
writes) in /tmp/untrained-draft.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "What is 17 times 23? Show your steps.",
    "Write a Python function that reverses a string.",
    "Give me three tips for staying focused while studying.",
    "Explain what a hash map is in two sentences.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether?",
    "Write a short poem about autumn leaves.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Summarize the plot of Romeo and Juliet in three sentences.",
]


def pick_draft(spec: str, target) -> tuple[Path, str]:
    if spec != "auto":
        return Path(spec), spec
    shipped = ROOT / "models" / "smollm2-135m-dflash"
    if (shipped / "config.json").is_file():
        return shipped, "models/smollm2-135m-dflash (shipped)"
    run = ROOT / "runs" / "smollm2-l2" / "draft"
    if (run / "config.json").is_file() and (run / "model.safetensors").is_file():
        snap = Path("/tmp/serve-bench-draft")
        shutil.rmtree(snap, ignore_errors=True)
        shutil.copytree(run, snap)
        meta = json.loads((snap / "config.json").read_text()).get("blockdraft", {})
        when = time.strftime("%H:%M", time.localtime((run / "model.safetensors").stat().st_mtime))
        return snap, f"runs/smollm2-l2/draft (in training; snapshot of {when}, metadata {meta or 'none'})"
    from blockdraft.draft import DFlashConfig, DFlashDraftModel
    from blockdraft.loading import default_mask_token_id

    out = Path("/tmp/untrained-draft")
    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        cfg = DFlashConfig.from_target(target.config, num_hidden_layers=2,
                                       mask_token_id=default_mask_token_id(target.tokenizer, target.vocab_size))
        DFlashDraftModel(cfg).init_from_target(target).save_pretrained(out)
    return out, "/tmp/untrained-draft (untrained, 2 layers)"


def run_level(scheduler, prompt_ids, concurrency: int, n_requests: int, max_tokens: int) -> dict:
    from blockdraft.config import GenerationConfig, SamplingParams

    cfg = GenerationConfig(max_new_tokens=max_tokens)
    lock = threading.Lock()
    counter = iter(range(n_requests))
    records = []

    def client():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            t0 = time.perf_counter()
            h = scheduler.submit(prompt_ids[i % len(prompt_ids)], cfg, SamplingParams())
            first = None
            for ev in h.events():
                if first is None and ev.kind == "delta":
                    first = time.perf_counter() - t0
            res = h.result
            with lock:
                records.append({"latency": time.perf_counter() - t0, "ttft": first if first is not None else 0.0,
                                "tokens": len(res.token_ids), "tau": res.stats.tau})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in records)
    lat = [r["latency"] for r in records]
    return {"concurrency": concurrency, "requests": len(records), "tokens": tokens, "wall_s": wall,
            "tok_per_s": tokens / wall, "lat_mean_s": statistics.mean(lat), "lat_max_s": max(lat),
            "ttft_mean_s": statistics.mean(r["ttft"] for r in records),
            "tau": statistics.mean(r["tau"] for r in records)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default="auto")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-step-tokens", type=int, default=None, help="BatchedEngine's per-step position budget")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="also write the markdown (and a .json next to it)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    from blockdraft.batch import BatchedEngine
    from blockdraft.draft import DFlashDraftModel
    from blockdraft.loading import encode_prompt, load_target
    from blockdraft.proposers.dflash import DFlashProposer
    from blockdraft.serve.scheduler import Scheduler

    target, src = load_target(args.target, args.dtype)
    draft_path, draft_desc = pick_draft(args.draft, target)
    draft = DFlashDraftModel.from_pretrained(draft_path, dtype=target.dtype)
    levels = [int(c) for c in args.concurrency.split(",")]
    prompt_ids = [encode_prompt(target.tokenizer, q) for q in PROMPTS]
    rows = []
    for method in ("ar", "dflash"):
        proposer = DFlashProposer(draft, target, args.block_size) if method == "dflash" else None
        engine = BatchedEngine(target, proposer, max_batch=max(levels), max_step_tokens=args.max_step_tokens)
        sched = Scheduler(engine, max_queue=1024).start()
        try:
            run_level(sched, prompt_ids, 1, 1, 8)  # warm-up
            for c in levels:
                r = run_level(sched, prompt_ids, c, max(c, args.min_requests), args.max_tokens)
                r["method"] = method
                rows.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
        finally:
            sched.stop()

    base = {r["concurrency"]: r["tok_per_s"] for r in rows if r["method"] == "ar"}
    lines = [
        f"target {src.name} ({args.dtype}), draft {draft_desc}, block size "
        f"{args.block_size or draft.block_size}, max_step_tokens {args.max_step_tokens}, greedy, "
        f"max_tokens {args.max_tokens}, "
        f"torch threads {args.threads}, CPU",
        "",
        "| method | concurrency | requests | tokens | wall s | total tok/s | vs ar | mean latency s | max latency s "
        "| mean TTFT s | tau |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['method']} | {r['concurrency']} | {r['requests']} | {r['tokens']} | {r['wall_s']:.1f} | "
                     f"{r['tok_per_s']:.1f} | {r['tok_per_s'] / base[r['concurrency']]:.2f}x | {r['lat_mean_s']:.2f} | "
                     f"{r['lat_max_s']:.2f} | {r['ttft_mean_s']:.2f} | {r['tau']:.2f} |")
    md = "\n".join(lines)
    print(md)
    if args.out:
        Path(args.out).write_text(md + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
