"""The DFlash draft trainer: AdamW + cosine schedule, bf16 autocast, gradient accumulation, atomic checkpoints with
exact resume (model, optimizer, scheduler, RNG, data position; train/checkpoint.py), periodic tau evaluation, DDP under
torchrun.

Determinism: the data order of each epoch is a permutation seeded by (seed, epoch) and the anchors of a sample by
(seed, sample index), so a run killed and resumed from a checkpoint replays exactly the batches an uninterrupted run
would have seen.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..draft import DFlashDraftModel, check_compatible
from ..draft_config import DFlashConfig
from ..target import TargetModel
from .blocks import (IGNORE, block_attention_mask, build_blocks, default_gamma, flex_block_mask, loss_weights,
                     sample_anchors)
from .checkpoint import export_draft, latest_checkpoint, load_checkpoint, save_checkpoint, trim_log
from .loss import block_loss

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    data: str = ""  # JSONL shard directory, or a packed .npz
    out_dir: str = "runs/draft"
    target: str | None = None
    init_draft: str | None = None  # start from this draft directory instead of a random init
    num_layers: int = 3
    init_layers: str = "random"  # or "target": start the layers as copies of the target's last ones
    target_labels: bool = False  # label every block row with the target's greedy token there (teacher-forced)
    block_size: int = 16
    num_target_features: int | None = None  # default: num_layers (as the public drafts)
    mask_token_id: int | None = None  # default: chosen from the target's tokenizer
    draft_vocab_size: int | None = None  # propose among the N most frequent response tokens of the data only
    num_anchors: int = 512  # per sequence (paper), capped by the valid positions
    gamma: float | None = None  # default from block size (7 for 16)
    no_loss_decay: bool = False
    uniform_blocks: bool = False
    no_target_features: bool = False
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    epochs: float = 1.0
    max_steps: int | None = None  # overrides epochs
    batch_size: int = 4  # sequences per optimizer step (gradient accumulation on one process)
    max_seq_len: int = 1024
    grad_clip: float = 1.0
    seed: int = 0
    dtype: str = "bf16"  # autocast dtype for the draft; the target runs in this dtype too
    features: str = "online"  # or a directory written by `blockdraft features`
    save_every: int = 200
    keep_last: int = 3
    eval_every: int = 0  # 0 = only at the end
    eval_prompts: int = 8
    eval_max_new_tokens: int = 64
    heldout: str | None = None  # shards/npz of held-out records for tau evaluation
    log_every: int = 10
    loss_chunk_rows: int = 512
    attention: str = "auto"  # "sdpa" (dense bool mask), "flex" (BlockMask), "auto" = flex on CUDA, else sdpa
    method: str = "dflash"  # "dflash" (block diffusion) or "eagle" (the EAGLE-3 baseline, train/eagle.py)
    ttt_steps: int = 3  # eagle: unrolled training-time-test steps after step 0 (EAGLE-3 uses 6; CPU budget: 3)

    @classmethod
    def from_yaml(cls, path: str, **overrides) -> "TrainConfig":
        import yaml

        with open(path) as f:
            raw = yaml.safe_load(f) or {}
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"{path}: unknown training options {sorted(unknown)}")
        raw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**raw)


def load_records(path: str | Path) -> list[dict]:
    """Training records from a JSONL shard directory or a packed `.npz` (see train/data.py)."""
    from .records import load_packed, read_shards

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"training data not found: {p}")
    records = load_packed(p) if p.suffix == ".npz" else list(read_shards(p))
    if not records:
        raise ValueError(f"no training records in {p}")
    return records


class TrainModule(nn.Module):
    """The draft's training forward in one module call (so DDP sees a single forward per micro-batch)."""

    def __init__(self, draft: DFlashDraftModel) -> None:
        super().__init__()
        self.draft = draft

    def forward(self, features: torch.Tensor | None, block_embeds: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """features [1, L, K*H] or None (no conditioning), block_embeds [1, R, H], positions [1, R],
        mask [1, 1, R, L + R] bool or the equivalent flex BlockMask -> hidden [R, H]."""
        cfg = self.draft.config
        if features is None:
            shape = (cfg.num_hidden_layers, 1, cfg.num_key_value_heads, 0, cfg.head_dim)
            ks = vs = block_embeds.new_zeros(shape)
        else:
            ks, vs = self.draft.context_kv(features, torch.arange(features.shape[1]).unsqueeze(0))
        return self.draft(block_embeds, positions, ks, vs, mask)[0]


def sample_loss(module: nn.Module, target: TargetModel, record: dict, features_fn, cfg: TrainConfig,
                draft_cfg: DFlashConfig, sample_index: int, vocab_ids: torch.Tensor | None = None,
                vocab_map: torch.Tensor | None = None):
    """Loss of one training sequence (all its anchor blocks in one forward). Returns None if it has no anchor.
    vocab_ids [Vd] / vocab_map [V] (target id -> draft id or IGNORE): a reduced draft vocabulary."""
    ids = torch.tensor(record["input_ids"][: cfg.max_seq_len], dtype=torch.long)
    lm = torch.tensor(record["loss_mask"][: cfg.max_seq_len], dtype=torch.long)
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + sample_index)
    anchors = sample_anchors(lm, cfg.num_anchors, draft_cfg.block_size, g, uniform=cfg.uniform_blocks)
    if anchors.numel() == 0:
        return None
    label_ids = None
    if cfg.target_labels:
        if not hasattr(features_fn, "with_greedy"):
            raise ValueError("target_labels needs online features (the target's greedy tokens come from its forward)")
        feats, greedy = features_fn.with_greedy(record, cfg.max_seq_len)
        # the token at t+1 is labelled with what the target itself would emit after the true prefix up to t
        label_ids = torch.cat([ids[:1], greedy[:-1].to(ids.device)])
    else:
        feats = None if cfg.no_target_features else features_fn(record)
    feats = None if cfg.no_target_features else feats[:, : ids.numel()]
    bb = build_blocks(ids, lm, anchors, draft_cfg.block_size, draft_cfg.mask_token_id, label_ids)
    ctx_len = 0 if feats is None else feats.shape[1]
    use_flex = cfg.attention == "flex" or (cfg.attention == "auto" and target.device.type == "cuda")
    if use_flex:
        mask = flex_block_mask(anchors, draft_cfg.block_size, ctx_len, target.device)
    else:
        mask = block_attention_mask(anchors, draft_cfg.block_size, ctx_len)[None, None].to(target.device)
    with torch.no_grad():
        embeds = target.embed(bb.block_ids.unsqueeze(0))
    autocast = torch.autocast("cpu" if target.device.type == "cpu" else "cuda", dtype=torch.bfloat16,
                              enabled=cfg.dtype == "bf16")
    head, labels = target.lm_head.weight, bb.labels
    if vocab_map is not None:
        # reduced draft vocabulary: logits over its rows only; labels outside it cannot be proposed and are ignored
        head = head[vocab_ids]
        labels = torch.where(labels >= 0, vocab_map[labels.clamp_min(0)], labels)
    with autocast:
        hidden = module(feats, embeds, bb.positions.unsqueeze(0), mask)
        gamma = None if cfg.no_loss_decay else (cfg.gamma or default_gamma(draft_cfg.block_size))
        out = block_loss(hidden, labels, bb.offsets, loss_weights(bb.offsets, gamma),
                         head, draft_cfg.block_size, cfg.loss_chunk_rows,
                         softcap=getattr(target, "_softcap", None))
    return out


