"""Verification of a step's candidates against the target: pure functions, no model state.

Every proposer's candidates are a tree (tree.py; a chain is the tree whose parents are i - 1). The target has seen
every node in one forward (a chain causally, a tree with tree attention), so row i of its logits/probs is the
target's distribution of the token that follows node i's path. Vocabulary, shared with the engine and the benchmark:
- **accepted path**: root = node 0, then at each accepted node the child that passes (greedy: the child whose token is
  the target's argmax; sampling: the first child that passes recursive rejection sampling among its siblings);
- **recovered**: when every child of the last accepted node is rejected, the token drawn from what is left of the
  target's distribution after the rejections (greedy: the argmax, which no child had);
- **bonus**: when the last accepted node is a leaf, one token drawn from (greedy: the argmax of) its row;
- a step commits a + 1 tokens: the a accepted nodes below the root and one recovered/bonus token.

On a chain this is speculative sampling (Leviathan et al. 2023; Chen et al. 2023): draft d_i, drawn from q_i, passes
when u * q_i(d_i) < p_i(d_i), a rejected position draws from norm(max(0, p_i - q_i)), and a point-mass draft (prompt
lookup's, or a greedy draft's) is the case q_i = 1 at d_i. Greedy, the committed tokens are the target's argmax along
the path: the target's own greedy text.

On a tree, sampling is multi-candidate speculative sampling by recursive rejection (SpecInfer, Miao et al. 2024;
without replacement as in Jeon et al. 2024): at an accepted node with target distribution p, the children are tried
in index order. Child c with token x, proposed from r (a point mass at x for a lookup token; for a sampled child,
the draft's q at its depth with the tokens of its earlier siblings removed and renormalised, which is how tree.py
draws it), is accepted with probability min(1, p(x) / r(x)); after a rejection p becomes norm(max(0, p - r)) for the
next sibling. Each stage is one speculative-sampling step, which returns a draw from the p it started with whatever
proposal r it used, so the accepted-or-recovered token is distributed exactly as the target's p, node after node.
"""

from __future__ import annotations

from typing import Callable

import torch

from .sampling import argmax, draw
from .tree import Tree


def _check(tree: Tree, rows) -> None:
    if callable(rows):
        return
    n = tree.num_nodes
    assert rows.dim() == 2 and rows.shape[0] == n, (
        f"target logits/probs must be [N, V] with N = {n} tree nodes, got {tuple(rows.shape)}")


def greedy_verify(tree: Tree, target_logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """tree with N nodes; target_logits [N, V] (row i after node i's path).
    Returns (path, committed): path = accepted node indices from the root (len a + 1), committed = the a accepted
    tokens followed by the bonus/recovered token (len a + 1); on a chain, path = [0, 1, .., a]."""
    _check(tree, target_logits)
    tokens = tree.tokens.tolist()
    kids = tree.children()
    path = [0]
    while True:
        # argmax of the visited rows only: with 64 nodes and a 49k vocabulary, all rows would cost milliseconds
        want = int(argmax(target_logits[path[-1]]))
        nxt = next((c for c in kids[path[-1]] if tokens[c] == want), None)
        if nxt is None:
            return path, [tokens[i] for i in path[1:]] + [want]
        path.append(nxt)


def rejection_verify(tree: Tree, target_probs: torch.Tensor | Callable[[int], torch.Tensor],
                     generator: torch.Generator | None) -> tuple[list[int], list[int]]:
    """tree with N nodes (tree.q set for sampled children); target_probs [N, V] processed target distributions, or a
    function node -> [V] that processes a row on demand (only the visited nodes' rows are needed, and top-p sorts a
    whole vocabulary per row). Returns (path, committed) as greedy_verify does; committed is distributed exactly
    as the target's."""
    _check(tree, target_probs)
    tokens, depth, pm = tree.tokens.tolist(), tree.depth.tolist(), tree.point_mass.tolist()
    kids = tree.children()
    path = [0]
    while True:
        node = path[-1]
        p = (target_probs(node) if callable(target_probs) else target_probs[node]).float()
        accepted = None
        tried: list[int] = []
        for c in kids[node]:
            x = tokens[c]
            if pm[c]:
                r = None  # a point mass at x
                r_x = 1.0
            else:
                assert tree.q is not None, "a sampled node needs the draft distributions tree.q"
                r = tree.q[depth[c] - 1].float().clone()
                if tried:
                    r[tried] = 0.0
                r = r / r.sum().clamp_min(1e-30)
                r_x = float(r[x])
            u = float(torch.rand((), generator=generator, device=p.device))
            if u * r_x < float(p[x]):  # u < p/r without dividing by a possibly tiny r
                accepted = c
                break
            residual = p.clone() if r is None else (p - r).clamp_min(0.0)
            if r is None:
                residual[x] = 0.0
            mass = residual.sum()
            # mass == 0 only when p == r, where a rejection has probability 0; keep p as a safe fallback
            p = residual / mass if float(mass) > 0 else p
            tried.append(x)
        if accepted is None:
            last = int(draw(p.unsqueeze(0), generator)[0])
            return path, [tokens[i] for i in path[1:]] + [last]
        path.append(accepted)
