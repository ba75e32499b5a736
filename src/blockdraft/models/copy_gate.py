"""The copy gate: a learned bonus on the logit of the token prompt lookup would copy (blockdraft's own extension).

Why: the draft reads the target only through its features, and a tapped feature at a context position holds the
target's prediction there, not the token that came; context positions never attend to each other inside the draft.
So "what followed the last occurrence of my suffix" is out of its reach. On the default target's held-out records
(teacher-forced, every anchor, the 8th-round draft) a 3-gram lookup match exists at 69% of anchors and its next
token is right 84-90% of the time, while the draft is right there 58% (ShareGPT) to 81% (math); the draft or the
lookup is right at 83% / 92% of anchors (ShareGPT / math) against the draft's 55% / 81% alone
(`experiments/copy_ceiling.py`, `benchmarks/default-draft/2026-12-01-8eb22f7d/copy_ceiling.json`).

What it computes, for block row k (1..B-1) whose lookup candidate is token c (matched by a suffix n-gram of length
n; rows without a candidate are left alone):

    score(c) = h_k . W_head[c] + table[n - 1, k] + w . h_k

h_k is the draft's final-normed hidden state, W_head the target's frozen LM head. Every other token keeps its
logit. A candidate outside a reduced draft vocabulary gets an extra column, so the draft can copy rare tokens
(names, numbers) that its head cannot propose. The bonus starts at zero: a draft that gains a gate computes the
same scores over its vocabulary until training moves it.

The gate is not part of the public DFlash layout: it is saved in its own file (`copy_gate.safetensors`) beside the
draft's weights, which stay loadable by other engines (they decode without the bonus).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from .ngram import lookup_table

GATE_WEIGHTS_NAME = "copy_gate.safetensors"


class CopyGate(nn.Module):
    def __init__(self, hidden_size: int, block_size: int, max_ngram: int = 3) -> None:
        super().__init__()
        self.max_ngram = max_ngram
        self.table = nn.Parameter(torch.zeros(max_ngram, block_size))  # [n - 1, k]
        self.w = nn.Parameter(torch.zeros(hidden_size))

    def bonus(self, hidden: torch.Tensor, n: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """hidden [R, H], n [R] (1..max_ngram), k [R] (block row) -> [R] fp32."""
        return self.table[n - 1, k] + hidden.float() @ self.w.float()


def gated_logits(logits: torch.Tensor, hidden: torch.Tensor, gate: CopyGate, cand: torch.Tensor, n: torch.Tensor,
                 k: torch.Tensor, head_weight: torch.Tensor, vocab_map: torch.Tensor | None,
                 softcap: float | None = None) -> torch.Tensor:
    """logits [R, Vd] over the draft vocabulary (fp32), hidden [R, H] the states they came from, cand [R] lookup
    candidates as target ids (-1: none), n [R] their match lengths, k [R] block rows, head_weight [V, H] the
    target's full LM head, vocab_map [V] target id -> draft id (-1 outside; None: the full vocabulary), softcap:
    the target's logit soft-cap, if `logits` carry one ->
    [R, Vd + 1]: the candidate's score replaces its logit (or fills the last column when it is outside the draft
    vocabulary); the last column is -inf in every other row."""
    has = cand >= 0
    out = torch.cat([logits.float(), logits.new_full((logits.shape[0], 1), float("-inf"), dtype=torch.float32)], 1)
    if not bool(has.any()):
        return out
    rows = has.nonzero().squeeze(-1)
    c = cand[rows]
    h = hidden[rows]
    bonus = gate.bonus(h, n[rows], k[rows])
    col = vocab_map[c] if vocab_map is not None else c
    inside = col >= 0
    # inside the vocabulary the logit is already there: add the bonus to it (the same value either way, and it
    # keeps the candidate's score bit-equal to the logit the head computed when the bonus is zero)
    out = out.index_put((rows[inside], col[inside]), bonus[inside], accumulate=True)
    if bool((~inside).any()):
        r_out = rows[~inside]
        s = (h[~inside].to(head_weight.dtype) * head_weight[c[~inside]]).sum(-1).float()
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        s = s + bonus[~inside]
        out = out.index_put((r_out, torch.full_like(r_out, logits.shape[1])), s)
    return out


def gated_ids(choice: torch.Tensor, cand: torch.Tensor, vocab_ids: torch.Tensor | None, vd: int) -> torch.Tensor:
    """choice [R, ...] indices into gated_logits' columns (one or several per row), cand [R] the rows' candidates
    -> target ids [R, ...]."""
    base = choice.clamp_max(vd - 1)
    ids = vocab_ids[base] if vocab_ids is not None else base
    cand = cand.view(cand.shape + (1,) * (choice.dim() - cand.dim()))
    return torch.where(choice == vd, cand, ids)


def gated_probs_to_vocab(probs: torch.Tensor, cand: torch.Tensor, vocab_ids: torch.Tensor | None,
                         vocab_size: int) -> torch.Tensor:
    """probs [G, Vd + 1] over gated_logits' columns -> [G, V] over the target's vocabulary (the last column's mass
    on each row's candidate)."""
    g, vd = probs.shape[0], probs.shape[1] - 1
    full = probs.new_zeros(g, vocab_size)
    if vocab_ids is None:
        full[:, :vd] = probs[:, :vd]
    else:
        full.index_copy_(1, vocab_ids, probs[:, :vd])
    extra = probs[:, vd]
    rows = (extra > 0).nonzero().squeeze(-1)
    if rows.numel():
        full[rows, cand[rows]] += extra[rows]
    return full


class LookupTables:
    """Per-sequence `lookup_table`s, computed on first use and kept (a sequence is drawn many times in training)."""

    def __init__(self, num_tokens: int, max_ngram: int = 3) -> None:
        self.num_tokens, self.max_ngram = num_tokens, max_ngram
        self._tables: dict[int, tuple[object, tuple[np.ndarray, np.ndarray]]] = {}

    def get(self, seq, max_len: int) -> tuple[np.ndarray, np.ndarray]:
        key = id(seq.tokens)
        if key not in self._tables:  # the token array is kept with its table, so its id cannot be reused meanwhile
            self._tables[key] = (seq.tokens, lookup_table(np.asarray(seq.tokens[:max_len]), self.num_tokens,
                                                          self.max_ngram))
        return self._tables[key][1]

    def rows(self, seqs, anchor_lists, block: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (cand [S, N*B], n [S, N*B]) for the rows of `make_batch(seqs, anchor_lists, block, ...)`: row k of the
        block at anchor p gets the k-th token of the continuation lookup finds for the prefix through p (what
        decoding sees at that anchor); -1 / 0 where there is none (row 0, padding, a continuation shorter than k)."""
        assert block - 1 <= self.num_tokens, "the tables hold fewer continuation tokens than the block has rows"
        s, nmax = len(seqs), max(1, max(len(a) for a in anchor_lists))
        cand = np.full((s, nmax, block), -1, dtype=np.int64)
        nm = np.zeros((s, nmax, block), dtype=np.int64)
        for i, (q, a) in enumerate(zip(seqs, anchor_lists)):
            if not len(a):
                continue
            cont, n = self.get(q, max_len)
            a = np.asarray(a, dtype=np.int64)
            cand[i, : len(a), 1:] = cont[a, : block - 1]
            nm[i, : len(a), 1:] = n[a, None]
        nm[cand < 0] = 0
        return torch.from_numpy(cand.reshape(s, -1)), torch.from_numpy(nm.reshape(s, -1))
