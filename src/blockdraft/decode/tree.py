"""Candidate trees: many continuations of the committed text, verified by the target in one forward.

A DFlash forward yields a distribution at every block position; the chain keeps only the top-1 token per position
and throws the near-misses away. A tree keeps the most promising alternatives (DDTree-style best-first expansion
under a node budget; score = product of the draft's probabilities along the path) and adds prompt-lookup
continuations as extra branches, merged with the draft's nodes where their prefixes coincide.

Layout (`Tree`): node 0 is the root, the last committed token t (not yet in the target's cache); every other node is
one candidate token. Nodes are numbered so that a parent precedes its children and siblings are in the order the
verifier tries them (breadth-first from the root). With n committed tokens, node i sits at position
n - 1 + depth[i] and attends to the committed context and to its ancestors (itself included) only, which is what
`ancestor_mask` returns.

Sampling trees (temperature > 0) are built in two stages so that rejection sampling over siblings stays lossless:
the *shape* (how many children each node gets, which are lookup tokens) is decided from the draft's distributions
and the lookup continuations only; then the sampled children of each node are drawn without replacement from the
draft distribution q of their depth, the lookup (point-mass) siblings excluded. A child's draw distribution is thus
"q with the tokens of its earlier siblings removed, renormalised", which is what `verify.rejection_verify`
assumes. Choosing which sampled candidates to keep after seeing them would bias the output; the shape never looks at
them.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch


@dataclass
class Tree:
    tokens: torch.Tensor  # [N] int64; tokens[0] is the root (the last committed token)
    parents: torch.Tensor  # [N] int64; -1 for the root, else the index of an earlier node
    depth: torch.Tensor  # [N] int64; 0 for the root, depth[parent] + 1 otherwise
    point_mass: torch.Tensor  # [N] bool; proposed deterministically (prompt lookup) instead of drawn from q
    score: torch.Tensor  # [N] float; estimated probability that the node ends up on the accepted path (root: 1)
    q: torch.Tensor | None = None  # [D, V] float: sampled children at depth d were drawn from row d-1; None: greedy
    expected: float | None = None  # build_tree: 1 + the kept nodes' scores in best-first order (expected tokens)
    # set by `chain`: parents i - 1 and depths i by construction, so the per-step checks need no tensor ops
    # (a plain step's tree is a root alone, and a few tensor ops are a few per cent of a small target's step)
    built_as_chain: bool = field(default=False, repr=False, compare=False)

    @classmethod
    def chain(cls, root: torch.Tensor | int, drafts: torch.Tensor | None = None,
              q: torch.Tensor | None = None) -> "Tree":
        """A chain as a tree: the root (the last committed token), then drafts [G] int64 (None: none, the root
        alone: a step that drafts nothing), each the child of the one before; q [G, V]: the distribution each draft
        was sampled from (None: proposed deterministically, a point mass as prompt lookup's, or greedily)."""
        dev = drafts.device if drafts is not None else getattr(root, "device", None)
        root = torch.as_tensor(root, dtype=torch.long, device=dev).view(1)
        # a copy either way: root may be a view of the row's committed tokens
        tokens = root.clone() if drafts is None else torch.cat([root, drafts.long()])
        n = tokens.numel()
        idx = torch.arange(n, device=dev)
        return cls(tokens, idx - 1, idx, torch.full((n,), q is None, dtype=torch.bool, device=dev),
                   torch.ones(n, device=dev), q=q, built_as_chain=True)

    @property
    def candidates(self) -> torch.Tensor:
        """[N - 1] the candidate tokens below the root (a chain's drafts, in order)."""
        return self.tokens[1:]

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.numel())

    @property
    def max_depth(self) -> int:
        return self.num_nodes - 1 if self.built_as_chain else int(self.depth.max())

    @property
    def is_chain(self) -> bool:
        """Every node's parent is the node before it: the tree is one causal chain (no branching)."""
        n = self.num_nodes
        return self.built_as_chain or bool(torch.equal(self.parents.cpu(), torch.arange(-1, n - 1)))

    def children(self) -> list[list[int]]:
        """children()[i] = the children of node i, in index order (the order the verifier tries them)."""
        if self.built_as_chain:
            return [[i + 1] for i in range(self.num_nodes - 1)] + [[]]
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            kids[p].append(i)
        return kids

    def path_tokens(self, node: int) -> list[int]:
        """Tokens from the root's first child down to `node` (the root excluded)."""
        parents, tokens = self.parents.tolist(), self.tokens.tolist()
        out = []
        while node > 0:
            out.append(tokens[node])
            node = parents[node]
        return out[::-1]


