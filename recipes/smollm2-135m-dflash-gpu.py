#!/usr/bin/env python
"""One GPU round for the default target (SmolLM2-135M-Instruct): regenerate answers for the wide prompt set, then
train a fresh DFlash draft on them plus the packaged answers, then decode a few held-out prompts with the engine on
the GPU as a check. Every stage has a time budget, so the round fits a fixed lease; what it writes goes to --out:

    regen-heldout.npz, regen-train-{0,1,2}.npz   the new answers (packed records, `records.load_packed`; JSONL
                                                 shard directories of those names for a vocabulary over 65,535)
    draft/ (config.json, model.safetensors; --split-draft writes model-{a,b}.safetensors instead)
    log.txt                                      progress, the training log and a summary as the last line

The prompts come tokenized (`--prompts`, written on a CPU by `blockdraft wide-prompts --out DIR --exclude
'data/smollm2-regen/train-*.npz'`, see data/smollm2-regen/README.md); the target is its GGUF file (`--gguf`). `--smoke` runs every stage on a tiny
random model instead, for a check of the code path on a new machine.

    python recipes/smollm2-135m-dflash-gpu.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --prompts prompts-train.npz \
        --heldout-prompts prompts-heldout.npz --existing 'data/smollm2-regen/train-*.npz' --out out \
        --gen-seconds 240 --train-minutes 4

Any GGUF target the engine loads runs the same round; for Qwen2.5-Coder-1.5B-Instruct, continuing its shipped draft
on blocks of 4 beside the answers committed as JSONL shards (docs/training-on-a-gpu.md, "Another target"):

    python recipes/smollm2-135m-dflash-gpu.py --gguf qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --prompts gpu15/prompts-train.npz --heldout-prompts gpu15/prompts-heldout.npz --heldout-answers false \
        --existing data/qwen2.5-coder-1.5b-regen/shards --init models/qwen2.5-coder-1.5b-dflash --block 16 \
        --train-block 4 --layers 1 --out out --gen-seconds 240 --train-minutes 6
"""

from __future__ import annotations

import argparse
import glob
import json
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch

T0 = time.time()
LOG: Path | None = None


def say(*parts) -> None:
    line = f"[{time.time() - T0:7.1f}s] " + " ".join(str(p) for p in parts)
    print(line, flush=True)
    if LOG is not None:
        with open(LOG, "a") as f:
            f.write(line + "\n")


