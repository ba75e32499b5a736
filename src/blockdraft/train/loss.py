"""Decay-weighted cross-entropy over block rows, computed in chunks through the frozen LM head.

Each chunk's [rows, V] logits are recomputed in the backward pass (activation checkpointing), so the
full-vocabulary logits of all N*B rows never sit in memory at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .blocks import IGNORE


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar: sum_k w_k * CE_k / sum_k w_k over labelled rows
    correct: torch.Tensor  # [B] number of rows at block offset k whose argmax equals the label
    counted: torch.Tensor  # [B] number of labelled rows at block offset k


def _chunk_loss(hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, head_weight: torch.Tensor,
                softcap: float | None):
    logits = F.linear(hidden, head_weight.to(hidden.dtype)).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    ce = F.cross_entropy(logits, labels.clamp_min(0), reduction="none")
    pred = logits.argmax(-1)
    return (ce * weights).sum(), pred


def block_loss(hidden: torch.Tensor, labels: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
               head_weight: torch.Tensor, block_size: int, chunk_rows: int = 512,
               softcap: float | None = None) -> LossOutput:
    """hidden [R, H] draft outputs, labels/offsets/weights [R], head_weight [V, H] (frozen) -> LossOutput."""
    assert hidden.dim() == 2 and labels.shape == offsets.shape == weights.shape == hidden.shape[:1]
    valid = labels != IGNORE
    w = torch.where(valid, weights, torch.zeros_like(weights))
    norm = w.sum().clamp_min(1e-8)
    total = hidden.new_zeros((), dtype=torch.float32)
    preds = []
    for s in range(0, hidden.shape[0], chunk_rows):
        sl = slice(s, s + chunk_rows)
        if hidden.requires_grad:
            part, pred = checkpoint(_chunk_loss, hidden[sl], labels[sl], w[sl], head_weight, softcap,
                                    use_reentrant=False)
        else:
            part, pred = _chunk_loss(hidden[sl], labels[sl], w[sl], head_weight, softcap)
        total = total + part
        preds.append(pred)
    pred = torch.cat(preds) if preds else labels
    hit = (pred == labels) & valid
    correct = torch.zeros(block_size, dtype=torch.long, device=offsets.device).index_add_(0, offsets, hit.long())
    counted = torch.zeros(block_size, dtype=torch.long, device=offsets.device).index_add_(0, offsets, valid.long())
    return LossOutput(loss=total / norm, correct=correct, counted=counted)
