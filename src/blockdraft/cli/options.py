"""The options several subcommands share, declared once: the target, the draft, the float type, the weights, how to
decode (a method of the registry and its settings) and how to sample."""

from __future__ import annotations

import argparse

from ..decode.spec import ALIASES, AUTO, AUTO_FALLBACK, DRAFT_WEIGHTS, METHODS, DecodeSpec

WEIGHT_CHOICES = ("auto", "bf16", "int8", "int4")
METHOD_NAMES = (AUTO,) + tuple(METHODS) + tuple(sorted(ALIASES))


def add_target(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument("--target", default=None,
                   help=help or "HF id, local dir, .gguf file or packaged alias (default: packaged SmolLM2-135M)")


def add_draft(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument("--draft", default=None,
                   help=help or "draft directory, 'none' for plain decoding (default: the target's shipped draft)")


def add_dtype(p: argparse.ArgumentParser, default: str = "bf16", auto: bool = False) -> None:
    p.add_argument("--dtype", default=default, choices=(["auto"] if auto else []) + ["bf16", "fp32"])


def add_weights(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument("--weights", default="auto", choices=WEIGHT_CHOICES,
                   help=help or "weights of the fast path: auto = a GGUF target's own quantization (4-bit / 8-bit "
                                "blocks mapped exactly), any other target float; bf16 = float weights (fp32 with "
                                "--dtype fp32); int8 / int4 = quantized from the float weights (opt-in, groups of 32)")


def add_model(p: argparse.ArgumentParser, draft_help: str | None = None, weights_help: str | None = None) -> None:
    """--target, --draft, --dtype, --weights."""
    add_target(p)
    add_draft(p, draft_help)
    add_dtype(p)
    add_weights(p, weights_help)


def add_decode(p: argparse.ArgumentParser, default_method: str) -> None:
    """--method and the DecodeSpec settings (--block-size, --denoise-steps, --tree-budget, --draft-weights,
    --recalibrate)."""
    p.add_argument("--method", default=default_method, choices=METHOD_NAMES, metavar="METHOD",
                   help="how to decode, one of: " + "; ".join(f"{m.name} = {m.summary}" for m in METHODS.values())
                        + f"; {AUTO} = the method the draft's config.json recommends (decode_method), else "
                          f"{AUTO_FALLBACK} (default {default_method}; aliases: "
                        + ", ".join(f"{a} = {t}" for a, t in sorted(ALIASES.items())) + ")")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per verify step (default: the draft's recommended decode block size, else its "
                        "trained size)")
    p.add_argument("--denoise-steps", type=int, default=1)
    p.add_argument("--tree-budget", type=int, default=None,
                   help="tree methods: candidate nodes per tree (default: chosen per step from a measured verify-cost "
                        "curve, cached in ~/.cache/blockdraft/calibration; fix it for exactly repeatable seeded "
                        "sampling)")
    p.add_argument("--draft-weights", default="auto", choices=DRAFT_WEIGHTS,
                   help="the draft's fused weights (auto: 8-bit when the target runs on quantized weights; int4 "
                        "halves the bytes a draft step reads, at some cost in acceptance)")
    p.add_argument("--recalibrate", "--tree-recalibrate", dest="recalibrate", action="store_true",
                   help="measure the verify-cost curve again (e.g. it was cached while the machine was busy)")


def decode_spec(args, batch_policy: str = "always") -> DecodeSpec:
    """The DecodeSpec of parsed `add_decode` options."""
    return DecodeSpec(method=args.method, block_size=args.block_size, denoise_steps=args.denoise_steps,
                      tree_budget=args.tree_budget, draft_weights=args.draft_weights, batch_policy=batch_policy,
                      recalibrate=args.recalibrate)


def add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--no-chat-template", action="store_true")


def csv(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def floats(s: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in csv(s))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None
