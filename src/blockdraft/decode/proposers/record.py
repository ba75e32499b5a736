"""Recording what the target computes while it writes an answer: a proposer that drafts nothing.

A draft's training data is the target's own answers plus, at every position, its tapped layers' outputs and its
next-token distribution (train/teacher.py). Plain decoding already computes all of them: the prefill taps the
prompt's positions, and every one-token step taps the position it feeds and gives that position's logits. This
proposer keeps them, so that one pass of the target writes answers and teacher data together (regeneration with
`record_layers`), instead of a second prefill over every answer. A k-token step gives the bits of k one-token steps
and a prefill the bits of one-token steps over the prompt, so what it records is what that second pass computes.

Position t's features are recorded when token t is fed: the prompt's at the start, the answer's one per step. The
final token is never fed (nothing follows it), so its row is left to the writer (zeros). Logits are those of the
positions whose next token was chosen: the prompt's last, then every fed answer position.
"""

from __future__ import annotations

import torch

from ...config import SamplingParams
from . import Proposer
from ..tree import Tree


class FeatureRecorder(Proposer):
    """Plain decoding (no drafts) that keeps the tapped features of every fed position and the top-k logits of
    every position whose next token was chosen. `fork()` gives each sequence its own record."""

    name = "record"
    observes_logits = True

    def __init__(self, layer_ids: tuple[int, ...], topk: int = 16) -> None:
        if not layer_ids:
            raise ValueError("a recorder needs the target layers to record")
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        self.layer_ids, self.topk = tuple(int(i) for i in layer_ids), int(topk)
        self.features: list[torch.Tensor] = []  # [n_i, K*H] chunks, positions in order
        self.topk_ids: list[torch.Tensor] = []  # [m_i, k]
        self.topk_logits: list[torch.Tensor] = []
        self.first_logit_position = 0  # the position of the first recorded logits row (the prompt's last)

    def fork(self) -> "FeatureRecorder":
        return FeatureRecorder(self.layer_ids, self.topk)

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        self.features = [features[0]] if features is not None else []
        self.topk_ids, self.topk_logits = [], []
        self.first_logit_position = int(prompt_ids.numel()) - 1

    def propose(self, tokens: torch.Tensor, num_draft: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Tree:
        return Tree.chain(tokens[-1])

    def accept(self, tree: Tree, path: list[int], features: torch.Tensor | None) -> None:
        if features is not None:
            self.features.append(features[0, :len(path)])

    def observe(self, logits: torch.Tensor) -> None:
        top = logits.float().topk(min(self.topk, logits.shape[-1]), dim=-1)
        self.topk_ids.append(top.indices)
        self.topk_logits.append(top.values)

    def recorded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (features [P, K*H] of positions 0 .. P-1, top-k ids and logits [Q, k] of positions
        first_logit_position .. first_logit_position + Q - 1)."""
        cat = lambda xs, dim: torch.cat(xs) if xs else torch.zeros(0, dim)  # noqa: E731
        return cat(self.features, 0), cat(self.topk_ids, self.topk).long(), cat(self.topk_logits, self.topk)
