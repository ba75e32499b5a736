"""The training-side subcommands: init-draft, data, wide-prompts, pack, features, train, teacher-cache, export and
heldout-tau. Each imports the library code it runs, so building the parser stays cheap."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from ..decode.spec import DRAFT_WEIGHTS
from ..train import heldout
from .options import add_dtype, add_target, add_weights

log = logging.getLogger("blockdraft")


def cmd_init_draft(args) -> int:
    """Write a randomly initialised draft for a target (the starting point of training, or a speed baseline)."""
    import torch

    from ..models.draft import DFlashDraftModel
    from ..models.draft_config import DFlashConfig
    from ..models.loading import default_mask_token_id, load_target

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
    from ..train.data import run_regeneration

    out = run_regeneration(target=args.target, out_dir=args.out, n_sharegpt=args.n_sharegpt, n_gsm=args.n_gsm,
                           max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                           dtype=args.dtype, temperature=args.temperature, extra_jsonl=tuple(args.jsonl),
                           num_threads=args.threads, weights=args.weights, only_task=args.only_task)
    print(json.dumps(out.get("summary", {}), default=str))
    return 0


def cmd_wide_prompts(args) -> int:
    """The wide prompt set, tokenized for a GPU regeneration round (recipes/smollm2-135m-dflash-gpu.py)."""
    import glob as globmod

    from ..models.loading import load_hf_target
    from ..train.records import load_records
    from ..train.wide_prompts import (prompt_ids_of_records, wide_prompt_set, wide_sources, write_tokenized)

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
    from ..train.records import pack_uint16, read_shards

    n = pack_uint16(read_shards(args.shards), args.out)
    print(json.dumps({"records": n, "out": args.out}))
    return 0


def cmd_features(args) -> int:
    """Precompute target features for offline training."""
    from ..models.draft import DFlashDraftModel
    from ..models.eagle import EagleDraftModel, is_eagle_draft
    from ..models.loading import load_target
    from ..train.features import precompute_features
    from ..train.records import load_records

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

    from ..train.config import TrainConfig
    from ..train.trainer import train

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

    from ..train.config import TrainConfig, parse_bool

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
    from ..models.loading import load_target
    from ..train.teacher import build_teacher_cache
    from ..train.records import load_records

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from ..train.precision import compute_dtype, dtype_name

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
        from ..models.draft_config import default_target_layer_ids

        tc = getattr(target.config, "text_config", None) or target.config
        layers = default_target_layer_ids(int(tc.num_hidden_layers), 6)
    out = build_teacher_cache(target, records, args.out, layers, topk=args.topk, max_len=args.max_len,
                              first_record=args.offset)
    print(json.dumps({"out": str(out), "records": len(records), "first_record": args.offset, "layer_ids": layers}))
    return 0


def cmd_export(args) -> int:
    from ..export.gguf import export_gguf

    res = export_gguf(args.out, args.draft, args.target, args.outtype)
    what = "target"
    if res.target_layers is not None:
        vocab = (f"draft vocabulary {res.draft_vocab_size} (d2t + head rows)" if res.draft_vocab_size
                 else "full vocabulary")
        what = f"draft, llama.cpp target layers {res.target_layers}, {vocab}"
    print(f"wrote {res.path} ({res.tensors} tensors, {args.outtype} {what})")
    return 0


def register(sub) -> None:
    i = sub.add_parser("init-draft", help="write a randomly initialised draft for a target")
    add_target(i)
    i.add_argument("--layers", type=int, default=3)
    i.add_argument("--block-size", type=int, default=16)
    i.add_argument("--num-target-features", type=int, default=None)
    i.add_argument("--mask-token-id", type=int, default=None)
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("--out", required=True)
    i.set_defaults(func=cmd_init_draft)

    d = sub.add_parser("data", help="build the prompt set and regenerate answers with the target (resumable)")
    add_target(d)
    d.add_argument("--out", required=True)
    d.add_argument("--n-sharegpt", type=int, default=6000)
    d.add_argument("--n-gsm", type=int, default=3000)
    d.add_argument("--jsonl", action="append", default=[], help="extra prompts: JSONL of {messages} or {prompt}")
    d.add_argument("--max-new-tokens", type=int, default=320)
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--batch-size", type=int, default=16)
    d.add_argument("--threads", type=int, default=None)
    add_dtype(d)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--only-task", default=None, choices=["sharegpt", "gsm", "jsonl"],
                   help="regenerate only this task's train prompts not yet written (the rest of the plan stays "
                        "for a later run without it)")
    add_weights(d)
    d.set_defaults(func=cmd_data)

    w = sub.add_parser("wide-prompts", help="the wide prompt set (ShareGPT turns, reasoning-gym, evals, "
                       "instructions), deduped, decontaminated and tokenized for a GPU regeneration round")
    add_target(w)
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
    add_target(f)
    f.add_argument("--data", required=True)
    f.add_argument("--draft", default=None, help="take the layer ids from this draft's config")
    f.add_argument("--layer-ids", default=None, help="comma-separated target layer ids")
    add_dtype(f)
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
    add_target(x, "the target's GGUF file (default: packaged SmolLM2-135M)")
    x.add_argument("--outtype", default="bf16", choices=["bf16", "f32"])
    x.add_argument("--out", required=True, help="output .gguf file")
    x.set_defaults(func=cmd_export)

    tc = sub.add_parser("teacher-cache", help="cache the target's features, greedy labels and top-k logits over "
                                              "training records (for train --cache; resumable)")
    add_target(tc)
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

    _register_heldout(sub)


def cmd_heldout_tau(args) -> int:
    import torch

    from ..models.loading import load_target

    drafts = []
    for spec in args.draft:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--draft takes NAME=DIR, got {spec!r}")
        drafts.append((name, path))
    if args.threads:
        torch.set_num_threads(args.threads)
    target, _ = load_target(args.target, "bf16", weights=args.weights)
    prompts = heldout.heldout_prompts(target.tokenizer, args.set, args.prompts, args.heldout)
    rows = heldout.heldout_tau(target, drafts, prompts, args.max_new_tokens, args.block_size, args.draft_weights)
    for r in rows:
        r.update(target=args.target, set=args.set, weights=args.weights)
        print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


def _register_heldout(sub) -> None:
    p = sub.add_parser("heldout-tau", help="held-out tau of several drafts in one run (greedy, the real engine)",
                       description=heldout.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", action="append", required=True, metavar="NAME=DIR", help="repeatable")
    add_target(p, "the drafts' target (a path, a hub id or an alias)")
    p.add_argument("--set", default="regen", choices=heldout.SETS, help="prompt set (see above)")
    p.add_argument("--block-size", type=int, default=None,
                   help="decode block (fixed width; default: each draft's recommended decode block)")
    p.add_argument("--heldout", default=None, help="held-out records for --set regen")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=96)
    add_weights(p)
    p.add_argument("--draft-weights", default="auto", choices=DRAFT_WEIGHTS,
                   help="the drafts' fused weights (auto: 8-bit beside a quantized target)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="append the results as JSON lines to this file")
    p.set_defaults(func=cmd_heldout_tau)
