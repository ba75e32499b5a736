"""The parts of one engine step that act on one row's plan: propose, run the target over every plan, verify.

A plan is what one row feeds the target this step: its last committed token and its candidates, a tree (a chain is
the tree whose parents are i - 1: it is fed causally, with neither positions nor a mask to build). The engine
(engine.py) decides which rows take part and fails a row alone when its part raises.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..models.target import TargetModel
from .row import Sequence
from .sampling import logits_to_probs
from .tree import Tree, ancestor_mask, check_tree
from .verify import greedy_verify, rejection_verify


@dataclass
class Plan:
    """One row's part of a step: its candidates and how the target sees them."""

    row: Sequence
    tree: Tree  # node 0 the last committed token, then the candidates
    positions: torch.Tensor | None  # [W], None = consecutive after the cache (a chain)
    tree_mask: torch.Tensor | None  # [W, W] for a tree that is not a chain

    @property
    def ids(self) -> torch.Tensor:
        """[W] what the target is fed: the last committed token, then the candidates."""
        return self.tree.tokens


def prefill_chunk(target: TargetModel, row: Sequence, size: int, taps: tuple[int, ...]) -> int:
    """One prefill forward of the row's next prompt chunk of at most `size` tokens (chunk boundaries at multiples
    of size, whatever else the step does), tapping layers `taps`; returns the tokens it took."""
    a = row.prefilled
    chunk = row.prompt[a:a + size]
    out = target.forward(chunk.unsqueeze(0), row.cache, last_only=True, tap=taps)
    row.stats.target_forwards += 1
    if taps:
        row.prompt_features.append(out.features)
    row.prefilled = a + chunk.numel()
    row.last_logits = out.logits[0, -1]
    return chunk.numel()


def plan_of(row: Sequence, tree: Tree, g: int, vocab_size: int) -> Plan:
    """A row's proposed tree of depth <= g, checked, as the plan the target is fed."""
    check_tree(tree, vocab_size)
    if tree.max_depth > g:
        raise ValueError(f"malformed tree: depth {tree.max_depth} > the {g} positions left")
    if int(tree.tokens[0]) != int(row.tokens[-1]):
        raise ValueError("malformed tree: its root must be the last committed token")
    if tree.is_chain:  # its ancestor mask is the causal mask: the plain causal path, nothing to build
        return Plan(row, tree, None, None)
    return Plan(row, tree, tree.depth + (row.tokens.numel() - 1), ancestor_mask(tree.parents))


def propose(cls: type, rows: list[Sequence], widths: list[int], vocab_size: int) -> tuple[list[Plan], float]:
    """Candidates for rows whose proposers are all of class cls, in one call (`Proposer.propose_rows`), row i's of
    depth at most widths[i] -> (their plans, the draft call's seconds: what the policies price a drafted step by,
    without the catch-up of `Proposer.prepare_rows`)."""
    t0 = time.perf_counter()
    cls.prepare_rows([r.proposer for r in rows], [r.tokens for r in rows], widths)
    t1 = time.perf_counter()
    trees = cls.propose_rows([r.proposer for r in rows], [r.tokens for r in rows], widths,
                             [r.sampling for r in rows], [r.generator for r in rows])
    dt = time.perf_counter() - t1
    plans, timed = [], {}
    for row, tree, g in zip(rows, trees, widths):
        plans.append(plan_of(row, tree, g, vocab_size))
        row.stats.draft_seconds += dt + (t1 - t0)  # the stats count all of the draft's time
        if tree.num_nodes > 1:  # one sample per call price: the rows of an engine share theirs
            timed[id(row.width.draft_seconds)] = row.width
    for width in timed.values():
        width.drafted(dt)
    return plans, dt


def forward_plans(target: TargetModel, plans: list[Plan], taps: tuple[int, ...]) -> list:
    """The target over every plan's tokens in one batched forward, tapping layers `taps`. Each row's cache is put
    back to its length before the call if the call fails, so a retry starts from the same state."""
    lengths = [p.row.cache.length for p in plans]
    if any(p.positions is not None for p in plans):
        positions = [p.positions if p.positions is not None else
                     torch.arange(p.row.tokens.numel() - 1, p.row.tokens.numel() - 1 + p.ids.numel(),
                                  device=p.ids.device) for p in plans]
    else:
        positions = None
    try:
        return target.forward_rows([p.ids for p in plans], [p.row.cache for p in plans], positions=positions,
                                   tree_masks=[p.tree_mask for p in plans], tap=taps)
    except Exception:
        for p, n in zip(plans, lengths):
            if p.row.cache is not None and p.row.cache.length > n:
                p.row.cache.crop(n)
        raise


def verify(plan: Plan, out, n: int, tapped: bool) -> tuple[torch.Tensor, int]:
    """The plan's acceptance (greedy or rejection sampling, verify.py) -> (committed tokens [a + 1], the depth it
    drafted). The cache keeps only the accepted path, in path order at positions n-1 .. n-1+a (for a chain: a crop);
    the proposer gets the path's features (and logits, when it observes them)."""
    row, tree = plan.row, plan.tree
    rows = out.logits[0]  # [W, V]
    if row.sampling.greedy:
        path, committed = greedy_verify(tree, rows)
    else:
        path, committed = rejection_verify(tree, lambda i: logits_to_probs(rows[i], row.sampling), row.generator)
    keep = torch.tensor(path, dtype=torch.long, device=tree.tokens.device)
    row.cache.compact(n - 1, keep)
    feats = None
    if tapped:  # a path that is a prefix of the nodes (every chain's) is a slice: no copy
        feats = out.features[:, :len(path)] if path[-1] == len(path) - 1 else out.features[:, keep]
    row.proposer.accept(tree, path, feats)
    if row.proposer.observes_logits:
        row.proposer.observe(rows[keep])
    row.stats.tree_nodes.append(tree.num_nodes - 1)
    return torch.tensor(committed, dtype=torch.long, device=tree.tokens.device), tree.max_depth