class MalformedTree(ValueError):
    """A tree that the verifier cannot use (bad shapes, a parent after its child, duplicate siblings, ...)."""


def check_tree(tree: Tree, vocab_size: int) -> None:
    """Raise MalformedTree with the reason if `tree` breaks the layout described in the module docstring."""
    t = tree.tokens
    if t.dim() != 1 or t.numel() < 1:
        raise MalformedTree(f"tokens must be a non-empty 1-D tensor, got shape {tuple(t.shape)}")
    n = t.numel()
    for name in ("parents", "depth", "point_mass", "score"):
        x = getattr(tree, name)
        if x.shape != (n,):
            raise MalformedTree(f"{name} must have shape [{n}] like tokens, got {tuple(x.shape)}")
    if t.dtype != torch.long or tree.parents.dtype != torch.long or tree.depth.dtype != torch.long:
        raise MalformedTree("tokens, parents and depth must be int64")
    if int(t.min()) < 0 or int(t.max()) >= vocab_size:
        raise MalformedTree(f"tree has token ids outside the vocabulary (0..{vocab_size - 1})")
    if tree.built_as_chain and tree.q is None:
        return  # parents, depths and siblings are right by construction (`Tree.chain`)
    parents, depth, tokens = tree.parents.tolist(), tree.depth.tolist(), t.tolist()
    if parents[0] != -1 or depth[0] != 0:
        raise MalformedTree("node 0 must be the root: parent -1, depth 0")
    seen: set[tuple[int, int]] = set()
    for i in range(1, n):
        p = parents[i]
        if not 0 <= p < i:
            raise MalformedTree(f"node {i} has parent {p}: a parent must be an earlier node (0..{i - 1})")
        if depth[i] != depth[p] + 1:
            raise MalformedTree(f"node {i} has depth {depth[i]} but its parent {p} has depth {depth[p]}")
        if (p, tokens[i]) in seen:
            raise MalformedTree(f"node {p} has two children with token {tokens[i]}: siblings must differ")
        seen.add((p, tokens[i]))
    if tree.q is not None:
        pm = tree.point_mass.tolist()
        deepest = max([0] + [d for d, m in zip(depth[1:], pm[1:]) if not m])  # the deepest sampled node
        if tree.q.dim() != 2 or tree.q.shape[0] < deepest or tree.q.shape[1] != vocab_size:
            raise MalformedTree(f"q must be [D >= {deepest}, {vocab_size}], got {tuple(tree.q.shape)}")
        kids = tree.children()
        for p in range(n):
            flags = [pm[c] for c in kids[p]]
            if flags != sorted(flags, reverse=True):
                raise MalformedTree(f"node {p}: point-mass children must precede the sampled ones")


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [N] int64 (topologically ordered) -> [N, N] bool, True where column j is row i or an ancestor of it:
    the part of the tree attention mask among the tree's own nodes."""
    par = parents.tolist()
    n = len(par)
    rows = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        if par[i] >= 0:
            rows[i] = rows[par[i]]
        rows[i, i] = True
    return rows.to(parents.device)


@dataclass
class _Node:
    parent: int  # index in pop order
    depth: int
    token: int | None  # None: a sampled slot whose token is drawn after the shape is fixed
    point_mass: bool
    score: float
    lookup: frozenset  # lookup branches (indices into the continuations) that this node follows


