"""The one training loop: AdamW, warm-up + cosine schedule with a floor, bf16 autocast where the hardware has it,
atomic checkpoints with exact resume (train/checkpoint.py), SIGTERM/SIGINT handling, a time budget, a held-out
learning curve, data-parallel training under torchrun.

What a step trains on comes from one of two objectives, picked by the config's source (`config.py`): teacher
caches (`cached.py`, the fast path on a CPU) or records with the target run online (`live.py`, also EAGLE-3). Both
draw their batches from generators seeded by the step (and the sample), so a run killed and resumed from a
checkpoint replays exactly the steps an uninterrupted run would have taken.

A run writes into out_dir: train_log.jsonl (loss, lr, gradient norm, per-row accuracy, rows/s every `log_every`
steps), curve.jsonl (the held-out evaluation every `eval_every` steps, against training minutes and rows),
checkpoints/ and draft/ (the current draft, loadable by every decoder).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..models.draft import DFlashDraftModel, check_compatible
from ..models.draft_config import DFlashConfig, default_target_layer_ids
from ..models.target import TargetModel
from .checkpoint import export_draft, latest_checkpoint, load_checkpoint, save_checkpoint, trim_log
from .config import INITS, TrainConfig
from .precision import compute_dtype, dtype_name
from .records import load_records
from ..models.loading import default_mask_token_id, load_target
from .cached import CachedObjective, frequent_greedy_tokens, open_caches
from .eagle import make_eagle_draft
from .live import LiveObjective, frequent_tokens

log = logging.getLogger(__name__)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over `warmup` steps, then a cosine from lr down to min_lr_ratio * lr at `steps`."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    prog = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))


def group_lr(role: str | None, step: int, cfg: TrainConfig) -> float:
    """A parameter group's learning rate at `step` (`draft_param_groups` names the roles): the draft's schedule;
    the copy gate's table at its own rate, constant after warm-up; the layer mix at `mix_lr_scale` times the
    schedule."""
    if role == "gate":
        return cfg.copy_gate_lr * min(1.0, (step + 1) / max(1, cfg.warmup))
    return lr_at(step, cfg) * (cfg.mix_lr_scale if role == "mix" else 1.0)


def draft_param_groups(draft: nn.Module) -> list[dict]:
    """The trainable parameters by role: "draft", and where the draft has them "gate" (the copy gate's table: a
    few dozen bonuses that must reach several nats; its w, one weight per hidden unit summed over H, moves with the
    draft's, since at the gate's rate its H steps would add up to nats) and "mix" (the layer mix's weights)."""
    gate = [draft.copy_gate.table] if getattr(draft, "copy_gate", None) is not None else []
    mix = [draft.mix] if getattr(draft, "mix", None) is not None else []
    own = {id(p) for p in gate + mix}
    groups = [{"params": [p for p in draft.parameters() if p.requires_grad and id(p) not in own], "role": "draft"}]
    groups += [{"params": [p for p in ps if p.requires_grad], "role": role} for role, ps in (("gate", gate),
                                                                                          ("mix", mix)) if ps]
    return [g for g in groups if g["params"]]


def resolve_layer_ids(cfg: TrainConfig, target) -> TrainConfig:
    """cfg with layer_ids filled in when unset: a continued draft's own, else `num_target_features` layers spread
    over the target's depth."""
    if cfg.layer_ids is not None or cfg.method == "eagle":
        return cfg
    if cfg.init not in INITS:
        ids = DFlashDraftModel.from_pretrained(cfg.init, dtype=torch.float32).config.target_layer_ids
    else:
        ids = default_target_layer_ids(int(target.config.num_hidden_layers), cfg.num_target_features)
    log.info("target layers for the fusion: %s", ids)
    return replace(cfg, layer_ids=[int(i) for i in ids])


def make_draft(cfg: TrainConfig, target, frequent: Callable[[int], torch.Tensor] | None = None) -> nn.Module:
    """The draft a run starts from: fresh (initialised per `cfg.init`) or a continued one, extended where the
    config asks for more than it has. frequent(n) -> the n token ids a reduced draft vocabulary keeps (each source
    counts its own labels)."""
    if cfg.method == "eagle":
        return make_eagle_draft(cfg, target).train()
    cfg = resolve_layer_ids(cfg, target)
    if cfg.init not in INITS:
        draft = DFlashDraftModel.from_pretrained(cfg.init, dtype=torch.float32)
        check_compatible(draft.config, target)
        if draft.selector is not None:
            log.info("%s's chain selector is dropped: it was fitted to the draft as it is (`blockdraft "
                     "train-selector` fits one to the continued draft)", cfg.init)
            draft = draft.without_selector()
        if draft.config.target_layer_ids != list(cfg.layer_ids):
            if any(i not in cfg.layer_ids for i in draft.config.target_layer_ids):
                raise ValueError(f"{cfg.init} reads layers {draft.config.target_layer_ids}, the run asks for "
                                 f"{list(cfg.layer_ids)} (a continued draft may only gain layers)")
            log.info("extending the fusion of %s from layers %s to %s (new columns start at zero)", cfg.init,
                     draft.config.target_layer_ids, list(cfg.layer_ids))
            draft = draft.with_target_layers(list(cfg.layer_ids))
        if cfg.num_layers > draft.config.num_hidden_layers:
            log.info("appending %d identity-initialised layers to %s", cfg.num_layers - draft.config.num_hidden_layers,
                     cfg.init)
            draft = draft.with_extra_layers(target, cfg.num_layers - draft.config.num_hidden_layers)
        if draft.config.next_token_feature and not cfg.next_token_feature:
            raise ValueError(f"{cfg.init} reads the next token's embedding; continue it with --next-token-feature true")
        if cfg.next_token_feature and not draft.config.next_token_feature:
            log.info("adding the next-token input to the fusion of %s (its columns start at zero)", cfg.init)
            draft = draft.with_next_token_feature(cfg.next_token_scale)
        if draft.config.copy_gate and not cfg.copy_gate:
            if cfg.source == "cache":
                raise ValueError(f"{cfg.init} has a copy gate; continue it with --copy-gate true")
            # the live source has no lookup candidates to train the gate on: it is kept as it is, frozen, so that
            # the continued draft still scores prompt lookup's candidate the way it learned to
            log.info("%s's copy gate is kept frozen (the live source does not train it)", cfg.init)
            draft.copy_gate.requires_grad_(False)
        if cfg.copy_gate and not draft.config.copy_gate:
            log.info("adding a copy gate to %s (its bonus starts at zero)", cfg.init)
            draft = draft.with_copy_gate()
        if draft.config.layer_mix and not cfg.layer_mix:
            raise ValueError(f"{cfg.init} mixes the fused inputs per layer; continue it with --layer-mix true")
        if cfg.layer_mix and not draft.config.layer_mix:
            log.info("giving each layer of %s its own mix of the fused inputs (all weights start at 1)", cfg.init)
            draft = draft.with_layer_mix()
        return draft.train()
    torch.manual_seed(cfg.seed)
    mask_id = (cfg.mask_token_id if cfg.mask_token_id is not None
               else default_mask_token_id(target.tokenizer, target.vocab_size))
    dcfg = DFlashConfig.from_target(target.config, num_hidden_layers=cfg.num_layers, block_size=cfg.block_size,
                                    mask_token_id=mask_id, target_layer_ids=list(cfg.layer_ids),
                                    draft_vocab_size=cfg.draft_vocab_size or None,
                                    next_token_feature=cfg.next_token_feature,
                                    next_token_scale=cfg.next_token_scale, copy_gate=cfg.copy_gate,
                                    layer_mix=cfg.layer_mix,
                                    **({"intermediate_size": cfg.intermediate_size} if cfg.intermediate_size else {}))
    draft = DFlashDraftModel(dcfg).float().init_from_target(target)
    if cfg.init in ("target", "target-identity"):
        draft.init_layers_from_target(target)
    if cfg.init == "target-identity":
        # the copied layers' output maps start at zero: every layer starts as the identity on the residual stream,
        # so the first logits are the head applied to the normed input embeddings (a loss near unigram level)
        # instead of deep-layer updates applied to an embedding-scale stream (~18 nats, gradient norms ~500)
        with torch.no_grad():
            for layer in draft.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    if dcfg.draft_vocab_size is not None:
        if frequent is None:
            raise ValueError("a reduced draft vocabulary is chosen from the training data: none given")
        draft.set_draft_vocab(frequent(dcfg.draft_vocab_size))
    return draft.train()


def _dist_info() -> tuple[int, int]:
    """(rank, world size). Under torchrun (WORLD_SIZE > 1) the process group is created here: NCCL on GPUs,
    gloo on CPU."""
    if dist.is_available() and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _average_gradients(params: list[torch.Tensor], world: int) -> None:
    """Data parallelism: every process ends the step with the mean of all processes' gradients."""
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


class _StopFlag:
    """SIGTERM/SIGINT ask for a checkpoint at the end of the current step, then a clean exit (`--resume`
    continues)."""

    def __init__(self) -> None:
        self.set = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside a test runner thread)
                pass
        return self

    def _handle(self, signum, frame) -> None:
        log.warning("signal %s: checkpointing after this step", signum)
        self.set = True

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _append(path: Path, entry: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


def train(cfg: TrainConfig, target: TargetModel | None = None, records: list[dict] | None = None,
          heldout: list[dict] | None = None, resume: bool = False, stop_after: int | None = None,
          progress: bool = True) -> dict:
    """Train (or, with resume, continue) a draft; returns a summary with the last held-out evaluation.
    records / heldout: the live source's records when not read from cfg.data / cfg.heldout. `stop_after` ends the
    process-local loop after that many steps (a test's stand-in for a kill; the checkpoint it leaves is what
    SIGTERM would leave)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rank, world = _dist_info()
    out = Path(cfg.out_dir)
    if target is None:
        if not cfg.target:
            raise ValueError("no target model: pass --target (a path, a hub id or an alias)")
        # training reads the float model; its prefill is compute-bound, so fp32 where bf16 matmuls are emulated
        device_type = torch.device(cfg.device).type
        target, _ = load_target(cfg.target, dtype_name(compute_dtype(cfg.precision, device_type)), device=cfg.device,
                                weights="bf16")
    target.requires_grad_(False)
    dtype = compute_dtype(cfg.precision, target.device.type)
    log.info("computing in %s (precision %s)", dtype_name(dtype), cfg.precision)
    cfg = resolve_layer_ids(cfg, target)
    if cfg.source == "cache":
        caches, held = open_caches(cfg)
        draft = make_draft(cfg, target, lambda n: frequent_greedy_tokens(caches, n, target.vocab_size,
                                                                         target.eos_token_ids))
        objective = CachedObjective(cfg, target, draft, caches, held, dtype)
    else:
        if records is None:
            if not cfg.data:
                raise ValueError("no training data: give data (records) or cache (teacher caches)")
            records = load_records(cfg.data)
        if heldout is None and cfg.heldout:
            heldout = load_records(cfg.heldout)
        draft = make_draft(cfg, target, lambda n: frequent_tokens(records, n, target.vocab_size,
                                                                  target.eos_token_ids))
        draft = draft.to(target.device)
        objective = LiveObjective(cfg, target, draft, records, heldout, dtype)
    draft.config.extra["trained_with"] = "blockdraft"
    draft.config.no_target_features = cfg.no_target_features
    if cfg.decode_block:
        draft.config.decode_block_size = cfg.decode_block
    if cfg.decode_method:
        draft.config.decode_method = cfg.decode_method

    groups = draft_param_groups(draft)
    params = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    state = {"step": 0, "samples_seen": 0, "rows": 0, "train_seconds": 0.0, "config": asdict(cfg)}
    log_path, curve_path = out / "train_log.jsonl", out / "curve.jsonl"
    ckpt = latest_checkpoint(out)
    if resume and ckpt is not None:
        state = load_checkpoint(ckpt, draft, opt)
        log.info("resumed from %s (step %d, %.1f min of training)", ckpt, state["step"], state["train_seconds"] / 60)
    elif resume:
        log.info("--resume: no checkpoint in %s, starting fresh", out)
    elif ckpt is not None:
        raise FileExistsError(f"{out} already has checkpoints: pass --resume to continue, or choose another --out")
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        for p in (log_path, curve_path):
            if state["step"] > 0:
                trim_log(p, state["step"])
            elif p.exists():  # a fresh run over an earlier one's logs (which left no checkpoint)
                p.unlink()

    def log_eval(extra: dict) -> dict:
        entry = {"step": state["step"], "minutes": round(state["train_seconds"] / 60, 3), "rows": state["rows"],
                 **extra, **objective.evaluate()}
        _append(curve_path, entry)
        log.info("step %d  %.1f min  %s", state["step"], entry["minutes"],
                 {k: v for k, v in entry.items() if k in ("loss", "tau4", "walk_tau", "eval_tau")})
        return entry

    def checkpoint() -> None:
        # the exported config carries the run's totals so far
        draft.config.extra.update({"steps": state["step"], "train_minutes": round(state["train_seconds"] / 60, 2)})
        save_checkpoint(out, draft, opt, state, cfg.keep_last)
        export_draft(draft, out / "draft")

    last = log_eval({}) if state["step"] == 0 and rank == 0 else None
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=state["step"], desc="train", dynamic_ncols=True)

    def new_window() -> dict:
        return {"loss": 0.0, "n": 0, "correct": torch.zeros(objective.acc_width, dtype=torch.long),
                "counted": torch.zeros(objective.acc_width, dtype=torch.long), "rows": 0, "seconds": 0.0}

    log_win, eval_win = new_window(), new_window()
    losses: list[float] = []
    steps_here, saved_at = 0, -1
    with _StopFlag() as stop:
        while state["step"] < cfg.steps:
            if cfg.minutes and state["train_seconds"] >= cfg.minutes * 60:
                break
            step = state["step"]
            for g in opt.param_groups:
                g["lr"] = group_lr(g.get("role"), step, cfg)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss, correct, counted, rows = objective.step(state, rank, world)
            if world > 1:
                _average_gradients(params, world)
            gnorm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
            opt.step()
            seconds = time.perf_counter() - t0
            state["train_seconds"] += seconds
            state["rows"] += rows
            state["step"] = step + 1
            steps_here += 1
            losses.append(loss)
            for w in (log_win, eval_win):
                w["loss"] += loss
                w["n"] += 1
                w["correct"] += correct
                w["counted"] += counted
                w["rows"] += rows
                w["seconds"] += seconds
            done = state["step"] == cfg.steps
            if rank == 0:
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.3f}", lr=f"{opt.param_groups[0]['lr']:.2e}")
                if state["step"] % cfg.log_every == 0 or done:
                    acc = (log_win["correct"].float() / log_win["counted"].clamp_min(1).float())
                    _append(log_path, {"step": state["step"], "loss": log_win["loss"] / log_win["n"],
                                       "lr": opt.param_groups[0]["lr"], "grad_norm": gnorm,
                                       "acc": [round(a, 4) for a in acc[objective.acc_from:].tolist()],
                                       "rows_per_s": log_win["rows"] / max(1e-9, log_win["seconds"]),
                                       "time": time.time()})
                    log_win = new_window()
                if (cfg.eval_every and state["step"] % cfg.eval_every == 0) or done:
                    acc = (eval_win["correct"].float() / eval_win["counted"].clamp_min(1).float())
                    last = log_eval({"loss": round(eval_win["loss"] / eval_win["n"], 4),
                                     "train_acc": [round(a, 4) for a in acc[objective.acc_from:][:4].tolist()],
                                     "grad_norm": round(gnorm, 3),
                                     "rows_per_s": round(state["rows"] / max(1e-9, state["train_seconds"]), 1)})
                    eval_win = new_window()
                halt = stop.set or (stop_after is not None and steps_here >= stop_after)
                if halt or done or state["step"] % cfg.save_every == 0:
                    checkpoint()
                    saved_at = state["step"]
            if stop.set or (stop_after is not None and steps_here >= stop_after):
                break
    if bar is not None:
        bar.close()
    if rank == 0:
        if last is None or last["step"] != state["step"]:
            last = log_eval({"rows_per_s": round(state["rows"] / max(1e-9, state["train_seconds"]), 1)})
        if saved_at != state["step"]:  # a time budget ended the loop between checkpoints
            checkpoint()
    return {**(last or {}), "step": state["step"], "steps": state["step"], "total_steps": cfg.steps, "losses": losses,
            "out": str(out / "draft")}
