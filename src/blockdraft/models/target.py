"""TargetModel: a thin adapter over any Hugging Face causal LM (LLaMA/SmolLM2, Qwen2/2.5, Qwen3, Gemma3, ...).

It exposes what speculative decoding needs and nothing else:
- `forward(ids, cache)` over new tokens -> logits and the hidden states of the tapped layers;
- the frozen embedding and LM head, shared with the draft;
- a cache object that can be rolled back after a rejection.

Layer tap convention: feature layer i is the *output of decoder layer i* (0-based), which is what Hugging Face
returns as `hidden_states[i + 1]` (index 0 there is the embedding output). The features of the K tapped layers are
concatenated along the hidden dimension: [B, T, K*H]. The layers to tap are passed with each forward (`tap`), so
several engines can share one target without state left on it; `layer_ids` is only the default of `tap=True`.
"""

from __future__ import annotations

import ctypes
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KVCache, keeps_prefix
from .hf_config import text_config
from .lean import LeanDecoder, Linear, packed_linear_available
from .quant import QuantLinear, WeightPlan, drop_float_weight, tensor_bytes

QHEAD_ROWS_KEPT = 4  # reduced-vocabulary heads kept per target (see TargetModel._quant_head_rows)


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, T', V]; T' = T, or 1 when only the last position's logits were asked for
    features: torch.Tensor | None  # [B, T, K*H] or None when no layers were tapped


class TargetCache:
    """The target's KV cache with an explicit length and rollback.

    It wraps the model's own `DynamicCache` (so every HF architecture, sliding-window layers included, keeps working)
    and records past states so that sliding-window layers can be cropped too.
    """

    def __init__(self, config) -> None:
        from transformers import DynamicCache

        self.hf = DynamicCache(config=config)
        if hasattr(self.hf, "activate_past_recording"):
            self.hf.activate_past_recording()

    @property
    def length(self) -> int:
        return int(self.hf.get_seq_length())

    def crop(self, n: int) -> None:
        """Keep the first n positions. A negative count is what transformers 5.x requires (and 4.x accepts)."""
        cur = self.length
        if not 0 <= n <= cur:
            raise ValueError(f"cannot crop a target cache of length {cur} to {n}")
        if n < cur:
            self.hf.crop(n - cur)

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Keep positions start + keep[j] at start + j and crop to start + len(keep) (see KVCache.compact): the
        accepted path of a candidate tree. keep [M] int64, increasing. Full-attention layers only, unless keep is a
        prefix (0, 1, .., M-1), which is a crop."""
        m = keep.numel()
        if keeps_prefix(start, keep, self.length):
            self.crop(start + m)
            return
        layers = getattr(self.hf, "layers", None)
        if layers is None or any(getattr(layer, "is_sliding", False) for layer in layers):
            raise ValueError("tree verification needs a cache of full-attention layers (no sliding windows)")
        src = keep.to(layers[0].keys.device) + start
        for layer in layers:
            for name in ("keys", "values"):
                x = getattr(layer, name)
                x[:, :, start:start + m] = x.index_select(2, src)  # index_select copies: overlap is safe
        self.crop(start + m)


def _return_freed_heap() -> None:
    """Hand the C heap's free pages back to the system. glibc keeps the pages of freed tensors for reuse: after
    `release_float_weights` on the 1.5B target a process stayed at 4.9 GB resident until this brought it to 2.6."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        pass