def build_tree(root: int, q: torch.Tensor | None, *, budget: int, top_k: int, lookups: Sequence[Sequence[int]] = (),
               lookup_conf: Sequence[float | Sequence[float]] = (), max_depth: int | None = None, sample: bool = False,
               choose: Callable[[list[float]], int] | None = None, costs: Sequence[float] | None = None,
               generator: torch.Generator | None = None, draft_scale: Sequence[float] | None = None,
               top: tuple[torch.Tensor, torch.Tensor] | None = None) -> Tree:
    """Build a candidate tree by best-first expansion.

    root: the last committed token. q: [D, V] the draft's distribution at depths 1..D (None: no draft, lookup only).
    budget: at most this many candidate nodes (the root excluded); top_k: at most this many draft children per node.
    lookups: prompt-lookup continuations (token lists starting at depth 1); lookup_conf[r]: the estimated probability
    that a token of continuation r is accepted given that its parent was, one number or one per depth (branch r's
    nodes score their parent's score times that, or times the draft's probability of the token when it is higher: a
    lookup token the draft also proposes is one node). max_depth: no node deeper than this.
    sample: False -> every draft child is one of the top-k tokens of q (greedy verification); True -> draft children
    are slots filled by drawing without replacement from q (lookup siblings excluded) after the shape is fixed.
    choose(scores) -> how many of the best nodes to keep; scores are in non-increasing order (default: all).
    costs[b] (b = 0..budget): the time of a step that verifies b nodes; instead of `choose`, keep the b that maximises
    expected tokens per unit of time, (1 + s_1 + ... + s_b) / costs[b] (the first such b), and stop expanding as
    soon as no further node can change that b (every later score is at most the best waiting one), which on a
    63-node budget usually ends the expansion after a few nodes. The tree is the one `choose` would give with
    that rule on the fully expanded list.
    draft_scale[d - 1]: a factor on the draft's probabilities at depth d when they are used as scores (min(1, p * f)),
    e.g. the measured acceptance over the predicted one; it changes which nodes are kept, never q itself.
    top: q's largest entries per depth, (probs [D, k'], ids [D, k']) in descending order with k' >= top_k +
    len(lookups) or every token q gives mass, when the caller has them cheaper than a topk over q's vocabulary.
    The children of a node are different tokens, so their scores (conditional on the node) are capped to sum to at
    most 1, the most likely first.
    Returns the tree in breadth-first order (see the module docstring).
    """
    if budget < 0 or top_k < 0:
        raise ValueError(f"budget and top_k must be >= 0, got {budget}, {top_k}")
    if len(lookup_conf) < len(lookups):
        raise ValueError("one lookup confidence per lookup continuation is needed")
    if costs is not None and (choose is not None or len(costs) < budget + 1):
        raise ValueError("costs replace choose and need one entry per node count 0..budget")
    d_draft = 0 if q is None else q.shape[0]
    deepest = max([d_draft] + [len(c) for c in lookups])
    if max_depth is not None:
        deepest = min(deepest, max_depth)
    # the top-k+len(lookups) tokens of each depth: enough to skip the lookup tokens and still have k left
    k_need = min(top_k + len(lookups), 0 if q is None else q.shape[1])
    best_p: list[list[float]] = []  # [depth - 1][rank]: the draft's most probable tokens and their probabilities
    best_t: list[list[int]] = []
    support: list[int] = []  # tokens with q > 0 per depth: a sampled slot can only be filled while some are left
    if q is not None and k_need > 0:
        if top is not None:
            vals, idx = top[0][:deepest, :k_need].float(), top[1][:deepest, :k_need]
        else:
            vals, idx = q[:deepest].float().topk(k_need, dim=-1)
        best_p, best_t = vals.tolist(), idx.tolist()
        if sample:
            support = (q[:deepest] > 0).sum(-1).tolist()

    # the continuations as ints and the draft's probability of each lookup token at each depth, read in one gather
    # per depth: indexing q one element at a time inside the expansion took most of a tree's build time
    lookups = [c.tolist() if isinstance(c, torch.Tensor) else [int(t) for t in c] for c in lookups]
    lk_q: list[dict[int, float]] = []
    for d in range(1, min(d_draft, deepest) + 1):
        toks = sorted({c[d - 1] for c in lookups if d <= len(c)})
        lk_q.append(dict(zip(toks, q[d - 1, toks].float().tolist())) if toks else {})

    # per depth, the draft's candidate children in rank order with their scores (the same for every node at that
    # depth; a node only skips its own lookup tokens), and each branch's token and confidence
    draft_kids: list[list[tuple[float, int]]] = []
    for d in range(1, len(best_p) + 1):
        f = 1.0 if draft_scale is None or d > len(draft_scale) else float(draft_scale[d - 1])
        draft_kids.append([(min(1.0, p * f), t) for p, t in zip(best_p[d - 1], best_t[d - 1]) if p > 0])
    branch_conf = [[float(c)] * len(lookups[r]) if isinstance(c, (int, float)) else [float(x) for x in c]
                   for r, c in enumerate(lookup_conf[: len(lookups)])]

    nodes = [_Node(-1, 0, root, False, 1.0, frozenset(range(len(lookups))))]
    heap: list[tuple] = []  # (-score, push order, parent, depth, token, point mass, branches): a node once popped
    counter = 0

    def push_children(i: int) -> None:
        nonlocal counter
        node = nodes[i]
        d = node.depth + 1
        if d > deepest:
            return
        lk: dict[int, tuple[float, frozenset]] = {}  # lookup token -> (confidence, branches)
        for r in sorted(node.lookup):
            if d <= len(lookups[r]):
                tok = lookups[r][d - 1]
                conf, br = lk.get(tok, (0.0, frozenset()))
                lk[tok] = (max(conf, branch_conf[r][d - 1]), br | {r})
        qd = lk_q[d - 1] if (q is not None and d <= d_draft) else None  # lookup token -> the draft's probability
        f = 1.0 if draft_scale is None or d > len(draft_scale) else float(draft_scale[d - 1])
        kids: list[tuple[float, int | None, bool, frozenset]] = []  # (P(child | node), token, point mass, branches)
        for tok, (conf, br) in lk.items():
            if qd is not None:
                conf = max(conf, min(1.0, qd[tok] * f))
            kids.append((conf, tok, True, br))
        if qd is not None and top_k > 0 and best_p:
            if sample:
                # slot r stands for the r-th draw without replacement from q minus the lookup tokens; its score
                # uses the r-th largest remaining probability (a shape heuristic: it never looks at what is drawn)
                rest = [p for p, t in zip(best_p[d - 1], best_t[d - 1]) if t not in lk]
                n_slots = min(top_k, support[d - 1] - sum(1 for t in lk if qd[t] > 0))
                kids += [(min(1.0, rest[r] * f), None, False, frozenset()) for r in range(min(n_slots, len(rest)))]
            else:
                kept = 0
                for score, t in draft_kids[d - 1]:  # a token the draft rules out (p = 0) is not worth a node
                    if kept == top_k:
                        break
                    if t in lk:  # merged with the lookup child above
                        continue
                    kept += 1
                    kids.append((score, t, False, frozenset()))
        # siblings are different tokens, so at most one of them is accepted: their conditional probabilities are
        # capped so that they sum to at most 1, the most likely first (two lookup branches that diverge here, each
        # with a high running rate, would otherwise promise more than one token at this depth)
        left = 1.0
        for conf, tok, pm, br in sorted(kids, key=lambda k: -k[0]):
            conf = min(conf, left)
            left -= conf
            heapq.heappush(heap, (-node.score * conf, counter, i, d, tok, pm, br))
            counter += 1

    push_children(0)
    expected, best_b, best_rate = 1.0, 0, (1.0 / costs[0] if costs is not None else 0.0)
    while heap and len(nodes) <= budget:
        if costs is not None and _settled(expected, len(nodes) - 1, -heap[0][0], best_rate, costs, budget):
            break
        neg, _, parent, d, tok, pm, br = heapq.heappop(heap)
        nodes.append(_Node(parent, d, tok, pm, -neg, br))
        push_children(len(nodes) - 1)
        if costs is not None:
            expected += -neg
            rate = expected / costs[len(nodes) - 1]
            if rate > best_rate:
                best_b, best_rate = len(nodes) - 1, rate
    # pop order has non-increasing scores and parents first, so any prefix is a valid tree
    if costs is not None:
        keep = best_b
    else:
        keep = len(nodes) - 1 if choose is None else max(0, min(len(nodes) - 1, choose([n.score for n in nodes[1:]])))
    nodes = nodes[: keep + 1]
    tree = _finish(nodes, q, sample, generator)
    tree.expected = 1.0
    for n in nodes[1:]:  # summed as the choice above sums them
        tree.expected += n.score
    return tree


