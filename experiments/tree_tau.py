#!/usr/bin/env python
"""Tokens committed per verify step (tau) of the DFlash chain against candidate trees of fixed node budgets, and of
prompt lookup against the tree with lookup branches, on a packaged target (the default one unless --target).
Acceptance only: these budgets are fixed, so the figures do not depend on the machine's speed (run `blockdraft
bench` for speed). With --no-lookup the lookup methods are left out (on a large target each costs a full decode).

    .venv/bin/python experiments/tree_tau.py --n 2 --max-new-tokens 64 --budgets 8,16,32,63 --threads 1
    .venv/bin/python experiments/tree_tau.py --target qwen2.5-coder-1.5b --tasks user-code,user-chat,user-math \
        --n 3 --max-new-tokens 96 --budgets 4,8,16 --no-lookup --threads 2
"""

from __future__ import annotations

import argparse
import json

import torch

from blockdraft.config import GenerationConfig
from blockdraft.decode.spec import DecodeSpec, build_engine
from blockdraft.models.loading import encode_prompt, load_draft, load_target, resolve_draft
from blockdraft.prompts import load_task


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="a packaged target (default: the default target)")
    ap.add_argument("--draft", default=None, help="DFlash draft directory (default: the shipped one)")
    ap.add_argument("--tasks", default="math,code,chat", help="comma list of prompt sets")
    ap.add_argument("--no-lookup", action="store_true", help="leave out pld and dflash+lookup")
    ap.add_argument("--n", type=int, default=2, help="prompts per task")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budgets", default="8,16,32,63", help="comma list of fixed node budgets")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    target, src = load_target(args.target, args.dtype)
    path = resolve_draft(args.draft, src.name)
    if path is None:
        raise SystemExit("no DFlash draft (--draft DIR)")
    draft = load_draft(path, target)
    engines = {"dflash (chain)": build_engine(target, draft, DecodeSpec("dflash"))}
    if not args.no_lookup:
        engines["pld"] = build_engine(target, None, DecodeSpec("pld"))
    for b in (int(x) for x in args.budgets.split(",")):
        engines[f"dflash-tree b={b}"] = build_engine(target, draft, DecodeSpec("dflash-tree", tree_budget=b))
        if not args.no_lookup:
            engines[f"dflash+lookup b={b}"] = build_engine(target, draft, DecodeSpec("dflash+lookup", tree_budget=b))
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    counts = {k: {} for k in engines}  # method -> task -> [tokens, steps]
    for task in args.tasks.split(","):
        for p in load_task(task, n=args.n, seed=0):
            ids = encode_prompt(target.tokenizer, p.messages)
            for name, eng in engines.items():
                s = eng.generate(ids, cfg).stats
                c = counts[name].setdefault(task, [0, 0])
                c[0] += sum(s.accept_lengths)
                c[1] += len(s.accept_lengths)
    table = {}
    for name, by_task in counts.items():
        tot = [sum(c[0] for c in by_task.values()), sum(c[1] for c in by_task.values())]
        table[name] = {t: round(c[0] / c[1], 3) for t, c in list(by_task.items()) + [("all", tot)]}
        print(f"{name:22s} " + "  ".join(f"{t} {v:.2f}" for t, v in table[name].items()))
    print(json.dumps({"target": src.name, "draft": str(path), "tasks": args.tasks, "n": args.n,
                      "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "tau": table}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
