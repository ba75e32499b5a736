"""Training the EAGLE-3 drafter with training-time test (TTT), on the same records and features as DFlash.

For one sequence x_0..x_{L-1} with target features F_0..F_{L-1}, draft rows r = 0..L-2 (row r reads feature r and
token x_{r+1}; see eagle.py):
- step 0: every row at once, causal attention among rows, input hidden g_r = fc(F_r), label x_{r+2};
- step j = 1..S (S = ttt_steps): row r reads its own step j-1 output h^{j-1}_r and the true token x_{r+1+j}, at
  position r+1+j, label x_{r+2+j}. This is exactly the j-th chained inference step after verified row r: inference
  would feed the hidden state of the previous step (one position earlier) and the token that step proposed, so the
  draft learns to run on its own hidden states (EAGLE-3 sec. 3.2);
- attention of a step-j query at row r: the step-0 keys of rows 0..r (what the inference cache holds: verified
  rows only) and the keys of the same row r at steps 1..j (the chain it would have built itself). In true positions
  a step-j query at position p sees step-0 keys of positions <= p - j and its own chain. This is the
  "causal block + one diagonal per step" mask of the EAGLE-3 / SpecForge implementations; the diagonals are computed
  as per-row dot products rather than materialising [T, (S+1)T] scores. One deliberate difference from SpecForge:
  there a row keeps its step-0 RoPE position at every step; here step j is rotated at its true position r+1+j, the
  position inference uses, so a training step and the inference step it imitates compute the same numbers (tested).
Loss: cross-entropy of every labelled row (label inside the response) of every step, weighted 0.8^j (EAGLE-3) and
normalised by the total weight; accuracy is reported per step.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.eagle import EagleConfig, EagleDraftModel
from ..models.target import TargetModel
from .blocks import IGNORE
from .config import INITS
from .loss import LossOutput, block_loss
from .precision import autocast

STEP_DECAY = 0.8  # EAGLE-3's weight of step j: 0.8^j


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, ks: list[torch.Tensor],
                  vs: list[torch.Tensor]) -> torch.Tensor:
    """q [B, Hq, T, D] queries of one TTT step; k0/v0 [B, Hkv, T, D] step-0 keys/values; ks/vs: j tensors
    [B, Hkv, T, D], the keys/values of steps 1..j (the current one included). Row t attends to k0 rows <= t and to
    row t of every tensor in ks. -> [B, Hq, T, D]."""
    b, hq, t, d = q.shape
    assert k0.shape[0] == b and k0.shape[2:] == (t, d) and hq % k0.shape[1] == 0, (tuple(q.shape), tuple(k0.shape))
    assert all(k.shape == k0.shape for k in ks) and len(ks) == len(vs)
    rep = hq // k0.shape[1]
    k0, v0 = k0.repeat_interleave(rep, 1), v0.repeat_interleave(rep, 1)
    scale = d ** -0.5
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = (q @ k0.transpose(-1, -2) * scale).float().masked_fill(~causal, float("-inf"))  # [B, Hq, T, T]
    if ks:
        kd = torch.stack(ks, dim=3).repeat_interleave(rep, 1)  # [B, Hq, T, j, D]
        vd = torch.stack(vs, dim=3).repeat_interleave(rep, 1)
        diag = (q.unsqueeze(3) * kd).sum(-1).float() * scale  # [B, Hq, T, j]
        scores = torch.cat([scores, diag], dim=-1)
    p = scores.softmax(-1).to(q.dtype)
    out = p[..., :t] @ v0
    if ks:
        out = out + (p[..., t:].unsqueeze(-1) * vd).sum(3)
    return out


def ttt_forward(draft: EagleDraftModel, features: torch.Tensor, embeds: torch.Tensor, steps: int) -> torch.Tensor:
    """features [1, L, 3H] target features, embeds [1, L, H] target embeddings of x_0..x_{L-1}, steps S ->
    layer outputs [S+1, L-1, H] (before the final norm); [j, r] is step j of row r. Rows whose step-j token lies
    past the sequence end read the last token instead; they have no label and only their own later steps see them."""
    assert features.dim() == 3 and embeds.dim() == 3 and features.shape[:2] == embeds.shape[:2], (
        f"features [1, L, 3H] and embeds [1, L, H] disagree: {tuple(features.shape)}, {tuple(embeds.shape)}")
    seq_len = embeds.shape[1]
    rows = torch.arange(seq_len - 1, device=embeds.device)
    hidden = draft.fuse(features[:, :-1])
    k0 = v0 = None
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    outs = []
    for j in range(steps + 1):
        at = rows + 1 + j
        q, k, v = draft.project(embeds[:, at.clamp(max=seq_len - 1)], hidden, at.unsqueeze(0))
        if j == 0:
            k0, v0 = k, v
        else:
            ks.append(k)
            vs.append(v)
        hidden = draft.finish(hidden, ttt_attention(q, k0, v0, ks, vs))
        outs.append(hidden[0])
    return torch.stack(outs)


def ttt_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """input_ids/loss_mask [L] -> labels [S+1, L-1]: x_{r+2+j} where that position exists and is in the response,
    else IGNORE."""
    assert input_ids.dim() == 1 and loss_mask.shape == input_ids.shape
    seq_len = input_ids.numel()
    at = torch.arange(seq_len - 1).unsqueeze(0) + 2 + torch.arange(steps + 1).unsqueeze(1)  # [S+1, L-1]
    safe = at.clamp(max=seq_len - 1)
    ok = (at < seq_len) & loss_mask.bool()[safe]
    return torch.where(ok, input_ids[safe], torch.full_like(at, IGNORE))


class EagleTrainModule(nn.Module):
    """The whole TTT unroll in one module call (so DDP sees a single forward per micro-batch)."""

    def __init__(self, draft: EagleDraftModel, steps: int) -> None:
        super().__init__()
        self.draft = draft
        self.steps = steps

    def forward(self, features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """features [1, L, 3H], embeds [1, L, H] -> final-normed hidden [S+1, L-1, H]."""
        return self.draft.norm(ttt_forward(self.draft, features, embeds, self.steps))


def make_eagle_draft(cfg, target: TargetModel) -> EagleDraftModel:
    """A fresh fp32 EAGLE drafter for `target` (or the draft directory `cfg.init` names), seeded by cfg.seed."""
    if cfg.init not in INITS:
        draft = EagleDraftModel.from_pretrained(cfg.init, dtype=torch.float32)
        draft.check_compatible(target)
        return draft
    torch.manual_seed(cfg.seed)
    return EagleDraftModel(EagleConfig.from_target(target.config)).float().init_from_target(target)


def eagle_sample_loss(module: nn.Module, target: TargetModel, record: dict, features_fn, cfg,
                      dtype: torch.dtype = torch.float32) -> LossOutput | None:
    """TTT loss of one training sequence; None when it has no labelled row. correct/counted are per step [S+1];
    dtype: the autocast compute type."""
    steps = cfg.ttt_steps
    ids = torch.tensor(record["input_ids"][: cfg.max_len], dtype=torch.long)
    lm = torch.tensor(record["loss_mask"][: cfg.max_len], dtype=torch.long)
    if ids.numel() < 3:
        return None
    labels = ttt_labels(ids, lm, steps).to(target.device)
    valid = labels != IGNORE
    if not valid.any():
        return None
    feats = features_fn(record)[:, : ids.numel()]
    with torch.no_grad():
        embeds = target.embed(ids.unsqueeze(0).to(target.device))
    step = torch.arange(steps + 1, device=labels.device).unsqueeze(1).expand_as(labels)
    decay = 1.0 if cfg.no_loss_decay else STEP_DECAY
    with autocast(dtype, target.device.type):
        hidden = module(feats, embeds)  # [S+1, L-1, H]
        # only labelled rows go through the LM head (prompt rows are computed: later rows attend to them)
        return block_loss(hidden[valid], labels[valid], step[valid], decay ** step[valid].float(),
                          target.lm_head.weight, steps + 1, cfg.loss_chunk_rows,
                          softcap=target.softcap)
