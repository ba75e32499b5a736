"""The DFlash draft's configuration: its shapes, which target layers it reads, and how it is written in the public
layout's `config.json` (so vLLM/SGLang load our drafts) with blockdraft's own metadata beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .hf_config import text_config


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """K distinct layer ids spread evenly from layer 1 to layer L-3 (shallow to deep, as the paper and the public
    drafts do; the last layers are skipped because their states are already specialised to the target's own next
    token). A target too shallow for that range uses all of its layers 0..L-1."""
    if num_features < 1:
        raise ValueError("need at least one target feature layer")
    if num_features > num_target_layers:
        raise ValueError(f"{num_features} feature layers requested but the target has {num_target_layers}")
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end - start + 1 < num_features:
        start, end = 0, num_target_layers - 1
    ids = [int(round(start + i * (end - start) / (num_features - 1))) for i in range(num_features)]
    assert len(set(ids)) == num_features, ids
    return ids


def target_layer_shape(target_config) -> dict:
    """A draft layer's shape as the target's HF config gives it (hidden size, heads, head_dim, MLP width, norm eps,
    rope, positions) and the target's depth (`num_target_layers`): what a draft that shares the target's layer
    widths reads from it."""
    tc = text_config(target_config)
    heads = int(tc.num_attention_heads)
    rope = getattr(tc, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0)) if isinstance(rope, dict)
                  else getattr(tc, "rope_theta", 10000.0))
    return dict(
        hidden_size=int(tc.hidden_size), num_attention_heads=heads,
        num_key_value_heads=int(getattr(tc, "num_key_value_heads", heads)),
        head_dim=int(getattr(tc, "head_dim", None) or tc.hidden_size // heads),
        intermediate_size=int(tc.intermediate_size), vocab_size=int(tc.vocab_size),
        num_target_layers=int(tc.num_hidden_layers), rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
        rope_theta=theta, max_position_embeddings=int(getattr(tc, "max_position_embeddings", 8192)),
    )


@dataclass
class DraftShape:
    """What every draft (DFlash's, EAGLE's) states about the target it serves: a layer's widths as the target has
    them (`target_layer_shape`), the target's depth and the layers whose outputs it reads."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids)


