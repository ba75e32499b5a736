"""The cache source of training targets: the target's outputs read from teacher caches, built for CPU minutes.

What makes it fast per CPU-second, against the live source (`live.py`):
- the target never runs during training: features, greedy labels and top-k logits come from a teacher cache
  (`teacher.py`) written once at prefill speed;
- the context keys/values of a sequence are computed once and shared by every anchor of that sequence, and the block
  mask is factorised (`blockattn.py`), so using every response position as an anchor costs ~L*B rows of compute
  instead of (L*B)^2 mask entries;
- the loss runs over a reduced draft vocabulary head (the draft can only propose those tokens anyway);
- labels are the target's own greedy tokens (teacher-forced), optionally with distillation against its top-k.

Batches (rows, labels, the draft-vocabulary head) are built in `batches.py`; the held-out learning curve (top-1
accuracy per block position, the tau it implies and the replayed-decoding tau) in `curve.py`. The sequences and
anchors of step i (on process r) are drawn from a generator seeded by (seed, i, r), so a resumed run replays
exactly the batches an uninterrupted one would see.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from ..models.copy_gate import LookupTables
from ..models.draft import DFlashDraftModel
from .batches import Batch, DraftHead, anchor_weights, fused_inputs, make_batch, valid_anchors
from .blockattn import block_forward, soft_cross_entropy
from .blocks import default_gamma, loss_weights
from .config import TrainConfig
from .curve import evaluate, heldout_anchors, walk_tau
from .precision import autocast
from .teacher import TeacherCache

log = logging.getLogger(__name__)


def open_caches(cfg: TrainConfig) -> tuple[list[TeacherCache], TeacherCache]:
    """The training caches and the held-out one, checked to come from one target."""
    caches = [TeacherCache(c) for c in cfg.cache.split(",") if c.strip()]
    if not caches:
        raise ValueError("no training teacher cache given (cache=...)")
    if not cfg.heldout_cache:
        raise ValueError("training from a teacher cache needs a held-out one too (heldout_cache=..., written by "
                         "`blockdraft teacher-cache` from the data's shards-heldout)")
    held = TeacherCache(cfg.heldout_cache)
    for c in caches:
        if c.hidden_size != held.hidden_size:
            raise ValueError(f"{c.dir} holds hidden size {c.hidden_size}, {held.dir} {held.hidden_size}: "
                             "caches of different targets")
    return caches, held


def batch_loss(draft: DFlashDraftModel, target, head: DraftHead, batch: Batch, cfg: TrainConfig,
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
    # labelled rows are rows 1.. of their blocks, so every one gets exp(-(k-1)/gamma) (or 1 without decay)
    w = loss_weights(offs, None if cfg.no_loss_decay else (cfg.gamma or default_gamma(cfg.block_size)))
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


class CachedObjective:
    """Training steps over teacher caches: `seqs_per_step` sequences per process and step in one factorised batch;
    held-out evaluation scores fixed anchors of the held-out cache and replays greedy decoding on it."""

    def __init__(self, cfg: TrainConfig, target, draft: DFlashDraftModel, caches: list[TeacherCache],
                 held: TeacherCache, dtype: torch.dtype) -> None:
        if draft.config.block_size != cfg.block_size:
            raise ValueError(f"draft block size {draft.config.block_size} != block_size {cfg.block_size}")
        self.cfg, self.target, self.draft, self.dtype = cfg, target, draft, dtype
        self.head = DraftHead(target, draft)
        self.tables = LookupTables(cfg.block_size - 1) if draft.copy_gate is not None else None
        self.acc_width, self.acc_from = cfg.train_block, 1
        self.cols = held.columns(cfg.layer_ids)  # the held-out cache's columns; each training cache has its own
        seqs, cols, n_anchors = [], [], []
        for c in caches:
            ccols = c.columns(cfg.layer_ids)
            for q in c.sequences:
                n = len(valid_anchors(q, cfg.max_len))
                if n:
                    seqs.append(q)
                    cols.append(ccols)
                    n_anchors.append(n)
        if not seqs:
            raise ValueError(f"no training sequence with a response anchor in {cfg.cache}")
        log.info("training sequences: %d from %s", len(seqs), ", ".join(f"{c.dir} ({len(c)})" for c in caches))
        if cfg.bucket:  # neighbours in this order have about as many anchors and context rows as each other
            cap = cfg.anchors or 10 ** 9
            order = sorted(range(len(seqs)), key=lambda i: (min(n_anchors[i], cap), min(len(seqs[i]), cfg.max_len), i))
            seqs, cols = [seqs[i] for i in order], [cols[i] for i in order]
        self.seqs, self.seq_cols = seqs, cols
        self.held_seqs, self.held_anchors = heldout_anchors(held, cfg.eval_seqs, cfg.eval_anchors, cfg.max_len,
                                                            cfg.seed)

    def step(self, state: dict, rank: int, world: int):
        """One optimizer step's forward and backward -> (loss, correct [W], counted [W], rows computed)."""
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, state["step"]] + ([rank] if world > 1 else []))
        n_pick = min(cfg.seqs_per_step, len(self.seqs))
        if cfg.bucket:  # a random window of neighbours (every sequence is about equally likely to be drawn)
            first = int(rng.integers(0, len(self.seqs) - n_pick + 1))
            picks = np.arange(first, first + n_pick)
        else:
            picks = rng.choice(len(self.seqs), size=n_pick, replace=False)
        seqs = [self.seqs[i] for i in picks]
        anchor_lists = []
        for q in seqs:
            a = valid_anchors(q, cfg.max_len)
            if cfg.anchors and len(a) > cfg.anchors:
                w = anchor_weights(q, a, cfg.anchor_bias) if cfg.anchor_bias else None
                a = np.sort(rng.choice(a, size=cfg.anchors, replace=False, p=w))
            anchor_lists.append(a)
        batch = make_batch(seqs, anchor_lists, cfg.train_block, self.draft.mask_token_id,
                           [self.seq_cols[i] for i in picks], cfg.max_len, with_topk=cfg.kd_weight > 0,
                           chain=cfg.chain_labels)
        copy = (self.tables.rows(seqs, anchor_lists, cfg.train_block, cfg.max_len) if self.tables is not None
                else None)
        with autocast(self.dtype):
            loss, correct, counted = batch_loss(self.draft, self.target, self.head, batch, cfg, copy)
        loss.backward()
        return float(loss.detach()), correct, counted, batch.rows

    def evaluate(self) -> dict:
        cfg, draft = self.cfg, self.draft
        ev = evaluate(draft, self.target, self.head, self.held_seqs, self.held_anchors, self.cols, cfg.max_len,
                      block=cfg.eval_block, tables=self.tables, dtype=self.dtype)
        if cfg.walk_seqs:
            ev.update(walk_tau(draft, self.target, self.head, self.held_seqs[: cfg.walk_seqs], self.cols,
                               cfg.max_len, cfg.walk_block, tables=self.tables, dtype=self.dtype))
        if draft.copy_gate is not None:
            ev["gate_table"] = [[round(x, 3) for x in r[: cfg.eval_block]] for r in draft.copy_gate.table.tolist()]
        return ev
