"""`blockdraft generate` and `blockdraft chat`: decode with a target and its draft, streaming the text."""

from __future__ import annotations

import json
import logging
import sys

import torch

from ..config import GenerationConfig, SamplingParams
from ..decode.spec import AUTO, build_engine
from ..models.loading import encode_prompt, load_draft, load_target, resolve_draft
from .options import add_decode, add_model, add_sampling, decode_spec

log = logging.getLogger("blockdraft")


def add_decode_command(p) -> None:
    add_model(p)
    add_decode(p, AUTO)
    # the method's older spellings, kept for the users who have them in their scripts
    p.add_argument("--fixed-width", dest="method", action="store_const", const="dflash",
                   help="the same as --method dflash: always draft block size - 1 tokens")
    p.add_argument("--tree", dest="method", action="store_const", const="dflash-tree",
                   help="the same as --method dflash-tree")
    p.add_argument("--tree-lookup", dest="method", action="store_const", const="dflash+lookup",
                   help="the same as --method dflash+lookup")
    p.add_argument("--hf-path", action="store_true",
                   help="decode through the target's HF modules and dynamic cache instead of the lean path")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the lean path's dense layers (minutes of compile; not faster on our CPU)")
    add_sampling(p)


def load_engine(args):
    """-> (engine, generation config, sampling, draft directory or None) for parsed generate/chat options."""
    torch.set_grad_enabled(False)
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    gen_cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_strings=tuple(args.stop))
    target, src = load_target(args.target, args.dtype, lean=not args.hf_path, compile=args.compile,
                              weights=args.weights, decode_only=True)
    path = resolve_draft(args.draft, src.name)
    engine = build_engine(target, load_draft(path, target) if path is not None else None, decode_spec(args))
    log.info("target=%s draft=%s dtype=%s weights=%s %s %s %s", src.name, path or "none", args.dtype,
             target.weights.describe(), engine.spec, gen_cfg, sampling)
    return engine, gen_cfg, sampling, path


def stats_line(res) -> str:
    s = res.stats
    return (f"[{s.new_tokens} tokens, tau {s.tau:.2f}, {s.target_forwards} target forwards, "
            f"decode {s.decode_tokens_per_s:.1f} tok/s, {s.total_seconds:.2f} s, "
            f"draft {s.draft_seconds:.2f} s / verify {s.verify_seconds:.2f} s"
            + (f", {sum(s.tree_nodes) / max(1, len(s.tree_nodes)):.1f} tree nodes per step (budget "
               f"{s.tree['budget']})" if s.tree else "") + "]")


def cmd_generate(args) -> int:
    engine, gen_cfg, sampling, draft = load_engine(args)
    ids = encode_prompt(engine.tokenizer, args.prompt, not args.no_chat_template)
    if args.json:
        res = engine.generate(ids, gen_cfg, sampling)
        print(json.dumps({"text": res.text, "token_ids": res.token_ids, "finish_reason": res.finish_reason,
                          "draft": str(draft) if draft else None, "tau": res.stats.tau,
                          "accept_lengths": res.stats.accept_lengths, "target_forwards": res.stats.target_forwards,
                          "seconds": res.stats.total_seconds, "stats": res.stats.to_dict()}))
        return 0
    gen = engine.stream(ids, gen_cfg, sampling)
    for delta in gen:
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(stats_line(gen.result), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    engine, gen_cfg, sampling, _ = load_engine(args)
    messages: list[dict] = []
    print("blockdraft chat: empty line or Ctrl-D to quit, /reset to clear the history", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        if line == "/reset":
            messages.clear()
            continue
        messages.append({"role": "user", "content": line})
        gen = engine.stream(encode_prompt(engine.tokenizer, messages), gen_cfg, sampling)
        for delta in gen:
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        print(stats_line(gen.result), file=sys.stderr)
        messages.append({"role": "assistant", "content": gen.result.text})
    return 0


def register(sub) -> None:
    g = sub.add_parser("generate", help="generate a completion (streams text)")
    add_decode_command(g)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    g.add_argument("prompt")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="multi-turn terminal chat")
    add_decode_command(c)
    c.set_defaults(func=cmd_chat)
