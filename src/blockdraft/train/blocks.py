"""Anchors, blocks, labels and the sparse attention mask of DFlash training (paper sec. 4).

For one sequence of length L with N anchors p_1 < ... < p_N and block size B:
- block j is [token at p_j, MASK x (B-1)] at positions p_j .. p_j+B-1; row k of block j is labelled with the true
  token at p_j + k (k = 1..B-1; row 0 holds the known token and has no label; labels past the sequence end or outside
  the response are ignored);
- queries are all N*B block rows; keys/values are [L context rows (target features of the whole sequence);
  N*B block rows];
- block j sees context rows c < p_j (what inference has in its context cache when the block starts at p_j), all
  B rows of its own block (bidirectional), and nothing of any other block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100


@dataclass
class BlockBatch:
    block_ids: torch.Tensor  # [N*B] input tokens: anchor token then mask ids
    positions: torch.Tensor  # [N*B] absolute positions p_j + k
    labels: torch.Tensor  # [N*B] target token or IGNORE
    offsets: torch.Tensor  # [N*B] k, the row's offset inside its block
    anchors: torch.Tensor  # [N]
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.anchors.numel()


def valid_anchor_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions p with loss_mask[p] and loss_mask[p+1]: the anchor is a response token and so is the first token
    the block must predict. loss_mask: [L] bool/int -> [M] int64."""
    m = loss_mask.bool()
    ok = m[:-1] & m[1:]
    return ok.nonzero().squeeze(-1)


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, block_size: int, generator: torch.Generator,
                   uniform: bool = False) -> torch.Tensor:
    """Choose anchors -> sorted [N] int64, N <= num_anchors.

    Random (DFlash): N distinct positions drawn uniformly from the valid ones, so blocks overlap and start anywhere
    in the response. Uniform (the standard block-diffusion split, an ablation): the response cut into consecutive
    blocks of B, anchors at their starts, chosen at random when there are more than num_anchors.
    """
    valid = valid_anchor_positions(loss_mask)
    if valid.numel() == 0:
        return valid
    if uniform:
        first = int(valid[0])
        cand = torch.arange(first, int(valid[-1]) + 1, block_size)
        cand = cand[torch.isin(cand, valid)]
    else:
        cand = valid
    if cand.numel() > num_anchors:
        cand = cand[torch.randperm(cand.numel(), generator=generator)[:num_anchors]]
    return cand.sort().values


def build_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int,
                 mask_token_id: int, label_ids: torch.Tensor | None = None) -> BlockBatch:
    """input_ids/loss_mask [L], anchors [N] -> BlockBatch of N*B rows. label_ids [L] (default input_ids): the token
    each position is labelled with, e.g. the target's own greedy choice there instead of the data's token."""
    assert input_ids.dim() == 1 and loss_mask.shape == input_ids.shape, "input_ids and loss_mask must be [L]"
    label_ids = input_ids if label_ids is None else label_ids
    assert label_ids.shape == input_ids.shape, "label_ids must be [L] like input_ids"
    seq_len = input_ids.numel()
    k = torch.arange(block_size)
    pos = (anchors.unsqueeze(1) + k).reshape(-1)  # [N*B]
    offsets = k.repeat(anchors.numel())
    inside = pos < seq_len
    safe = pos.clamp(max=seq_len - 1)
    labels = torch.where(inside & loss_mask.bool()[safe] & (offsets > 0), label_ids[safe],
                         torch.full_like(pos, IGNORE))
    block_ids = torch.where(offsets == 0, input_ids[safe], torch.full_like(pos, mask_token_id))
    return BlockBatch(block_ids=block_ids, positions=pos, labels=labels, offsets=offsets, anchors=anchors,
                      block_size=block_size)


def block_attention_mask(anchors: torch.Tensor, block_size: int, context_len: int) -> torch.Tensor:
    """[N*B, L + N*B] bool, True = visible: row (j, k) sees context c < p_j and the rows of block j only."""
    n = anchors.numel()
    rows_block = torch.arange(n).repeat_interleave(block_size)  # block index of each query row
    ctx = torch.arange(context_len).unsqueeze(0) < anchors[rows_block].unsqueeze(1)  # [NB, L]
    own = rows_block.unsqueeze(1) == rows_block.unsqueeze(0)  # [NB, NB]
    return torch.cat([ctx, own], dim=1)


def flex_block_mask(anchors: torch.Tensor, block_size: int, context_len: int, device: str | torch.device = "cpu"):
    """The same visibility as `block_attention_mask`, as a flex-attention BlockMask: only the visible tiles are
    computed, which is what makes hundreds of anchors per sequence affordable on GPUs. anchors [N] (one sequence)
    or [S, N] (a batch: sequence s's block j sees its context rows < anchors[s, j])."""
    from torch.nn.attention.flex_attention import create_block_mask

    anchors = anchors.to(device)
    rows = anchors.shape[-1] * block_size

    if anchors.dim() == 1:
        def visible(b, h, q, kv):
            blk = q // block_size
            in_ctx = (kv < context_len) & (kv < anchors[blk])
            in_own_block = (kv >= context_len) & ((kv - context_len) // block_size == blk)
            return in_ctx | in_own_block

        return create_block_mask(visible, None, None, rows, context_len + rows, device=device)

    def visible_batched(b, h, q, kv):
        blk = q // block_size
        in_ctx = (kv < context_len) & (kv < anchors[b, blk])
        in_own_block = (kv >= context_len) & ((kv - context_len) // block_size == blk)
        return in_ctx | in_own_block

    return create_block_mask(visible_batched, anchors.shape[0], None, rows, context_len + rows, device=device)


def loss_weights(offsets: torch.Tensor, gamma: float | None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for k >= 1 (paper eq. 4); row 0 gets 0. gamma None = no decay (ablation)."""
    k = offsets.to(torch.float32)
    w = torch.ones_like(k) if gamma is None else torch.exp(-(k - 1) / gamma)
    return torch.where(offsets > 0, w, torch.zeros_like(w))


def default_gamma(block_size: int) -> float:
    """The paper's decay: 7 for B=16, 5 for B=10, 4 for B=8; in between, interpolated linearly."""
    table = {8: 4.0, 10: 5.0, 16: 7.0}
    if block_size in table:
        return table[block_size]
    if block_size < 8:
        return max(1.0, block_size / 2)
    if block_size < 10:
        return 4.0 + (block_size - 8) * 0.5
    return 5.0 + (block_size - 10) * (2.0 / 6.0)
