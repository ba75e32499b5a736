"""The EAGLE-3 drafter, the paper's autoregressive baseline: one decoder layer that drafts token by token.

Architecture (EAGLE-3, Li et al. 2025, sec. 3; parameter names follow the public `midlayer` layout):
- feature fusion: the outputs of 3 target layers (low, middle, high) concatenated [*, 3H] -> fc (Linear 3H -> H);
- one Llama-shaped decoder layer whose input at draft row r is concat[input_layernorm(embed(x_{r+1})),
  hidden_norm(g_r)] (2H wide: q/k/v take 2H, o_proj gives H back); the residual stream starts at g_r;
- g_r = fc(features_r) at the first draft step; at later steps it is the layer's own previous output (before the
  final norm), so the drafter runs on its own hidden states instead of the target's ("training-time test");
- causal self-attention with RoPE over its own KV cache; final RMSNorm; logits from the *target's* frozen LM head
  (no embedding and no LM head are stored in the draft).

Row / position convention, shared by inference (proposers/eagle.py) and training (train/eagle.py): draft row r pairs
the target feature of position r with the token at position r+1 and predicts the token at r+2. Its RoPE position is
r+1, the true position of its input token. The j-th chained step after row r sits at position r+1+j, the position of
the token it reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .draft import copy_target_final_norm, init_draft_weights
from .draft_files import CONFIG_NAME, WEIGHTS_NAME, load_checked, read_draft_dir, write_draft_dir
from .draft_config import DraftShape, default_target_layer_ids, target_layer_shape
from .draft_layers import MLP, RMSNorm, apply_rope, rope_cos_sin

ARCHITECTURE = "Eagle3DraftModel"


def eagle_target_layer_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3's taps: layer 1, L//2 - 1 and L - 4 (low, middle, high). Targets too shallow for three distinct
    layers there fall back to three layers spread evenly (see `default_target_layer_ids`)."""
    ids = [1, num_target_layers // 2 - 1, num_target_layers - 4]
    if len(set(ids)) == 3 and all(0 <= i < num_target_layers for i in ids) and ids == sorted(ids):
        return ids
    return default_target_layer_ids(num_target_layers, 3)


@dataclass(kw_only=True)
class EagleConfig(DraftShape):
    max_draft_steps: int = 7  # default chain length gamma at inference
    # blockdraft's own metadata (training recipe, provenance), saved under "blockdraft" in config.json.
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.target_layer_ids) != 3:
            raise ValueError(f"an EAGLE-3 draft fuses 3 target layers, got {self.target_layer_ids}")
        if self.max_draft_steps < 1:
            raise ValueError("max_draft_steps must be >= 1")

    @classmethod
    def from_target(cls, target_config, *, target_layer_ids: list[int] | None = None,
                    **overrides) -> "EagleConfig":
        """Derive the layer shape from the target's HF config (`target_layer_shape`)."""
        kw = target_layer_shape(target_config)
        kw["target_layer_ids"] = list(target_layer_ids or eagle_target_layer_ids(kw["num_target_layers"]))
        kw.update(overrides)
        return cls(**kw)

    def to_hf_dict(self) -> dict:
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "dtype": "bfloat16",
            "num_target_layers": self.num_target_layers,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": self.target_layer_ids,
                             "use_aux_hidden_state": True, "max_draft_steps": self.max_draft_steps},
            "blockdraft": self.extra,
        }

    @classmethod
    def from_hf_dict(cls, d: dict) -> "EagleConfig":
        if not is_eagle_config(d):
            raise ValueError(f"not an EAGLE draft config (architectures {d.get('architectures')}; expected "
                             f"[{ARCHITECTURE!r}] with an eagle_config)")
        ec = d.get("eagle_config") or {}
        ids = ec.get("eagle_aux_hidden_state_layer_ids")
        if ids is None:
            raise ValueError("EAGLE draft config has no eagle_config.eagle_aux_hidden_state_layer_ids")
        rope = d.get("rope_parameters") or {}
        heads = int(d["num_attention_heads"])
        return cls(
            hidden_size=int(d["hidden_size"]), num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads", heads)),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            intermediate_size=int(d["intermediate_size"]), vocab_size=int(d["vocab_size"]),
            num_target_layers=int(d.get("num_target_layers", max(ids) + 1)), target_layer_ids=list(ids),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
            max_draft_steps=int(ec.get("max_draft_steps", 7)), extra=dict(d.get("blockdraft") or {}),
        )


def is_eagle_config(d: dict) -> bool:
    return ARCHITECTURE in (d.get("architectures") or []) or "eagle_config" in d


def is_eagle_draft(path: str | Path) -> bool:
    """Whether the draft directory holds an EAGLE draft (by its config.json); False when it cannot tell."""
    p = Path(path) / CONFIG_NAME
    try:
        return is_eagle_config(json.loads(p.read_text()))
    except (OSError, json.JSONDecodeError):
        return False


