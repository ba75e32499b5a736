"""Reference predictors for a draft's position 1: what a draft should beat.

For a block anchored at p, block row 1 predicts the target's token after position p. Two small MLPs through the
target's frozen LM head (draft vocabulary rows) predict the same label from less:
- `bigram`: the anchor token's embedding only. A draft at this level has not learned to read the target;
- `feature`: the last context feature (target layer `layer` at p - 1, the newest row of the draft's context cache)
  plus the anchor embedding. A draft should reach this level, since it sees that feature and more.
Both are trained on every valid anchor of the training cache and scored on exactly the held-out anchors the draft's
learning curve uses.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..models.draft_layers import RMSNorm
from .teacher import TeacherSequence, feats_tensor


class Probe(nn.Module):
    def __init__(self, in_dim: int, hidden: int, out_dim: int, final_norm: torch.Tensor | None) -> None:
        super().__init__()
        self.inp = RMSNorm(in_dim, 1e-6)
        self.up = nn.Linear(in_dim, hidden)
        self.down = nn.Linear(hidden, out_dim)
        self.norm = RMSNorm(out_dim, 1e-6)
        if final_norm is not None:
            with torch.no_grad():
                self.norm.weight.copy_(final_norm.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(F.silu(self.up(self.inp(x)))))


def probe_samples(seqs: list[TeacherSequence], anchor_lists: list[np.ndarray], col: np.ndarray, kind: str):
    """-> (anchor token ids [M], last context features [M, H] or None, labels [M] target ids)."""
    toks, feats, labels = [], [], []
    for q, a in zip(seqs, anchor_lists):
        a = np.asarray(a, dtype=np.int64)
        toks.append(np.asarray(q.tokens, dtype=np.int64)[a])
        labels.append(np.asarray(q.greedy, dtype=np.int64)[a])
        if kind == "feature":
            feats.append(feats_tensor(q, col)[torch.from_numpy(a - 1)])
    f = torch.cat(feats) if feats else None
    return torch.from_numpy(np.concatenate(toks)), f, torch.from_numpy(np.concatenate(labels))


def train_probe(kind: str, target, head, train: tuple, held: tuple, steps: int = 600, batch: int = 1024,
                lr: float = 1e-3, hidden: int = 1024, eval_every: int = 100, seed: int = 0) -> list[dict]:
    """kind "bigram" or "feature"; train/held from `probe_samples`; head: fast.DraftHead -> learning curve
    [{step, minutes, acc1}], held-out position-1 top-1 accuracy against the target's greedy token."""
    if kind not in ("bigram", "feature"):
        raise ValueError(f"probe kind must be bigram or feature, got {kind!r}")
    h = target.hidden_size
    in_dim = h if kind == "bigram" else 2 * h
    norm = getattr(getattr(target.decoder, "norm", None), "weight", None)
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        probe = Probe(in_dim, hidden, h, norm)
    opt = torch.optim.AdamW(probe.parameters(), lr=lr, betas=(0.9, 0.95))
    tok, feat, lab = train
    lab_d = head.map[lab]
    keep = lab_d >= 0
    tok, lab_d = tok[keep], lab_d[keep]
    feat = feat[keep] if feat is not None else None

    def inputs(t, f):
        with torch.no_grad():
            e = target.embed(t).float()
        return e if f is None else torch.cat([f.float(), e], dim=-1)

    def score() -> float:
        ht, hf, hl = held
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            pred = head.ids[head.logits(probe(inputs(ht, hf))).float().argmax(-1)]
        return float((pred == hl).float().mean())

    curve, secs = [{"step": 0, "minutes": 0.0, "acc1": round(score(), 4)}], 0.0
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        idx = torch.randint(0, tok.numel(), (batch,), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = head.logits(probe(inputs(tok[idx], None if feat is None else feat[idx]))).float()
        loss = F.cross_entropy(logits, lab_d[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        secs += time.perf_counter() - t0
        if step % eval_every == 0 or step == steps:
            curve.append({"step": step, "minutes": round(secs / 60, 3), "acc1": round(score(), 4),
                          "loss": round(float(loss.detach()), 4)})
    return curve
