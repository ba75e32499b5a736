"""`blockdraft serve`: the OpenAI-compatible server's options, mapped onto serve.config.ServeConfig (serve/app.py
runs it)."""

from __future__ import annotations

import argparse
import dataclasses
import os

from ..serve.config import ServeConfig
from .options import add_decode, add_model


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_model(p, draft_help="draft directory, 'none' for plain decoding, 'pld' for prompt lookup (default: shipped)",
              weights_help="weights mode (see `blockdraft generate --help`)")
    add_decode(p, "dflash")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: pick a free one; printed at start)")
    p.add_argument("--api-key", default=os.environ.get("BLOCKDRAFT_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $BLOCKDRAFT_API_KEY, else none)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together")
    p.add_argument("--batch-policy", default="measured", choices=["measured", "always"],
                   help="with several sequences active: measured = each step drafts only when this target's "
                        "measured verify cost says it commits more tokens per second than a plain step (a wide "
                        "verify of many rows is compute-bound on a CPU); always = every step drafts")
    p.add_argument("--draft-max-batch", type=int, default=0,
                   help="never draft while more than this many sequences are active (0: no cap)")
    p.add_argument("--max-queue", type=int, default=32, help="requests waiting beyond max-batch (then 429)")
    p.add_argument("--max-tokens-cap", type=int, default=512, help="upper bound on max_tokens per request")
    p.add_argument("--max-prompt-tokens", type=int, default=2048,
                   help="longest prompt accepted (then 400): a prompt is prefilled inside one step, during which no "
                        "other stream moves (0: only the target's context bounds prompts)")
    p.add_argument("--max-step-tokens", type=int, default=None,
                   help="verified positions per step shared by all rows (default: no limit, full blocks)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body size limit (then 413)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds allowed to receive a request body (then 408; guards against stalled uploads)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument("--debug-step-delay", type=float, default=0.0, help=argparse.SUPPRESS)  # testing aid


def serve_config(args) -> ServeConfig:
    """The ServeConfig of parsed `add_serve_args` options (each of its fields is the flag of the same name)."""
    return ServeConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServeConfig)})


def cmd_serve(args) -> int:
    cfg = serve_config(args)
    from ..serve.app import serve_main  # the web stack is imported only when a server runs

    try:
        return serve_main(cfg)
    except (NotImplementedError, OSError) as e:
        raise ValueError(str(e)) from e


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to the CLI's subparsers."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with batched speculative decoding")
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)
    return p
