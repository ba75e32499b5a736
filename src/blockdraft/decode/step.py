"""The parts of one engine step that act on one row's plan: propose, run the target over every plan, verify.

A plan is what one row feeds the target this step: its last committed token and its candidates (a chain, or a
candidate tree with positions and an ancestor mask). The engine (engine.py) decides which rows take part and fails
a row alone when its part raises.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..models.target import TargetModel
from .proposers import Proposal
from .row import Sequence
from .sampling import logits_to_probs
from .tree import Tree, ancestor_mask, check_tree
from .verify import greedy_verify, rejection_verify
from .verify_tree import greedy_verify_tree, rejection_verify_tree


@dataclass
class Plan:
    """One row's part of a step: what it feeds the target and how to verify it."""

    row: Sequence
    ids: torch.Tensor  # [W] the last committed token, then the candidates
    positions: torch.Tensor | None  # [W], None = consecutive after the cache
    tree_mask: torch.Tensor | None  # [W, W] for a tree that is not a chain
    proposal: Proposal | None = None  # a chain
    tree: Tree | None = None


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


def propose_tree(row: Sequence, g: int, vocab_size: int) -> Plan:
    """One row's candidate tree of depth <= g, checked."""
    t1 = time.perf_counter()
    tree = row.proposer.propose_tree(row.tokens, g, row.sampling, row.generator)
    row.stats.draft_seconds += time.perf_counter() - t1
    if tree.max_depth > g:
        raise ValueError(f"malformed tree: depth {tree.max_depth} > the {g} positions left")
    check_tree(tree, vocab_size)
    if int(tree.tokens[0]) != int(row.tokens[-1]):
        raise ValueError("malformed tree: its root must be the last committed token")
    n = row.tokens.numel()
    # a chain (e.g. a lookup-only step) takes the plain causal path: its ancestor mask is the causal
    # mask, so nothing needs building (and calibrate.py prices it as a chain)
    pos = None if tree.is_chain else tree.depth + (n - 1)
    mask = None if tree.is_chain else ancestor_mask(tree.parents)
    return Plan(row, tree.tokens, pos, mask, tree=tree)


def propose_chains(cls: type, rows: list[Sequence], widths: list[int]) -> tuple[list[Plan], float]:
    """Chains for rows whose proposers are all of class cls, in one batched call (`Proposer.propose_rows`),
    row i drafting at most widths[i] tokens -> (their plans, the draft call's seconds: what the policies price a
    drafted step by, without the catch-up of `Proposer.prepare_rows`)."""
    t0 = time.perf_counter()
    cls.prepare_rows([r.proposer for r in rows], [r.tokens for r in rows], widths)
    t1 = time.perf_counter()
    props = cls.propose_rows([r.proposer for r in rows], [r.tokens for r in rows], widths,
                             [r.sampling for r in rows], [r.generator for r in rows])
    dt = time.perf_counter() - t1
    plans, timed = [], {}
    for row, prop in zip(rows, props):
        row.stats.draft_seconds += dt + (t1 - t0)  # the stats count all of the draft's time
        if prop.tokens.numel():  # one sample per running mean: the rows of an engine share theirs
            timed[id(row.width.draft_seconds)] = row.width
        plans.append(Plan(row, torch.cat([row.tokens[-1:], prop.tokens]), None, None, proposal=prop))
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


def verify_chain(plan: Plan, out, n: int, tapped: bool) -> tuple[torch.Tensor, int]:
    """A chain's acceptance (greedy or rejection sampling) -> (committed tokens [a + 1], tokens drafted); the cache
    is cropped to n + a and the proposer gets the verified positions' features."""
    row, prop = plan.row, plan.proposal
    if row.sampling.greedy:
        committed, acc = greedy_verify(prop.tokens.unsqueeze(0), out.logits)
    else:
        p = logits_to_probs(out.logits, row.sampling)
        q = prop.probs.unsqueeze(0) if prop.probs is not None else None
        committed, acc = rejection_verify(prop.tokens.unsqueeze(0), q, p, row.generator)
    a = int(acc[0])
    row.cache.crop(n + a)
    if tapped:
        row.proposer.accept(out.features[:, : a + 1], a + 1)
    if row.proposer.observes_logits:
        row.proposer.observe(out.logits[0, : a + 1])
    return committed[0, : a + 1], prop.tokens.numel()


def verify_tree(plan: Plan, out, n: int, tapped: bool) -> tuple[torch.Tensor, int]:
    """Acceptance over the tree's nodes, then the cache keeps only the accepted path (in path order, at positions
    n-1 .. n-1+a) and the proposer gets the path's features -> (committed tokens, the tree's depth)."""
    row, tree = plan.row, plan.tree
    if row.sampling.greedy:
        path, committed = greedy_verify_tree(tree, out.logits[0])
    else:
        rows = out.logits[0]
        path, committed = rejection_verify_tree(tree, lambda i: logits_to_probs(rows[i], row.sampling),
                                                row.generator)
    keep = torch.tensor(path, dtype=torch.long, device=tree.tokens.device)
    row.cache.compact(n - 1, keep)
    row.proposer.accept_tree(tree, path, out.features[:, keep] if tapped else None)
    row.stats.tree_nodes.append(tree.num_nodes - 1)
    return torch.tensor(committed, dtype=torch.long, device=tree.tokens.device), tree.max_depth
