"""Ways of drafting, behind one interface the decode engine drives (`decode/engine.py`).

Life cycle for one sequence (n = number of committed tokens, prompt included):
1. `start(prompt_ids, features)` after the target's prefill; features [1, n0, K*H] of the prompt positions
   (None when the proposer does not ask for them).
2. `propose(tokens, num_draft, sampling, generator)` -> Proposal with G <= num_draft tokens for positions n .. n+G-1.
   `tokens` [n] are all committed tokens; the last one is not yet in the target's cache.
3. `accept(features, num_committed)` after verification; features [1, a+1, K*H] of the verified positions
   n-1 .. n-1+a (the last committed token of the previous step and the accepted drafts).
A `TreeProposerBase` proposes a candidate tree instead (`propose_tree` / `accept_tree`, see tree.py). A proposer
that `observes_logits` is also shown the logits of the positions it kept (`FeatureRecorder`, record.py).

One proposer object holds one sequence's state; `fork()` gives another sequence its own state around the same
weights (a stateless proposer returns itself). `propose_rows` drafts for several sequences at once: the default asks
each in turn, a proposer with a batched forward (the DFlash draft) overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config import SamplingParams


@dataclass
class Proposal:
    tokens: torch.Tensor  # [G] int64
    probs: torch.Tensor | None  # [G, V] the distribution each token was sampled from; None = deterministic


class Proposer:
    """What every way of drafting declares. Subclasses set `name`, `layer_ids` (target layers whose outputs they
    read; empty: none) and `block_size` (at most block_size - 1 drafts per step), and implement `propose`."""

    name: str = "proposer"
    layer_ids: tuple[int, ...] = ()
    block_size: int = 1
    proposes_trees = False  # True: `propose_tree` / `accept_tree` instead of `propose` / `accept`
    observes_logits = False  # True: the engine also hands it the logits of the positions it kept (`observe`)

    @property
    def max_width(self) -> int:
        """The most tokens one verify of this proposer's candidates feeds the target (the last committed token
        included): the room a sequence's cache keeps beyond its committed tokens."""
        return max(1, self.block_size)

    def fork(self) -> "Proposer":
        """A proposer for another sequence: the same weights, its own per-sequence state. Stateless proposers
        (no state between steps) return themselves."""
        return self

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        pass

    def propose(self, tokens: torch.Tensor, num_draft: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        raise NotImplementedError

    def accept(self, features: torch.Tensor | None, num_committed: int) -> None:
        pass

    def observe(self, logits: torch.Tensor) -> None:
        """logits [m, V] of the positions whose next token was just chosen (the prompt's last at the start, then
        each step's verified ones); called only when `observes_logits` (recording teacher data)."""

    def describe(self) -> dict | None:
        """Settings the decode statistics report (None: nothing beyond the name)."""
        return None

    @classmethod
    def prepare_rows(cls, proposers: list["Proposer"], tokens: list[torch.Tensor], num_drafts: list[int]) -> None:
        """Bring the state of the rows about to draft (num_drafts[i] > 0) up to the committed tokens before the
        draft call is timed (nothing by default). What is done here is bookkeeping that accumulates while a row
        does not draft (e.g. the DFlash draft's context), so it is no part of what one drafted step costs: the width
        policy prices a step by the draft call alone (policy.py)."""

    @classmethod
    def propose_rows(cls, proposers: list["Proposer"], tokens: list[torch.Tensor], num_drafts: list[int],
                     samplings: list[SamplingParams], generators: list) -> list[Proposal]:
        """Proposals for several sequences, row i by proposers[i] (all of this class): one by one by default."""
        return [p.propose(t, g, s, gen) for p, t, g, s, gen in zip(proposers, tokens, num_drafts, samplings,
                                                                      generators)]


class TreeProposerBase(Proposer):
    """A proposer of candidate trees (tree.py): the target verifies every node in one forward and the sequence
    keeps the accepted path. `max_nodes` bounds a tree's size, the root included."""

    proposes_trees = True
    max_nodes: int = 1

    @property
    def max_width(self) -> int:
        return max(1, self.max_nodes)

    def propose_tree(self, tokens: torch.Tensor, max_depth: int, sampling: SamplingParams,
                     generator: torch.Generator | None):
        """tokens [n] committed (the last one becomes the root) -> a `tree.Tree` of depth <= max_depth."""
        raise NotImplementedError

    def accept_tree(self, tree, path: list[int], features: torch.Tensor | None) -> None:
        """After verification: path = the accepted nodes from the root; features [1, len(path), K*H] of them."""


class NoDraft(Proposer):
    """Plain autoregressive decoding through the same engine: proposes nothing, so every step verifies one token."""

    name = "ar"
    layer_ids: tuple[int, ...] = ()

    def start(self, prompt_ids, features) -> None:
        pass

    def propose(self, tokens, num_draft, sampling, generator) -> Proposal:
        return Proposal(tokens.new_zeros(0), None)

    def accept(self, features, num_committed) -> None:
        pass
