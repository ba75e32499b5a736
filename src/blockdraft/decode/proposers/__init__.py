"""Ways of drafting, behind the one interface the decode engine drives (`decode/engine.py`).

Every proposer proposes a candidate tree (`decode/tree.py`): node 0 is the last committed token, every other node a
candidate token whose parent precedes it. A chain (one candidate per position, what the DFlash draft, EAGLE and
prompt lookup propose) is the tree whose parents are i - 1 (`Tree.chain`); the engine feeds it causally and the same
verifier walks it (`decode/verify.py`).

Life cycle for one sequence (n = number of committed tokens, prompt included):
1. `start(prompt_ids, features)` after the target's prefill; features [1, n0, K*H] of the prompt positions
   (None when the proposer does not ask for them).
2. `propose(tokens, num_draft, sampling, generator)` -> a Tree of depth <= num_draft for positions n .. n+depth-1.
   `tokens` [n] are all committed tokens; the last one (the root) is not yet in the target's cache.
3. `accept(tree, path, features)` after verification: path = the accepted nodes from the root (len a + 1); features
   [1, a+1, K*H] of them (positions n-1 .. n-1+a: the last committed token of the previous step and the accepted
   candidates), None when the proposer reads no target layers. A proposer that `observes_logits` is also shown the
   logits of those positions (`FeatureRecorder`, record.py).

How many tokens a step drafts is the drafting policy's call (`decode/policy.py`): a proposer whose candidates are a
chain of up to num_draft tokens lets it choose the width per step (`adapts_width`); a tree proposer sizes its own
tree within the depth it is given (its node budget, `proposers/tree.py`).

One proposer object holds one sequence's state; `fork()` gives another sequence its own state around the same
weights (a stateless proposer returns itself). `propose_rows` drafts for several sequences at once: the default asks
each in turn, a proposer with a batched forward (the DFlash draft) overrides it.
"""

from __future__ import annotations

import torch

from ...config import SamplingParams
from ..tree import Tree


class Proposer:
    """What every way of drafting declares. Subclasses set `name`, `layer_ids` (target layers whose outputs they
    read; empty: none) and `block_size` (trees of depth at most block_size - 1), and implement `propose`."""

    name: str = "proposer"
    layer_ids: tuple[int, ...] = ()
    block_size: int = 1
    adapts_width = True  # the width policy chooses each step's depth (False: the proposer sizes its own tree)
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
                generator: torch.Generator | None) -> Tree:
        raise NotImplementedError

    def accept(self, tree: Tree, path: list[int], features: torch.Tensor | None) -> None:
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
                     samplings: list[SamplingParams], generators: list) -> list[Tree]:
        """Candidates for several sequences, row i by proposers[i] (all of this class): one by one by default."""
        return [p.propose(t, g, s, gen) for p, t, g, s, gen in zip(proposers, tokens, num_drafts, samplings,
                                                                      generators)]


class NoDraft(Proposer):
    """Plain autoregressive decoding through the same engine: proposes nothing, so every step verifies one token."""

    name = "ar"
    layer_ids: tuple[int, ...] = ()

    def start(self, prompt_ids, features) -> None:
        pass

    def propose(self, tokens, num_draft, sampling, generator) -> Tree:
        return Tree.chain(tokens[-1])
