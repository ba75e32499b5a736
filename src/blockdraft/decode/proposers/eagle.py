"""EAGLE-3 proposer: a chain of gamma sequential drafter steps (the autoregressive baseline of the paper).

Draft rows (see eagle.py): row r pairs the target feature of position r with the committed token at r+1. When
`propose` sees n committed tokens, features exist for positions 0..n-2, so rows 0..n-2 are fully known (true
features, true tokens): they are the verified rows and their K/V stay in the draft's cache. The last of them,
row n-2, is also the first draft step: its output predicts the token at position n. Rows are computed lazily in
`propose`, because a row needs the token *after* its feature, and the bonus token of a verify step only reaches the
proposer with the next `tokens`. So `start`/`accept` only queue the true features; the next `propose` turns every
queued row into cached K/V in one forward, which is also draft step 1. Steps 2..gamma each read the previous step's
hidden state and the token it proposed; their K/V are speculative and are cropped once the proposal is made.
"""

from __future__ import annotations

import torch

from ...models.cache import KVCache
from ...config import SamplingParams
from ...models.eagle import EagleDraftModel
from ..sampling import logits_to_probs, sample
from ...models.target import TargetModel
from . import Proposer
from ..tree import Tree


class EagleProposer(Proposer):
    name = "eagle"

    def __init__(self, draft: EagleDraftModel, target: TargetModel, gamma: int | None = None) -> None:
        draft.check_compatible(target)
        g = gamma or draft.config.max_draft_steps
        if g < 1:
            raise ValueError("gamma (draft chain length) must be >= 1")
        self.draft, self.target = draft, target
        self.gamma = g
        self.block_size = g + 1  # the engine drafts block_size - 1 tokens per verify step
        self.layer_ids = tuple(draft.config.target_layer_ids)
        cfg = draft.config
        self.cache = KVCache(1, 1, cfg.num_key_value_heads, cfg.head_dim, capacity=512, dtype=draft.dtype,
                             device=target.device)
        self.pending: list[torch.Tensor] = []  # [1, t, 3H] true features of rows not yet in the cache

    def fork(self) -> "EagleProposer":
        return EagleProposer(self.draft, self.target, self.gamma)

    @torch.no_grad()
    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        assert features is not None and features.dim() == 3, "EAGLE needs the prompt's features [1, n0, 3H]"
        self.cache.reset()
        self.pending = [features]

    @torch.no_grad()
    def accept(self, tree: Tree, path: list[int], features: torch.Tensor | None) -> None:
        assert features is not None and features.shape[1] == len(path), "features of the verified positions"
        self.pending.append(features)

    def _forward(self, ids: torch.Tensor, hidden: torch.Tensor, start: int) -> torch.Tensor:
        """ids [T] input tokens at positions start..start+T-1, hidden [1, T, H] -> outputs [1, T, H]; their K/V
        are appended to the cache."""
        pos = torch.arange(start, start + ids.shape[0], device=ids.device).unsqueeze(0)
        k_past, v_past = self.cache.view(0)
        out, k, v = self.draft.step(self.target.embed(ids.unsqueeze(0)), hidden, pos, k_past, v_past)
        self.cache.append(k.unsqueeze(0), v.unsqueeze(0))
        return out

    def _logits(self, out: torch.Tensor, position: int) -> torch.Tensor:
        """out [H] a step's output -> logits [V] for the token at `position` (the target's LM head)."""
        return self.target.logits(self.draft.norm(out).to(self.target.dtype)).float()

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, num_draft: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Tree:
        g = min(num_draft, self.gamma)
        if g <= 0:
            return Tree.chain(tokens[-1])
        n = tokens.shape[0]
        feats = torch.cat(self.pending, dim=1) if len(self.pending) > 1 else self.pending[0]
        c = self.cache.length
        assert c + feats.shape[1] == n - 1, "draft rows out of step with the committed tokens"
        # verified rows c..n-2: true features, tokens at positions c+1..n-1; the last row is draft step 1
        out = self._forward(tokens[c + 1:], self.draft.fuse(feats), c + 1)[:, -1:]
        self.pending = []
        drafted = torch.zeros(g, dtype=torch.long, device=tokens.device)
        q = None if sampling.greedy else torch.zeros(g, self.target.vocab_size, device=tokens.device)
        for j in range(g):
            logits = self._logits(out[0, 0], n + j)
            if sampling.greedy:
                drafted[j] = logits.argmax(-1)
            else:
                q[j] = logits_to_probs(logits, sampling)
                drafted[j] = sample(q[j], generator)
            if j + 1 < g:  # step j+2 reads this step's hidden state and its token, at that token's position
                out = self._forward(drafted[j:j + 1], out, n + j)
        self.cache.crop(n - 1)
        return Tree.chain(tokens[-1], drafted, q)