def _settled(expected: float, b: int, bound: float, best_rate: float, costs: Sequence[float], budget: int) -> bool:
    """Whether no tree of more than b nodes can beat best_rate when every further node scores at most `bound`:
    b + k nodes commit at most expected + k * bound tokens in costs[b + k]. The margin covers the rounding of the
    running sums, so an early stop never changes the kept count."""
    for k in range(1, budget - b + 1):
        if expected + k * bound >= best_rate * costs[b + k] * (1.0 - 1e-9):
            return False
    return True


def _finish(nodes: list[_Node], q: torch.Tensor | None, sample: bool, generator) -> Tree:
    """Renumber breadth-first (point-mass siblings first, then the rest in pop order), draw the sampled slots."""
    kids: list[list[int]] = [[] for _ in nodes]
    for i, node in enumerate(nodes[1:], start=1):
        kids[node.parent].append(i)
    order, new_parent = [0], [-1]
    head = 0
    while head < len(order):
        old = order[head]
        for c in sorted(kids[old], key=lambda c: not nodes[c].point_mass):  # stable: pop order otherwise
            order.append(c)
            new_parent.append(head)
        head += 1
    tokens = [nodes[i].token for i in order]
    if sample:
        _draw_slots(tokens, [nodes[i] for i in order], new_parent, q, generator)
    dev = q.device if q is not None else "cpu"
    return Tree(
        tokens=torch.tensor(tokens, dtype=torch.long, device=dev),
        parents=torch.tensor(new_parent, dtype=torch.long, device=dev),
        depth=torch.tensor([nodes[i].depth for i in order], dtype=torch.long, device=dev),
        point_mass=torch.tensor([nodes[i].point_mass for i in order], dtype=torch.bool, device=dev),
        score=torch.tensor([nodes[i].score for i in order], dtype=torch.float32, device=dev),
        q=q if sample else None,
    )


