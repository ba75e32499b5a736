"""Draft training on the cached target outputs, built for CPU minutes.

What makes it fast per CPU-second, against the generic trainer (`trainer.py`):
- the target never runs during training: features, greedy labels and top-k logits come from a teacher cache
  (`teacher.py`) written once at prefill speed;
- the context keys/values of a sequence are computed once and shared by every anchor of that sequence, and the block
  mask is factorised (`blockattn.py`), so using every response position as an anchor costs ~L*B rows of compute
  instead of (L*B)^2 mask entries;
- the loss runs over a reduced draft vocabulary head (the draft can only propose those tokens anyway);
- labels are the target's own greedy tokens (teacher-forced), optionally with distillation against its top-k.

Batches (rows, labels, the draft-vocabulary head) are built in `batches.py`. Every run logs a learning curve
(`curve.py`: held-out top-1 accuracy per block position, the tau it implies and the replayed-decoding tau, against
wall clock and rows seen) to `curve.jsonl`, checkpoints atomically and resumes exactly (`--resume`): the sequences and
anchors of step i are drawn from a generator seeded by (seed, i).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..copy_gate import LookupTables
from ..draft import DFlashDraftModel
from ..draft_config import DFlashConfig, default_target_layer_ids
from .batches import Batch, DraftHead, fused_inputs, make_batch, valid_anchors
from .blockattn import block_forward, soft_cross_entropy
from .curve import evaluate, heldout_anchors, walk_tau
from .precision import autocast, compute_dtype, dtype_name
from .teacher import TeacherCache

log = logging.getLogger(__name__)


@dataclass
class FastConfig:
    cache: str = ""  # teacher cache(s) of the training records, comma-separated (sequences drawn from their union)
    heldout_cache: str = ""  # teacher cache of held-out records (learning curve)
    out_dir: str = "runs/fast"
    layer_ids: list[int] | None = None  # tapped target layers fed to the fusion (default: a continued draft's, else
    #                                     two spread over the target's depth, `default_target_layer_ids`)
    num_layers: int = 2  # draft layers; a continued draft with fewer gets identity-initialised layers appended
    init: str = "target"  # "target" (copy the target's last layers), "target-identity" (the same with zeroed output
    #                        maps), "random", or a draft directory to continue
    block_size: int = 16  # the draft's block size (decoding may use any size up to it)
    train_block: int = 0  # rows per training block (<= block_size; 0 = block_size): short blocks put more of each
    #                        step into the first positions, which decide acceptance most
    anchors: int = 0  # anchors per sequence; 0 = every valid response position
    seqs_per_step: int = 4
    bucket: bool = True  # a step's sequences are neighbours in (anchors, length) order, so that padding (anchor
    #                      slots and context rows a shorter sequence leaves empty) nearly vanishes
    steps: int = 1000
    minutes: float = 0.0  # stop after this much training time (0 = no limit); the schedule still uses `steps`
    lr: float = 6e-4
    warmup: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    gamma: float = 7.0  # loss weight exp(-(k-1)/gamma) of block row k
    kd_weight: float = 0.0  # 0 = cross-entropy on the target's greedy token; 1 = distillation on its top-k only
    chain_labels: bool = True  # label block row k >= 2 only where the text between the anchor and that row is what
    #                            the target itself would have written (always so on target-written records; on
    #                            teacher-forced human text only those rows are what decoding would ever verify)
    draft_vocab_size: int = 8192
    next_token_feature: bool = False  # the fusion also reads each context position's next-token embedding (a
    #                                   departure from the public layout: `DFlashConfig.next_token_feature`)
    next_token_scale: float = 1.0  # ... times this factor, when the input is added
    copy_gate: bool = False  # a learned bonus on prompt lookup's candidate (`copy_gate.py`; its own file, outside
    #                          the public layout)
    copy_gate_lr: float = 1e-2  # the gate table's own (constant after warm-up) learning rate: its bonuses must reach
    #                             a few nats, and Adam moves a weight by about its lr per step
    mask_token_id: int | None = None  # default: chosen from the target's tokenizer
    max_len: int = 512
    seed: int = 0
    eval_every: int = 50  # steps
    eval_seqs: int = 64
    eval_anchors: int = 32  # per held-out sequence (seeded, fixed for the whole run)
    eval_block: int = 0  # rows per evaluated block (0 = block_size); the implied tau covers decode blocks up to it
    walk_seqs: int = 16  # held-out sequences decoded by a teacher-forced walk (`walk_tau`; 0 = off)
    walk_block: int = 4  # the decode block of that walk (the default draft decodes with 4)
    save_every: int = 100
    threads: int = 0  # torch threads (0 = torch's default)
    precision: str = "auto"  # "bf16" autocast, "fp32", or "auto": bf16 only where the CPU multiplies it natively

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> "FastConfig":
        """A recipe file (YAML, FastConfig field names) with `overrides` (not None) on top; unknown names raise."""
        import yaml

        with open(path) as f:
            raw = yaml.safe_load(f) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a recipe is a mapping of FastConfig fields, got {type(raw).__name__}")
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown train-fast options {sorted(unknown)}")
        raw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**raw)

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError("block_size must be >= 2")
        if self.train_block == 0:
            self.train_block = self.block_size
        if not 2 <= self.train_block <= self.block_size:
            raise ValueError(f"train_block must be in 2..block_size ({self.block_size}), got {self.train_block}")
        if self.eval_block == 0:
            self.eval_block = self.block_size
        if not 2 <= self.eval_block <= self.block_size:
            raise ValueError(f"eval_block must be in 2..block_size ({self.block_size}), got {self.eval_block}")
        if not 0.0 <= self.kd_weight <= 1.0:
            raise ValueError("kd_weight must be in [0, 1]")
        if self.seqs_per_step < 1 or self.steps < 1:
            raise ValueError("seqs_per_step and steps must be >= 1")


def parse_bool(text: str) -> bool:
    """A command-line boolean (FastConfig's bool fields): true/false, yes/no, on/off, 1/0."""
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def batch_loss(draft: DFlashDraftModel, target, head: DraftHead, batch: Batch, cfg: FastConfig,
               copy: tuple[torch.Tensor, torch.Tensor] | None = None):
    """-> (loss, correct [B], counted [B]) of one batch (position-1 accuracy etc. on the training rows).
    copy: for a draft with a copy gate, (candidates, match lengths), each [S, N*B] (`LookupTables.rows`)."""
    block = cfg.train_block
    with torch.no_grad():
        embeds = target.embed(batch.block_ids)
    hidden = block_forward(draft, fused_inputs(draft, target, batch), batch.ctx_len, embeds, batch.anchors, block)
    valid = batch.labels >= 0
    h = hidden[valid]
    offs = batch.offsets[valid]
    cand = copy[0][valid] if copy is not None else None
    lab = head.columns(batch.labels[valid], cand)  # -1 where the draft cannot propose the greedy token
    w = torch.exp(-(offs.float() - 1) / cfg.gamma)
    logits = head.scores(h, None if copy is None else (cand, copy[1][valid], offs))  # [R, Vd (+1)]
    ce = F.cross_entropy(logits, lab.clamp_min(0), reduction="none") * (lab >= 0)
    loss_rows = ce
    if cfg.kd_weight > 0:
        tk_ids = head.map[batch.topk_ids[valid]]  # [R, k] draft ids or -1
        tk_lg = batch.topk_logits[valid].masked_fill(tk_ids < 0, float("-inf"))
        p = torch.softmax(tk_lg, -1).nan_to_num(0.0)
        dense = torch.zeros_like(logits).scatter_add_(1, tk_ids.clamp_min(0), p * (tk_ids >= 0))
        # (with a copy gate, an out-of-vocabulary candidate's column gets no teacher mass: distillation covers the
        # draft vocabulary, the cross-entropy part the candidate)
        loss_rows = (1 - cfg.kd_weight) * ce + cfg.kd_weight * soft_cross_entropy(logits, dense)
    loss = (loss_rows * w).sum() / w.sum().clamp_min(1e-8)
    hit = (logits.argmax(-1) == lab) & (lab >= 0)
    correct = torch.zeros(block, dtype=torch.long).index_add_(0, offs, hit.long())
    counted = torch.zeros(block, dtype=torch.long).index_add_(0, offs, torch.ones_like(offs))
    return loss, correct, counted


def lr_at(step: int, cfg: FastConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    prog = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))


