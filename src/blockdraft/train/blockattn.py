"""The DFlash training forward with the block mask factorised: many anchors per sequence at the cost of a few.

The dense reference (`TrainModule` + `block_attention_mask`) lets N*B block rows attend over [L context rows;
N*B block rows] with a boolean mask, so its score matrix is [N*B, L + N*B] although each row sees at most L + B
entries: with every response position an anchor (N ~ L) that is quadratic in N*B. Here each row's scores are split
into the two parts it can see:

- context: [S, H, N*B, L], row (j, k) sees context c < p_j (and c < the sequence's length: padding);
- own block: [S, H, N, B, B], rows of block j see each other (bidirectional).

One softmax over their concatenation gives exactly the attention of the dense mask (tests/test_fast_train.py checks
it against `TrainModule`), and the own-block part costs N*B*B instead of (N*B)^2. Sequences of a batch are padded
to the longest context and the largest anchor count; padded anchors are ignored by the loss.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..models.draft import DFlashDraftModel
from ..models.draft_layers import Layer, apply_rope, rope_cos_sin


def _layer_forward(layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                   ctx_v: torch.Tensor, ctx_visible: torch.Tensor, n_blocks: int, block: int) -> torch.Tensor:
    """x [S, R, H] (R = N*B block rows), cos/sin [S, 1, R, D], ctx_k/ctx_v [S, H_kv, L, D] (normed/rotated),
    ctx_visible [S, N, L] bool -> [S, R, H]."""
    attn = layer.self_attn
    s, r, _ = x.shape
    hq, hkv, d = attn.n_heads, attn.n_kv, attn.head_dim
    g = hq // hkv
    h = layer.input_layernorm(x)
    q = attn.q_norm(attn.q_proj(h).view(s, r, hq, d)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(h).view(s, r, hkv, d)).transpose(1, 2)
    v = attn.v_proj(h).view(s, r, hkv, d).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    scale = 1.0 / math.sqrt(d)
    # heads sharing a kv head are folded into the row axis, so both products are plain batched matmuls
    qg = q.reshape(s, hkv, g * r, d)
    sc_ctx = (qg @ ctx_k.transpose(-1, -2)).view(s, hkv, g, n_blocks, block, -1) * scale
    sc_ctx = sc_ctx.masked_fill(~ctx_visible[:, None, None, :, None, :], float("-inf"))
    qb = q.reshape(s, hkv, g, n_blocks, block, d)
    kb = k.reshape(s, hkv, 1, n_blocks, block, d)
    vb = v.reshape(s, hkv, 1, n_blocks, block, d)
    sc_own = (qb @ kb.transpose(-1, -2)) * scale  # [S, Hkv, g, N, B, B]
    ctx_len = sc_ctx.shape[-1]
    p = torch.softmax(torch.cat([sc_ctx, sc_own], dim=-1).float(), dim=-1).to(q.dtype)
    out_ctx = (p[..., :ctx_len].reshape(s, hkv, g * r, ctx_len) @ ctx_v).view(s, hkv, g, n_blocks, block, d)
    out = out_ctx + p[..., ctx_len:] @ vb
    out = out.reshape(s, hq, r, d).transpose(1, 2).reshape(s, r, hq * d)
    x = x + attn.o_proj(out)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def block_forward(draft: DFlashDraftModel, features: torch.Tensor, ctx_len: torch.Tensor, block_embeds: torch.Tensor,
                  anchors: torch.Tensor, block: int) -> torch.Tensor:
    """The draft over N blocks of `block` rows per sequence, each block seeing the context before its anchor.

    features [S, L, K*H] (padded past ctx_len), ctx_len [S] int, block_embeds [S, N*block, H] (embeddings of
    [anchor token, MASK...] per block), anchors [S, N] (positions p_j; padding anchors may be any value in 1..L)
    -> final-normed hidden states [S, N*block, H].
    """
    s, n = anchors.shape
    assert features.dim() == 3 and features.shape[0] == s, f"features must be [S, L, K*H], got {tuple(features.shape)}"
    assert block_embeds.shape[:2] == (s, n * block), (
        f"block_embeds must be [S, N*B, H] = [{s}, {n * block}, H], got {tuple(block_embeds.shape)}")
    cfg = draft.config
    seq = features.shape[1]
    ctx_pos = torch.arange(seq, device=features.device)
    ks, vs = draft.context_kv(features, ctx_pos.unsqueeze(0).expand(s, seq))
    ctx_visible = (ctx_pos[None, None, :] < anchors[:, :, None]) & (ctx_pos[None, None, :] < ctx_len[:, None, None])
    positions = (anchors[:, :, None] + torch.arange(block, device=anchors.device)).reshape(s, n * block)
    x = block_embeds.to(draft.dtype) if not torch.is_autocast_enabled() else block_embeds
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, ks.dtype)
    for i, layer in enumerate(draft.layers):
        x = _layer_forward(layer, x, cos, sin, ks[i], vs[i], ctx_visible, n, block)
    return draft.norm(x)


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """logits [R, V], target_probs [R, V] (rows sum to 1 or 0) -> [R] cross-entropy -sum p log q. Columns the
    teacher gives no mass add nothing, even where the draft's logit is -inf (a copy gate's candidate column in a row
    without a candidate), where 0 * log 0 would otherwise make the whole loss NaN."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -torch.where(target_probs > 0, target_probs * logp, 0.0).sum(-1)
