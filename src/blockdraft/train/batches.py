"""Training and evaluation batches of the cache source (train/cached.py): which block rows a sequence contributes, what
labels they carry, and the frozen head they are scored through.

A block at anchor p holds the anchor token and B-1 mask rows; row k is labelled with the target's own greedy choice
for position p + k after the true prefix (teacher-forced, from the teacher cache), and with chain labels only where
the target would have reached that row by itself (`chain_ok`). Sequences of one batch are padded to the longest
context and the longest anchor list; `Batch.rows` counts the real rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..models.copy_gate import gated_ids, gated_logits
from ..models.draft import DFlashDraftModel
from .blocks import IGNORE
from .teacher import TeacherSequence, feats_tensor


def valid_anchors(seq: TeacherSequence, max_len: int) -> np.ndarray:
    """Positions p (>= 1) whose token and next token are both response tokens -> [M] int64."""
    m = np.asarray(seq.loss_mask[:max_len], dtype=bool)
    ok = m[:-1] & m[1:]
    ok[0] = False  # a block needs at least one context row
    return np.nonzero(ok)[0].astype(np.int64)


def anchor_weights(seq: TeacherSequence, anchors: np.ndarray, bias: float) -> np.ndarray:
    """anchors [M] (valid ones, each >= 1) -> [M] float64 sampling probabilities proportional to
    1 + bias * (1 - P_target(token p | tokens before p)), P read from the cached top-k logits at p - 1 (normalised
    over the top k, 0 for a token outside them).

    Why: in decoding every block starts right after the token that ended the previous one, the target's correction
    of a draft token it rejected, and the draft misses mostly where the target itself hesitates. After such a token
    the context's features (computed before it) do not know which way the text went, so the block has to
    re-plan from the anchor's embedding: the held-out position-1 acceptance in decoding (~0.5) sits far below the
    teacher-forced accuracy over uniformly drawn anchors (~0.7). Weighting anchors this way moves training toward the
    anchors decoding meets."""
    logits = np.asarray(seq.topk_logits[anchors - 1], dtype=np.float64)  # [M, k]
    ids = np.asarray(seq.topk_ids[anchors - 1])
    tok = np.asarray(seq.tokens[anchors])[:, None]
    z = np.exp(logits - logits.max(-1, keepdims=True))
    prob = (z * (ids == tok)).sum(-1) / z.sum(-1)
    w = 1.0 + bias * (1.0 - prob)
    return w / w.sum()


@dataclass
class Batch:
    features: torch.Tensor  # [S, L, K*H] bf16
    next_ids: torch.Tensor  # [S, L] the token after each position (0 past the end): `fused_inputs`
    ctx_len: torch.Tensor  # [S]
    anchors: torch.Tensor  # [S, N]
    block_ids: torch.Tensor  # [S, N*B] anchor token then mask ids
    labels: torch.Tensor  # [S, N*B] target greedy token (target vocabulary) or IGNORE
    kd_pos: torch.Tensor  # [S, N*B] the position whose top-k distribution labels the row (or -1)
    offsets: torch.Tensor  # [S, N*B] k = row offset in its block
    topk_ids: torch.Tensor | None  # [S, N*B, k]
    topk_logits: torch.Tensor | None  # [S, N*B, k]
    rows: int  # real block rows (anchors x block), padding excluded; the batch computes S*N*B


def chain_ok(tokens: torch.Tensor, greedy: torch.Tensor, anchors: torch.Tensor, block: int) -> torch.Tensor:
    """[L] tokens, [L] greedy, [n] anchors -> [n, block] bool: row k of the block at anchor p is a decoding label
    only if tokens p+1 .. p+k-1 are the target's own greedy choices (greedy[t] = the choice after position t), i.e.
    the target would have reached row k by itself. Rows 0 and 1 are always True."""
    L = tokens.shape[0]
    agree = torch.zeros(L + block, dtype=torch.bool)
    agree[: L - 1] = tokens[1:] == greedy[:-1]  # agree[t]: the text's token t+1 is the target's choice after t
    steps = agree[anchors[:, None] + torch.arange(block - 1)].long().cumprod(-1).bool()  # [n, B-1]: rows 2..B
    return torch.cat([torch.ones(anchors.shape[0], 1, dtype=torch.bool), torch.ones_like(steps[:, :1]),
                      steps[:, :-1]], dim=1)


def make_batch(seqs: list[TeacherSequence], anchor_lists: list[np.ndarray], block: int, mask_id: int,
               cols: np.ndarray | list[np.ndarray], max_len: int, with_topk: bool, chain: bool = True) -> Batch:
    """Pad S sequences and their anchor lists into one batch. Row (j, k) of a block at anchor p is labelled with
    greedy[p + k - 1], the target's own choice for position p + k after the true prefix (teacher-forced); with
    `chain`, rows k >= 2 only where the prefix up to them is the target's own (`chain_ok`). cols: the feature
    columns to read, one array for all sequences or one per sequence (caches that store different layers)."""
    s = len(seqs)
    lens = [min(len(q), max_len) for q in seqs]
    seq_len, n = max(lens), max(1, max(len(a) for a in anchor_lists))
    per_seq = cols if isinstance(cols, list) else [cols] * s
    kh = len(per_seq[0])
    feats = torch.zeros(s, seq_len, kh, dtype=torch.bfloat16)
    next_ids = torch.zeros(s, seq_len, dtype=torch.long)
    anchors = torch.ones(s, n, dtype=torch.long)
    labels = torch.full((s, n * block), IGNORE, dtype=torch.long)
    kd_pos = torch.full((s, n * block), -1, dtype=torch.long)
    block_ids = torch.full((s, n * block), mask_id, dtype=torch.long)
    k = torch.arange(block)
    offsets = k.repeat(n).unsqueeze(0).expand(s, -1).contiguous()
    topk = seqs[0].topk_ids.shape[1]
    tk_ids = torch.zeros(s, n * block, topk, dtype=torch.long) if with_topk else None
    tk_lg = torch.zeros(s, n * block, topk, dtype=torch.float32) if with_topk else None
    for i, (q, a) in enumerate(zip(seqs, anchor_lists)):
        L = lens[i]
        c = per_seq[i]
        feats[i, :L] = feats_tensor(q, c if len(c) < q.feats.shape[1] else None)[:L]
        next_ids[i, : L - 1] = torch.from_numpy(np.asarray(q.tokens[1:L], dtype=np.int64))
        if len(a) == 0:
            continue
        at = torch.from_numpy(a)
        anchors[i, : len(a)] = at
        tokens = torch.from_numpy(np.asarray(q.tokens[:L], dtype=np.int64))
        greedy = torch.from_numpy(np.asarray(q.greedy[:L], dtype=np.int64))
        mask = torch.from_numpy(np.asarray(q.loss_mask[:L], dtype=bool))
        pos = (at[:, None] + k).reshape(-1)  # [n_i * B]
        rows = slice(0, len(a) * block)
        inside = pos < L
        safe = pos.clamp(max=L - 1)
        offs = offsets[i, rows]
        ok = inside & mask[safe] & (offs > 0)
        if chain:
            ok &= chain_ok(tokens, greedy, at, block).reshape(-1)
        labels[i, rows] = torch.where(ok, greedy[(safe - 1).clamp_min(0)], torch.full_like(pos, IGNORE))
        kd_pos[i, rows] = torch.where(ok, safe - 1, torch.full_like(pos, -1))
        block_ids[i, rows] = torch.where(offs == 0, tokens[safe], torch.full_like(pos, mask_id))
        if with_topk:
            src = (safe - 1).clamp_min(0).numpy()
            tk_ids[i, rows] = torch.from_numpy(np.asarray(q.topk_ids[src], dtype=np.int64))
            tk_lg[i, rows] = torch.from_numpy(np.asarray(q.topk_logits[src], dtype=np.float32))
    return Batch(feats, next_ids, torch.tensor(lens), anchors, block_ids, labels, kd_pos, offsets, tk_ids, tk_lg,
                 rows=sum(len(a) for a in anchor_lists) * block)


def fused_inputs(draft: DFlashDraftModel, target, batch: Batch) -> torch.Tensor:
    """What the draft's context fusion reads -> [S, L, K*H], or [S, L, (K+1)*H] for a draft with
    `next_token_feature`: the target's embedding of the token after each position appended. No position sees its
    own future through it: block rows at anchor p read context c < p, whose next tokens are at most the anchor."""
    if not draft.config.next_token_feature:
        return batch.features
    with torch.no_grad():
        nxt = draft.next_token_input(target.embed(batch.next_ids))  # in the target's dtype, as the proposer
    return torch.cat([batch.features.to(nxt.dtype), nxt], dim=-1)


class DraftHead:
    """The target's frozen LM-head rows of the draft vocabulary and the target-id -> draft-id map."""

    def __init__(self, target, draft: DFlashDraftModel) -> None:
        v = target.vocab_size
        ids = draft.vocab_ids
        self.ids = torch.arange(v) if ids is None else ids.cpu()
        self.weight = target.lm_head.weight.detach()[self.ids]  # [Vd, H]
        self.map = torch.full((v,), -1, dtype=torch.long)
        self.map[self.ids] = torch.arange(self.ids.numel())
        self.full_weight = target.lm_head.weight.detach()  # [V, H]: a copy gate's candidate may lie outside
        self.gate = draft.copy_gate

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight.to(hidden.dtype))

    def scores(self, hidden: torch.Tensor, copy: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
               ) -> torch.Tensor:
        """hidden [R, H] -> fp32 scores [R, Vd] (no copy gate) or [R, Vd + 1] (`copy_gate.gated_logits`; copy =
        (candidates [R] target ids or -1, match lengths [R], block rows [R]))."""
        logits = self.logits(hidden).float()
        if self.gate is None:
            return logits
        cand, n, k = copy
        return gated_logits(logits, hidden, self.gate, cand, n.clamp_min(1), k, self.full_weight, self.map)

    def target_ids(self, choice: torch.Tensor, cand: torch.Tensor | None) -> torch.Tensor:
        """column indices of `scores` -> target ids."""
        if self.gate is None:
            return self.ids[choice]
        return gated_ids(choice, cand, self.ids, self.ids.numel())

    def columns(self, labels: torch.Tensor, cand: torch.Tensor | None) -> torch.Tensor:
        """target-id labels [R] -> columns of `scores` (-1: the draft cannot propose that token)."""
        col = self.map[labels.clamp_min(0)].masked_fill(labels < 0, -1)
        if self.gate is not None:
            col = torch.where((col < 0) & (labels >= 0) & (labels == cand), self.ids.numel(), col)
        return col
