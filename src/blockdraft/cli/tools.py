"""Product tools as subcommands: soak (the server under a long mixed load), serve-bench (serving throughput over
HTTP), step-profile (one target step per weights mode and decoder path), prefill-bench (prefill beside llama.cpp's
prompt processing), reduce-vocab (a draft proposing among the
most frequent tokens), plot (learning curves). Each imports its module only when it runs."""

from __future__ import annotations

import argparse
import importlib

from ..decode.spec import DRAFT_WEIGHTS
from .options import add_draft, add_dtype, add_target


def _run(module: str):
    def run(args) -> int:
        return importlib.import_module(f"blockdraft.{module}").run(args)

    return run


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
    p.set_defaults(func=_run("eval.soak"))

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
    p.set_defaults(func=_run("eval.serve_bench"))

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
    p.set_defaults(func=_run("eval.step_profile"))

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
    p.set_defaults(func=_run("eval.prefill"))

    p = sub.add_parser("reduce-vocab", help="derive a draft proposing only among the N most frequent response "
                                            "tokens of its training records (lossless: verification stays full)")
    add_target(p)
    p.add_argument("--draft", required=True)
    p.add_argument("--data", required=True, help="the draft's training records (JSONL shards or packed .npz)")
    p.add_argument("--heldout", default=None, help="held-out records: report the subset's coverage of their answers")
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_run("train.reduce_vocab"))

    p = sub.add_parser("plot", help="learning curves of training runs (curve.jsonl) against the reference probes")
    p.add_argument("--run", action="append", required=True, help="NAME=path/to/curve.jsonl")
    p.add_argument("--probes", default=None)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_run("train.plot_curves"))