class TargetModel(nn.Module):
    """Wraps an HF `*ForCausalLM`. `layer_ids` are the decoder layers whose outputs form the draft's context."""

    def __init__(self, hf_model: nn.Module, tokenizer=None, layer_ids: list[int] | tuple[int, ...] = (),
                 lean: bool = True, compile: bool = False, weights: WeightPlan | None = None,
                 source: str | None = None) -> None:
        """lean: decode on the fused-weight path with a preallocated cache (`lean.py`) when the architecture allows
        it (else the HF modules are used and `lean_reason` says why); compile: also torch.compile that path;
        weights: which weights that path and the LM head hold quantized (`quant.plan_weights`; None = float);
        source: the file or directory the weights came from (recorded in results)."""
        super().__init__()
        self.hf = hf_model
        self.tokenizer = tokenizer
        self.config = text_config(hf_model.config)
        self.decoder = hf_model.get_decoder()
        self.layers = self.decoder.layers
        self.lm_head = hf_model.get_output_embeddings()
        self.embed_tokens = hf_model.get_input_embeddings()
        # Gemma-style final logit soft-capping (None: none); the draft's head applies the same
        self.softcap: float | None = getattr(self.config, "final_logit_softcapping", None)
        # transformers 5.x renames `past_key_values=` to `cache=`; use whichever this version's decoder takes.
        self._cache_kw = "cache" if "cache" in inspect.signature(self.decoder.forward).parameters else "past_key_values"
        self._captured: dict[int, torch.Tensor] | None = None  # set only inside an HF-path forward that taps
        self._hooks: dict[int, torch.utils.hooks.RemovableHandle] = {}  # layer -> its capture hook (HF path)
        self.layer_ids: tuple[int, ...] = ()
        self.set_layer_ids(layer_ids)
        self._lean_wanted, self._compile = lean, compile
        self._lean_reason = LeanDecoder.supports(hf_model) if lean else "disabled"
        self._lean = None  # built on first use, once the model has its final dtype and device
        self._lean_key = None
        self._head = None  # ((dtype, device), the LM head prepacked, or None) once first needed, see logits()
        self.weights = weights if weights is not None else WeightPlan("bf16")
        self.source = source
        self._qhead: QuantLinear | None = None  # the quantized LM head, built on first use (see logits())
        self._qhead_built = False
        # per reduced draft vocabulary asked for, most recent first (see logits()): (the tensor last asked with, its
        # version then, a copy of its values, the gathered head)
        self._qhead_rows: list[tuple[torch.Tensor, int, torch.Tensor, QuantLinear]] = []
        self.released = False  # `release_float_weights` was called: the lean path is the only one left
        self._release_on_build = False  # the lean path, built by release_float_weights, frees sources as it packs

    @property
    def lean(self):
        """The `LeanDecoder` for this target (None if disabled or unsupported; `lean_reason` says which). It holds
        fused copies of the weights, rebuilt when the target's dtype or device changes; in-place edits of the
        target's weights after first use are not seen (targets are frozen)."""
        if self._lean_reason is not None:
            return None
        key = (self.dtype, self.device)
        if self._lean_key != key:
            if self.released:
                raise RuntimeError(f"this target released its float weights when it was built for {self._lean_key}; "
                                   f"load it again to decode in {key}")
            self._lean = LeanDecoder(self.hf, compile=self._compile, weights=self.weights,
                                     release_sources=self._release_on_build)
            self._lean_key = key
        return self._lean

    def release_float_weights(self) -> int:
        """Free the weights only the HF modules read, once the lean path holds its own copies: the decoder layers'
        float linears and, where the kernels hold them packed, their unpacked quantized weights (on the 1.5B GGUF
        target about half of what a decoding process holds; docs/serving.md). The embedding, the LM head and the
        norms stay. A decoding process (generate, chat, serve) calls this once after loading; from then on the
        target runs on its lean path only, and a forward through the HF modules, or a change of dtype or device, is
        refused. -> the bytes released (0 without a lean path: the HF modules are the decode path then)."""
        self._quant_head()  # built from the plan's head weight before the plan forgets the layers'
        # a lean path built now frees each layer's unpacked weights as soon as it holds the layer packed
        built_now = self._release_on_build = self._lean_key is None
        lean = self.lean
        if lean is None:
            return 0
        before = 0 if built_now else lean.released_bytes
        held = [drop_float_weight(m) for m in self.layers.modules()
                if isinstance(m, nn.Linear) and m.weight.device.type != "meta"]
        if lean.native is not None:  # the native stack reads the packed copies only
            head = self._quant_head()
            if head is not None:
                head.native()  # packed now, while loading: the first request waited for it (4.5 s on the 1.5B)
            lean.release_sources()
        self.released = True
        freed = tensor_bytes(held) + lean.released_bytes - before
        del held
        _return_freed_heap()
        return freed

    @property
    def lean_reason(self) -> str | None:
        """Why the lean path is not used (None when it is)."""
        return self._lean_reason

    # ----------------------------------------------------------------------------------------------- properties
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.weight.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids: set[int] = set()
        for src in (getattr(self.hf, "generation_config", None), self.config):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif eos:
                ids.update(int(e) for e in eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    # -------------------------------------------------------------------------------------------------- the tap
    def set_layer_ids(self, layer_ids) -> None:
        """The layers `tap=True` taps (a forward may name others with `tap=layer ids`)."""
        self.layer_ids = self.taps(layer_ids)

    def taps(self, tap) -> tuple[int, ...]:
        """A forward's `tap` -> the layer ids it taps: True = `layer_ids`, False / None / () = none, else the ids."""
        if tap is True:
            return self.layer_ids
        if not tap:
            return ()
        ids = tuple(int(i) for i in tap)
        for i in ids:
            if not 0 <= i < self.num_layers:
                raise ValueError(f"target layer id {i} out of range: the target has {self.num_layers} layers")
        return ids

    def _hook_layers(self, ids: tuple[int, ...]) -> None:
        """Capture hooks on the HF decoder layers `ids` (installed once per layer, kept until `remove_hooks`);
        a hook records only inside a forward that taps its layer."""
        for i in ids:
            if i not in self._hooks:
                self._hooks[i] = self.layers[i].register_forward_hook(self._capture(i))

    def _capture(self, i: int):
        def hook(_module, _inputs, output):
            if self._captured is not None and i in self._captured:
                self._captured[i] = output[0] if isinstance(output, tuple) else output

        return hook

    def remove_hooks(self) -> None:
        """Remove every capture hook this target put on its HF layers (the HF model is left as it was loaded)."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()

    # ---------------------------------------------------------------------------------------------- primitives
    def new_cache(self) -> TargetCache:
        """The HF cache (any architecture, holes and padding masks allowed): what batched decoding uses."""
        return TargetCache(self.config)

    def new_decode_cache(self, capacity: int = 1024) -> "TargetCache | KVCache":
        """The cache for single-sequence decoding: a preallocated `KVCache` on the lean path when this target has
        one, else the HF cache. Both have `.length` and `.crop(n)`; `hidden`/`forward` dispatch on the type."""
        lean = self.lean
        if lean is not None:
            return lean.new_cache(capacity)
        return self.new_cache()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> embeddings [B, T, H], exactly as the target embeds its own input (Gemma's scale included)."""
        return self.embed_tokens(ids)

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """final-normed hidden [..., H] -> logits [..., V] through the target's LM head (and soft-cap if any);
        with rows [V'] only those vocabulary entries: [..., V'] (a reduced draft vocabulary)."""
        qhead = self._quant_head()
        if qhead is not None and not torch.is_grad_enabled():
            # float32 logits: the kernel's own precision (no bf16 ties at the argmax), and an argmax over float32
            # rows runs faster than over bf16 ones
            h = hidden.float()
            out = qhead(h) if rows is None else self._quant_head_rows(qhead, rows)(h)
        elif rows is None:
            head = self._packed_head()
            out = head(hidden) if head is not None else self.lm_head(hidden)
        else:
            bias = self.lm_head.bias[rows] if getattr(self.lm_head, "bias", None) is not None else None
            out = F.linear(hidden, self.lm_head.weight[rows], bias)
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    @property
    def quantized_head(self) -> bool:
        """Whether the LM head runs on quantized weights (the weight plan's head; decoding only)."""
        return self._quant_head() is not None

    def head_weight_bytes(self) -> int:
        """The bytes the LM head streams per product: the quantized head's packed weights, else the float ones."""
        q = self._quant_head()
        if q is not None:
            return int(q.native().weight_bytes)
        return int(self.lm_head.weight.numel() * self.lm_head.weight.element_size())

    def _quant_head(self) -> QuantLinear | None:
        """The LM head as the weight plan has it (quantized), or None where it stays float; built once."""
        if not self._qhead_built:
            self._qhead_built = True
            if self._lean_reason != "disabled":
                w = self.weights.head_weight(self.lm_head.weight)
                if w is not None:
                    self._qhead = QuantLinear(w, getattr(self.lm_head, "bias", None))
        return self._qhead

    def _quant_head_rows(self, head: QuantLinear, rows: torch.Tensor) -> QuantLinear:
        """The quantized head restricted to vocabulary rows [V'], built once per distinct vocabulary. Matched by
        value, not identity: every engine's proposer holds its own tensor of its draft's vocabulary, and engines
        that take turns on one target (a benchmark's methods, a server's batch rows) would otherwise rebuild the
        gathered head at every turn, which costs as much as many draft steps. The tensor last asked with, unchanged
        since (its version counter), is matched without comparing its values."""
        for i, (asked, version, known, lin) in enumerate(self._qhead_rows):
            unchanged = asked is rows and rows._version == version
            if unchanged or (known.shape == rows.shape and torch.equal(known, rows)):
                self._qhead_rows.pop(i)
                self._qhead_rows.insert(0, (rows, rows._version, known, lin))
                return lin
        bias = None if head.bias is None else head.bias[rows]
        lin = QuantLinear(head.weight.select(rows), bias)
        # a few drafts' vocabularies (a benchmark comparing drafts); each is a small fraction of the head
        self._qhead_rows = [(rows, rows._version, rows.clone(), lin)] + self._qhead_rows[:QHEAD_ROWS_KEPT - 1]
        return lin

    def _packed_head(self):
        """The LM head prepacked for oneDNN (bf16 on CPU, lean path wanted), built once per dtype/device; None
        otherwise. Its product is bit-identical to `lm_head` (lean.py) and faster at 1-16 rows."""
        if self._lean_reason == "disabled" or torch.is_grad_enabled():
            return None
        key = (self.dtype, self.device)
        if self._head is None or self._head[0] != key:
            w = self.lm_head.weight
            packed = packed_linear_available(w.dtype, w.device)
            self._head = (key, Linear(w, getattr(self.lm_head, "bias", None), True) if packed else None)
        return self._head[1]

    # no_grad rather than inference_mode: the training pipeline feeds these features into modules that save
    # their inputs for backward, which inference tensors forbid.
    @torch.no_grad()
    def hidden(self, ids: torch.Tensor, cache: TargetCache | None, *, positions: torch.Tensor | None = None,
               attention_mask: torch.Tensor | None = None, tap=True, tree_mask: torch.Tensor | None = None):
        """Final hidden states (before the LM head) and tapped features of new tokens.

        ids: [B, T]; positions: [B, T] (default: cache.length .. cache.length + T - 1 for every row);
        attention_mask: [B, cache slots + T] (1 = visible), for batches whose rows have holes or padding;
        tree_mask: [T, T] bool (True = new token i sees new token j; every one sees the whole cache), for a candidate
        tree (tree.py), with positions = cache length + node depth; tap: the layers to tap (`taps`).
        Returns (hidden [B, T, H], features [B, T, K*H] or None).
        """
        assert ids.dim() == 2, f"ids must be [B, T], got {tuple(ids.shape)}"
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        assert positions.shape == ids.shape, "positions must be [B, T] like ids"
        taps = self.taps(tap)
        if isinstance(cache, KVCache):
            assert attention_mask is None, "the lean path decodes dense rows only (no holes or padding)"
            lean = self.lean
            assert lean is not None, "a KVCache needs the lean path (see new_decode_cache)"
            return lean(ids, cache, positions, taps, tree_mask=tree_mask)
        if self.released:
            raise RuntimeError("this target released its float weights (release_float_weights): it decodes on its "
                               "lean path only, with the cache of new_decode_cache")
        if tree_mask is not None:
            assert attention_mask is None and ids.shape[0] == 1, "a tree is verified alone (batch 1, no padding)"
            t = ids.shape[1]
            assert tree_mask.shape == (t, t), f"tree_mask must be [{t}, {t}], got {tuple(tree_mask.shape)}"
            past = cache.length if cache is not None else 0
            seen = torch.cat([tree_mask.new_ones(t, past), tree_mask], dim=1)
            # an additive 4D mask is used as given by the HF attention (eager and sdpa alike)
            attention_mask = torch.zeros(1, 1, t, past + t, dtype=self.dtype, device=ids.device).masked_fill(
                ~seen, torch.finfo(self.dtype).min)
        self._hook_layers(taps)
        self._captured = dict.fromkeys(taps) if taps else None
        try:
            kw = {self._cache_kw: cache.hf} if cache is not None else {}
            if attention_mask is not None:
                kw["attention_mask"] = attention_mask
            out = self.decoder(input_ids=ids, position_ids=positions, use_cache=cache is not None, **kw)
            captured = self._captured
        finally:
            self._captured = None
        feats = None
        if captured is not None:
            feats = torch.cat([captured[i] for i in taps], dim=-1)
        return out.last_hidden_state, feats

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, cache: TargetCache | None, *, last_only: bool = False,
                tap=True, positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None) -> TargetOutput:
        """Run the target over new tokens appended after the cache.

        ids: [B, T] int64 at positions cache.length .. cache.length + T - 1 (or `positions` [B, T]).
        last_only: compute logits for the last position only (prefill), saving a [T, V] LM-head product.
        tap: the layers whose outputs are returned as features [B, T, K*H] (`taps`: True = `layer_ids`).
        tree_mask: [T, T] bool, the new tokens form a candidate tree (see `hidden`).
        """
        hidden, feats = self.hidden(ids, cache, tap=tap, positions=positions, tree_mask=tree_mask)
        logits = self.logits(hidden[:, -1:] if last_only else hidden)
        return TargetOutput(logits=logits, features=feats)

    @torch.no_grad()
    def forward_rows(self, ids: list[torch.Tensor], caches: list, *, positions: list[torch.Tensor] | None = None,
                     tree_masks: list[torch.Tensor | None] | None = None, tap=True) -> list[TargetOutput]:
        """Several sequences at once, each on its own cache: row i feeds ids[i] [T_i] after caches[i] (positions[i]
        [T_i], tree_masks[i] [T_i, T_i] or None) -> one TargetOutput per row (logits [1, T_i, V], features
        [1, T_i, K*H]). On the lean path one forward serves every row (`LeanDecoder.forward_rows`)
        and one LM-head product every row's logits; other architectures run the rows one after another."""
        n = len(ids)
        positions = positions if positions is not None else [None] * n
        tree_masks = tree_masks if tree_masks is not None else [None] * n
        lean = self.lean
        if lean is None or not all(isinstance(c, KVCache) for c in caches):
            return [self.forward(x.unsqueeze(0), c, tap=tap,
                                 positions=None if p is None else p.unsqueeze(0), tree_mask=m)
                    for x, c, p, m in zip(ids, caches, positions, tree_masks)]
        given = [p for p in positions if p is not None]
        assert not given or len(given) == n, "positions for every row or for none"
        hidden, feats = lean.forward_rows(ids, caches, given or None, tree_masks, self.taps(tap))
        counts = [int(x.shape[0]) for x in ids]
        parts = self.logits(hidden).split(counts)
        fparts = list(feats.split(counts)) if feats is not None else [None] * n
        return [TargetOutput(logits=lg[None], features=None if f is None else f[None]) for lg, f in zip(parts, fparts)]
