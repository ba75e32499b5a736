"""Ways of drafting, behind one small protocol the engine drives.

Life cycle for one sequence (n = number of committed tokens, prompt included):
1. `start(prompt_ids, features)` after the target's prefill; features [1, n0, K*H] of the prompt positions
   (None when the proposer does not ask for them).
2. `propose(tokens, num_draft, sampling, generator)` -> Proposal with G <= num_draft tokens for positions n .. n+G-1.
   `tokens` [n] are all committed tokens; the last one is not yet in the target's cache.
3. `accept(features, num_committed)` after verification; features [1, a+1, K*H] of the verified positions
   n-1 .. n-1+a (the last committed token of the previous step and the accepted drafts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import SamplingParams


@dataclass
class Proposal:
    tokens: torch.Tensor  # [G] int64
    probs: torch.Tensor | None  # [G, V] the distribution each token was sampled from; None = deterministic


class Proposer(Protocol):
    name: str
    layer_ids: tuple[int, ...]  # target layers whose outputs this proposer needs (empty: none)

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None) -> None: ...

    def propose(self, tokens: torch.Tensor, num_draft: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal: ...

    def accept(self, features: torch.Tensor | None, num_committed: int) -> None: ...


class NoDraft:
    """Plain autoregressive decoding through the same engine: proposes nothing, so every step verifies one token."""

    name = "ar"
    layer_ids: tuple[int, ...] = ()

    def start(self, prompt_ids, features) -> None:
        pass

    def propose(self, tokens, num_draft, sampling, generator) -> Proposal:
        return Proposal(tokens.new_zeros(0), None)

    def accept(self, features, num_committed) -> None:
        pass
