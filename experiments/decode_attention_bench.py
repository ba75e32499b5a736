#!/usr/bin/env python
"""Plain greedy decoding of the default target with the single-query attention of `lean.grouped_decode_attention`
against torch's SDPA kernel (`LeanDecoder.grouped_single_query`), interleaved, at a few context lengths.

Each round decodes `--new` tokens after a prompt of `--context` tokens with one setting, then the other (the order
alternates by round); reported: decode tokens/s (median over rounds) and the ratio, plus whether the greedy tokens
agree (bf16: the kernels round differently, so a near-tie may flip).

    .venv/bin/python experiments/decode_attention_bench.py --threads 2 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from blockdraft.models.loading import load_target


def decode(target, prompt: torch.Tensor, new: int) -> tuple[float, list[int]]:
    cache = target.new_decode_cache(capacity=prompt.numel() + new + 8)
    out = target.forward(prompt.unsqueeze(0), cache, last_only=True, tap=False)
    tok = int(out.logits[0, -1].argmax())
    toks = [tok]
    t0 = time.perf_counter()
    for _ in range(new - 1):
        out = target.forward(torch.tensor([[tok]]), cache, last_only=True, tap=False)
        tok = int(out.logits[0, -1].argmax())
        toks.append(tok)
    return (new - 1) / (time.perf_counter() - t0), toks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--context", type=int, nargs="+", default=[64, 400, 1000])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_target(None, "bf16")
    lean = target.lean
    if lean is None:
        raise SystemExit(f"the default target has no lean path here ({target.lean_reason})")
    g = torch.Generator().manual_seed(0)
    rows = []
    for ctx in args.context:
        prompt = torch.randint(100, target.vocab_size - 100, (ctx,), generator=g)
        speed = {True: [], False: []}
        same = True
        for r in range(args.rounds + 1):
            got = {}
            for grouped in ((True, False) if r % 2 == 0 else (False, True)):
                lean.grouped_single_query = grouped
                tps, toks = decode(target, prompt, args.new)
                got[grouped] = toks
                if r > 0:  # round 0 warms up
                    speed[grouped].append(tps)
            same &= got[True] == got[False]
        lean.grouped_single_query = True
        row = {"context": ctx, "grouped_tok_s": statistics.median(speed[True]),
               "sdpa_tok_s": statistics.median(speed[False]), "same_tokens": same}
        row["ratio"] = row["grouped_tok_s"] / row["sdpa_tok_s"]
        rows.append(row)
        print(f"context {ctx:5d}: grouped {row['grouped_tok_s']:.1f} tok/s, sdpa {row['sdpa_tok_s']:.1f} tok/s, "
              f"ratio {row['ratio']:.2f}x, same greedy tokens: {same}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "rounds": args.rounds, "new": args.new, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
