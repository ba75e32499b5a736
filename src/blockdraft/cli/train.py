"""The training-side subcommands: init-draft, data, wide-prompts, pack, features, train, teacher-cache, train-selector,
export and heldout-tau. Each maps its options onto the library's config and prints what the library returns."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import MISSING, fields

from ..decode.spec import DRAFT_WEIGHTS
from ..export.gguf import export_gguf
from ..train import heldout
from ..train.config import TrainConfig, load_train_config, parse_bool
from ..train.data import run_regeneration
from ..train.features import FeaturesConfig, write_features
from ..train.init_draft import InitDraftConfig, init_draft
from ..train.records import pack_uint16, read_shards
from ..train.selector import SelectorConfig, train_selector
from ..train.teacher import FEATS, TeacherCacheConfig, run_teacher_cache
from ..train.trainer import train
from ..train.wide_prompts import WidePromptsConfig, write_wide_prompts
from .options import add_dtype, add_target, add_weights

log = logging.getLogger("blockdraft")


def _layer_ids(text: str | None) -> tuple[int, ...] | None:
    return tuple(int(x) for x in text.split(",")) if text else None


def cmd_init_draft(args) -> int:
    """Write a randomly initialised draft for a target (the starting point of training, or a speed baseline)."""
    cfg = init_draft(InitDraftConfig(out=args.out, target=args.target, layers=args.layers, block_size=args.block_size,
                                     num_target_features=args.num_target_features,
                                     mask_token_id=args.mask_token_id, seed=args.seed))
    print(json.dumps({"out": args.out, "layers": cfg.num_hidden_layers, "target_layer_ids": cfg.target_layer_ids,
                      "mask_token_id": cfg.mask_token_id, "block_size": cfg.block_size}))
    return 0


def cmd_data(args) -> int:
    """Build the prompt set (dedupe, held-out split, decontamination) and regenerate answers with the target."""
    out = run_regeneration(target=args.target, out_dir=args.out, n_sharegpt=args.n_sharegpt, n_gsm=args.n_gsm,
                           max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                           dtype=args.dtype, temperature=args.temperature, extra_jsonl=tuple(args.jsonl),
                           num_threads=args.threads, weights=args.weights, only_task=args.only_task,
                           record_layers=_layer_ids(args.record_layers) or (), record_topk=args.record_topk,
                           record_max_len=args.record_max_len, record_feats=args.record_feats)
    print(json.dumps(out.get("summary", {}), default=str))
    return 0


def cmd_wide_prompts(args) -> int:
    """The wide prompt set, tokenized for a GPU regeneration round (recipes/smollm2-135m-dflash-gpu.py)."""
    card = write_wide_prompts(WidePromptsConfig(out=args.out, target=args.target, exclude=args.exclude,
                                                max_prompt_tokens=args.max_prompt_tokens, heldout=args.heldout,
                                                seed=args.seed))
    print(json.dumps(card))
    return 0


def cmd_pack(args) -> int:
    """Pack JSONL shards into one compact uint16 .npz (what the repo commits)."""
    n = pack_uint16(read_shards(args.shards), args.out)
    print(json.dumps({"records": n, "out": args.out}))
    return 0


def cmd_features(args) -> int:
    """Precompute target features for offline training."""
    layer_ids = write_features(FeaturesConfig(data=args.data, out=args.out, target=args.target, draft=args.draft,
                                              layer_ids=_layer_ids(args.layer_ids), dtype=args.dtype))
    print(json.dumps({"out": args.out, "layer_ids": layer_ids}))
    return 0


def cmd_train(args) -> int:
    """Train a draft (train/trainer.py): from teacher caches (cache=...) or from records (data=...)."""
    kw = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name, None) is not None}
    if "layer_ids" in kw:
        kw["layer_ids"] = [int(x) for x in kw["layer_ids"].split(",")]
    cfg = load_train_config(args.config, **kw)
    log.info("training config: %s", cfg)
    summary = train(cfg, resume=args.resume)
    summary.pop("losses", None)
    print(json.dumps(summary))
    return 0


def _train_args(t: argparse.ArgumentParser) -> None:
    """Every TrainConfig field as an optional flag (None = keep the config file's or the default value)."""
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
    print(json.dumps(run_teacher_cache(TeacherCacheConfig(
        data=args.data, out=args.out, target=args.target, layer_ids=_layer_ids(args.layer_ids), topk=args.topk,
        max_len=args.max_len, limit=args.limit, offset=args.offset, threads=args.threads, dtype=args.dtype,
        feats=args.feats, weights=args.weights))))
    return 0


def cmd_train_selector(args) -> int:
    """Fit a chain selector to a trained draft (train/selector.py)."""
    print(json.dumps(train_selector(SelectorConfig(
        draft=args.draft, cache=args.cache, heldout_cache=args.heldout_cache, out_dir=args.out, target=args.target,
        rank=args.rank, top_k=args.top_k, block=args.block, anchors=args.anchors, max_len=args.max_len,
        limit=args.limit, epochs=args.epochs, lr=args.lr, threads=args.threads))))
    return 0


def cmd_export(args) -> int:
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
    d.add_argument("--record-layers", default=None,
                   help="also write the answers' teacher data from the same pass (the tapped features of these "
                        "target layers, comma-separated, and the top-k logits) into OUT/teacher and "
                        "OUT/teacher-heldout, what `train --cache` reads (default: none; `teacher-cache` later)")
    d.add_argument("--record-topk", type=int, default=16, help="with --record-layers: logits kept per position")
    d.add_argument("--record-max-len", type=int, default=512,
                   help="with --record-layers: positions kept per record (as teacher-cache's --max-len)")
    d.add_argument("--record-feats", default="bf16", choices=FEATS,
                   help="with --record-layers: the features as bf16, or int8 codes with a scale per 32 values "
                        "(56%% of the disk)")
    d.set_defaults(func=cmd_data)

    w = sub.add_parser("wide-prompts", help="the wide prompt set (ShareGPT turns, reasoning-gym, evals, "
                       "instructions), deduped, decontaminated and tokenized for a GPU regeneration round")
    add_target(w)
    w.add_argument("--out", required=True, help="directory: prompts-train.npz, prompts-heldout.npz, prompt-card.json")
    w.add_argument("--exclude", default=None, help="glob of records whose prompts are already answered (packed "
                   ".npz files or JSONL shard directories)")
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
    tc.add_argument("--feats", default="bf16", choices=FEATS,
                    help="the features as bf16, or int8 codes with a scale per 32 values (56%% of the disk)")
    tc.add_argument("--limit", type=int, default=None, help="N records only (the first N, or N from --offset)")
    tc.add_argument("--offset", type=int, default=0,
                    help="skip the first N records: cache records appended after an earlier cache in a cache of "
                         "their own (train --cache A,B reads the union)")
    tc.add_argument("--threads", type=int, default=None)
    tc.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                    help="the prefill's float type (auto: bf16 where the CPU multiplies it natively, else fp32; the "
                         "features are stored as --feats says either way)")
    tc.add_argument("--weights", default="bf16", choices=["bf16", "auto"],
                    help="bf16: the target's float modules; auto: its decode path on its own weights (a GGUF's "
                         "quantized blocks on the native kernels): the features `data --record-layers` records, "
                         "bit for bit, and the faster prefill on a CPU")
    tc.set_defaults(func=cmd_teacher_cache)

    sl = sub.add_parser("train-selector", help="fit a chain selector (the block's rows chosen in order among the "
                                               "draft's top-k) to a trained draft, which stays frozen (resumable)")
    add_target(sl)
    sl.add_argument("--draft", required=True, help="the trained draft's directory")
    sl.add_argument("--cache", required=True, help="teacher caches, comma-separated (as train --cache)")
    sl.add_argument("--heldout-cache", required=True)
    sl.add_argument("--out", required=True, help="run directory; the draft with its selector goes to OUT/draft")
    sl.add_argument("--rank", type=int, default=256, help="the selector MLP's width")
    sl.add_argument("--top-k", type=int, default=16, help="candidates per row")
    sl.add_argument("--block", type=int, default=None, help="rows per block (default: the draft's decode block)")
    sl.add_argument("--anchors", type=int, default=64, help="anchors per training sequence")
    sl.add_argument("--max-len", type=int, default=640)
    sl.add_argument("--limit", type=int, default=0, help="training sequences (0: all)")
    sl.add_argument("--epochs", type=int, default=2,
                    help="passes over the rows (more overfit a few thousand answers' rows)")
    sl.add_argument("--lr", type=float, default=2e-3)
    sl.add_argument("--threads", type=int, default=None)
    sl.set_defaults(func=cmd_train_selector)

    _register_heldout(sub)


def cmd_heldout_tau(args) -> int:
    drafts = []
    for spec in args.draft:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--draft takes NAME=DIR, got {spec!r}")
        drafts.append((name, path))
    rows = heldout.run_heldout_tau(heldout.HeldoutTauConfig(
        drafts=tuple(drafts), target=args.target, prompt_set=args.set, block_size=args.block_size,
        heldout=args.heldout, prompts=args.prompts, max_new_tokens=args.max_new_tokens, weights=args.weights,
        draft_weights=args.draft_weights, threads=args.threads, out=args.out))
    for r in rows:
        print(json.dumps(r), flush=True)
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
