"""Command-line entry points. Argument parsing only: each subcommand calls the library and prints.

Each subcommand imports the library code it runs, so building the parser loads only what registering the `bench`
and `serve` subcommands needs."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

log = logging.getLogger("blockdraft")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="HF id, local dir or .gguf file (default: packaged SmolLM2-135M)")
    p.add_argument("--draft", default=None, help="draft directory, 'none' for plain decoding (default: shipped)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    _weights_arg(p)
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per verify step (default: the draft's recommended decode block size, else its trained "
                        "size)")
    p.add_argument("--denoise-steps", type=int, default=1)
    p.add_argument("--hf-path", action="store_true",
                   help="decode through the target's HF modules and dynamic cache instead of the lean path")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the lean path's dense layers (minutes of compile; not faster on our CPU)")
    p.add_argument("--fixed-width", action="store_true",
                   help="always draft block size - 1 tokens (default: choose 0 .. block size - 1 per step from the "
                        "measured verify cost, the draft's time and its acceptance so far, skipping the draft where "
                        "it does not pay)")
    p.add_argument("--tree", action="store_true",
                   help="verify a tree of the draft's best candidates per step instead of its top-1 chain")
    p.add_argument("--tree-lookup", action="store_true",
                   help="a tree with prompt-lookup continuations as extra branches (implies --tree)")
    p.add_argument("--tree-budget", type=int, default=None,
                   help="candidate nodes per tree (default: chosen per step from a measured verify-cost curve, "
                        "cached in ~/.cache/blockdraft/calibration; fix it for exactly repeatable seeded sampling)")
    p.add_argument("--tree-recalibrate", action="store_true",
                   help="measure the verify-cost curve again (e.g. it was cached while the machine was busy)")


def _weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", default="auto", choices=["auto", "bf16", "int8", "int4"],
                   help="weights of the fast path: auto = a GGUF target's own quantization (4-bit / 8-bit blocks "
                        "mapped exactly), any other target float; bf16 = float weights (fp32 with --dtype fp32); "
                        "int8 / int4 = quantized from the float weights (opt-in, groups of 32)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--no-chat-template", action="store_true")


def _load(args):
    import torch

    from .config import GenerationConfig, SamplingParams
    from .loading import build_engine, build_tree_engine, load_target, resolve_draft

    torch.set_grad_enabled(False)
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    gen_cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                               denoise_steps=args.denoise_steps, stop_strings=tuple(args.stop))
    target, src = load_target(args.target, args.dtype, lean=not args.hf_path, compile=args.compile,
                              weights=args.weights)
    draft = resolve_draft(args.draft, src.name)
    if args.tree or args.tree_lookup:
        engine = build_tree_engine(target, draft, lookup=args.tree_lookup, budget=args.tree_budget,
                                   block_size=args.block_size, recalibrate=args.tree_recalibrate)
    else:
        engine = build_engine(target, draft, args.block_size, args.denoise_steps, adaptive=not args.fixed_width,
                              recalibrate=args.tree_recalibrate)
    log.info("target=%s draft=%s dtype=%s weights=%s %s %s", src.name, draft or "none", args.dtype,
             target.weights.describe(), gen_cfg, sampling)
    return engine, gen_cfg, sampling, draft


def _stats_line(res) -> str:
    s = res.stats
    return (f"[{s.new_tokens} tokens, tau {s.tau:.2f}, {s.target_forwards} target forwards, "
            f"decode {s.decode_tokens_per_s:.1f} tok/s, {s.total_seconds:.2f} s, "
            f"draft {s.draft_seconds:.2f} s / verify {s.verify_seconds:.2f} s"
            + (f", {sum(s.tree_nodes) / max(1, len(s.tree_nodes)):.1f} tree nodes per step (budget "
               f"{s.tree['budget']})" if s.tree else "") + "]")


def cmd_generate(args) -> int:
    from .loading import encode_prompt

    engine, gen_cfg, sampling, draft = _load(args)
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
    print(_stats_line(gen.result), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from .loading import encode_prompt

    engine, gen_cfg, sampling, _ = _load(args)
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
        print(_stats_line(gen.result), file=sys.stderr)
        messages.append({"role": "assistant", "content": gen.result.text})
    return 0


def cmd_init_draft(args) -> int:
    """Write a randomly initialised draft for a target (the starting point of training, or a speed baseline)."""
    import torch

    from .models.draft import DFlashDraftModel
    from .models.draft_config import DFlashConfig
    from .loading import default_mask_token_id, load_target

    target, _ = load_target(args.target, "fp32", weights="bf16")
    torch.manual_seed(args.seed)
    cfg = DFlashConfig.from_target(
        target.config, num_hidden_layers=args.layers, block_size=args.block_size,
        mask_token_id=args.mask_token_id if args.mask_token_id is not None
        else default_mask_token_id(target.tokenizer, target.vocab_size),
        num_target_features=args.num_target_features)
    DFlashDraftModel(cfg).init_from_target(target).save_pretrained(args.out)
    print(json.dumps({"out": args.out, "layers": cfg.num_hidden_layers, "target_layer_ids": cfg.target_layer_ids,
                      "mask_token_id": cfg.mask_token_id, "block_size": cfg.block_size}))
    return 0


def cmd_data(args) -> int:
    """Build the prompt set (dedupe, held-out split, decontamination) and regenerate answers with the target."""
    from .train.data import run_regeneration

    out = run_regeneration(target=args.target, out_dir=args.out, n_sharegpt=args.n_sharegpt, n_gsm=args.n_gsm,
                           max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                           dtype=args.dtype, temperature=args.temperature, extra_jsonl=tuple(args.jsonl),
                           num_threads=args.threads, weights=args.weights, only_task=args.only_task)
    print(json.dumps(out.get("summary", {}), default=str))
    return 0


def cmd_wide_prompts(args) -> int:
    """The wide prompt set, tokenized for a GPU regeneration round (recipes/smollm2-135m-dflash-gpu.py)."""
    import glob as globmod

    from .loading import load_hf_target
    from .train.records import load_records
    from .train.wide_prompts import (prompt_ids_of_records, wide_prompt_set, wide_sources, write_tokenized)

    _, tok, _ = load_hf_target(args.target, dtype="bf16")
    train, held, rep = wide_prompt_set(wide_sources(seed=args.seed), seed=args.seed)
    done = prompt_ids_of_records(r for f in sorted(globmod.glob(args.exclude)) for r in load_records(f)) \
        if args.exclude else set()
    out = Path(args.out)
    card = {"prompt_set": {k: v for k, v in rep.to_json().items() if k != "contaminated_ids"},
            "already_answered": len(done), "max_prompt_tokens": args.max_prompt_tokens,
            "train": write_tokenized(tok, train, out / "prompts-train.npz", args.max_prompt_tokens, done),
            "heldout": write_tokenized(tok, held[: args.heldout], out / "prompts-heldout.npz",
                                       args.max_prompt_tokens, done)}
    (out / "prompt-card.json").write_text(json.dumps(card, indent=1) + "\n")
    print(json.dumps(card))
    return 0


def cmd_pack(args) -> int:
    """Pack JSONL shards into one compact uint16 .npz (what the repo commits)."""
    from .train.records import pack_uint16, read_shards

    n = pack_uint16(read_shards(args.shards), args.out)
    print(json.dumps({"records": n, "out": args.out}))
    return 0


def cmd_features(args) -> int:
    """Precompute target features for offline training."""
    from .models.draft import DFlashDraftModel
    from .models.eagle import EagleDraftModel, is_eagle_draft
    from .loading import load_target
    from .train.features import precompute_features
    from .train.records import load_records

    target, _ = load_target(args.target, args.dtype, weights="bf16")  # training reads the float model
    draft_cls = EagleDraftModel if args.draft and is_eagle_draft(args.draft) else DFlashDraftModel
    layer_ids = (draft_cls.from_pretrained(args.draft).config.target_layer_ids if args.draft
                 else [int(x) for x in args.layer_ids.split(",")])
    precompute_features(target, layer_ids, load_records(args.data), args.out)
    print(json.dumps({"out": args.out, "layer_ids": layer_ids}))
    return 0


def cmd_train(args) -> int:
    """Train a draft (train/trainer.py): from teacher caches (cache=...) or from records (data=...)."""
    from dataclasses import fields

    from .train.config import TrainConfig
    from .train.trainer import train

    kw = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name, None) is not None}
    if "layer_ids" in kw:
        kw["layer_ids"] = [int(x) for x in kw["layer_ids"].split(",")]
    cfg = TrainConfig.from_yaml(args.config, **kw) if args.config else TrainConfig(**kw)
    if not cfg.cache and not cfg.data:
        raise ValueError("no training data: pass --cache DIR (a teacher cache, with --heldout-cache) or --data DIR "
                         "(records), or set one of them in the --config file")
    log.info("training config: %s", cfg)
    summary = train(cfg, resume=args.resume)
    summary.pop("losses", None)
    print(json.dumps(summary))
    return 0


def _train_args(t: argparse.ArgumentParser) -> None:
    """Every TrainConfig field as an optional flag (None = keep the config file's or the default value)."""
    from dataclasses import MISSING, fields

    from .train.config import TrainConfig, parse_bool

    for f in fields(TrainConfig):
        default = f.default if f.default is not MISSING else f.default_factory()
        if f.name == "layer_ids":
            default = "a continued draft's, else --num-target-features spread over the target's depth"
        kind = {"int": int, "float": float, "int | None": int, "float | None": float, "bool": parse_bool}.get(
            str(f.type), str)
        t.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=None,
                       help=f"(default {default})")