def lr_lambda(total_steps: int, warmup_ratio: float):
    warm = max(1, int(round(total_steps * warmup_ratio)))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


# --------------------------------------------------------------------------------------------------- the loop
def _dist_info() -> tuple[int, int]:
    """(rank, world size). Under torchrun (WORLD_SIZE > 1) the process group is created here: NCCL on GPUs,
    gloo on CPU."""
    if dist.is_available() and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def frequent_tokens(records: list[dict], n: int, vocab_size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The n most frequent response tokens of the training records (ties by id), always including `always`
    (e.g. the end-of-turn token, which every answer needs) -> sorted [n] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in records:
        ids = torch.tensor(r["input_ids"], dtype=torch.long)
        m = torch.tensor(r["loss_mask"], dtype=torch.bool)
        counts += torch.bincount(ids[m], minlength=vocab_size)[:vocab_size]
    score = counts.double()
    score[list(always)] = float("inf")
    return score.topk(n).indices.sort().values


def make_draft(cfg: TrainConfig, target: TargetModel, records: list[dict] | None = None) -> DFlashDraftModel:
    from ..loading import default_mask_token_id

    if cfg.method == "eagle":
        from .eagle import make_eagle_draft

        return make_eagle_draft(cfg, target)
    if cfg.init_draft:
        draft = DFlashDraftModel.from_pretrained(cfg.init_draft, dtype=torch.float32)
        check_compatible(draft.config, target)
        return draft
    torch.manual_seed(cfg.seed)
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else default_mask_token_id(
        target.tokenizer, target.vocab_size)
    dcfg = DFlashConfig.from_target(target.config, num_hidden_layers=cfg.num_layers, block_size=cfg.block_size,
                                    mask_token_id=mask_id, num_target_features=cfg.num_target_features,
                                    draft_vocab_size=cfg.draft_vocab_size)
    draft = DFlashDraftModel(dcfg).float().init_from_target(target)
    if cfg.init_layers == "target":
        draft.init_layers_from_target(target)
    elif cfg.init_layers != "random":
        raise ValueError(f"init_layers must be random or target, got {cfg.init_layers!r}")
    if dcfg.draft_vocab_size is not None:
        if not records:
            raise ValueError("a reduced draft vocabulary is chosen from the training records: none given")
        draft.set_draft_vocab(frequent_tokens(records, dcfg.draft_vocab_size, target.vocab_size,
                                              target.eos_token_ids))
    return draft


class _StopFlag:
    """SIGTERM/SIGINT ask for a checkpoint at the end of the current step, then a clean exit."""

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


def evaluate_tau(target: TargetModel, draft: DFlashDraftModel, prompts: list[list[int]], max_new_tokens: int) -> float:
    """Greedy decode held-out prompts with the real engine and the current draft -> mean tau."""
    from ..config import GenerationConfig
    from ..decode.engine import Engine
    from ..proposers.dflash import DFlashProposer

    if not prompts:
        return float("nan")
    d = type(draft)(draft.config)
    d.load_state_dict(draft.state_dict())
    d = d.to(target.dtype).eval()
    if isinstance(d, DFlashDraftModel):
        eng = Engine(target, DFlashProposer(d, target))
    else:
        from ..proposers.eagle import EagleProposer

        eng = Engine(target, EagleProposer(d, target))
    steps = committed = 0
    for p in prompts:
        res = eng.generate(p, GenerationConfig(max_new_tokens=max_new_tokens))
        steps += len(res.stats.accept_lengths)
        committed += sum(res.stats.accept_lengths)
    return committed / max(1, steps)


def prompt_of(record: dict) -> list[int]:
    """The prompt part of a regenerated record (the tokens before the first loss-masked one)."""
    lm = record["loss_mask"]
    n = lm.index(1) if 1 in lm else len(lm)
    return list(record["input_ids"][:n])


def train(cfg: TrainConfig, target: TargetModel | None = None, records: list[dict] | None = None,
          heldout: list[dict] | None = None, resume: bool = False, stop_after: int | None = None,
          progress: bool = True) -> dict:
    """Train a draft; returns a summary. `stop_after` ends the process-local loop after that many steps (a test's
    stand-in for a kill; the checkpoint it leaves is what SIGTERM would leave)."""
    from ..loading import load_target
    from .features import OfflineFeatures, OnlineFeatures

    rank, world = _dist_info()
    out = Path(cfg.out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    if target is None:
        target, _ = load_target(cfg.target, cfg.dtype, weights="bf16")  # training reads the float model
    target.requires_grad_(False)
    if cfg.attention not in ("auto", "sdpa", "flex"):
        raise ValueError(f"attention must be auto, sdpa or flex, got {cfg.attention!r}")
    if cfg.attention == "flex" and target.device.type == "cpu":
        raise ValueError("flex attention has no backward pass on CPU: train with --attention sdpa (or auto)")
    if cfg.method not in ("dflash", "eagle"):
        raise ValueError(f"method must be dflash or eagle, got {cfg.method!r}")
    eagle = cfg.method == "eagle"
    if eagle and (cfg.no_target_features or cfg.draft_vocab_size):
        raise ValueError("method eagle supports neither no_target_features nor draft_vocab_size")
    if eagle and cfg.ttt_steps < 0:
        raise ValueError(f"ttt_steps must be >= 0, got {cfg.ttt_steps}")
    records = records if records is not None else load_records(cfg.data)
    if heldout is None and cfg.heldout:
        heldout = load_records(cfg.heldout)
    draft = make_draft(cfg, target, records)
    dcfg = draft.config
    vocab_ids = draft.vocab_ids
    vocab_map = None
    if vocab_ids is not None:
        vocab_map = torch.full((target.vocab_size,), IGNORE, dtype=torch.long)
        vocab_map[vocab_ids] = torch.arange(vocab_ids.numel())
    dcfg.extra.update({"trained_with": "blockdraft", "no_target_features": cfg.no_target_features})
    features_fn = (OnlineFeatures(target, dcfg.target_layer_ids) if cfg.features == "online"
                   else OfflineFeatures(cfg.features, dcfg.target_layer_ids))
    if eagle:
        from .eagle import EagleTrainModule, eagle_sample_loss

        module: nn.Module = EagleTrainModule(draft, cfg.ttt_steps)
    else:
        module = TrainModule(draft)
    acc_width = cfg.ttt_steps + 1 if eagle else dcfg.block_size  # accuracy per TTT step / per block offset
    if world > 1:
        module = nn.parallel.DistributedDataParallel(module)

    per_epoch = math.ceil(len(records) / (cfg.batch_size * world))
    total = cfg.max_steps or max(1, int(per_epoch * cfg.epochs))
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, cfg.warmup_ratio))
    state = {"step": 0, "samples_seen": 0, "config": asdict(cfg)}
    ckpt = latest_checkpoint(out)
    if resume and ckpt is not None:
        state = load_checkpoint(ckpt, draft, opt, sched)
        log.info("resumed from %s (step %d)", ckpt, state["step"])
    elif resume:
        log.info("--resume: no checkpoint in %s, starting fresh", out)
    elif ckpt is not None:
        raise FileExistsError(f"{out} already has checkpoints: pass --resume to continue, or choose another --out")
    if resume and rank == 0:
        trim_log(out / "train_log.jsonl", state["step"])

    eval_prompts = [prompt_of(r) for r in (heldout or [])[: cfg.eval_prompts]]
    log_path = out / "train_log.jsonl"
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=state["step"], desc="train", dynamic_ncols=True)
    losses: list[float] = []
    t_last, rows_last = time.perf_counter(), 0
    with _StopFlag() as stop:
        steps_here = 0
        while state["step"] < total:
            opt.zero_grad(set_to_none=True)
            step_loss, n_ok = 0.0, 0
            correct = torch.zeros(acc_width, dtype=torch.long)
            counted = torch.zeros(acc_width, dtype=torch.long)
            for micro in range(cfg.batch_size):
                global_index = state["samples_seen"] + micro * world + rank
                epoch, pos = divmod(global_index, len(records))
                perm = torch.randperm(len(records), generator=torch.Generator().manual_seed(cfg.seed + epoch))
                rec = records[int(perm[pos])]
                # DDP: all-reduce gradients only on the last micro-batch of the step
                sync_ctx = module.no_sync() if world > 1 and micro < cfg.batch_size - 1 else nullcontext()
                with sync_ctx:
                    res = (eagle_sample_loss(module, target, rec, features_fn, cfg) if eagle else
                           sample_loss(module, target, rec, features_fn, cfg, dcfg, global_index, vocab_ids, vocab_map))
                    if res is None:
                        continue
                    (res.loss / cfg.batch_size).backward()
                step_loss += float(res.loss.detach())
                n_ok += 1
                correct += res.correct
                counted += res.counted
            state["samples_seen"] += cfg.batch_size * world
            grad_norm = float(torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip))
            opt.step()
            sched.step()
            state["step"] += 1
            steps_here += 1
            mean_loss = step_loss / max(1, n_ok)
            losses.append(mean_loss)
            rows_last += int(counted.sum())
            if rank == 0:
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{mean_loss:.3f}", lr=f"{sched.get_last_lr()[0]:.2e}")
                if state["step"] % cfg.log_every == 0 or state["step"] == total:
                    now = time.perf_counter()
                    acc = (correct.float() / counted.clamp_min(1).float())[0 if eagle else 1:].tolist()
                    entry = {"step": state["step"], "loss": mean_loss, "lr": sched.get_last_lr()[0],
                             "grad_norm": grad_norm, "acc": [round(a, 4) for a in acc],
                             "rows_per_s": rows_last / max(1e-9, now - t_last), "time": time.time()}
                    t_last, rows_last = now, 0
                    with open(log_path, "a") as f:
                        f.write(json.dumps(entry) + "\n")
                if cfg.eval_every and state["step"] % cfg.eval_every == 0 and eval_prompts:
                    tau = evaluate_tau(target, draft, eval_prompts, cfg.eval_max_new_tokens)
                    with open(log_path, "a") as f:
                        f.write(json.dumps({"step": state["step"], "eval_tau": tau}) + "\n")
                    log.info("step %d: held-out tau %.3f", state["step"], tau)
                done = state["step"] == total
                want = stop.set or done or (stop_after is not None and steps_here >= stop_after)
                if want or state["step"] % cfg.save_every == 0:
                    save_checkpoint(out, draft, opt, sched, state, cfg.keep_last)
                    export_draft(draft, out / "draft")
            if stop.set or (stop_after is not None and steps_here >= stop_after):
                break
    if bar is not None:
        bar.close()
    summary = {"steps": state["step"], "total_steps": total, "losses": losses, "out": str(out / "draft")}
    if rank == 0 and state["step"] == total and eval_prompts:
        summary["eval_tau"] = evaluate_tau(target, draft, eval_prompts, cfg.eval_max_new_tokens)
        with open(log_path, "a") as f:
            f.write(json.dumps({"step": state["step"], "eval_tau": summary["eval_tau"], "final": True}) + "\n")
    return summary
