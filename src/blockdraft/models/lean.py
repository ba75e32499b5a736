"""A lean decode path for LLaMA-family targets (LLaMA/SmolLM2, Qwen2/2.5, Qwen3): fused and prepacked weights, a
preallocated KV cache, few ops per layer.

Why: a decode step of a small target through the Hugging Face modules pays framework overhead on top of
its matmuls, and the matmuls themselves run slower than they need to: for bf16, oneDNN's prepacked linear is
faster than `F.linear` at 1-16 rows, with bit-identical results. This path keeps the target's
weights but
- fuses q/k/v into one projection and gate/up into one (two matmuls fewer per layer, one read of the input);
- prepacks every bf16 weight for oneDNN once (`Linear`), the target's LM head included (see TargetModel.logits);
- writes keys/values in place into a `KVCache` (crop = move a length pointer; no `torch.cat` per step);
- computes RoPE once per forward for all layers and taps the feature layers directly (no hooks);
- attends a row's single-query steps (plain decoding) with one grouped matmul per key/value head
  instead of torch's flash kernel, which is slow for one query (`grouped_decode_attention`);
- holds quantized weights where a `quant.WeightPlan` says so (a GGUF's own 4/8-bit blocks), and when every linear is
  quantized runs forwards through the native stack (`csrc/decoder.cpp`: the whole layer stack in one call, one row
  or many, tested against these Python layers); `forward_rows` serves several sequences, each on its own cache.
`compile=True` additionally runs each layer's two dense halves through `torch.compile` (fixed shapes per query
width; attention stays eager because the key length grows). Measured on SmolLM2 it compiled for about a minute per
query width and was not faster than the eager prepacked path, so it is off by default.

It computes the same function as the HF modules: `tests/test_lean.py` checks logits and features against the HF
forward and greedy decoding token for token (fp32). Architectures it does not cover (sliding windows, Gemma's
scaled embeddings and extra norms, ...) keep the HF path: see `LeanDecoder.supports`.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KVCache
from .hf_config import text_config
from .quant import QuantLinear, WeightPlan, quant_kernels, tensor_bytes

log = logging.getLogger(__name__)

_FAMILIES = ("llama", "qwen2", "qwen3")
_PREPACK_WORKS: bool | None = None


def packed_linear_available(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Prepacked oneDNN linears are used for bf16 on CPU only, where oneDNN has bf16 kernels for this CPU (it
    refuses to prepack on CPUs without AVX512-BF16/AVX-NE-CONVERT or AVX512BW/VL/DQ); fp32 keeps `F.linear`."""
    global _PREPACK_WORKS
    if not (dtype == torch.bfloat16 and torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if _PREPACK_WORKS is None:
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
            _PREPACK_WORKS = True
        except RuntimeError as e:
            log.info("bf16 weights stay unpacked: oneDNN cannot prepack them on this CPU (%s)", str(e)[:120])
            _PREPACK_WORKS = False
    return _PREPACK_WORKS


class Linear:
    """y = x W^T + b, x [..., in] -> [..., out]: through a weight prepacked for oneDNN when `packed`, else
    `F.linear`. The packed copy is made once; the source weight is not kept."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool) -> None:
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.bias = None if bias is None else bias.detach()
        self.packed = packed
        w = weight.detach()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w, 1) if packed else w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LLaMA RMSNorm, op for op (normalise in fp32, cast back, then scale), so results match its modules."""
    dt = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dt)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D], cos/sin [B, 1, T, D] -> x rotated (HF's rotate_half convention)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


GROUPED_MIN_KEYS = 256  # single-row decode steps attend through grouped_decode_attention from this many keys on


def grouped_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                             key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """One query per row: q [B, Hq, 1, D], keys/values [B, Hkv, S, D], key_mask [B, 1, 1, S] bool (True = a real
    token; None = every key) -> [B, Hq, 1, D], what `F.scaled_dot_product_attention(..., enable_gqa=True)` computes.

    Why: torch's CPU flash kernel is slow for a single query, several times slower than this for padded batched
    rows and about twice for one row (the figures: docs/results-history.md, "Measurements behind the code's
    choices"). Here the query heads of one key/value group are the rows of one matmul. Scores and softmax run in fp32, as the flash kernel accumulates.
    At 4-16 queries the flash kernel is the faster one, so only single-query steps come here."""
    b, hq, t, d = q.shape
    hkv, s = keys.shape[1], keys.shape[2]
    assert t == 1 and hq % hkv == 0 and (key_mask is None or key_mask.shape == (b, 1, 1, s)), (
        f"expects q [B, Hq, 1, D] with Hq a multiple of Hkv and key_mask [B, 1, 1, S]: {tuple(q.shape)}, "
        f"{tuple(keys.shape)}, {None if key_mask is None else tuple(key_mask.shape)}")
    scores = torch.matmul(q.reshape(b, hkv, hq // hkv, d) * d ** -0.5, keys.transpose(-1, -2)).float()
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask, float("-inf"))  # [B, Hkv, G, S]; broadcasts over Hkv and G
    return torch.matmul(scores.softmax(-1).to(values.dtype), values).view(b, hq, 1, d)


def _cat(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if ts[0] is None else torch.cat([t.detach() for t in ts])


def _layers_prefix(hf_model: nn.Module, decoder: nn.Module) -> str:
    """The parameter-name prefix of the decoder's layers (`model.layers` for LLaMA-family *ForCausalLM), which the
    weight plan's names use."""
    for name, module in hf_model.named_modules():
        if module is decoder.layers:
            return name
    raise ValueError("the decoder's layers are not a submodule of the model")


class LinearFactory:
    """Builds each (fused) linear of the lean path from the model's modules: quantized where the weight plan says
    so (`quant.WeightPlan`), else the float weights, prepacked when `packed`."""

    def __init__(self, packed: bool, plan: WeightPlan | None = None) -> None:
        self.packed, self.plan = packed, plan

    def __call__(self, names: list[str], modules: list[nn.Module]) -> "Linear | QuantLinear":
        weights = [m.weight for m in modules]
        biases = [getattr(m, "bias", None) for m in modules]
        bias = _cat(biases) if all(b is not None for b in biases) else None
        assert bias is not None or all(b is None for b in biases), f"{names}: some parts have a bias, some not"
        q = self.plan.weight_for(names, weights) if self.plan is not None else None
        if q is not None:
            return QuantLinear(q, bias)
        return Linear(_cat(weights), bias, self.packed)


class _Layer:
    """One decoder layer: fused projections, the norms' weights, and the two dense halves around attention."""

    def __init__(self, layer: nn.Module, cfg, linear: LinearFactory, prefix: str) -> None:
        att, mlp = layer.self_attn, layer.mlp
        self.head_dim = int(getattr(att, "head_dim", cfg.hidden_size // cfg.num_attention_heads))
        self.n_q, self.n_kv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
        self.w_in, self.eps_in = layer.input_layernorm.weight, float(layer.input_layernorm.variance_epsilon)
        self.w_post = layer.post_attention_layernorm.weight
        self.eps_post = float(layer.post_attention_layernorm.variance_epsilon)
        a, m = f"{prefix}.self_attn", f"{prefix}.mlp"
        self.qkv_proj = linear([f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"], [att.q_proj, att.k_proj, att.v_proj])
        self.o_proj = linear([f"{a}.o_proj"], [att.o_proj])
        self.q_norm = getattr(att, "q_norm", None)  # Qwen3 normalises q and k per head before RoPE
        self.k_norm = getattr(att, "k_norm", None)
        self.gate_up = linear([f"{m}.gate_proj", f"{m}.up_proj"], [mlp.gate_proj, mlp.up_proj])
        self.down = linear([f"{m}.down_proj"], [mlp.down_proj])
        self.act = mlp.act_fn
        self.inter = int(mlp.gate_proj.weight.shape[0])

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, H] -> q [B, Hq, T, D], k/v [B, Hkv, T, D] (q and k rotated)."""
        b, t, _ = x.shape
        d = self.head_dim
        q, k, v = self.qkv_proj(rms_norm(x, self.w_in, self.eps_in)).split(
            [self.n_q * d, self.n_kv * d, self.n_kv * d], dim=-1)
        q, k = q.view(b, t, self.n_q, d), k.view(b, t, self.n_kv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = _rotate(q.transpose(1, 2), cos, sin)
        k = _rotate(k.transpose(1, 2), cos, sin)
        return q, k, v.view(b, t, self.n_kv, d).transpose(1, 2)

    def out_mlp(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] residual, attn [B, T, Hq*D] -> the layer's output [B, T, H]."""
        x = x + self.o_proj(attn)
        gate, up = self.gate_up(rms_norm(x, self.w_post, self.eps_post)).split(self.inter, dim=-1)
        return x + self.down(self.act(gate) * up)


class RopeRows:
    """RoPE rows for the native stacks: positions [T] -> float32 (cos, sin) [T, D], read from a table that
    `build(n)` -> (cos, sin) [n, D] fills for positions 0..n-1, built once and grown by doubling (instead of ~10
    tensor ops at every step). Valid where RoPE of a position does not depend on the others."""

    def __init__(self, build: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.build = build
        self.table: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max()) + 1
        if self.table is None or self.table[0].shape[0] < need:
            n = max(need, 2 * (0 if self.table is None else self.table[0].shape[0]), 256)
            cos, sin = self.build(n)
            self.table = (cos.float().contiguous(), sin.float().contiguous())
        return self.table[0][positions].contiguous(), self.table[1][positions].contiguous()


class LeanDecoder:
    """The target's decoder stack on a `KVCache`. Check `LeanDecoder.supports(hf_model)` before building one.

    It reads the model's weights at construction (fused and, for bf16 on CPU, prepacked copies; quantized ones where
    `weights` says so): build it after the model has its final dtype and device.
    """

    def __init__(self, hf_model: nn.Module, compile: bool = False, compile_widths: tuple[int, ...] = (1, 16),
                 weights: WeightPlan | None = None, release_sources: bool = False) -> None:
        """release_sources: once the native stack holds a layer packed, free that layer's unpacked quantized weights
        (its linears' and the weight plan's), so that a load never holds both copies of every layer: for a target
        that will only decode (`TargetModel.release_float_weights`)."""
        cfg = text_config(hf_model.config)
        dec = hf_model.get_decoder()
        self.cfg = cfg
        self.embed_tokens, self.rotary, self.norm = dec.embed_tokens, dec.rotary_emb, dec.norm
        w = dec.embed_tokens.weight  # the layers' linears may hold no storage (a decode-only GGUF plan)
        self.dtype, self.device = w.dtype, w.device
        # torch.compile traces F.linear, not an opaque packed oneDNN tensor: the two options exclude each other
        self.packed = packed_linear_available(self.dtype, self.device) and not compile
        linear = LinearFactory(self.packed, weights)
        prefix = _layers_prefix(hf_model, dec)
        self.layers = [_Layer(layer, cfg, linear, f"{prefix}.{i}") for i, layer in enumerate(dec.layers)]
        self._plan, self._prefix, self._release = weights, prefix, release_sources
        self.released_bytes = 0  # what the release of unpacked weights freed so far
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = self.layers[0].head_dim
        self._qkv = self._qkv_eager = [layer.qkv for layer in self.layers]
        self._out = self._out_eager = [layer.out_mlp for layer in self.layers]
        # compiled kernels are shape-specialised: only these query widths (plain decoding, a full verify block) use
        # them; prefills and short end-of-generation blocks stay eager rather than trigger a recompile each
        self.compile_widths = tuple(compile_widths)
        self.compiled = bool(compile) and self._compile()
        # single-query steps attend through `grouped_decode_attention` (faster here); False = torch's SDPA kernel,
        # kept to measure the difference (experiments/decode_attention_bench.py)
        self.grouped_single_query = True
        # every linear quantized: single-row batches run the whole stack in one native call (csrc/decoder.cpp)
        self.native, self.native_reason = self._build_native(hf_model)
        # the native stack reads RoPE rows from a table, valid where RoPE does not depend on the sequence length
        # (dynamic / long-rope scaling rescale with it)
        rope = getattr(self.cfg, "rope_parameters", None) or getattr(self.cfg, "rope_scaling", None) or {}
        self._rope_static = rope.get("rope_type", rope.get("type", "default")) not in ("dynamic", "longrope")
        self._rope_table: RopeRows | None = None

    def _build_native(self, hf_model: nn.Module):
        """(the native decoder, None) when this model and its weights allow it, else (None, why not)."""
        if self.compiled:
            return None, "torch.compile requested"
        linears = [lin for layer in self.layers for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up, layer.down)]
        if not all(isinstance(lin, QuantLinear) for lin in linears):
            return None, "not every linear is quantized"
        if any(layer.q_norm is not None for layer in self.layers):
            return None, "per-head q/k norms (Qwen3)"
        if getattr(self.cfg, "hidden_act", None) != "silu":
            return None, f"activation {getattr(self.cfg, 'hidden_act', None)!r}, not SiLU"
        if self.head_dim % 8:
            return None, f"head_dim {self.head_dim} is not a multiple of 8"
        kernels = quant_kernels()
        if kernels is None:
            return None, "no quantized kernels"
        cfg = self.cfg
        native = kernels.Decoder(int(cfg.hidden_size), self.layers[0].n_q, self.num_kv_heads, self.head_dim,
                                 self.layers[0].inter, self.norm.weight.detach(), float(self.norm.variance_epsilon))
        for i, layer in enumerate(self.layers):
            lins = (layer.qkv_proj, layer.o_proj, layer.gate_up, layer.down)
            native.add_layer(*(lin.native() for lin in lins), layer.w_in.detach(), layer.eps_in,
                             layer.w_post.detach(), layer.eps_post)
            if self._release:
                self._release_layer(i)
        return native, None

    def release_sources(self) -> None:
        """Free every layer's unpacked quantized weights (its linears' and the weight plan's): the native stack reads
        its packed copies only. Nothing without the native stack (the Python layers read the unpacked ones)."""
        if self.native is not None:
            for i in range(len(self.layers)):
                self._release_layer(i)

    def _release_layer(self, i: int) -> None:
        layer = self.layers[i]
        held = [t for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up, layer.down) for t in lin.release_source()]
        if self._plan is not None:
            held += self._plan.release([n for n in self._plan.exact if n.startswith(f"{self._prefix}.{i}.")])
        self.released_bytes += tensor_bytes(held)

    @staticmethod
    def supports(hf_model: nn.Module) -> str | None:
        """None if the lean path computes this model exactly, else the reason it does not."""
        cfg = text_config(hf_model.config)
        mt = getattr(cfg, "model_type", "")
        if mt not in _FAMILIES:
            return f"model_type {mt!r} is not one of {_FAMILIES}"
        if getattr(cfg, "use_sliding_window", False) or (mt == "llama" and getattr(cfg, "sliding_window", None)):
            return "sliding-window attention"
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
            return "layers other than full attention"
        dec = hf_model.get_decoder()
        if not all(hasattr(dec, n) for n in ("embed_tokens", "rotary_emb", "norm", "layers")):
            return "decoder without the LLaMA module layout"
        return None

    def _compile(self) -> bool:
        """Compile each layer's dense halves; False (logged) where torch.compile cannot run here, e.g. without a
        C++ compiler: the eager path then stays in use."""
        try:
            qkv = [torch.compile(f, dynamic=False, fullgraph=True) for f in self._qkv]
            out = [torch.compile(f, dynamic=False, fullgraph=True) for f in self._out]
            # a first call on a throwaway input, so that a compiler failure shows here and not mid-generation
            x = torch.zeros(1, 1, int(self.cfg.hidden_size), dtype=self.dtype, device=self.device)
            cos, sin = self._rope(torch.zeros(1, 1, dtype=torch.long, device=self.device), x)
            q, _, _ = qkv[0](x, cos, sin)
            out[0](x, q.transpose(1, 2).reshape(1, 1, -1))
        except Exception as e:  # noqa: BLE001 - whatever the compiler's failure, the answer is to stay eager
            log.warning("torch.compile unavailable for the lean target path (%s); staying eager", e)
            return False
        self._qkv, self._out = qkv, out
        return True

    def _rope(self, positions: torch.Tensor, like: torch.Tensor):
        cos, sin = self.rotary(like, positions)  # [B, T, D]: the target's own RoPE, its scaling included
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def _rope_rows(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> float32 (cos, sin) [T, D] for the native stack: the target's own RoPE in the model's
        dtype (what `_rope` gives, position by position)."""
        if not self._rope_static:
            cos, sin = self._rope(positions.unsqueeze(0), like)
            return cos[0, 0].float().contiguous(), sin[0, 0].float().contiguous()
        if self._rope_table is None:
            dev, one = like.device, like[:1, :1]
            self._rope_table = RopeRows(
                lambda n: tuple(t[0, 0] for t in self._rope(torch.arange(n, device=dev).unsqueeze(0), one)))
        return self._rope_table(positions)

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        return KVCache(len(self.layers), batch, self.num_kv_heads, self.head_dim, capacity, self.dtype, self.device)

    def __call__(self, ids: torch.Tensor, cache: KVCache, positions: torch.Tensor | None = None,
                 tap: tuple[int, ...] = (), tree_mask: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [1, T] appended after cache.length -> (final-normed hidden [1, T, H], features [1, T, K*H] of the
        tapped layers, in `tap` order, or None). The cache advances by T. positions [1, T] (default: the cache
        slots'). tree_mask [T, T] bool (True = query i sees new token j) replaces causal order among the new tokens,
        for a candidate tree (tree.py; `positions` then give each node's depth): every query still sees the whole
        cache. One sequence of `forward_rows`."""
        assert ids.dim() == 2 and ids.shape[0] == 1, f"ids must be [1, T], got {tuple(ids.shape)}"
        hidden, feats = self.forward_rows([ids[0]], [cache], None if positions is None else [positions[0]],
                                          [tree_mask], tap)
        return hidden[None], (feats[None] if feats is not None else None)

    def forward_rows(self, ids: list[torch.Tensor], caches: list[KVCache],
                     positions: list[torch.Tensor] | None = None, tree_masks: list[torch.Tensor | None] | None = None,
                     tap: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Several sequences at once: row i feeds ids[i] [T_i] after caches[i].length (at positions[i] [T_i],
        default the cache slots'; tree_masks[i] [T_i, T_i] or None for causal order) -> (final-normed hidden
        [S, H], features [S, K*H] or None), S = sum T_i, stacked row by row. Each cache advances by its T_i.
        The projections and the MLP run over all rows together (each weight read once); every row attends over its
        own cache."""
        n = len(ids)
        assert n >= 1 and len(caches) == n, "one cache per row"
        counts = [int(x.shape[0]) for x in ids]
        assert all(c >= 1 for c in counts), "every row needs at least one new token"
        starts = [c.length for c in caches]
        dev = ids[0].device
        if positions is None:
            positions = [torch.arange(s, s + c, device=dev) for s, c in zip(starts, counts)]
        tree_masks = tree_masks if tree_masks is not None else [None] * n
        for c, t, m in zip(caches, counts, tree_masks):
            assert m is None or m.shape == (t, t), f"a row's tree_mask must be [{t}, {t}]"
            c.reserve(c.length + t)
        pos = torch.cat(positions) if n > 1 else positions[0]
        x = self.embed_tokens(torch.cat(ids) if n > 1 else ids[0])  # [S, H]
        if self.native is not None:
            cos, sin = self._rope_rows(pos, x[None])
            empty = torch.zeros(0, 0, dtype=torch.bool)
            hidden, feats = self.native.forward(
                x, [c.k for c in caches], [c.v for c in caches], starts, counts, cos, sin,
                [empty if m is None else m for m in tree_masks], list(tap))
            for c, t in zip(caches, counts):
                c.length += t
            return hidden, (feats if tap else None)
        return self._rows_python(x[None], caches, starts, counts, pos, tree_masks, tap)

    def _rows_python(self, x: torch.Tensor, caches: list[KVCache], starts: list[int], counts: list[int],
                     pos: torch.Tensor, tree_masks: list, tap: tuple[int, ...]):
        """`forward_rows` through the Python layers: x [1, S, H] embeddings, pos [S]."""
        s_total = x.shape[1]
        cos, sin = self._rope(pos[None], x)
        masks, single = [], []
        for start, t, m in zip(starts, counts, tree_masks):
            total = start + t
            # new query i sits at slot start + i and sees slots 0 .. start + i (causal with an offset); q = 1 sees
            # all; a tree sees the whole cache and its row of the tree mask
            if m is not None:
                masks.append(torch.cat([m.new_ones(t, start), m], dim=1))
            elif t > 1:
                slots = torch.arange(total, device=x.device)
                masks.append(slots <= (start + torch.arange(t, device=x.device)).unsqueeze(1))
            else:
                masks.append(None)
            # a one-token step from GROUPED_MIN_KEYS keys on (below it the two measure alike; the figures:
            # experiments/decode_attention_bench.py and docs/results-history.md)
            single.append(t == 1 and m is None and self.grouped_single_query and total >= GROUPED_MIN_KEYS)
        taps: dict[int, torch.Tensor] = {}
        fast = self.compiled and s_total in self.compile_widths
        qkv_fns, out_fns = (self._qkv, self._out) if fast else (self._qkv_eager, self._out_eager)
        for i in range(len(self.layers)):
            q, k, v = qkv_fns[i](x, cos, sin)  # [1, Hq, S, D], [1, Hkv, S, D]
            atts, o = [], 0
            for r, cache in enumerate(caches):
                t = counts[r]
                keys, values = cache.write(i, k[:, :, o:o + t], v[:, :, o:o + t])  # this row's cache, new included
                qr = q[:, :, o:o + t]
                if single[r]:
                    atts.append(grouped_decode_attention(qr, keys, values))
                else:
                    atts.append(F.scaled_dot_product_attention(qr, keys, values, attn_mask=masks[r], enable_gqa=True))
                o += t
            attn = torch.cat(atts, dim=2) if len(atts) > 1 else atts[0]
            x = out_fns[i](x, attn.transpose(1, 2).reshape(1, s_total, -1))
            if i in tap:
                taps[i] = x
        for c, t in zip(caches, counts):
            c.length += t
        feats = torch.cat([taps[i] for i in tap], dim=-1)[0] if tap else None
        return self.norm(x)[0], feats
