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
from ..decode.spec import DecodeSpec, build_engine
from .eagle import EagleTrainModule, eagle_sample_loss


class TrainModule(nn.Module):
    """The draft's training forward in one module call: features [1, L, K*H] or None (no conditioning),
    block_embeds [1, R, H], positions [1, R], mask [1, 1, R, L + R] bool or the equivalent flex BlockMask ->
    hidden [R, H]."""

    def __init__(self, draft: DFlashDraftModel) -> None:
        super().__init__()
        self.draft = draft

    def forward(self, features: torch.Tensor | None, block_embeds: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor, keep_batch: bool = False) -> torch.Tensor:
        """keep_batch: features [S, L, K*H], block_embeds [S, R, H], positions [S, R], mask [S, 1, R, L + R] (or a
        BlockMask over S) -> hidden [S, R, H] (a batch of sequences, `batch_loss`)."""
        cfg = self.draft.config
        b = block_embeds.shape[0]
        if features is None:
            shape = (cfg.num_hidden_layers, b, cfg.num_key_value_heads, 0, cfg.head_dim)
            ks = vs = block_embeds.new_zeros(shape)
        else:
            ctx_pos = torch.arange(features.shape[1], device=features.device).unsqueeze(0).expand(b, -1)
            ks, vs = self.draft.context_kv(features, ctx_pos)
        hidden = self.draft(block_embeds, positions, ks, vs, mask)
        return hidden if keep_batch else hidden[0]


def live_block(cfg: TrainConfig, draft_cfg: DFlashConfig) -> int:
    """Rows per training block on the live source: `train_block` where it is set below `block_size` (a draft that
    decodes short blocks learns its first rows from more anchors), else the draft's own block size (a continued
    draft keeps its size). The loss decay stays the draft's (as on a teacher cache)."""
    if cfg.train_block < cfg.block_size:
        return min(cfg.train_block, draft_cfg.block_size)
    return draft_cfg.block_size


def sample_loss(module: nn.Module, target: TargetModel, record: dict, features_fn, cfg: TrainConfig,
                draft_cfg: DFlashConfig, sample_index: int, vocab_ids: torch.Tensor | None = None,
                vocab_map: torch.Tensor | None = None, dtype: torch.dtype = torch.float32):
    """Loss of one training sequence (all its anchor blocks in one forward). Returns None if it has no anchor.
    vocab_ids [Vd] / vocab_map [V] (target id -> draft id or IGNORE): a reduced draft vocabulary; dtype: the
    autocast compute type (`precision.compute_dtype`)."""
    ids = torch.tensor(record["input_ids"][: cfg.max_len], dtype=torch.long)
    lm = torch.tensor(record["loss_mask"][: cfg.max_len], dtype=torch.long)
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + sample_index)
    bs = live_block(cfg, draft_cfg)
    anchors = sample_anchors(lm, cfg.anchors or lm.numel(), bs, g, uniform=cfg.uniform_blocks)
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
    bb = build_blocks(ids, lm, anchors, bs, draft_cfg.mask_token_id, label_ids)
    ctx_len = 0 if feats is None else feats.shape[1]
    use_flex = cfg.attention == "flex" or (cfg.attention == "auto" and target.device.type == "cuda")
    if use_flex:
        mask = flex_block_mask(anchors, bs, ctx_len, target.device)
    else:
        mask = block_attention_mask(anchors, bs, ctx_len)[None, None].to(target.device)
    with torch.no_grad():
        embeds = target.embed(bb.block_ids.unsqueeze(0).to(target.device))
    dev = target.device
    head, labels, offsets = target.lm_head.weight, bb.labels.to(dev), bb.offsets.to(dev)
    if vocab_map is not None:
        # reduced draft vocabulary: logits over its rows only; labels outside it cannot be proposed and are ignored
        head = head[vocab_ids.to(dev)]
        labels = torch.where(labels >= 0, vocab_map.to(dev)[labels.clamp_min(0)], labels)
    with autocast(dtype, dev.type):
        hidden = module(feats, embeds, bb.positions.unsqueeze(0).to(dev), mask)
        gamma = None if cfg.no_loss_decay else (cfg.gamma or default_gamma(draft_cfg.block_size))
        out = block_loss(hidden, labels, offsets, loss_weights(offsets, gamma),
                         head, bs, cfg.loss_chunk_rows,
                         softcap=target.softcap)
    out.correct, out.counted = out.correct.cpu(), out.counted.cpu()
    return out


