"""The DFlash draft: a small block-diffusion transformer conditioned on fused target hidden states.

Architecture (paper sec. 3; layout of the public DFlash checkpoints, so vLLM/SGLang load our drafts):
- context fusion: concat of K tapped target layers [*, K*H] -> fc (Linear K*H -> H, no bias) -> hidden_norm (RMSNorm);
- each layer is Qwen3-shaped (per-head RMSNorm on q and k, SwiGLU MLP) whatever the target's family; queries come
  from the block only, keys/values are [k/v_proj(context); k/v_proj(block)] with RoPE at absolute positions, and the
  block attends to itself bidirectionally (no causal mask);
- final RMSNorm; logits come from the *target's* frozen LM head, the input embeddings from the target's embedding
  (the mask token is the target's row at `mask_token_id`). Neither is stored in the draft.

Because every layer projects the same fused context, the context K/V of all layers are produced by one matmul with
the layers' k/v weights stacked (`context_kv`), and only those are cached between decode steps. With `layer_mix`
(blockdraft's extension, draft_config.py) each layer has a context of its own: the fusion projects each tapped
layer once and every layer mixes the projections with its own learned weights (`mix`) before the shared norm.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .copy_gate import GATE_WEIGHTS_NAME, CopyGate
from .selector import SELECTOR_WEIGHTS_NAME, ChainSelector
from .draft_config import DFlashConfig
from .draft_files import WEIGHTS_NAME, load_checked, read_draft_dir, write_draft_dir
from .draft_layers import Layer, RMSNorm, apply_rope, rope_cos_sin


class DFlashDraftModel(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.num_fused_inputs * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.draft_vocab_size is not None:
            # target id = draft id + d2t[draft id] (vLLM's convention for reduced draft vocabularies)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        # blockdraft's extension (off by default): a bonus on prompt lookup's candidate token (copy_gate.py)
        self.copy_gate = CopyGate(cfg.hidden_size, cfg.block_size) if cfg.copy_gate else None
        # blockdraft's extension (off by default): layer l weighs fused input k by mix[l, k] (`DFlashConfig.layer_mix`)
        self.mix = nn.Parameter(torch.ones(cfg.num_hidden_layers, cfg.num_fused_inputs)) if cfg.layer_mix else None
        self.reset_parameters()
        # blockdraft's extension (off by default): the block's rows chosen in order among the top-k (selector.py);
        # built after the draft's own initialisation, which would otherwise redraw its weights
        self.selector = (ChainSelector(cfg.hidden_size, cfg.selector_rank, cfg.selector_top_k)
                         if cfg.selector_rank else None)

    def reset_parameters(self, std: float = 0.02) -> None:
        init_draft_weights(self, std)
        if self.mix is not None:
            with torch.no_grad():
                self.mix.fill_(1.0)  # every layer starts with the one fused input

    @torch.no_grad()
    def init_from_target(self, target, scale: float = 1.0) -> "DFlashDraftModel":
        """Start the final norm at the target's final-norm weights: the draft's output feeds the target's LM head,
        so it should begin at the per-channel scale that head expects. (A damped start such as 0.1x gives a
        near-uniform first loss but then caps the logit scale: Adam grows a norm weight by ~lr per step, and a
        SmolLM2 draft trained that way sat at loss ~6.9 after 200 steps.)"""
        copy_target_final_norm(self.norm, target, scale)
        return self

    @torch.no_grad()
    def init_layers_from_target(self, target) -> "DFlashDraftModel":
        """Start draft layer i as a copy of target decoder layer L-n+i (the target's last n layers), and the context
        fusion as a pass-through of the deepest tapped layer normed like the input of the first copied layer.

        The draft's layer shapes must equal the target's (the default: the draft takes the target's widths), except
        for a narrower MLP: then each copied MLP keeps the target's channels of the largest |gate_j| * |up_j| *
        |down_j| (row and column norms), the channels whose output can be largest. Why copy at all: at this data
        scale a random draft spends most of its budget learning what a language-model layer is; copied layers start
        as working attention/MLP maps, and the context keys/values of draft layer 0 start as exactly the keys/values
        the target's own layer computes at those positions. The Qwen3-style q/k norms (which LLaMA layers lack)
        start at 1."""
        cfg, tl = self.config, target.layers
        n = cfg.num_hidden_layers
        if n > len(tl):
            raise ValueError(f"cannot copy {n} layers from a {len(tl)}-layer target")
        copied = tl[len(tl) - n:]
        names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")
        for layer, src in zip(self.layers, copied):
            keep = _mlp_channels(src.mlp, cfg.intermediate_size)
            for name in names:
                dst, srcm = layer.get_submodule(name), src.get_submodule(name)
                w = srcm.weight
                if keep is not None and name in ("mlp.gate_proj", "mlp.up_proj"):
                    w = w[keep]
                elif keep is not None and name == "mlp.down_proj":
                    w = w[:, keep]
                if dst.weight.shape != w.shape:
                    raise ValueError(f"draft {name} {tuple(dst.weight.shape)} != target "
                                     f"{tuple(w.shape)}: layer init from the target needs equal shapes")
                w = w.float()
                if isinstance(dst, RMSNorm) and type(src).__name__.startswith("Gemma"):
                    w = w + 1.0  # Gemma norms store (weight - 1)
                dst.weight.copy_(w)
        h = cfg.hidden_size
        self.fc.weight.zero_()
        deepest = cfg.target_layer_ids.index(max(cfg.target_layer_ids))  # features are concatenated in tap order
        self.fc.weight[:, deepest * h:(deepest + 1) * h].copy_(torch.eye(h))
        self.hidden_norm.weight.copy_(self.layers[0].input_layernorm.weight)
        return self

    @torch.no_grad()
    def with_target_layers(self, layer_ids: list[int]) -> "DFlashDraftModel":
        """A copy that reads `layer_ids` (a superset of today's taps, any order) and computes exactly what this draft
        computes: the fusion's columns for the new layers start at zero. Why: a trained draft can then learn to use
        more of the target without first forgetting what it reads today (a fresh fusion would restart training)."""
        old = self.config.target_layer_ids
        missing = [i for i in old if i not in layer_ids]
        if missing or len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"cannot extend a draft reading layers {old} to {list(layer_ids)}: the new list must hold "
                             "every old layer once")
        cfg = replace(self.config, target_layer_ids=[int(i) for i in layer_ids],
                                  extra=dict(self.config.extra))
        new = type(self)(cfg).to(self.fc.weight.dtype)
        state = {k: v for k, v in self.state_dict().items() if k != "fc.weight"}
        h = cfg.hidden_size
        w = torch.zeros(h, cfg.num_fused_inputs * h, dtype=self.fc.weight.dtype)
        for j, lid in enumerate(old):
            k = list(layer_ids).index(lid)
            w[:, k * h:(k + 1) * h] = self.fc.weight[:, j * h:(j + 1) * h]
        if cfg.next_token_feature:  # its block stays last
            w[:, -h:] = self.fc.weight[:, -h:]
        state["fc.weight"] = w
        if self.mix is not None:  # a new input's weight is moot while its fusion columns are zero
            mix = torch.ones(cfg.num_hidden_layers, cfg.num_fused_inputs, dtype=self.mix.dtype)
            for j, lid in enumerate(old):
                mix[:, list(layer_ids).index(lid)] = self.mix[:, j]
            if cfg.next_token_feature:
                mix[:, -1] = self.mix[:, -1]
            state["mix"] = mix
        new.load_state_dict(state)
        return new.train(self.training)

    @torch.no_grad()
    def with_extra_layers(self, target, n_extra: int) -> "DFlashDraftModel":
        """A copy with `n_extra` more layers appended, each a copy of a target layer whose output maps (o_proj,
        down_proj) start at zero, so the deeper draft computes exactly what this one does and only adds capacity."""
        cfg = replace(self.config, num_hidden_layers=self.config.num_hidden_layers + n_extra,
                                  extra=dict(self.config.extra))
        new = type(self)(cfg).to(self.fc.weight.dtype)
        fresh = type(self)(cfg).float()
        fresh.init_layers_from_target(target)  # copies of the target's last layers, for the appended slots
        state = dict(self.state_dict())
        for i in range(self.config.num_hidden_layers, cfg.num_hidden_layers):
            layer = fresh.layers[i]
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            state.update({f"layers.{i}.{k}": v for k, v in layer.state_dict().items()})
        if self.mix is not None:  # the appended layers read the inputs equally (moot while their outputs are zero)
            state["mix"] = torch.cat([self.mix, self.mix.new_ones(n_extra, self.mix.shape[1])])
        new.load_state_dict(state)
        return new.train(self.training)

    @torch.no_grad()
    def with_next_token_feature(self, scale: float = 1.0) -> "DFlashDraftModel":
        """A copy whose fusion also reads the next token's embedding times `scale` (`DFlashConfig.next_token_feature`),
        with those columns at zero: it computes exactly what this draft computes until training moves them."""
        if self.config.next_token_feature:
            return self
        cfg = replace(self.config, next_token_feature=True, next_token_scale=float(scale),
                      extra=dict(self.config.extra))
        new = type(self)(cfg).to(self.fc.weight.dtype)
        state = dict(self.state_dict())
        state["fc.weight"] = torch.cat([self.fc.weight, self.fc.weight.new_zeros(cfg.hidden_size, cfg.hidden_size)],
                                       dim=1)
        if self.mix is not None:
            state["mix"] = torch.cat([self.mix, self.mix.new_ones(self.mix.shape[0], 1)], dim=1)
        new.load_state_dict(state)
        return new.train(self.training)

    @torch.no_grad()
    def with_layer_mix(self) -> "DFlashDraftModel":
        """A copy in which each layer mixes the fused inputs with its own weights (`DFlashConfig.layer_mix`), all
        starting at 1: it computes what this draft computes (up to rounding) until training moves them."""
        if self.config.layer_mix:
            return self
        cfg = replace(self.config, layer_mix=True, extra=dict(self.config.extra))
        new = type(self)(cfg).to(self.fc.weight.dtype)
        if new.copy_gate is not None:  # fp32 before loading, so that the gate's values are not rounded on the way
            new.copy_gate.float()
        new.load_state_dict({**self.state_dict(), "mix": new.mix.detach().clone()})
        return new.train(self.training)

    @torch.no_grad()
    def with_copy_gate(self) -> "DFlashDraftModel":
        """A copy with a copy gate whose bonus starts at zero (`copy_gate.py`): over its vocabulary it scores exactly
        what this draft scores until training moves the gate."""
        if self.config.copy_gate:
            return self
        cfg = replace(self.config, copy_gate=True, extra=dict(self.config.extra))
        new = type(self)(cfg).to(self.fc.weight.dtype)
        new.load_state_dict({**self.state_dict(), **{f"copy_gate.{k}": v for k, v in
                                                     new.copy_gate.state_dict().items()}})
        new.copy_gate.float()
        return new.train(self.training)

    @torch.no_grad()
    def without_copy_gate(self) -> "DFlashDraftModel":
        """The public-layout part alone (what vLLM, SGLang and llama.cpp run from this draft's model.safetensors)."""
        if not self.config.copy_gate:
            return self
        cfg = replace(self.config, copy_gate=False, extra=dict(self.config.extra))
        new = type(self)(cfg).to(self.fc.weight.dtype)
        new.load_state_dict({k: v for k, v in self.state_dict().items() if not k.startswith("copy_gate.")})
        return new.train(self.training)

    @torch.no_grad()
    def with_selector(self, rank: int, top_k: int = 16) -> "DFlashDraftModel":
        """A copy with a fresh chain selector (`selector.py`), which proposes (greedy) what this draft proposes until
        training moves it; rank 0: without one (a selector fits one draft's outputs: a draft trained on needs a new
        one)."""
        cfg = replace(self.config, selector_rank=rank, selector_top_k=top_k, extra=dict(self.config.extra))
        new = type(self)(cfg).to(self.fc.weight.dtype)
        new._keep_extensions_fp32()
        own = {k: v for k, v in self.state_dict().items() if not k.startswith("selector.")}
        fresh = {f"selector.{k}": v for k, v in new.selector.state_dict().items()} if rank else {}
        new.load_state_dict({**own, **fresh})
        return new.train(self.training)

    def without_selector(self) -> "DFlashDraftModel":
        return self if self.selector is None else self.with_selector(0)

    def _keep_extensions_fp32(self) -> None:
        # the copy gate's bonuses and the selector's scores sit at logit scale: fp32 whatever the draft's dtype
        for m in (self.copy_gate, self.selector):
            if m is not None:
                m.float()

    def next_token_input(self, embeds: torch.Tensor) -> torch.Tensor:
        """The fusion's next-token input from the target's embeddings of those tokens (training and decoding both
        build it here, so they cannot disagree on the scale)."""
        return embeds * self.config.next_token_scale

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """target_ids [Vd]: the distinct target tokens the draft may propose (sorted here)."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).unique()
        assert self.config.draft_vocab_size is not None and ids.numel() == self.config.draft_vocab_size, (
            f"expected {self.config.draft_vocab_size} distinct ids, got {ids.numel()}")
        self.d2t.copy_(ids - torch.arange(ids.numel()))

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        """[Vd] target ids of the draft vocabulary, or None for the full vocabulary."""
        if self.config.draft_vocab_size is None:
            return None
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def context_layer_ids(self) -> tuple[int, ...]:
        """The target layers whose outputs form this draft's context; none for a draft trained without target
        features (the paper's ablation: the block sees itself only)."""
        return () if self.config.no_target_features else tuple(self.config.target_layer_ids)

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Project target features into every layer's context keys/values with one matmul.

        features [B, C, K*H] (the tapped target layers, then with `next_token_feature` the embeddings of the tokens
        after these positions: [B, C, (K+1)*H]), positions [B, C] (their true positions).
        Returns (ks, vs), each [L, B, H_kv, C, D]: keys k-normed and rotated, as the attention consumes them.
        """
        cfg = self.config
        b, c, kh = features.shape
        assert kh == cfg.num_fused_inputs * cfg.hidden_size, (
            f"features must be [B, C, K*H] with K*H = {cfg.num_fused_inputs * cfg.hidden_size}, got {kh}"
        )
        attn = [layer.self_attn for layer in self.layers]
        ctx = self.fused_context(features)  # [B, C, H], or [L, B, C, H] with layer_mix
        if self.mix is None:  # one context for every layer: all their k/v in one matmul
            w = torch.cat([a.k_proj.weight for a in attn] + [a.v_proj.weight for a in attn], dim=0)
            kv = F.linear(ctx, w).view(b, c, 2, len(attn), cfg.num_key_value_heads, cfg.head_dim)
            k = kv[:, :, 0].permute(2, 0, 3, 1, 4)  # [L, B, H_kv, C, D]
            v = kv[:, :, 1].permute(2, 0, 3, 1, 4)
        else:
            kv = torch.stack([F.linear(ctx[i], torch.cat([a.k_proj.weight, a.v_proj.weight]))
                              for i, a in enumerate(attn)]).view(len(attn), b, c, 2, cfg.num_key_value_heads,
                                                                 cfg.head_dim)
            k = kv[:, :, :, 0].transpose(2, 3)  # [L, B, H_kv, C, D]
            v = kv[:, :, :, 1].transpose(2, 3)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, k.dtype)
        ks = torch.stack([apply_rope(a.k_norm(k[i]), cos, sin) for i, a in enumerate(attn)])
        return ks, v.contiguous()

    def fused_context(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, C, K*H] -> the normed fused context: [B, C, H], or [L, B, C, H] (one per layer) with
        `layer_mix`, where fc(mix[l] * features) = sum_k mix[l, k] W_k features_k is computed as K projections made
        once and mixed per layer (the cost of one fusion whatever the depth)."""
        x = features.to(self.dtype)
        if self.mix is None:
            return self.hidden_norm(self.fc(x))
        cfg = self.config
        b, c, _ = x.shape
        k, h = cfg.num_fused_inputs, cfg.hidden_size
        per_input = torch.einsum("bckh,okh->bcko", x.view(b, c, k, h), self.fc.weight.view(h, k, h))
        return self.hidden_norm(torch.einsum("bcko,lk->lbco", per_input, self.mix.to(per_input.dtype)))

    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor, ctx_k, ctx_v,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """block_embeds [B, Q, H] (target embeddings of [token, MASK...] per block), block_positions [B, Q],
        ctx_k/ctx_v: per-layer sequences (tensor [L, B, H_kv, C, D] or list of [B, H_kv, C, D]),
        mask [B|1, 1, Q, C+Q] bool or None (inference: the block sees all context and itself).
        Returns final-normed hidden states [B, Q, H]."""
        assert block_embeds.dim() == 3 and block_positions.shape == block_embeds.shape[:2], (
            f"block_embeds [B, Q, H] / block_positions [B, Q] mismatch: {tuple(block_embeds.shape)}, "
            f"{tuple(block_positions.shape)}"
        )
        x = block_embeds.to(self.dtype)
        cos, sin = rope_cos_sin(block_positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, ctx_k[i], ctx_v[i], mask)
        return self.norm(x)

    # ----------------------------------------------------------------------------------------- save / load
    def save_pretrained(self, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """Write config.json + model.safetensors in the public DFlash layout (no embedding, no LM head); a copy gate
        and a chain selector go to files of their own (fp32: small, and their values are compared at logit scale)."""
        state = {k: (v.detach() if k == "d2t" else v.detach().to(dtype)) for k, v in self.state_dict().items()
                 if not k.startswith(("copy_gate.", "selector."))}
        write_draft_dir(out_dir, state, self.config.to_hf_dict())
        for module, name in ((self.copy_gate, GATE_WEIGHTS_NAME), (self.selector, SELECTOR_WEIGHTS_NAME)):
            path = Path(out_dir) / name
            if module is not None:
                from safetensors.torch import save_file

                tmp = path.with_suffix(".tmp")
                save_file({k: v.detach().float().contiguous() for k, v in module.state_dict().items()}, str(tmp))
                tmp.replace(path)
            elif path.exists():  # a stale file from an earlier save into the same directory
                path.unlink()

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu") -> "DFlashDraftModel":
        d, state = read_draft_dir(path)
        model = cls(DFlashConfig.from_hf_dict(d))
        own = {}  # the extensions' weights, from their own files
        for module, prefix, name, what in ((model.copy_gate, "copy_gate", GATE_WEIGHTS_NAME, "a copy gate"),
                                           (model.selector, "selector", SELECTOR_WEIGHTS_NAME, "a chain selector")):
            if module is None:
                continue
            if not (Path(path) / name).is_file():
                raise FileNotFoundError(f"{path} declares {what} (blockdraft.models.{prefix}) but has "
                                        f"no {name}")
            _, own[prefix] = read_draft_dir(path, weights=name)
            state = {**state, **{f"{prefix}.{k}": v for k, v in own[prefix].items()}}
        load_checked(model, state, Path(path) / WEIGHTS_NAME)
        model = model.to(device=device, dtype=dtype or state["fc.weight"].dtype)
        model._keep_extensions_fp32()
        for prefix, weights in own.items():  # loaded again in fp32: the cast above may have rounded them
            getattr(model, prefix).load_state_dict({k: v.float() for k, v in weights.items()})
        if "d2t" in state:  # .to(dtype) leaves integer buffers alone, but be explicit about the mapping's type
            model.d2t = model.d2t.long()
        return model.eval()


# --------------------------------------------------------------------------- shared by the DFlash and EAGLE drafts
def _mlp_channels(mlp: nn.Module, width: int) -> torch.Tensor | None:
    """The `width` channels of a gated MLP (gate/up rows, down columns) of the largest product of their weights'
    norms, in their original order; None when width is the MLP's own."""
    d = mlp.down_proj.weight.float()
    if width == d.shape[1]:
        return None
    if not 0 < width < d.shape[1]:
        raise ValueError(f"a draft MLP of {width} channels cannot be copied from one of {d.shape[1]}")
    score = mlp.gate_proj.weight.float().norm(dim=1) * mlp.up_proj.weight.float().norm(dim=1) * d.norm(dim=0)
    return score.topk(width).indices.sort().values


def init_draft_weights(model: nn.Module, std: float = 0.02) -> None:
    """Linear weights ~ N(0, std), norm weights 1."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)


@torch.no_grad()
def copy_target_final_norm(norm: RMSNorm, target, scale: float = 1.0) -> None:
    """Set a draft's final norm to the target's final-norm scale (times `scale`), if the shapes agree."""
    tnorm = getattr(target.decoder, "norm", None)
    w = getattr(tnorm, "weight", None)
    if w is not None and w.shape == norm.weight.shape:
        w = w.float()
        if type(tnorm).__name__.startswith("Gemma"):  # Gemma norms store (weight - 1) and scale by (1 + weight)
            w = w + 1.0
        norm.weight.copy_(w * scale)


def check_compatible(cfg: DFlashConfig, target) -> None:
    """Raise a clear error when a draft does not fit a target (wrong checkpoint for this model)."""
    problems = []
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden size {cfg.hidden_size} != target's {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab size {cfg.vocab_size} != target's {target.vocab_size}")
    if cfg.num_target_layers != target.num_layers:
        problems.append(f"trained for a {cfg.num_target_layers}-layer target, this one has {target.num_layers}")
    if max(cfg.target_layer_ids) >= target.num_layers:
        problems.append(f"target_layer_ids {cfg.target_layer_ids} exceed the target's {target.num_layers} layers")
    if problems:
        raise ValueError("draft does not fit this target: " + "; ".join(problems))


def decode_block_size(draft, block_size: int | None = None) -> int:
    """The block size a draft decodes with: block_size when given, else the one its card recommends for decoding
    (`decode_block_size` in config.json: a measured choice, e.g. a weak draft on a CPU verifies fewer tokens per
    step), else the one it was trained with. The one place this rule lives."""
    bs = block_size or int(draft.config.decode_block_size or draft.block_size)
    if bs < 1:
        raise ValueError("block_size must be >= 1")
    return bs


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def config_summary(cfg: DFlashConfig) -> dict:
    d = asdict(cfg)
    d["params_M"] = round(
        (cfg.num_fused_inputs * cfg.hidden_size * cfg.hidden_size
         + (cfg.num_hidden_layers * cfg.num_fused_inputs if cfg.layer_mix else 0)
         + cfg.num_hidden_layers * (2 * cfg.hidden_size * cfg.head_dim * (cfg.num_attention_heads
                                                                         + cfg.num_key_value_heads)
                                    + 3 * cfg.hidden_size * cfg.intermediate_size)) / 1e6, 2)
    return d

