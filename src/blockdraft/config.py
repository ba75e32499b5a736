"""Typed configuration for decoding (sampling parameters, generation limits) and where the cache lives."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
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
    """Limits and drafting knobs of one generate call.

    block_size: tokens verified per step (1 committed + block_size-1 drafted); None = the draft's trained size.
    denoise_steps: draft passes per block (1 = the paper's single-pass drafting; >1 re-masks low-confidence positions
    and re-runs, as block-diffusion LMs do).
    """

    max_new_tokens: int = 256
    block_size: int | None = None
    denoise_steps: int = 1
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size < 1):
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if not isinstance(self.denoise_steps, int) or self.denoise_steps < 1:
            raise ValueError(f"denoise_steps must be an integer >= 1, got {self.denoise_steps!r}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty")
