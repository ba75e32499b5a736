"""Logits processing (temperature, top-k, top-p) and sampling with an explicit generator.

The same `logits_to_probs` is applied to the target's logits (p) and the draft's logits (q): rejection sampling is
lossless with respect to the *processed* target distribution only if both sides see the same processing.
"""

from __future__ import annotations

import torch

from ..config import SamplingParams
from ..models.quant import loaded_kernels


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> [...] int64, exactly `logits.argmax(-1)` (the first index of the maximum; a NaN counts as
    the maximum). Float32 rows on the CPU go through the native row argmax when the kernels are loaded (a quantized
    target loads them): over a 150k vocabulary torch's argmax is several times slower (docs/results-history.md,
    "Measurements behind the code's choices")."""
    k = loaded_kernels()
    if k is not None and logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.shape[-1] > 0:
        return k.argmax_rows(logits)
    return logits.argmax(-1)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probs [..., V] (float32) after temperature, top-k and top-p. Requires a sampling
    temperature (not `params.greedy`)."""
    assert not params.greedy, "greedy decoding has no distribution; use argmax"
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
        keep_sorted = (sorted_probs.cumsum(-1) - sorted_probs) < params.top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [..., V] -> token ids [...] drawn with `generator`. A row that is not a distribution (NaN, inf or no
    mass: the logits were not finite) raises ValueError, which fails that row's request alone."""
    flat = probs.reshape(-1, probs.shape[-1])
    mass = flat.sum(-1)
    if not (torch.isfinite(mass).all() and (mass > 0).all() and (flat >= 0).all()):
        raise ValueError("sampling: the probabilities are not finite or have no mass (non-finite logits)")
    return draw(flat, generator).view(probs.shape[:-1])


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """weights [R, V] (>= 0, each row with mass) -> [R] int64: one index per row drawn with probability weight / row
    sum, by inverting the row's cumulative sum (float64) at one uniform number from `generator`. A zero weight is
    never drawn. Why not torch.multinomial: over a 150k vocabulary it took ~4 ms a row on 2 threads, a tenth of a
    1.5B target's step; this takes ~1 ms."""
    cdf = weights.cumsum(-1, dtype=torch.float64)
    u = torch.rand((weights.shape[0], 1), generator=generator, dtype=torch.float64, device=weights.device)
    total = cdf[:, -1:].contiguous()
    idx = torch.searchsorted(cdf, u * total, right=True)
    # u * total rounds up to total for u within 2^-53 of 1: then the row's last index with weight, not a zero past it
    return torch.minimum(idx, torch.searchsorted(cdf, total, right=False)).squeeze(1)


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
