"""Command-line entry points: argument parsing only, each subcommand calls the library and prints.

Subcommands by module: decode.py (generate, chat), train.py (init-draft, data, wide-prompts, pack, features, train,
teacher-cache, export, heldout-tau), bench.py (bench), serve.py (serve), tools.py (soak, serve-bench,
step-profile, prefill-bench, reduce-vocab, plot); options.py declares the options they share."""

from __future__ import annotations

import argparse
import logging
import sys

from . import bench, decode, serve, tools, train


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="blockdraft", description="DFlash block-diffusion speculative decoding")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)
    for module in (decode, train, bench, serve, tools):
        module.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