def _draw_slots(tokens: list, nodes: list[_Node], parents: list[int], q: torch.Tensor, generator) -> None:
    """Fill the sampled slots in place: the slots under one parent are one ordered draw without replacement from
    q[depth - 1] with the parent's point-mass children *in the final tree* removed (torch.multinomial without
    replacement returns the draws in order: the first from q, the next from q without the first, ...)."""
    groups: dict[int, list[int]] = {}
    fixed: dict[int, list[int]] = {}
    for i in range(1, len(nodes)):
        if tokens[i] is None:
            groups.setdefault(parents[i], []).append(i)
        else:
            fixed.setdefault(parents[i], []).append(tokens[i])
    for parent, slots in groups.items():
        w = q[nodes[slots[0]].depth - 1].float().clone()
        if parent in fixed:
            w[fixed[parent]] = 0.0
        # drawn among the tokens q gives mass to (a draft's vocabulary: ~8k of a target's ~150k): the same
        # distribution, and a draw without replacement costs by the entries it is given (over the whole vocabulary
        # these draws were most of a sampled tree's 13 ms draft step on the 1.5B target)
        support = w.nonzero().squeeze(1)
        drawn = support[torch.multinomial(w[support], len(slots), replacement=False, generator=generator)].tolist()
        for i, t in zip(slots, drawn):
            tokens[i] = t