def cmd_teacher_cache(args) -> int:
    """Prefill the target over training records once: features, greedy labels, top-k logits (train/teacher.py)."""
    from .loading import load_target
    from .train.teacher import build_teacher_cache
    from .train.records import load_records

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from .train.precision import compute_dtype, dtype_name

    if args.offset < 0 or (args.limit is not None and args.limit < 0):
        raise ValueError("--offset and --limit must be >= 0")
    records = load_records(args.data)
    if args.offset > len(records):
        raise ValueError(f"--offset {args.offset}: {args.data} holds only {len(records)} records")
    end = None if args.limit is None else args.offset + args.limit
    records = records[args.offset:end]
    # training reads the float model; its prefill is compute-bound, so fp32 where bf16 matmuls are emulated
    target, _ = load_target(args.target, dtype_name(compute_dtype(args.dtype)), weights="bf16")
    if args.layer_ids:
        layers = [int(x) for x in args.layer_ids.split(",")]
    else:
        from .models.draft_config import default_target_layer_ids

        tc = getattr(target.config, "text_config", None) or target.config
        layers = default_target_layer_ids(int(tc.num_hidden_layers), 6)
    out = build_teacher_cache(target, records, args.out, layers, topk=args.topk, max_len=args.max_len,
                              first_record=args.offset)
    print(json.dumps({"out": str(out), "records": len(records), "first_record": args.offset, "layer_ids": layers}))
    return 0


