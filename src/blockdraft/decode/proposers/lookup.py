"""Prompt-lookup decoding (PLD): draft by copying what followed an earlier occurrence of the current suffix.

No model is involved. At every step the last n committed tokens (n = max_ngram down to min_ngram, longest first)
are searched for in all earlier committed tokens (prompt and answer); at the most recent earlier match, the tokens
that followed it are proposed. Drafts are deterministic (point masses, a `Tree.chain` without q): greedy verification
compares tokens, and at temperature > 0 the rejection verifier treats them as point masses.
The lookup itself is `ngram.find_continuation`.
"""

from __future__ import annotations

import torch

from ...config import SamplingParams
from ...models.ngram import find_continuation
from . import Proposer
from ..tree import Tree


class PromptLookupProposer(Proposer):
    """A stateless proposer: n-gram lookup in the committed tokens (name "pld", no target features)."""

    name = "pld"
    layer_ids: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_pred: int | None = None,
                 block_size: int = 16) -> None:
        if min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if num_pred is not None and num_pred < 1:
            raise ValueError(f"num_pred must be >= 1 (or None for the engine's limit), got {num_pred}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.max_ngram, self.min_ngram, self.num_pred = max_ngram, min_ngram, num_pred
        self.block_size = block_size  # read by the engine when the generation config does not set one

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        pass

    def propose(self, tokens: torch.Tensor, num_draft: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Tree:
        k = num_draft if self.num_pred is None else min(num_draft, self.num_pred)
        return Tree.chain(tokens[-1], find_continuation(tokens, k, self.max_ngram, self.min_ngram))