def batch_loss(module: nn.Module, target: TargetModel, records: list[dict], features_fn, cfg: TrainConfig,
               draft_cfg: DFlashConfig, sample_indices: list[int], vocab_ids: torch.Tensor | None = None,
               vocab_map: torch.Tensor | None = None, dtype: torch.dtype = torch.float32):
    """Loss of several training sequences in one forward of the target and one of the draft: what keeps a GPU busy
    (one sequence per forward leaves it idle between kernel launches). Each sequence draws the anchors
    `sample_loss` would draw for its sample index; sequences are right-padded (the target is causal, so padding
    never reaches a real position), and anchor slots a sequence leaves empty hold blocks without labels that see
    nothing but themselves. The loss is the decay-weighted mean over every labelled row of the batch (`sample_loss`
    weighs each sequence's rows alone). Returns None if no sequence has an anchor."""
    bs, mask_id, dev = live_block(cfg, draft_cfg), draft_cfg.mask_token_id, target.device
    rows = []
    for rec, index in zip(records, sample_indices):
        ids = torch.tensor(rec["input_ids"][: cfg.max_len], dtype=torch.long)
        lm = torch.tensor(rec["loss_mask"][: cfg.max_len], dtype=torch.long)
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + index)
        anchors = sample_anchors(lm, cfg.anchors or lm.numel(), bs, g, uniform=cfg.uniform_blocks)
        if anchors.numel():
            rows.append((ids, build_blocks(ids, lm, anchors, bs, mask_id)))
    if not rows:
        return None
    s_n = len(rows)
    ctx_len = max(ids.numel() for ids, _ in rows)
    n_max = max(bb.num_blocks for _, bb in rows)
    r_max = n_max * bs
    ids_pad = torch.zeros(s_n, ctx_len, dtype=torch.long)
    block_ids = torch.full((s_n, r_max), mask_id, dtype=torch.long)
    positions = torch.zeros(s_n, r_max, dtype=torch.long)
    labels = torch.full((s_n, r_max), IGNORE, dtype=torch.long)
    offsets = torch.arange(bs).repeat(n_max).unsqueeze(0).repeat(s_n, 1)
    anchors = torch.zeros(s_n, n_max, dtype=torch.long)  # an empty slot's anchor 0: it sees no context row
    for i, (ids, bb) in enumerate(rows):
        r = bb.block_ids.numel()
        ids_pad[i, : ids.numel()] = ids
        block_ids[i, :r], positions[i, :r], labels[i, :r] = bb.block_ids, bb.positions, bb.labels
        anchors[i, : bb.num_blocks] = bb.anchors
    feats = None
    if not cfg.no_target_features:
        feats = features_fn.batch(ids_pad.to(dev))
    use_flex = cfg.attention == "flex" or (cfg.attention == "auto" and dev.type == "cuda")
    if use_flex:
        mask = flex_block_mask(anchors, bs, ctx_len if feats is not None else 0, dev)
    else:
        mask = torch.stack([block_attention_mask(a, bs, ctx_len if feats is not None else 0) for a in anchors])
        mask = mask[:, None].to(dev)
    with torch.no_grad():
        embeds = target.embed(block_ids.to(dev))
    head, labels = target.lm_head.weight, labels.reshape(-1).to(dev)
    if vocab_map is not None:
        head = head[vocab_ids.to(dev)]
        labels = torch.where(labels >= 0, vocab_map.to(dev)[labels.clamp_min(0)], labels)
    with autocast(dtype, dev.type):
        hidden = module(feats, embeds, positions.to(dev), mask, keep_batch=True)
        gamma = None if cfg.no_loss_decay else (cfg.gamma or default_gamma(draft_cfg.block_size))
        flat_offsets = offsets.reshape(-1).to(dev)
        out = block_loss(hidden.reshape(-1, hidden.shape[-1]), labels, flat_offsets,
                         loss_weights(flat_offsets, gamma), head, bs, cfg.loss_chunk_rows,
                         softcap=target.softcap)
    out.correct, out.counted = out.correct.cpu(), out.counted.cpu()
    return out


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
    eng = build_engine(target, d, DecodeSpec("dflash"))  # an EAGLE draft decodes its own chain
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
        # per TTT step / block row
        self.acc_width = cfg.ttt_steps + 1 if self.eagle else live_block(cfg, draft.config)
        self.acc_from = 0 if self.eagle else 1  # block row 0 is the given token
        self.vocab_ids = None if self.eagle else draft.vocab_ids
        self.vocab_map = None
        if self.vocab_ids is not None:
            dev = self.vocab_ids.device
            self.vocab_map = torch.full((target.vocab_size,), IGNORE, dtype=torch.long, device=dev)
            self.vocab_map[self.vocab_ids] = torch.arange(self.vocab_ids.numel(), device=dev)
        self.prompts = [prompt_of(r) for r in (heldout or [])[: cfg.eval_prompts]]
        self._perms: dict[int, torch.Tensor] = {}  # the current epoch's record order (batched steps)

    def step(self, state: dict, rank: int, world: int):
        """One optimizer step's forward and backward -> (mean loss, correct [W], counted [W], rows)."""
        cfg, n = self.cfg, len(self.records)
        total, n_ok = 0.0, 0
        correct = torch.zeros(self.acc_width, dtype=torch.long)
        counted = torch.zeros(self.acc_width, dtype=torch.long)
        if cfg.batched and not self.eagle:
            return self._batched_step(state, rank, world)
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

    def _batched_step(self, state: dict, rank: int, world: int):
        """`step` with the step's sequences in one batched forward (`batch_loss`); the same records and anchors."""
        cfg, n = self.cfg, len(self.records)
        recs, indices = [], []
        for micro in range(cfg.seqs_per_step):
            index = state["samples_seen"] + micro * world + rank
            epoch, pos = divmod(index, n)
            if epoch not in self._perms:
                self._perms = {epoch: torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + epoch))}
            recs.append(self.records[int(self._perms[epoch][pos])])
            indices.append(index)
        state["samples_seen"] += cfg.seqs_per_step * world
        res = batch_loss(self.module, self.target, recs, self.features, cfg, self.draft.config, indices,
                         self.vocab_ids, self.vocab_map, self.dtype)
        if res is None:
            zeros = torch.zeros(self.acc_width, dtype=torch.long)
            return 0.0, zeros, zeros.clone(), 0
        res.loss.backward()
        return float(res.loss.detach()), res.correct, res.counted, int(res.counted.sum())

    def evaluate(self) -> dict:
        if not self.prompts:
            return {}
        return {"eval_tau": evaluate_tau(self.target, self.draft, self.prompts, self.cfg.eval_max_new_tokens)}