def cmd_export(args) -> int:
    from .export.gguf import export_gguf

    res = export_gguf(args.out, args.draft, args.target, args.outtype)
    what = "target"
    if res.target_layers is not None:
        vocab = (f"draft vocabulary {res.draft_vocab_size} (d2t + head rows)" if res.draft_vocab_size
                 else "full vocabulary")
        what = f"draft, llama.cpp target layers {res.target_layers}, {vocab}"
    print(f"wrote {res.path} ({res.tensors} tensors, {args.outtype} {what})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="blockdraft", description="DFlash block-diffusion speculative decoding")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate a completion (streams text)")
    _model_args(g)
    _sampling_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    g.add_argument("prompt")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="multi-turn terminal chat")
    _model_args(c)
    _sampling_args(c)
    c.set_defaults(func=cmd_chat)

    i = sub.add_parser("init-draft", help="write a randomly initialised draft for a target")
    i.add_argument("--target", default=None)
    i.add_argument("--layers", type=int, default=3)
    i.add_argument("--block-size", type=int, default=16)
    i.add_argument("--num-target-features", type=int, default=None)
    i.add_argument("--mask-token-id", type=int, default=None)
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("--out", required=True)
    i.set_defaults(func=cmd_init_draft)

    d = sub.add_parser("data", help="build the prompt set and regenerate answers with the target (resumable)")
    d.add_argument("--target", default=None)
    d.add_argument("--out", required=True)
    d.add_argument("--n-sharegpt", type=int, default=6000)
    d.add_argument("--n-gsm", type=int, default=3000)
    d.add_argument("--jsonl", action="append", default=[], help="extra prompts: JSONL of {messages} or {prompt}")
    d.add_argument("--max-new-tokens", type=int, default=320)
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--batch-size", type=int, default=16)
    d.add_argument("--threads", type=int, default=None)
    d.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--only-task", default=None, choices=["sharegpt", "gsm", "jsonl"],
                   help="regenerate only this task's train prompts not yet written (the rest of the plan stays "
                        "for a later run without it)")
    _weights_arg(d)
    d.set_defaults(func=cmd_data)

    w = sub.add_parser("wide-prompts", help="the wide prompt set (ShareGPT turns, reasoning-gym, evals, "
                       "instructions), deduped, decontaminated and tokenized for a GPU regeneration round")
    w.add_argument("--target", default=None)
    w.add_argument("--out", required=True, help="directory: prompts-train.npz, prompts-heldout.npz, prompt-card.json")
    w.add_argument("--exclude", default=None, help="glob of packed records whose prompts are already answered")
    w.add_argument("--max-prompt-tokens", type=int, default=512)
    w.add_argument("--heldout", type=int, default=480, help="held-out prompts written (of ~2%% held out)")
    w.add_argument("--seed", type=int, default=0)
    w.set_defaults(func=cmd_wide_prompts)

    k = sub.add_parser("pack", help="pack regenerated JSONL shards into a compact uint16 .npz")
    k.add_argument("shards")
    k.add_argument("--out", required=True)
    k.set_defaults(func=cmd_pack)

    f = sub.add_parser("features", help="precompute target features for offline training")
    f.add_argument("--target", default=None)
    f.add_argument("--data", required=True)
    f.add_argument("--draft", default=None, help="take the layer ids from this draft's config")
    f.add_argument("--layer-ids", default=None, help="comma-separated target layer ids")
    f.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    f.add_argument("--out", required=True)
    f.set_defaults(func=cmd_features)

    for name in ("train", "train-fast"):
        t = sub.add_parser(name, help="train a DFlash draft from teacher caches (--cache, the fast path on a CPU) "
                                      "or from records (--data; also the EAGLE-3 baseline, --method eagle)"
                           if name == "train" else "the same as train")
        t.add_argument("--config", default=None, help="a recipe (YAML of the options below, e.g. recipes/*.yaml); "
                                                      "flags given here override it")
        t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out-dir")
        _train_args(t)
        t.set_defaults(func=cmd_train)

    x = sub.add_parser("export", help="export a DFlash draft (or, without --draft, the target) for llama.cpp")
    x.add_argument("--format", default="gguf", choices=["gguf"])
    x.add_argument("--draft", default=None, help="DFlash draft directory (omit: export the target itself)")
    x.add_argument("--target", default=None, help="the target's GGUF file (default: packaged SmolLM2-135M)")
    x.add_argument("--outtype", default="bf16", choices=["bf16", "f32"])
    x.add_argument("--out", required=True, help="output .gguf file")
    x.set_defaults(func=cmd_export)

    tc = sub.add_parser("teacher-cache", help="cache the target's features, greedy labels and top-k logits over "
                                              "training records (for train --cache; resumable)")
    tc.add_argument("--target", default=None)
    tc.add_argument("--data", required=True, help="JSONL shard directory or packed .npz of records")
    tc.add_argument("--out", required=True)
    tc.add_argument("--layer-ids", default=None, help="target layers to store, comma-separated (a superset of the "
                                                      "draft's; default: 6 spread over the target's depth)")
    tc.add_argument("--topk", type=int, default=16)
    tc.add_argument("--max-len", type=int, default=512)
    tc.add_argument("--limit", type=int, default=None, help="N records only (the first N, or N from --offset)")
    tc.add_argument("--offset", type=int, default=0,
                    help="skip the first N records: cache records appended after an earlier cache in a cache of "
                         "their own (train --cache A,B reads the union)")
    tc.add_argument("--threads", type=int, default=None)
    tc.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                    help="the prefill's float type (auto: bf16 where the CPU multiplies it natively, else fp32; the "
                         "cache stores bf16 features either way)")
    tc.set_defaults(func=cmd_teacher_cache)

    from .eval.bench import register as register_bench
    from .eval.heldout import register as register_heldout

    register_bench(sub)
    register_heldout(sub)

    from .serve.app import register as register_serve

    register_serve(sub)
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


if __name__ == "__main__":
    sys.exit(main())