@dataclass(kw_only=True)
class DFlashConfig(DraftShape):
    num_hidden_layers: int
    mask_token_id: int
    block_size: int = 16
    hidden_act: str = "silu"
    # Reduced draft vocabulary: the draft proposes only among these many target tokens (its LM-head rows are the
    # target's rows at `d2t`-mapped ids, saved as the `d2t` tensor, vLLM's convention); None = the full vocabulary.
    draft_vocab_size: int | None = None
    # blockdraft's own metadata (training recipe, provenance), saved under "blockdraft" in config.json: records only;
    # what changes behaviour has a field of its own (below), saved in the same section.
    extra: dict = field(default_factory=dict)
    # The block the draft decodes best with (None: its trained block), the default of `decode_block_size`.
    decode_block_size: int | None = None
    # The decoding method the draft is fastest with where it was measured (a name of the decode registry; None: the
    # engine's default), what `--method auto` decodes with: e.g. a tree where a chain's verify width costs more than
    # its accepted tokens pay for. The decode layer checks the name when it resolves the method.
    decode_method: str | None = None
    # Trained without the target's features (an ablation): the draft taps no target layer at decode time.
    no_target_features: bool = False
    # An input beyond the public layout (off by default): the fusion also reads, at each context position, the
    # target's embedding of the token that follows it there. Why: a tapped feature at position i holds the target's
    # *prediction* of token i+1, which on user-written text (a prompt's names and numbers) is often not the token
    # that came, so the draft cannot copy what followed an earlier occurrence of its anchor; with this input one
    # attention hop can. The fusion's weight then has one more H-wide block of columns, last; vLLM/SGLang/llama.cpp
    # cannot load such a draft (export refuses it).
    next_token_feature: bool = False
    # That input is the embedding times this factor: token embeddings are ~200x smaller than tapped features (median
    # RMS 0.12 vs 2.7 / 27 on SmolLM2), and Adam moves every fusion weight by about the same step, so unscaled the
    # input barely registers behind the fusion's RMSNorm.
    next_token_scale: float = 1.0
    # blockdraft's copy gate (`copy_gate.py`, off by default): a learned bonus on the logit of the token prompt lookup
    # would copy. Its weights live in their own file, so the draft's model.safetensors keeps the public layout.
    copy_gate: bool = False
    # Each draft layer reads its own mix of the fused inputs (off by default, outside the public layout): the fusion
    # projects each tapped layer once, and layer l's context is the RMSNorm of sum_k mix[l, k] * fc_k(feature_k)
    # (`DFlashDraftModel.mix`, one learned scalar per draft layer and input). Why: with one fused input every draft
    # layer attends to the same context, which is what stops a deeper draft from gaining (DFlare, arXiv 2606.02091);
    # the mix costs no more than one fusion. With one draft layer it adds nothing the fusion cannot learn.
    layer_mix: bool = False
    # blockdraft's chain selector (`selector.py`, off when 0): the block's rows chosen left to right among the
    # draft's `selector_top_k` best columns by an MLP of this width that reads the token chosen for the row before.
    # Its weights live in their own file, like the copy gate's.
    selector_rank: int = 0
    selector_top_k: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.selector_rank < 0 or self.selector_top_k < 1:
            raise ValueError(f"selector_rank must be >= 0 and selector_top_k >= 1 (got {self.selector_rank}, "
                             f"{self.selector_top_k})")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside the vocabulary ({self.vocab_size})")
        if self.block_size < 2:
            raise ValueError("a DFlash draft needs block_size >= 2")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..{self.vocab_size}")
        if self.draft_vocab_size == self.vocab_size:
            self.draft_vocab_size = None

    @property
    def num_fused_inputs(self) -> int:
        """H-wide inputs of the context fusion: the tapped layers, plus the next token's embedding if enabled."""
        return self.num_target_features + int(self.next_token_feature)

    @classmethod
    def from_target(cls, target_config, *, num_hidden_layers: int = 3, block_size: int = 16,
                    mask_token_id: int, num_target_features: int | None = None,
                    target_layer_ids: list[int] | None = None, **overrides) -> "DFlashConfig":
        """Derive the layer shape from the target's HF config (`target_layer_shape`)."""
        kw = target_layer_shape(target_config)
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(kw["num_target_layers"],
                                                        num_target_features or num_hidden_layers)
        kw.update(num_hidden_layers=num_hidden_layers, target_layer_ids=list(target_layer_ids),
                  mask_token_id=mask_token_id, block_size=block_size)
        kw.update(overrides)
        return cls(**kw)

    # ------------------------------------------------------------------------ the public (vLLM/SGLang) layout
    def to_hf_dict(self) -> dict:
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": self.hidden_act,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size or self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "use_cache": False,
            "dtype": "bfloat16",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"target_layer_ids": self.target_layer_ids, "mask_token_id": self.mask_token_id,
                              "block_size": self.block_size},
            "blockdraft": self._extra_dict(),
        }

    def _extra_dict(self) -> dict:
        d = dict(self.extra)
        if self.decode_block_size is not None:
            d["decode_block_size"] = self.decode_block_size
        if self.decode_method is not None:
            d["decode_method"] = self.decode_method
        if self.no_target_features:
            d["no_target_features"] = True
        if self.next_token_feature:
            d.update(next_token_feature=True, next_token_scale=self.next_token_scale)
        if self.copy_gate:
            d["copy_gate"] = True
        if self.layer_mix:
            d["layer_mix"] = True
        if self.selector_rank:
            d.update(selector_rank=self.selector_rank, selector_top_k=self.selector_top_k)
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> "DFlashConfig":
        dc = d.get("dflash_config") or {}
        ids = dc.get("target_layer_ids", d.get("target_layer_ids"))
        if ids is None:
            raise ValueError("draft config has no dflash_config.target_layer_ids: not a DFlash draft")
        mask = dc.get("mask_token_id", d.get("mask_token_id"))
        if mask is None:
            raise ValueError("draft config has no dflash_config.mask_token_id")
        rope = d.get("rope_parameters") or {}
        heads = int(d["num_attention_heads"])
        extra = dict(d.get("blockdraft") or {})
        next_token = bool(extra.pop("next_token_feature", False))
        next_scale = float(extra.pop("next_token_scale", 1.0))
        copy_gate = bool(extra.pop("copy_gate", False))
        layer_mix = bool(extra.pop("layer_mix", False))
        selector_rank = int(extra.pop("selector_rank", 0))
        selector_top_k = int(extra.pop("selector_top_k", 16))
        decode_block = extra.pop("decode_block_size", None)
        decode_method = extra.pop("decode_method", None)
        no_features = bool(extra.pop("no_target_features", False))
        return cls(
            hidden_size=int(d["hidden_size"]), num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads, num_key_value_heads=int(d.get("num_key_value_heads", heads)),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            intermediate_size=int(d["intermediate_size"]), vocab_size=int(d["vocab_size"]),
            num_target_layers=int(d.get("num_target_layers", max(ids) + 1)), target_layer_ids=list(ids),
            mask_token_id=int(mask), block_size=int(dc.get("block_size", d.get("block_size", 16))),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
            hidden_act=d.get("hidden_act", "silu"), extra=extra, draft_vocab_size=d.get("draft_vocab_size"),
            next_token_feature=next_token, next_token_scale=next_scale, copy_gate=copy_gate, layer_mix=layer_mix,
            selector_rank=selector_rank, selector_top_k=selector_top_k,
            decode_block_size=int(decode_block) if decode_block else None, no_target_features=no_features,
            decode_method=str(decode_method) if decode_method else None,
        )