def frequent_greedy_tokens(cache: TeacherCache | list[TeacherCache], n: int, vocab_size: int,
                           always=()) -> torch.Tensor:
    """The n most frequent target-greedy labels of response positions (what the draft must propose) -> sorted [n]."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    caches = cache if isinstance(cache, list) else [cache]
    for q in (q for c in caches for q in c.sequences):
        m = np.asarray(q.loss_mask, dtype=bool)
        lab = np.asarray(q.greedy, dtype=np.int64)[:-1][m[1:]]
        counts += np.bincount(lab, minlength=vocab_size)[:vocab_size]
    score = torch.from_numpy(counts).double()
    score[list(always)] = float("inf")
    return score.topk(n).indices.sort().values


def resolve_layer_ids(cfg: FastConfig, target) -> FastConfig:
    """cfg with layer_ids filled in when unset: a continued draft's own, else two layers spread over the target's
    depth (layers 1 and L-3)."""
    if cfg.layer_ids is not None:
        return cfg
    if cfg.init not in ("target", "target-identity", "random"):
        ids = DFlashDraftModel.from_pretrained(cfg.init, dtype=torch.float32).config.target_layer_ids
    else:
        tc = getattr(target.config, "text_config", None) or target.config
        ids = default_target_layer_ids(int(tc.num_hidden_layers), 2)
    log.info("target layers for the fusion: %s", ids)
    return replace(cfg, layer_ids=list(ids))


def make_fast_draft(cfg: FastConfig, target, cache: TeacherCache | list[TeacherCache]) -> DFlashDraftModel:
    from ..loading import default_mask_token_id

    if cfg.init not in ("target", "target-identity", "random"):
        draft = DFlashDraftModel.from_pretrained(cfg.init, dtype=torch.float32)
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
            raise ValueError(f"{cfg.init} has a copy gate; continue it with --copy-gate true")
        if cfg.copy_gate and not draft.config.copy_gate:
            log.info("adding a copy gate to %s (its bonus starts at zero)", cfg.init)
            draft = draft.with_copy_gate()
        return draft.train()
    torch.manual_seed(cfg.seed)
    dcfg = DFlashConfig.from_target(target.config, num_hidden_layers=cfg.num_layers, block_size=cfg.block_size,
                                    mask_token_id=cfg.mask_token_id if cfg.mask_token_id is not None
                                    else default_mask_token_id(target.tokenizer, target.vocab_size),
                                    target_layer_ids=list(cfg.layer_ids), draft_vocab_size=cfg.draft_vocab_size,
                                    next_token_feature=cfg.next_token_feature,
                                    next_token_scale=cfg.next_token_scale, copy_gate=cfg.copy_gate)
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
        draft.set_draft_vocab(frequent_greedy_tokens(cache, dcfg.draft_vocab_size, target.vocab_size,
                                                     target.eos_token_ids))
    return draft.train()


class _StopOnSignal:
    """SIGTERM/SIGINT end the loop after the current step; the run then checkpoints and exports its draft as if it
    had reached its last step (`--resume` continues it)."""

    def __init__(self) -> None:
        self.requested = False
        self._old = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass

    def _handle(self, signum, frame) -> None:
        log.warning("signal %s: stopping after this step", signum)
        self.requested = True

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _save_state(out: Path, draft, opt, state: dict) -> None:
    tmp = out / "state.pt.tmp"
    torch.save({"draft": draft.state_dict(), "opt": opt.state_dict(), "state": state}, tmp)
    os.replace(tmp, out / "state.pt")


def train_fast(cfg: FastConfig, target, resume: bool = False) -> dict:
    """Train (or resume) a draft from teacher caches; writes out_dir/{curve.jsonl, state.pt, draft/} and returns
    the last evaluation."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cfg = resolve_layer_ids(cfg, target)
    dtype = compute_dtype(cfg.precision)
    log.info("computing in %s (precision %s)", dtype_name(dtype), cfg.precision)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    caches = [TeacherCache(c) for c in cfg.cache.split(",") if c.strip()]
    if not caches:
        raise ValueError("no training teacher cache given (cache=...)")
    held = TeacherCache(cfg.heldout_cache)
    for c in caches:
        if c.hidden_size != held.hidden_size:
            raise ValueError(f"{c.dir} holds hidden size {c.hidden_size}, {held.dir} {held.hidden_size}: "
                             "caches of different targets")
    cols = held.columns(cfg.layer_ids)  # the held-out cache's columns; each training cache has its own (below)
    draft = make_fast_draft(cfg, target, caches)
    if draft.config.block_size != cfg.block_size:
        raise ValueError(f"draft block size {draft.config.block_size} != --block-size {cfg.block_size}")
    head = DraftHead(target, draft)
    # the gate's table (a few dozen bonuses that must reach several nats) gets its own learning rate; its w (one
    # weight per hidden unit, summed over H) moves with the draft's: at 1e-2 its H steps would add up to nats per step
    gate_params = [draft.copy_gate.table] if draft.copy_gate is not None else []
    gate_ids = {id(p) for p in gate_params}
    groups = [{"params": [p for p in draft.parameters() if p.requires_grad and id(p) not in gate_ids],
               "role": "draft"}]
    if gate_params:
        groups.append({"params": gate_params, "role": "gate"})
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    tables = LookupTables(cfg.block_size - 1) if draft.copy_gate is not None else None
    state = {"step": 0, "train_seconds": 0.0, "rows": 0, "config": asdict(cfg)}
    curve_path = out / "curve.jsonl"
    if resume and (out / "state.pt").is_file():
        blob = torch.load(out / "state.pt", weights_only=False)
        draft.load_state_dict(blob["draft"])
        opt.load_state_dict(blob["opt"])
        state = blob["state"]
        if curve_path.is_file():  # drop entries written after the checkpoint (they are written again)
            lines = [ln for ln in curve_path.read_text().splitlines() if ln.strip()]
            kept = [ln for ln in lines if json.loads(ln)["step"] <= state["step"]]
            curve_path.write_text("".join(ln + "\n" for ln in kept))
        log.info("resumed at step %d (%.1f min of training)", state["step"], state["train_seconds"] / 60)
    elif curve_path.exists():
        curve_path.unlink()
    train_seqs, train_cols, n_anchors = [], [], []
    for c in caches:
        ccols = c.columns(cfg.layer_ids)
        for q in c.sequences:
            n = len(valid_anchors(q, cfg.max_len))
            if n:
                train_seqs.append(q)
                train_cols.append(ccols)
                n_anchors.append(n)
    log.info("training sequences: %d from %s", len(train_seqs), ", ".join(f"{c.dir} ({len(c)})" for c in caches))
    if cfg.bucket:  # neighbours in this order have about as many anchors and context rows as each other
        cap = cfg.anchors or 10 ** 9
        order = sorted(range(len(train_seqs)),
                       key=lambda i: (min(n_anchors[i], cap), min(len(train_seqs[i]), cfg.max_len), i))
        train_seqs = [train_seqs[i] for i in order]
        train_cols = [train_cols[i] for i in order]
    held_seqs, held_anchors = heldout_anchors(held, cfg.eval_seqs, cfg.eval_anchors, cfg.max_len, cfg.seed)

    def log_eval(extra: dict) -> dict:
        ev = evaluate(draft, target, head, held_seqs, held_anchors, cols, cfg.max_len, block=cfg.eval_block,
                      tables=tables, dtype=dtype)
        if cfg.walk_seqs:
            ev.update(walk_tau(draft, target, head, held_seqs[: cfg.walk_seqs], cols, cfg.max_len, cfg.walk_block,
                               tables=tables, dtype=dtype))
        if draft.copy_gate is not None:
            ev["gate_table"] = [[round(x, 3) for x in r[: cfg.eval_block]] for r in draft.copy_gate.table.tolist()]
        entry = {"step": state["step"], "minutes": round(state["train_seconds"] / 60, 3), "rows": state["rows"],
                 **extra, **ev}
        with open(curve_path, "a") as f:
            f.write(json.dumps(entry) + "\n")
        log.info("step %d  %.1f min  rows %d  held-out acc@1..4 %s  tau4 %.3f  walk tau %s  %s", state["step"],
                 entry["minutes"], state["rows"], ev["acc"][:4], ev.get("tau4", float("nan")),
                 ev.get("walk_tau"), {k: v for k, v in extra.items()})
        return entry

    if state["step"] == 0:
        last = log_eval({})
    window = {"loss": 0.0, "correct": torch.zeros(cfg.train_block), "counted": torch.zeros(cfg.train_block), "n": 0}
    last = None
    stop = _StopOnSignal()
    while state["step"] < cfg.steps and not stop.requested:
        if cfg.minutes and state["train_seconds"] >= cfg.minutes * 60:
            break
        step = state["step"]
        t0 = time.perf_counter()
        rng = np.random.default_rng([cfg.seed, step])
        n_pick = min(cfg.seqs_per_step, len(train_seqs))
        if cfg.bucket:  # a random window of neighbours (every sequence is about equally likely to be drawn)
            first = int(rng.integers(0, len(train_seqs) - n_pick + 1))
            picks = np.arange(first, first + n_pick)
        else:
            picks = rng.choice(len(train_seqs), size=n_pick, replace=False)
        seqs = [train_seqs[i] for i in picks]
        seq_cols = [train_cols[i] for i in picks]
        anchor_lists = []
        for q in seqs:
            a = valid_anchors(q, cfg.max_len)
            if cfg.anchors and len(a) > cfg.anchors:
                a = np.sort(rng.choice(a, size=cfg.anchors, replace=False))
            anchor_lists.append(a)
        batch = make_batch(seqs, anchor_lists, cfg.train_block, draft.mask_token_id, seq_cols, cfg.max_len,
                           with_topk=cfg.kd_weight > 0, chain=cfg.chain_labels)
        for grp in opt.param_groups:
            grp["lr"] = (lr_at(step, cfg) if grp.get("role") != "gate"
                         else cfg.copy_gate_lr * min(1.0, (step + 1) / max(1, cfg.warmup)))
        copy = tables.rows(seqs, anchor_lists, cfg.train_block, cfg.max_len) if tables is not None else None
        with autocast(dtype):
            loss, correct, counted = batch_loss(draft, target, head, batch, cfg, copy)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
        opt.step()
        state["train_seconds"] += time.perf_counter() - t0
        state["rows"] += batch.rows
        state["step"] = step + 1
        window["loss"] += float(loss.detach())
        window["correct"] += correct
        window["counted"] += counted
        window["n"] += 1
        if state["step"] % cfg.eval_every == 0 or state["step"] == cfg.steps:
            tr = (window["correct"] / window["counted"].clamp_min(1))[1:5].tolist()
            last = log_eval({"loss": round(window["loss"] / window["n"], 4), "train_acc": [round(x, 4) for x in tr],
                             "grad_norm": round(float(gnorm), 3),
                             "rows_per_s": round(state["rows"] / max(1e-9, state["train_seconds"]), 1)})
            window = {"loss": 0.0, "correct": torch.zeros(cfg.train_block), "counted": torch.zeros(cfg.train_block),
                      "n": 0}
        if state["step"] % cfg.save_every == 0:
            _save_state(out, draft, opt, state)
    stop.restore()
    _save_state(out, draft, opt, state)
    if last is None or last["step"] != state["step"]:
        last = log_eval({"rows_per_s": round(state["rows"] / max(1e-9, state["train_seconds"]), 1)})
    draft.config.extra.update({"trained_with": "blockdraft train-fast", "steps": state["step"],
                               "train_minutes": round(state["train_seconds"] / 60, 2)})
    draft.save_pretrained(out / "draft")
    return last