# --------------------------------------------------------------------------------------------------- the layer
class EagleAttention(nn.Module):
    """q/k/v read the 2H-wide [embedding; hidden] input; keys are stored rotated (RoPE at true positions)."""

    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)


class EagleLayer(nn.Module):
    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the fused feature / previous hidden
        self.self_attn = EagleAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)


class EagleDraftModel(nn.Module):
    """fc + one decoder layer (`midlayer`) + final norm. The pieces are exposed separately (`project`, `finish`)
    because inference attends over a KV cache while training attends over the training-time-test key layout."""

    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.num_target_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = EagleLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        init_draft_weights(self, std)

    @torch.no_grad()
    def init_from_target(self, target) -> "EagleDraftModel":
        """Start the final norm at the target's final-norm weights (the draft feeds the target's LM head; see
        DFlashDraftModel.init_from_target for why)."""
        copy_target_final_norm(self.norm, target)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def vocab_ids(self) -> None:
        """Always the full vocabulary (the trainer's reduced-vocabulary hook)."""
        return None

    # ------------------------------------------------------------------------------------------------ pieces
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, T, 3H] (the tapped target layers) -> g [B, T, H], the first step's input hidden."""
        cfg = self.config
        assert features.dim() == 3 and features.shape[-1] == cfg.num_target_features * cfg.hidden_size, (
            f"features must be [B, T, {cfg.num_target_features * cfg.hidden_size}], got {tuple(features.shape)}")
        return self.fc(features.to(self.dtype))

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """embeds [B, T, H] (target embeddings of the input tokens), hidden [B, T, H] (g), positions [B, T] ->
        (q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, D]); q and k rotated at `positions`."""
        assert embeds.dim() == 3 and embeds.shape == hidden.shape, (
            f"embeds and hidden must both be [B, T, H]: {tuple(embeds.shape)} vs {tuple(hidden.shape)}")
        assert positions.shape == embeds.shape[:2], f"positions must be [B, T], got {tuple(positions.shape)}"
        layer, attn = self.midlayer, self.midlayer.self_attn
        b, t, _ = embeds.shape
        x = torch.cat([layer.input_layernorm(embeds.to(self.dtype)), layer.hidden_norm(hidden.to(self.dtype))], -1)
        q = attn.q_proj(x).view(b, t, attn.n_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, attn.n_kv, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, attn.n_kv, attn.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, attn.head_dim, self.config.rope_theta, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] (the residual input g), attn_out [B, Hq, T, D] -> layer output [B, T, H] (before the
        final norm: the hidden state the next draft step reads)."""
        layer = self.midlayer
        b, _, t, _ = attn_out.shape
        h = hidden.to(self.dtype) + layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, t, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             past_k: torch.Tensor | None = None, past_v: torch.Tensor | None = None):
        """One causal forward of T new rows after C cached ones (inference).

        embeds/hidden [B, T, H], positions [B, T], past_k/past_v [B, Hkv, C, D] or None.
        Returns (out [B, T, H] layer outputs before the final norm, k [B, Hkv, T, D], v [B, Hkv, T, D]) where k/v
        are the new rows' keys/values for the caller's cache. Row t sees every cached row and new rows <= t.
        """
        q, k, v = self.project(embeds, hidden, positions)
        t = q.shape[2]
        keys, vals = (k, v) if past_k is None else (torch.cat([past_k, k], 2), torch.cat([past_v, v], 2))
        c = keys.shape[2] - t
        mask = None
        if t > 1:
            mask = torch.ones(t, c + t, dtype=torch.bool, device=q.device).tril(c)
        attn = self.midlayer.self_attn
        out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=attn.n_kv != attn.n_heads)
        return self.finish(hidden, out), k, v

    # ----------------------------------------------------------------------------------------- checks / save
    def check_compatible(self, target) -> None:
        """Raise a clear ValueError when this draft does not fit `target` (a wrong checkpoint for this model)."""
        cfg, problems = self.config, []
        if cfg.hidden_size != target.hidden_size:
            problems.append(f"hidden size {cfg.hidden_size} != target's {target.hidden_size}")
        if cfg.vocab_size != target.vocab_size:
            problems.append(f"vocab size {cfg.vocab_size} != target's {target.vocab_size}")
        if any(not 0 <= i < target.num_layers for i in cfg.target_layer_ids):
            problems.append(f"target_layer_ids {cfg.target_layer_ids} out of range for the target's "
                            f"{target.num_layers} layers")
        if problems:
            raise ValueError("EAGLE draft does not fit this target: " + "; ".join(problems))

    def save_pretrained(self, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """Write config.json + model.safetensors (no embedding, no LM head)."""
        write_draft_dir(out_dir, {k: v.detach().to(dtype) for k, v in self.state_dict().items()},
                        self.config.to_hf_dict())

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu") -> "EagleDraftModel":
        d, state = read_draft_dir(path)
        model = cls(EagleConfig.from_hf_dict(d))
        load_checked(model, state, Path(path) / WEIGHTS_NAME)
        return model.to(device=device, dtype=dtype or state["fc.weight"].dtype).eval()

