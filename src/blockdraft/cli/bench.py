"""`blockdraft bench`: the paired speed benchmark's options (eval/bench.py runs it)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ..eval import bench
from ..eval.engines import weights_methods
from ..eval.report import fmt_num, fmt_speedup
from .options import add_draft, add_dtype, add_target, csv, floats


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to the CLI's subparsers."""
    p = subparsers.add_parser("bench", help="paired speed benchmark: ar vs dflash vs prompt lookup",
                              description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target(p)
    add_draft(p, "draft directory, 'none' (skip the draft's methods), default: the shipped one")
    p.add_argument("--tasks", type=csv, default=bench.BenchConfig.tasks,
                   help="comma list of math,code,chat (the benchmark sets) and user-math,user-code,user-chat (prompts "
                        "as users write them, never trained on)")
    p.add_argument("--methods", type=csv, default=bench.BenchConfig.methods,
                   help="comma list of " + ",".join(bench.METHODS)
                        + " (default: " + ",".join(bench.DEFAULT_METHODS) + ")")
    p.add_argument("--n", type=int, default=bench.BenchConfig.n, help="prompts per task (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=bench.BenchConfig.max_new_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--temperatures", type=floats, default=None, help="comma list, e.g. 0,1 (overrides --temperature)")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--denoise-steps", type=int, default=1)
    add_dtype(p)
    p.add_argument("--weights", type=csv, default=bench.BenchConfig.weights,
                   help="comma list of weights modes (auto, bf16, int8, int4): the first for every method, each "
                        "further one reruns " + ",".join(weights_methods()) + " as METHOD@MODE in the same run")
    p.add_argument("--compare-draft", action="append", default=[], metavar="NAME=DIR",
                   help="another DFlash draft of the same target (repeatable): the DFlash methods run again with it "
                        "as METHOD@NAME in the same run, prompt by prompt beside the others")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", default=None, help="JSONL prompt file ({'prompt': ...} or {'messages': [...]})")
    p.add_argument("--quick", action="store_true", help="2 prompts per task, 64 new tokens, temperature 0")
    p.add_argument("--multi-turn", action="store_true", help="also ask MT-Bench's second turn after ar's answer")
    p.add_argument("--pld-max-ngram", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="torch.compile the lean target path (warm-up pays it)")
    p.add_argument("--llamacpp-gguf", default=None,
                   help="GGUF for the llamacpp methods (default: the target's own GGUF when it was loaded from one)")
    p.add_argument("--llamacpp-bf16-gguf", default=None,
                   help="bf16 GGUF for llamacpp-bf16 / llamacpp-dflash-bf16 (default: exported from the target's GGUF "
                        "into the cache dir once)")
    p.add_argument("--llamacpp-draft-gguf", default=None,
                   help="draft GGUF for llamacpp-dflash* (default: the --draft directory exported once)")
    p.add_argument("--llamacpp-draft-n", type=int, default=None,
                   help="llamacpp-dflash*: tokens drafted per step (default: the draft's decode block size - 1)")
    p.add_argument("--llamacpp-spec-gguf", default=None,
                   help="llamacpp-spec*: llama.cpp's draft model, a smaller GGUF of the target's family (default: the "
                        "packaged one for a packaged target: qwen2.5-coder-0.5b for qwen2.5-coder-1.5b)")
    p.add_argument("--llamacpp-spec-n", type=int, default=bench.BenchConfig.llamacpp_spec_n,
                   help="llamacpp-spec-n: tokens the draft model drafts per step at most (llamacpp-spec keeps "
                        "llama.cpp's default)")
    p.add_argument("--eagle-draft", default=None, help="EAGLE draft directory (method eagle; skipped without)")
    p.add_argument("--gamma", type=int, default=bench.BenchConfig.gamma, help="eagle: tokens drafted per verify step")
    p.add_argument("--tree-budget", type=int, default=None,
                   help="dflash-tree, dflash+lookup: candidate nodes per step (default: chosen per step from a "
                        "verify-cost calibration measured at start)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default=bench.BenchConfig.out, help="output directory")
    p.set_defaults(func=cmd_bench)
    return p


def _named(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not path:
        raise SystemExit(f"blockdraft bench: --compare-draft takes NAME=DIR, got {value!r}")
    return name, path


def config_from_args(args) -> bench.BenchConfig:
    temps = args.temperatures if args.temperatures is not None else (args.temperature,)
    return bench.BenchConfig(target=args.target, draft=args.draft, tasks=tuple(args.tasks), methods=tuple(args.methods),
                       n=args.n or None, max_new_tokens=args.max_new_tokens, temperatures=tuple(temps),
                       block_size=args.block_size, denoise_steps=args.denoise_steps, dtype=args.dtype,
                       weights=tuple(args.weights), compare_drafts=tuple(_named(v) for v in args.compare_draft),
                       seed=args.seed,
                       prompts=args.prompts, quick=args.quick, multi_turn=args.multi_turn, out=args.out,
                       pld_max_ngram=args.pld_max_ngram, eagle_draft=args.eagle_draft, gamma=args.gamma,
                       tree_budget=args.tree_budget,
                       llamacpp_gguf=args.llamacpp_gguf, compile=args.compile,
                       llamacpp_bf16_gguf=args.llamacpp_bf16_gguf, llamacpp_draft_gguf=args.llamacpp_draft_gguf,
                       llamacpp_draft_n=args.llamacpp_draft_n, llamacpp_spec_gguf=args.llamacpp_spec_gguf,
                       llamacpp_spec_n=args.llamacpp_spec_n, threads=args.threads, plots=not args.no_plots,
                       progress=not args.no_progress, command=shlex.join(["blockdraft"] + sys.argv[1:]))


def cmd_bench(args) -> int:
    results = bench.run_bench(config_from_args(args))
    for note in results["notes"]:
        print(f"note: {note}", file=sys.stderr)
    for tkey, block in results["summary"].items():
        overall = "all" if len(block["tasks"]) > 1 else block["tasks"][0]
        for r in block["rows"]:
            if r["task"] == overall:
                print(f"T={tkey} {r['task']:>5} {r['method']:>12}: tau {fmt_num(r['tau'])}, decode speedup "
                      f"{fmt_speedup(r['decode_speedup'])}, e2e speedup {fmt_speedup(r['e2e_speedup'])}")
    out = Path(results["config"]["out"])
    print(f"wrote {out / 'report.md'}, {out / 'results.json'} and {len(results['files']) - 2} plots")
    return 0
