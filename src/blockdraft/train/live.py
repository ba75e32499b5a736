"""The live source of training targets: records in, the target (or precomputed features) run per sequence.

One sequence's anchor blocks go through the draft in one forward under a dense (or, on CUDA, flex) block mask
(`blocks.py`); labels are the record's own next tokens or, with `target_labels`, the target's greedy ones. This is
the path for GPUs, for the EAGLE-3 baseline and for the ablations that need raw records (uniform blocks, no target
features); on a CPU the cache source (`cached.py`) trains the same draft several times faster.

Determinism: the records of each epoch are a permutation seeded by (seed, epoch) and the anchors of a sample by
(seed, sample index), so a run resumed from a checkpoint replays exactly the batches an uninterrupted run would see.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.draft import DFlashDraftModel
from ..models.draft_config import DFlashConfig
from ..models.target import TargetModel
from .blocks import (IGNORE, block_attention_mask, build_blocks, default_gamma, flex_block_mask, loss_weights,
                     sample_anchors)
from .config import TrainConfig
from .features import OfflineFeatures, OnlineFeatures
from .loss import block_loss
from .precision import autocast
from ..config import GenerationConfig
from ..decode.engine import Engine
from ..decode.proposers.dflash import DFlashProposer
from ..decode.proposers.eagle import EagleProposer
from .eagle import EagleTrainModule, eagle_sample_loss


class TrainModule(nn.Module):
    """The draft's training forward in one module call: features [1, L, K*H] or None (no conditioning),
    block_embeds [1, R, H], positions [1, R], mask [1, 1, R, L + R] bool or the equivalent flex BlockMask ->
    hidden [R, H]."""

    def __init__(self, draft: DFlashDraftModel) -> None:
        super().__init__()
        self.draft = draft

    def forward(self, features: torch.Tensor | None, block_embeds: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        cfg = self.draft.config
        if features is None:
            shape = (cfg.num_hidden_layers, 1, cfg.num_key_value_heads, 0, cfg.head_dim)
            ks = vs = block_embeds.new_zeros(shape)
        else:
            ks, vs = self.draft.context_kv(features, torch.arange(features.shape[1]).unsqueeze(0))
        return self.draft(block_embeds, positions, ks, vs, mask)[0]


def sample_loss(module: nn.Module, target: TargetModel, record: dict, features_fn, cfg: TrainConfig,
                draft_cfg: DFlashConfig, sample_index: int, vocab_ids: torch.Tensor | None = None,
                vocab_map: torch.Tensor | None = None, dtype: torch.dtype = torch.float32):
    """Loss of one training sequence (all its anchor blocks in one forward). Returns None if it has no anchor.
    vocab_ids [Vd] / vocab_map [V] (target id -> draft id or IGNORE): a reduced draft vocabulary; dtype: the
    autocast compute type (`precision.compute_dtype`)."""
    ids = torch.tensor(record["input_ids"][: cfg.max_len], dtype=torch.long)
    lm = torch.tensor(record["loss_mask"][: cfg.max_len], dtype=torch.long)
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + sample_index)
    anchors = sample_anchors(lm, cfg.anchors or lm.numel(), draft_cfg.block_size, g, uniform=cfg.uniform_blocks)
    if anchors.numel() == 0:
        return None
    label_ids = None
    if cfg.target_labels:
        if not hasattr(features_fn, "with_greedy"):
            raise ValueError("target_labels needs online features (the target's greedy tokens come from its forward)")
        feats, greedy = features_fn.with_greedy(record, cfg.max_len)
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
    head, labels = target.lm_head.weight, bb.labels
    if vocab_map is not None:
        # reduced draft vocabulary: logits over its rows only; labels outside it cannot be proposed and are ignored
        head = head[vocab_ids]
        labels = torch.where(labels >= 0, vocab_map[labels.clamp_min(0)], labels)
    with autocast(dtype, target.device.type):
        hidden = module(feats, embeds, bb.positions.unsqueeze(0), mask)
        gamma = None if cfg.no_loss_decay else (cfg.gamma or default_gamma(draft_cfg.block_size))
        return block_loss(hidden, labels, bb.offsets, loss_weights(bb.offsets, gamma),
                          head, draft_cfg.block_size, cfg.loss_chunk_rows,
                          softcap=getattr(target, "_softcap", None))


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


def evaluate_tau(target: TargetModel, draft: nn.Module, prompts: list[list[int]], max_new_tokens: int) -> float:
    """Greedy decode held-out prompts with the real engine and the current draft -> mean tau."""
    if not prompts:
        return float("nan")
    d = type(draft)(draft.config)
    d.load_state_dict(draft.state_dict())
    d = d.to(target.dtype).eval()
    proposer = DFlashProposer(d, target) if isinstance(d, DFlashDraftModel) else EagleProposer(d, target)
    eng = Engine(target, proposer)
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


class LiveObjective:
    """Training steps over records: `seqs_per_step` sequences per process and step, their losses summed with
    gradient accumulation; held-out evaluation decodes prompts with the engine."""

    def __init__(self, cfg: TrainConfig, target: TargetModel, draft: nn.Module, records: list[dict],
                 heldout: list[dict] | None, dtype: torch.dtype) -> None:
        self.cfg, self.target, self.draft, self.records, self.dtype = cfg, target, draft, records, dtype
        self.eagle = cfg.method == "eagle"
        layer_ids = draft.config.target_layer_ids
        self.features = (OnlineFeatures(target, layer_ids) if cfg.features == "online"
                         else OfflineFeatures(cfg.features, layer_ids))
        if self.eagle:
            self.module: nn.Module = EagleTrainModule(draft, cfg.ttt_steps)
        else:
            self.module = TrainModule(draft)
        self.acc_width = cfg.ttt_steps + 1 if self.eagle else draft.config.block_size  # per TTT step / block row
        self.acc_from = 0 if self.eagle else 1  # block row 0 is the given token
        self.vocab_ids = None if self.eagle else draft.vocab_ids
        self.vocab_map = None
        if self.vocab_ids is not None:
            self.vocab_map = torch.full((target.vocab_size,), IGNORE, dtype=torch.long)
            self.vocab_map[self.vocab_ids] = torch.arange(self.vocab_ids.numel())
        self.prompts = [prompt_of(r) for r in (heldout or [])[: cfg.eval_prompts]]

    def param_groups(self) -> list[dict]:
        return [{"params": [p for p in self.draft.parameters() if p.requires_grad], "role": "draft"}]

    def step(self, state: dict, rank: int, world: int):
        """One optimizer step's forward and backward -> (mean loss, correct [W], counted [W], rows)."""
        cfg, n = self.cfg, len(self.records)
        total, n_ok = 0.0, 0
        correct = torch.zeros(self.acc_width, dtype=torch.long)
        counted = torch.zeros(self.acc_width, dtype=torch.long)
        for micro in range(cfg.seqs_per_step):
            index = state["samples_seen"] + micro * world + rank
            epoch, pos = divmod(index, n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + epoch))
            rec = self.records[int(perm[pos])]
            if self.eagle:
                res = eagle_sample_loss(self.module, self.target, rec, self.features, cfg, self.dtype)
            else:
                res = sample_loss(self.module, self.target, rec, self.features, cfg, self.draft.config, index,
                                  self.vocab_ids, self.vocab_map, self.dtype)
            if res is None:
                continue
            (res.loss / cfg.seqs_per_step).backward()
            total += float(res.loss.detach())
            n_ok += 1
            correct += res.correct
            counted += res.counted
        state["samples_seen"] += cfg.seqs_per_step * world
        return total / max(1, n_ok), correct, counted, int(counted.sum())

    def evaluate(self) -> dict:
        if not self.prompts:
            return {}
        return {"eval_tau": evaluate_tau(self.target, self.draft, self.prompts, self.cfg.eval_max_new_tokens)}
