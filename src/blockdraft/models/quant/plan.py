"""Which weights the fast path holds quantized: a `WeightPlan` per weights mode (auto / bf16 / int8 / int4), from a
GGUF file's own blocks or quantized from the float weights."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..hf_config import text_config
from .formats import BLOCK, WEIGHT_MODES, QWeight, bits_of, fuse, qweight_tensors, quantize, quantize_q8
from .gguf import GGUFBlocks, gguf_name, match_rows
from .kernels import kernel_isa, kernel_status

log = logging.getLogger(__name__)


@dataclass
class WeightPlan:
    """Which weights of a target the fast path holds quantized, and how.

    mode: 'bf16' (the model's float weights, whatever its dtype), 'int8' / 'int4' (quantized from them, groups of
    32; the LM head 8-bit in both), or 'gguf' (the GGUF file's own blocks, mapped exactly: `exact`, keyed by the
    model's module names, e.g. `model.layers.0.self_attn.q_proj` and `lm_head`).
    A fused linear (q/k/v, gate/up) is quantized only when every part is; what stays float is listed in `kept`."""

    mode: str
    exact: dict[str, QWeight] | None = None
    source: str | None = None
    kept: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("bf16", "int8", "int4", "gguf"):
            raise ValueError(f"unknown weight plan mode {self.mode!r}")
        self.exact = dict(self.exact or {})
        self.kept = dict(self.kept or {})
        self._quantized: dict[str, str] = {}  # module name -> 'q4' / 'q8', for every linear built quantized
        self.released = False  # `release` was called: only the kept weights are left

    def weight_for(self, names: list[str], weights: list[torch.Tensor]) -> QWeight | None:
        """The quantized weight of the linear made of `names` (their float weights stacked along the output), or
        None where it stays float."""
        if self.mode == "bf16":
            return None
        if self.released:
            raise RuntimeError("this weight plan released its layers' weights: they live in the decode path built "
                               "from it (load the target again to build another)")
        if self.mode == "gguf":
            parts = [self.exact.get(n) for n in names]
            if any(p is None for p in parts):
                for n, p in zip(names, parts):
                    self.kept.setdefault(n, "no exact block mapping" if p is None else
                                         "fused with a part that has no exact block mapping")
                return None
            w = fuse(parts)
        else:
            if any(int(x.shape[1]) % BLOCK for x in weights):
                for n in names:
                    self.kept[n] = f"input width not a multiple of {BLOCK}"
                return None
            w = quantize(torch.cat([x.detach() for x in weights]), self.mode)
        for n in names:
            self._quantized[n] = f"q{bits_of(w)}"
        return w

    def release(self, names) -> list[torch.Tensor]:
        """Forget the exact weights of these modules, once the decode path built from them holds its own copies:
        -> the tensors they held. A decode path built from this plan afterwards is refused."""
        held = [t for name in names if name in self.exact for t in qweight_tensors(self.exact.pop(name))]
        self.released = True
        return held

    def head_weight(self, weight: torch.Tensor) -> QWeight | None:
        """The LM head's quantized weight [V, H] (8-bit in the int8 / int4 modes: 4-bit logits lose too much), or
        None where it stays float."""
        if self.mode == "bf16":
            return None
        if self.mode == "gguf":
            w = self.exact.get("lm_head")
            if w is None:
                self.kept.setdefault("lm_head", "no exact block mapping")
            return w
        if int(weight.shape[1]) % BLOCK:
            self.kept["lm_head"] = f"input width not a multiple of {BLOCK}"
            return None
        return quantize_q8(weight)

    def describe(self) -> dict:
        """What the plan did so far: mode, source, linears per kind, what stayed float and why, kernel status."""
        kinds: dict[str, int] = {}
        for k in self._quantized.values():
            kinds[k] = kinds.get(k, 0) + 1
        return {"mode": self.mode, "source": self.source, "quantized": kinds, "kept": dict(self.kept),
                "kernels": kernel_status() or kernel_isa()}


def drop_float_weight(module: torch.nn.Module) -> torch.Tensor:
    """Replace a module's weight by a meta tensor of its shape and dtype (no storage: what reads a shape still can,
    what reads values fails loudly) -> the weight it held."""
    held = module.weight
    module.weight = torch.nn.Parameter(torch.empty_like(held, device="meta"), requires_grad=False)
    return held


def plan_weights(mode: str, model: torch.nn.Module, gguf_path: str | Path | None = None,
                 release_matched: bool = False) -> WeightPlan:
    """--weights MODE for a loaded HF model: 'auto' keeps a GGUF target's own quantization (every linear whose
    blocks map exactly; the rest stays float, logged) and leaves any other target float; 'bf16' keeps the float
    weights; 'int8' / 'int4' quantize them (opt-in: their quality cost is in the docs). release_matched: see
    `gguf_plan`."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"unknown weights mode {mode!r}; choose one of {WEIGHT_MODES}")
    if mode == "auto":
        return gguf_plan(model, gguf_path, release_matched) if gguf_path is not None else WeightPlan("bf16")
    return WeightPlan(mode)


def gguf_plan(model: torch.nn.Module, gguf_path: str | Path, release_matched: bool = False) -> WeightPlan:
    """Map the GGUF file's blocks onto the model's linears, each checked against the model's own (dequantized)
    weight so that a name or row-order mismatch can never slip through: it stays float instead.
    release_matched: free each matched layer linear's float weight once checked (it becomes a meta tensor of its
    shape; the LM head keeps its): for a process that will only decode on the plan's weights, so that the float
    model and the file's blocks never sit in memory side by side (`load_target(decode_only=True)`)."""
    blocks = GGUFBlocks(gguf_path)
    other = blocks.other
    cfg = text_config(model.config)
    heads = (int(getattr(cfg, "num_attention_heads", 0) or 0), int(getattr(cfg, "num_key_value_heads", 0) or 0))
    exact: dict[str, QWeight] = {}
    kept: dict[str, str] = {}
    head = model.get_output_embeddings()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, module in linears.items():
        key = "lm_head" if module is head else name
        g = "output.weight" if module is head else gguf_name(f"{name}.weight")
        if module is head and g not in blocks and g not in other:
            g = "token_embd.weight"  # a tied head: the file stores the embedding only
        if g is None:
            continue
        if g not in blocks:
            kept[key] = f"{other.get(g, 'missing')} in the file"
            continue
        w = match_rows(blocks[g], module.weight, heads)
        if w is None:
            kept[key] = f"{g} does not reproduce the model's weight"
        else:
            exact[key] = w
            if release_matched and module is not head:
                drop_float_weight(module)
    plan = WeightPlan("gguf", exact, str(gguf_path), kept)
    kinds: dict[str, int] = {}
    for w in exact.values():
        kind = f"{bits_of(w)}-bit"
        kinds[kind] = kinds.get(kind, 0) + 1
    log.info("weights auto: %s from %s; float: %s", ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())),
             Path(gguf_path).name, ", ".join(f"{k} ({v})" for k, v in kept.items()) or "none")
    return plan