def pack_split(records: list[dict], stem: Path, parts: int) -> list[str]:
    """records in `parts` files stem-k.npz (packed), or, for a vocabulary uint16 cannot hold, JSONL shard
    directories stem-k/ (written beside, then swapped in: the round rewrites them as answers come in)."""
    from blockdraft.train.records import UINT16_MAX, ShardWriter, pack_uint16

    wide = any(max(r["input_ids"], default=0) > UINT16_MAX for r in records)
    names = []
    for k in range(parts):
        chunk = records[k::parts]
        if not chunk:
            continue
        if wide:
            d = stem.with_name(f"{stem.name}-{k}")
            tmp = d.with_name(d.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            writer = ShardWriter(tmp, 10**9)
            writer.write(chunk)
            writer.close()
            shutil.rmtree(d, ignore_errors=True)
            tmp.rename(d)
            names.append(d.name)
        else:
            p = stem.with_name(f"{stem.name}-{k}.npz")
            pack_uint16(chunk, p)
            names.append(p.name)
    return names


def tiny_target(device):
    from transformers import LlamaConfig, LlamaForCausalLM

    from blockdraft.models.target import TargetModel

    cfg = LlamaConfig(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.05, eos_token_id=299, bos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).to(torch.bfloat16).to(device).eval().requires_grad_(False)
    return TargetModel(hf, lean=False)


def main() -> int:
    global LOG
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--heldout-prompts", default=None)
    ap.add_argument("--existing", default="", help="globs (comma-separated) of records trained on beside the new "
                    "ones: packed .npz files or JSONL shard directories (a vocabulary over 65,535 tokens)")
    ap.add_argument("--existing-heldout", default="", help="packed held-out records (the engine check's prompts)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/blockdraft-round")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gen-seconds", type=float, default=240)
    ap.add_argument("--train-minutes", type=float, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=288)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--taps", type=int, default=5)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--train-block", type=int, default=0, help="rows per training block, below --block (0: --block): "
                    "a draft that decodes short blocks trains them")
    ap.add_argument("--anchors", type=int, default=96)
    ap.add_argument("--seqs", type=int, default=48)
    ap.add_argument("--max-len", type=int, default=640)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--draft-vocab", type=int, default=8192, help="the draft proposes among this many tokens")
    ap.add_argument("--extra-taps", default="", help="with --init: target layers the continued draft also reads, "
                    "comma-separated (its fusion's new columns start at zero; --layers above its own appends layers "
                    "that start as the identity): draft capacity, grown without forgetting")
    ap.add_argument("--init", default="target", help="'target' (a fresh draft from the target's last layers) or a "
                    "draft directory to continue (its layers, taps and vocabulary are kept, or grown by --layers / "
                    "--extra-taps)")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--sizes", default="", help="a data-scaling curve instead of one run: comma-separated record "
                    "counts, each a run of --epochs epochs on that many records (a seeded draw of all of them)")
    ap.add_argument("--epochs", type=float, default=1.0, help="epochs of each --sizes run")
    ap.add_argument("--check-prompts", type=int, default=4, help="held-out prompts the engine check decodes")
    ap.add_argument("--heldout-answers", default="true", choices=["true", "false"],
                    help="answer the held-out prompts too (false: they only serve the engine check)")
    ap.add_argument("--split-draft", action="store_true", help="weights in two files (a size cap on outputs)")
    ap.add_argument("--smoke", action="store_true", help="every stage on a tiny random model")
    args = ap.parse_args()

    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    LOG = out / "log.txt"
    summary: dict = {"args": vars(args)}
    dev = torch.device(args.device)
    say("torch", torch.__version__, "device", dev, torch.cuda.get_device_name(0) if dev.type == "cuda" else "")

    from blockdraft.models.draft_config import default_target_layer_ids
    from blockdraft.train.config import TrainConfig
    from blockdraft.train.records import load_records
    from blockdraft.train.regen_hf import generate_batched
    from blockdraft.train.trainer import train
    from blockdraft.train.wide_prompts import read_tokenized

    # ------------------------------------------------------------------------------------------- the target
    if args.smoke:
        target = tiny_target(dev)
        g = torch.Generator().manual_seed(1)
        train_ids = [f"smoke/{i}" for i in range(40)]
        train_prompts = [torch.randint(1, 290, (int(n),), generator=g).tolist()
                         for n in torch.randint(4, 30, (40,), generator=g)]
        held_ids, held_prompts = train_ids[:4], train_prompts[:4]
        mask_id = 300
    else:
        from blockdraft.models.loading import default_mask_token_id, load_target

        target, _ = load_target(args.gguf, "bf16", device=str(dev), lean=False, weights="bf16")
        train_ids, train_prompts = read_tokenized(args.prompts) if args.prompts else ([], [])
        held_ids, held_prompts = read_tokenized(args.heldout_prompts) if args.heldout_prompts else ([], [])
        mask_id = default_mask_token_id(target.tokenizer, target.vocab_size)
    target.requires_grad_(False)
    eos = list(target.eos_token_ids)
    tok = target.tokenizer
    pad = int(tok.pad_token_id) if tok is not None and tok.pad_token_id is not None else eos[0]
    say("target loaded:", target.num_layers, "layers, vocab", target.vocab_size, "eos", eos, "pad", pad,
        "prompts", len(train_prompts), "held", len(held_prompts))

    # ------------------------------------------------------------------------------------------- regeneration
    def records_of(ids, prompts, got):
        return [{"id": ids[i], "input_ids": prompts[i] + a, "loss_mask": [0] * len(prompts[i]) + [1] * len(a)}
                for i, a in sorted(got.items()) if a]

    new_records: list[dict] = []
    gen_prompts = train_prompts if args.gen_seconds > 0 else []  # none: train on --existing alone
    try:
        gen_end = time.time() + args.gen_seconds
        held_got: dict[int, list[int]] = {}
        if held_prompts and args.gen_seconds > 0 and args.heldout_answers == "true":
            st = generate_batched(target.hf, held_prompts, eos_ids=eos, pad_id=pad,
                                  max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                  on_batch=lambda idx, ans: held_got.update(zip(idx, ans)))
            pack_split(records_of(held_ids, held_prompts, held_got), out / "regen-heldout", 1)
            say("held-out answers:", st)
        got: dict[int, list[int]] = {}
        last_save = [time.time()]

        def on_batch(idx, ans):
            got.update(zip(idx, ans))
            n_tok = sum(len(a) for a in got.values())
            say(f"answers {len(got)}/{len(gen_prompts)}, {n_tok} tokens, "
                f"{n_tok / max(1e-9, time.time() - gen_start):.0f} tok/s")
            if time.time() - last_save[0] > 100:
                pack_split(records_of(train_ids, train_prompts, got), out / "regen-train", 3)
                last_save[0] = time.time()

        gen_start = time.time()
        st = generate_batched(target.hf, gen_prompts, eos_ids=eos, pad_id=pad, max_new_tokens=args.max_new_tokens,
                              batch_size=args.batch_size, deadline=gen_end, on_batch=on_batch)
        new_records = records_of(train_ids, train_prompts, got)
        summary["regen"] = {"answered": st.answered, "tokens": st.new_tokens, "finished": st.finished,
                            "seconds": round(st.seconds, 1), "tok_per_s": round(st.tokens_per_s)}
        say("regeneration:", summary["regen"], "files", pack_split(new_records, out / "regen-train", 3))
        if new_records:  # kept on the machine too: a later call on it can train on them
            pack_split(new_records, work / "regen-train", 3)
    except Exception:  # noqa: BLE001 - what was answered is kept; training still runs on what there is
        say("regeneration failed:\n" + traceback.format_exc())

    # ------------------------------------------------------------------------------------------- training
    try:
        existing = [r for pat in args.existing.split(",") if pat for f in sorted(glob.glob(pat))
                    for r in load_records(f)]
        if args.smoke:
            existing = records_of(train_ids, train_prompts, {i: [7, 8, 9, 7, 8, 9] * 5 for i in range(40)})
        records = existing + new_records
        say("training on", len(records), "records (", len(existing), "packaged +", len(new_records), "new )")
        taps = default_target_layer_ids(target.num_layers, min(args.taps, target.num_layers))
        if args.init != "target":  # a continued draft keeps its taps, layers and vocabulary (or gains some)
            from blockdraft.models.draft import DFlashDraftModel

            init_cfg = DFlashDraftModel.from_pretrained(args.init, dtype=torch.float32).config
            extra = [int(i) for i in args.extra_taps.split(",") if i.strip()]
            taps = sorted(set(init_cfg.target_layer_ids) | set(extra))
            args.layers = max(args.layers, init_cfg.num_hidden_layers)
            if args.block != init_cfg.block_size:  # the live source trains whole blocks of the draft's own size
                raise SystemExit(f"--block {args.block}: {args.init} has block size {init_cfg.block_size}; a "
                                 "continued draft keeps its block size (--train-block trains shorter blocks)")
            say("continuing", args.init, "taps", taps, "layers", args.layers, "block", init_cfg.block_size)
        base = dict(device=str(dev), batched=True, attention="sdpa", num_layers=args.layers,
                    layer_ids=taps, block_size=args.block, train_block=args.train_block, mask_token_id=mask_id,
                    anchors=args.anchors,
                    seqs_per_step=args.seqs, max_len=args.max_len, lr=args.lr, warmup=args.warmup, min_lr_ratio=0.05,
                    precision="bf16", init=args.init, eval_every=0, eval_prompts=0, log_every=25,
                    save_every=10**9, keep_last=1, seed=0, loss_chunk_rows=8192,
                    draft_vocab_size=min(args.draft_vocab, target.vocab_size // 2))

        def run_training(name: str, recs: list[dict], steps: int | None) -> Path:
            """One run on recs: `steps` steps, or (None) as many as --train-minutes allows, timed by a probe.
            -> the run's draft directory."""
            run = work / name
            shutil.rmtree(run, ignore_errors=True)
            if steps is None:
                # the schedule needs a step count: time a few steps of the same shape first, then fit the budget
                probe_dir = work / "probe"
                shutil.rmtree(probe_dir, ignore_errors=True)
                train(TrainConfig(**{**base, "out_dir": str(probe_dir), "log_every": 1}, steps=8), target=target,
                      records=recs, progress=False)
                log_lines = [json.loads(x) for x in (probe_dir / "train_log.jsonl").read_text().splitlines()]
                gaps = sorted(b["time"] - a["time"] for a, b in zip(log_lines[2:], log_lines[3:]))
                sec_per_step = gaps[len(gaps) // 2]
                steps = max(20, int(args.train_minutes * 60 / sec_per_step))
                say(f"probe: ~{sec_per_step * 1000:.0f} ms/step -> {steps} steps "
                    f"({steps * args.seqs / max(1, len(recs)):.2f} epochs)", log_lines[-1])
            cfg = {**base, "out_dir": str(run), "log_every": max(1, min(25, steps // 40)),
                   "warmup": min(args.warmup, max(1, steps // 5))}
            res = train(TrainConfig(**cfg, steps=steps, minutes=args.train_minutes * 1.1 if not args.sizes else 0),
                        target=target, records=recs, progress=False)
            if (run / "train_log.jsonl").is_file():
                for line in (run / "train_log.jsonl").read_text().splitlines():
                    say(f"train[{name}]", line)
            summary.setdefault("train", {})[name] = {k: v for k, v in res.items() if k != "losses"}
            summary["train"][name].update(records=len(recs), steps_planned=steps,
                                          epochs=round(steps * args.seqs / max(1, len(recs)), 3))
            return run / "draft"

        def publish(src: Path, name: str) -> Path:
            draft_dir = out / name
            shutil.rmtree(draft_dir, ignore_errors=True)
            shutil.copytree(src, draft_dir)
            if args.split_draft:
                from safetensors.torch import load_file, save_file

                state = load_file(str(draft_dir / "model.safetensors"))
                total = sum(v.numel() * v.element_size() for v in state.values())
                first, size = {}, 0
                for k in sorted(state):
                    if size < total / 2:
                        first[k] = state[k]
                        size += state[k].numel() * state[k].element_size()
                save_file(first, str(draft_dir / "model-a.safetensors"))
                save_file({k: v for k, v in state.items() if k not in first},
                          str(draft_dir / "model-b.safetensors"))
                (draft_dir / "model.safetensors").unlink()
            say("draft written:", name, sorted(p.name for p in draft_dir.iterdir()))
            return draft_dir

        if args.sizes:
            order = torch.randperm(len(records), generator=torch.Generator().manual_seed(7)).tolist()
            for n in [int(x) for x in args.sizes.split(",") if x.strip()]:
                recs = [records[i] for i in order[:n]]
                steps = max(1, round(args.epochs * len(recs) / args.seqs))
                checked = run_training(f"run-{len(recs)}", recs, steps)
                publish(checked, f"draft-{len(recs)}")
        else:
            checked = run_training("run", records, None)
            publish(checked, "draft")
    except Exception:  # noqa: BLE001
        say("training failed:\n" + traceback.format_exc())
        checked = None

    # ------------------------------------------------------------------------------------------- engine check
    try:
        from blockdraft.config import GenerationConfig
        from blockdraft.decode.spec import DecodeSpec, build_engine
        from blockdraft.models.draft import DFlashDraftModel

        if checked is not None and (checked / "model.safetensors").is_file():
            draft = DFlashDraftModel.from_pretrained(checked, dtype=target.dtype).to(dev).eval()
            plain = build_engine(target, None, DecodeSpec("ar"))
            drafted = build_engine(target, draft, DecodeSpec("dflash", draft_weights="bf16"))
            checks = []
            for p in held_prompts[: args.check_prompts]:
                a = plain.generate(p, GenerationConfig(max_new_tokens=64))
                b = drafted.generate(p, GenerationConfig(max_new_tokens=64))
                acc = b.stats.accept_lengths
                checks.append({"equal": a.token_ids == b.token_ids, "tau": sum(acc) / max(1, len(acc))})
            summary["engine_check"] = checks
            say("engine on", dev, checks)
    except Exception:  # noqa: BLE001
        say("engine check failed:\n" + traceback.format_exc())
    summary["seconds"] = round(time.time() - T0, 1)
    say("SUMMARY", json.dumps(summary, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
