"""Product tools as subcommands: soak (the server under a long mixed load), serve-bench (serving throughput over
HTTP), step-profile (one target step per weights mode and decoder path), prefill-bench (prefill beside llama.cpp's
prompt processing), reduce-vocab (a draft proposing among the
most frequent tokens), plot (learning curves). Each maps its options onto its tool's config and runs it."""

from __future__ import annotations

import argparse
import shlex
import sys

from ..decode.spec import DRAFT_WEIGHTS
from ..eval import prefill, serve_bench, soak, step_profile
from ..serve.config import ServeConfig
from ..train import reduce_vocab
from .options import add_draft, add_dtype, add_target, csv


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(","))


def cmd_soak(args) -> int:
    server = ServeConfig(target=args.target, draft=args.draft, dtype=args.dtype, port=0, max_batch=args.max_batch,
                         max_queue=args.max_queue, max_tokens_cap=args.max_tokens, threads=args.threads or None)
    return soak.run(soak.SoakConfig(
        server=server, minutes=args.minutes, concurrency=args.concurrency, burst_every=args.burst_every,
        timeout=args.timeout, warmup=args.warmup, rss_tolerance=args.rss_tolerance, seed=args.seed, out=args.out,
        command=shlex.join(["blockdraft", *sys.argv[1:]])))


def cmd_serve_bench(args) -> int:
    server = ServeConfig(target=args.target, draft=args.draft, dtype=args.dtype, port=0, max_batch=args.max_batch,
                         max_queue=256, max_tokens_cap=args.max_tokens, threads=args.threads)
    return serve_bench.run(serve_bench.ServeBenchConfig(
        server=server, methods=tuple(args.methods.split(",")), tasks=tuple(args.tasks.split(",")), n=args.n,
        concurrency=_ints(args.concurrency), min_requests=args.min_requests, max_tokens=args.max_tokens,
        out=args.out))


def cmd_step_profile(args) -> int:
    return step_profile.run(step_profile.StepProfileConfig(
        target=args.target, dtype=args.dtype, context=args.context, widths=_ints(args.widths), reps=args.reps,
        rounds=args.rounds, threads=args.threads, layers=_ints(args.layers), paths=tuple(args.paths.split(",")),
        parts=tuple(args.parts.split(",")) if args.parts else (), draft=args.draft, draft_weights=args.draft_weights,
        accepted=args.accepted, out=args.out))


def cmd_prefill_bench(args) -> int:
    # a bad option exits as the tool's other refusals do: status 1, the message alone
    try:
        tokens = _ints(args.tokens)
    except ValueError:
        raise SystemExit(f"--tokens must be comma-separated integers, got {args.tokens!r}") from None
    try:
        cfg = prefill.PrefillConfig(target=args.target, dtype=args.dtype, draft=args.draft, tokens=tokens,
                                    methods=csv(args.methods), rounds=args.rounds, threads=args.threads,
                                    llamacpp_gguf=args.llamacpp_gguf, out=args.out)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return prefill.run(cfg)


def cmd_reduce_vocab(args) -> int:
    return reduce_vocab.run(reduce_vocab.ReduceVocabConfig(draft=args.draft, data=args.data, out=args.out,
                                                           size=args.size, heldout=args.heldout, target=args.target))


def cmd_plot(args) -> int:
    from ..train import plot_curves  # matplotlib takes longer to import than the rest of the CLI

    runs = []
    for spec in args.run:
        name, path = spec.split("=", 1)
        runs.append((name, path))
    return plot_curves.run(plot_curves.PlotConfig(runs=tuple(runs), out=args.out, probes=args.probes))


def register(sub) -> None:
    p = sub.add_parser("soak", help="soak test of the HTTP server: a bounded mixed load with faults, then a report "
                                    "(0 5xx, nothing lost or duplicated, flat RSS)")
    p.add_argument("--minutes", type=float, default=10.0)
    add_target(p)
    add_draft(p)
    add_dtype(p)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--max-queue", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48, help="largest max_tokens asked (also the server's cap)")
    p.add_argument("--burst-every", type=float, default=60.0, help="seconds between bursts above the queue limit")
    p.add_argument("--threads", type=int, default=1, help="server torch threads")
    p.add_argument("--timeout", type=float, default=300.0, help="client timeout per request (then: lost)")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds of load before the first RSS reading counts")
    p.add_argument("--rss-tolerance", type=float, default=0.05, help="allowed RSS growth, first to last minute")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/soak")
    p.set_defaults(func=cmd_soak)

    p = sub.add_parser("serve-bench", help="serving benchmark over HTTP at several concurrency levels, against the "
                                           "engine's solo runs on the same prompts")
    add_target(p)
    add_draft(p, "draft for the dflash method (default: the shipped one)")
    add_dtype(p)
    p.add_argument("--tasks", default="math,code,chat")
    p.add_argument("--n", type=int, default=3, help="prompts per task")
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--methods", default="ar,dflash", help="comma list of decode methods (blockdraft serve --method)")
    p.add_argument("--out", default=None, help="also write the markdown (and a .json next to it)")
    p.set_defaults(func=cmd_serve_bench)

    p = sub.add_parser("step-profile", help="time one target step per weights mode and decoder path, interleaved",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target(p)
    add_dtype(p)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--widths", default="1,4,8,16")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", default="1,27", help="tapped target layers (the default draft's)")
    p.add_argument("--paths", default="bf16-python,auto-python,auto-native", help="configurations to time")
    p.add_argument("--parts", default="ceiling,linears,draft",
                   help="measured beside the steps: ceiling (int8 multiply-adds/s), linears (the layers' linears "
                        "on M rows), head (the LM head on M rows), read (read bandwidth and the step's read floor), "
                        "draft (one draft step); comma-separated, '' for none")
    add_draft(p)
    p.add_argument("--draft-weights", default="int8", choices=[w for w in DRAFT_WEIGHTS if w != "auto"],
                   help="the draft's weights in the draft step (decoding on a quantized target uses int8)")
    p.add_argument("--accepted", type=int, default=2, help="positions committed by the verify before the draft step")
    p.add_argument("--out", default=None)
    p.set_defaults(func=cmd_step_profile)

    p = sub.add_parser("prefill-bench", help="prefill speed beside llama.cpp's own prompt processing of the same "
                                             "GGUF, methods interleaved",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target(p)
    add_dtype(p)
    add_draft(p, "draft for the dflash method (default: the shipped one)")
    p.add_argument("--tokens", default="512", help="prompt lengths, comma-separated")
    p.add_argument("--methods", default="ar,dflash,llamacpp-server",
                   help="comma list of ar, dflash (our engine) and llamacpp-server (llama.cpp's own timing)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llamacpp-gguf", default=None, help="GGUF for llama-server (default: the target's own file)")
    p.add_argument("--out", default=None, help="also write the figures as JSON")
    p.set_defaults(func=cmd_prefill_bench)

    p = sub.add_parser("reduce-vocab", help="derive a draft proposing only among the N most frequent response "
                                            "tokens of its training records (lossless: verification stays full)")
    add_target(p)
    p.add_argument("--draft", required=True)
    p.add_argument("--data", required=True, help="the draft's training records (JSONL shards or packed .npz)")
    p.add_argument("--heldout", default=None, help="held-out records: report the subset's coverage of their answers")
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_reduce_vocab)

    p = sub.add_parser("plot", help="learning curves of training runs (curve.jsonl) against the reference probes")
    p.add_argument("--run", action="append", required=True, help="NAME=path/to/curve.jsonl")
    p.add_argument("--probes", default=None)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_plot)
