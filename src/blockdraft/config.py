"""Typed configuration for decoding (sampling parameters, generation limits) and where the cache lives."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path


def cache_dir() -> Path:
    """Where converted targets, joined GGUFs, calibrations and built tools live: $BLOCKDRAFT_CACHE, else
    ~/.cache/blockdraft."""
    root = os.environ.get("BLOCKDRAFT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "blockdraft")
    return Path(root)


GREEDY_BELOW = 1e-4  # temperatures below this decode greedily (see SamplingParams)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. A temperature below GREEDY_BELOW (0 included) means greedy (top_k/top_p are
    then irrelevant): dividing logits by a temperature near zero overflows float32 into inf and NaN, and long before
    that the distribution is the argmax's point mass.

    top_k == 0 disables top-k; top_p == 1.0 disables nucleus sampling. `seed` seeds the explicit generator that the
    engine passes to every random draw, so a seeded call is reproducible.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be finite, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class GenerationConfig:
    """One request's limits and stops (how it samples is its `SamplingParams`). How the engine drafts and verifies
    (method, block size, denoising passes) is the engine's `decode.spec.DecodeSpec`, set once for every request."""

    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty")
