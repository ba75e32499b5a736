"""The DFlash draft's decode-time forward on fused, prepacked weights.

Why: at decode time the draft runs a handful of tokens (one block of 4-16 and the few newly committed context
positions) through small matrices, so each step's cost is framework overhead and small-matrix matmuls, not FLOPs.
On the 3-layer default draft most of the module forward's time went to small unpacked matmuls and to projecting
newly committed context again (docs/results-history.md, "Measurements behind the code's choices"). This path keeps
the draft's weights but
- fuses q/k/v into one projection and gate/up into one, and every layer's context k/v into one (computed once,
  not concatenated again at every call as `DFlashDraftModel.context_kv` does);
- prepacks every bf16 weight for oneDNN once (`lean.Linear`, faster than `F.linear` at 1-16 rows);
- writes the block's keys/values in place after the context in the proposer's `KVCache` (without advancing its
  length) instead of concatenating the whole context with them in every layer.

It computes the same function as `DFlashDraftModel.context_kv` + `forward` with no mask (the block sees the whole
context and itself): `tests/test_draft_lean.py` compares the two, and the engine's token-exactness tests run through
it. It is a snapshot: weights changed after construction (training) are not seen.

With every linear quantized (a draft beside a quantized target) and the kernels built, both calls run natively
(`csrc/decoder.cpp` `DraftStack`): the same operations on the same weights in a handful of calls, where the Python
layers cost several times their matmuls in per-op dispatch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cache import KVCache
from .draft import DFlashDraftModel
from .draft_layers import apply_rope, rope_cos_sin
from .lean import Linear, RopeRows, rms_norm, packed_linear_available  # rms_norm is draft.RMSNorm op for op
from .quant import BLOCK, QuantLinear, quant_kernels, quantize


def _linear(weights: list[torch.Tensor], packed: bool, mode: str):
    """The (fused) linear of these weights stacked along the output: float (prepacked when `packed`), or quantized
    for mode 'int8' / 'int4' where the input width allows it."""
    w = torch.cat([x.detach() for x in weights])
    if mode in ("int8", "int4") and w.shape[1] % BLOCK == 0:
        return QuantLinear(quantize(w, mode))
    return Linear(w, None, packed)


class _DraftLayer:
    def __init__(self, layer, packed: bool, mode: str) -> None:
        att, mlp = layer.self_attn, layer.mlp
        self.n_heads, self.n_kv, self.head_dim = att.n_heads, att.n_kv, att.head_dim
        self.qkv = _linear([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight], packed, mode)
        self.o = _linear([att.o_proj.weight], packed, mode)
        self.gate_up = _linear([mlp.gate_proj.weight, mlp.up_proj.weight], packed, mode)
        self.down = _linear([mlp.down_proj.weight], packed, mode)
        self.inter = int(mlp.gate_proj.weight.shape[0])
        self.ln1, self.ln2 = layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()
        self.q_norm, self.k_norm = att.q_norm.weight.detach(), att.k_norm.weight.detach()
        self.eps = layer.input_layernorm.eps


class LeanDraft:
    """Inference forward of a DFlashDraftModel (see the module docstring)."""

    def __init__(self, draft: DFlashDraftModel, packed: bool | None = None, weights: str = "bf16") -> None:
        """weights: 'bf16' keeps the draft's float weights; 'int8' / 'int4' quantize its linears (quant/)."""
        cfg = draft.config
        self.config = cfg
        self.dtype = draft.dtype
        self.weights = weights
        device = draft.fc.weight.device
        packed = packed_linear_available(self.dtype, device) if packed is None else packed
        self.fc = _linear([draft.fc.weight], packed, weights)
        self.hidden_norm = draft.hidden_norm.weight.detach()
        self.mix = None if draft.mix is None else draft.mix.detach().to(self.dtype)  # [L, K]: layer_mix
        self.final_norm = draft.norm.weight.detach()
        self.eps = draft.norm.eps
        self.layers = [_DraftLayer(layer, packed, weights) for layer in draft.layers]
        attn = [layer.self_attn for layer in draft.layers]
        self.ctx_kv = _linear([a.k_proj.weight for a in attn] + [a.v_proj.weight for a in attn], packed, weights)
        self.native = self._build_native()
        # the values `rope_cos_sin` gives, position by position
        self._rope_rows = RopeRows(lambda n: tuple(t[0, 0] for t in rope_cos_sin(
            torch.arange(n, device=device).unsqueeze(0), cfg.head_dim, cfg.rope_theta, torch.float32)))

    def _build_native(self):
        """The native stack (csrc/decoder.cpp) when every linear is quantized and the kernels are built, else None."""
        lins = [self.fc, self.ctx_kv] + [x for la in self.layers for x in (la.qkv, la.o, la.gate_up, la.down)]
        if not all(isinstance(x, QuantLinear) for x in lins) or quant_kernels() is None:
            return None
        cfg, first = self.config, self.layers[0]
        f32 = lambda t: t.float().contiguous()  # noqa: E731
        native = quant_kernels().DraftStack(
            int(cfg.hidden_size), first.n_heads, first.n_kv, first.head_dim, first.inter, self.fc.native(),
            f32(self.hidden_norm), float(cfg.rms_norm_eps), self.ctx_kv.native(), f32(self.final_norm),
            float(self.eps))
        for la in self.layers:
            native.add_layer(la.qkv.native(), la.o.native(), la.gate_up.native(), la.down.native(), f32(la.ln1),
                             f32(la.ln2), f32(la.q_norm), f32(la.k_norm), float(la.eps))
        return native

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [1, T] -> float32 (cos, sin) [T, D] for the native stack."""
        return self._rope_rows(positions[0])

    def append_context(self, features: torch.Tensor, positions: torch.Tensor, ctx: KVCache) -> None:
        """features [1, C, K*H] at positions [1, C] -> their keys / values appended to every layer of `ctx`. The
        native stack knows one fused context only: a `layer_mix` draft projects its few new positions here."""
        if self.native is None or features.shape[0] != 1 or self.mix is not None:
            ctx.append(*self.context_kv(features, positions))
            return
        c = features.shape[1]
        ctx.reserve(ctx.length + c)
        self.native.context(features[0], ctx.k, ctx.v, ctx.length, *self._cos_sin(positions))
        ctx.length += c

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """features [B, C, K*H], positions [B, C] -> (ks, vs) [L, B, H_kv, C, D], keys k-normed and rotated
        (what DFlashDraftModel.context_kv returns)."""
        cfg = self.config
        b, c, kh = features.shape
        assert kh == cfg.num_fused_inputs * cfg.hidden_size, (
            f"features must be [B, C, K*H] with K*H = {cfg.num_fused_inputs * cfg.hidden_size}, got {kh}")
        n = len(self.layers)
        x = features.to(self.dtype)
        if self.mix is None:
            ctx = rms_norm(self.fc(x), self.hidden_norm, cfg.rms_norm_eps)
            kv = self.ctx_kv(ctx).view(b, c, 2, n, cfg.num_key_value_heads, cfg.head_dim)
            k = kv[:, :, 0].permute(2, 0, 3, 1, 4)  # [L, B, H_kv, C, D]
            v = kv[:, :, 1].permute(2, 0, 3, 1, 4)
        else:
            # layer l's context is fc(mix[l] * features): the L scaled copies go through the fusion as one call (at
            # decode time a few rows, so one weight read), then each layer keeps its own rows of the stacked k/v
            k_in, h = cfg.num_fused_inputs, cfg.hidden_size
            scaled = (x.view(1, b, c, k_in, h) * self.mix.view(n, 1, 1, k_in, 1)).reshape(n * b, c, k_in * h)
            ctx = rms_norm(self.fc(scaled), self.hidden_norm, cfg.rms_norm_eps)
            kv = self.ctx_kv(ctx).view(n, b, c, 2, n, cfg.num_key_value_heads, cfg.head_dim)
            kv = kv[torch.arange(n), :, :, :, torch.arange(n)]  # [L, B, C, 2, H_kv, D]
            k = kv[:, :, :, 0].transpose(2, 3)  # [L, B, H_kv, C, D]
            v = kv[:, :, :, 1].transpose(2, 3)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, k.dtype)
        ks = torch.stack([apply_rope(rms_norm(k[i], layer.k_norm, layer.eps), cos, sin)
                          for i, layer in enumerate(self.layers)])
        return ks, v.contiguous()

    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor, ctx: KVCache) -> torch.Tensor:
        """block_embeds [B, Q, H] at block_positions [B, Q], attending to the whole context in `ctx` and to the
        whole block -> final-normed hidden states [B, Q, H]. The block's keys/values are written after the context
        in `ctx` (capacity grows if needed) and its length is left as it was."""
        b, q_len, _ = block_embeds.shape
        if self.native is not None and b == 1:
            return self.forward_rows(block_embeds[0], block_positions[0], [ctx], [q_len])[None]
        x = block_embeds.to(self.dtype)
        ctx.reserve(ctx.length + q_len)
        cfg = self.config
        cos, sin = rope_cos_sin(block_positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.ln1, layer.eps)
            nq, nk, d = layer.n_heads * layer.head_dim, layer.n_kv * layer.head_dim, layer.head_dim
            qkv = layer.qkv(h)
            q = rms_norm(qkv[..., :nq].view(b, q_len, layer.n_heads, d), layer.q_norm, layer.eps).transpose(1, 2)
            k = rms_norm(qkv[..., nq:nq + nk].view(b, q_len, layer.n_kv, d), layer.k_norm, layer.eps).transpose(1, 2)
            v = qkv[..., nq + nk:].reshape(b, q_len, layer.n_kv, d).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            keys, values = ctx.write(i, k, v)  # [B, H_kv, C + Q, D]: the context, then this block
            att = F.scaled_dot_product_attention(q, keys, values, enable_gqa=layer.n_kv != layer.n_heads)
            x = x + layer.o(att.transpose(1, 2).reshape(b, q_len, nq))
            gu = layer.gate_up(rms_norm(x, layer.ln2, layer.eps))
            x = x + layer.down(F.silu(gu[..., :layer.inter]) * gu[..., layer.inter:])
        return rms_norm(x, self.final_norm, self.eps)

    def forward_rows(self, block_embeds: torch.Tensor, block_positions: torch.Tensor, ctxs: list[KVCache],
                     counts: list[int]) -> torch.Tensor:
        """Several sequences' blocks at once: block_embeds [S, H] stacked row by row (row i: counts[i] tokens at
        block_positions [S], attending to its own context ctxs[i] and its own block) -> hidden states [S, H]. The
        native stack reads each weight once for all the rows; the Python layers run row by row."""
        assert block_embeds.shape[0] == block_positions.shape[0] == sum(counts) and len(ctxs) == len(counts)
        x = block_embeds.to(self.dtype)
        if self.native is None:
            outs, o = [], 0
            for ctx, c in zip(ctxs, counts):
                outs.append(self.forward(x[None, o:o + c], block_positions[None, o:o + c], ctx)[0])
                o += c
            return torch.cat(outs)
        for ctx, c in zip(ctxs, counts):
            ctx.reserve(ctx.length + c)
        return self.native.forward(x.contiguous(), [c.k for c in ctxs], [c.v for c in ctxs],
                                   [c.length for c in ctxs], list(counts), *self._rope_rows(block_positions))
