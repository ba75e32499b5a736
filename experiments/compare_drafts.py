#!/usr/bin/env python
"""Several drafts for the default target in one run: `ar` and each draft decode the same prompts, interleaved
prompt by prompt in a rotating order. Reports tau, decode tok/s, draft/verify ms per step and the paired decode
speedup over `ar`, overall and per task. Used for full vs reduced draft vocabulary and for draft depths.

    .venv/bin/python experiments/compare_drafts.py --draft full=runs/smollm2-l2/draft --draft reduced=runs/smollm2-l2-v8k \
        --n 4 --max-new-tokens 96 --threads 1 --out benchmarks/smollm2-135m-fast/vocab
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from blockdraft.config import GenerationConfig
from blockdraft.decode.spec import DecodeSpec, build_engine
from blockdraft.models.loading import encode_prompt, load_draft, load_target
from blockdraft.prompts import load_task


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", action="append", required=True, metavar="NAME=DIR[@B]",
                    help="repeatable; @B decodes with block size B (default: the draft's own)")
    ap.add_argument("--tasks", default="math,code,chat")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_target(None, "bf16")
    engines = {"ar": build_engine(target, None, DecodeSpec("ar"))}
    for spec in args.draft:
        name, _, path = spec.partition("=")
        path, _, block = path.partition("@")
        if not path or name in engines or (block and not block.isdigit()):
            raise SystemExit(f"--draft wants NAME=DIR[@B] with distinct names, got {spec!r}")
        spec = DecodeSpec(block_size=int(block) if block else None)
        engines[name] = build_engine(target, load_draft(path, target), spec)
    names = list(engines)
    prompts = [p for t in args.tasks.split(",") for p in load_task(t, n=args.n, seed=0)]
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    records = []
    for m in names:  # warm-up, not measured
        engines[m].generate(encode_prompt(target.tokenizer, prompts[0].messages), GenerationConfig(max_new_tokens=8))
    for i, p in enumerate(prompts):
        ids = encode_prompt(target.tokenizer, p.messages)
        order = names[i % len(names):] + names[: i % len(names)]
        for m in order:
            out = engines[m].generate(ids, cfg)
            s = out.stats
            records.append({"prompt": p.id, "task": p.task, "method": m, "tau": s.tau, "steps": len(s.accept_lengths),
                            "tokens": sum(s.accept_lengths), "decode_tps": s.decode_tokens_per_s, "ids": out.token_ids,
                            "draft_ms_per_step": 1e3 * s.draft_seconds / max(1, len(s.accept_lengths)),
                            "verify_ms_per_step": 1e3 * s.verify_seconds / max(1, len(s.accept_lengths))})
    summary = {}
    ar = {r["prompt"]: r for r in records if r["method"] == "ar"}
    tasks = list(dict.fromkeys(r["task"] for r in records))
    for m, task in [(m, t) for t in tasks + ["all"] for m in names]:
        rs = [r for r in records if r["method"] == m and task in ("all", r["task"])]
        summary[f"{task}/{m}"] = {
            "tau": sum(r["tokens"] for r in rs) / sum(r["steps"] for r in rs),
            "decode_tps_median": statistics.median(r["decode_tps"] for r in rs),
            "draft_ms_per_step": statistics.median(r["draft_ms_per_step"] for r in rs),
            "verify_ms_per_step": statistics.median(r["verify_ms_per_step"] for r in rs),
            "speedup_median": statistics.median(r["decode_tps"] / ar[r["prompt"]]["decode_tps"] for r in rs),
            # bf16: batched verification may flip a near-tie, so the text can differ from plain decoding's
            "same_as_ar": sum(r["ids"] == ar[r["prompt"]]["ids"] for r in rs) / len(rs),
        }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["| task | method | tau | decode tok/s | draft ms/step | verify ms/step | speedup vs ar (median) | "
             "same text as ar |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for key, s in summary.items():
        task, m = key.split("/", 1)
        lines.append(f"| {task} | {m} | {s['tau']:.3f} | {s['decode_tps_median']:.1f} | {s['draft_ms_per_step']:.1f} | "
                     f"{s['verify_ms_per_step']:.1f} | {s['speedup_median']:.2f}x | {s['same_as_ar']:.0%} |")
    cmd = " ".join(["experiments/compare_drafts.py"] + sys.argv[1:])
    (out / "report.md").write_text(f"# Drafts compared\n\n`{cmd}`, {len(prompts)} prompts "
                                   f"({args.tasks}), {args.threads} thread(s)\n\n" + "\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps({"command": cmd, "summary": summary, "records": records}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
