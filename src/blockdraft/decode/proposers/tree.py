"""Tree proposer: one DFlash forward and/or prompt lookup -> a candidate tree that the target verifies in one forward.

Methods: `dflash-tree` (the draft's best branches) and `dflash+lookup` (the same tree plus prompt-lookup
continuations as extra branches, merged where the draft proposes the same tokens). It sizes its own tree
(`adapts_width` False): the engine gives it the depth left and the budget below decides the nodes.

Node budget: fixed (`budget`), or chosen every step from a measured verify-cost curve (`calibrate.VerifyCost`): with
the candidate nodes in best-first order (scores s_1 >= s_2 >= ...; a node's score estimates the probability that it
is accepted, so the expected tokens committed by a tree of b nodes is 1 + s_1 + ... + s_b), keep the b that maximises
expected tokens per second, (1 + s_1 + ... + s_b) / (draft time + verify_cost(b + 1)).

Scores: the product of the draft's probabilities along the path; a lookup token's factor is the running acceptance
rate, in this generation, of lookup tokens given that their parent was accepted (prior 1/2), kept apart by the length
of the n-gram that matched (on the default target a 1-gram match's first token is right ~0.3 of the time, a 3-gram
match's ~0.7) and for a branch's first token and the tokens after it (a copy that starts right tends to go on), or
the draft's probability of the token when higher.

The draft's probabilities are scaled per depth by how they have fared in this generation (greedy only): the
accepted draft nodes over their summed probabilities, among nodes whose parent was accepted (`draft_scale`, prior 1).
The scale only ranks and counts nodes; it never touches the distributions that sampling verifies against.

Skipping the draft (`dflash+lookup` with a chosen budget): when a lookup continuation exists, the lookup-only tree's
best rate is compared with the rate expected if the draft also runs, (1 + E_lookup + G) / (draft time +
verify_cost(1 + lookup nodes + draft nodes)), where G and the number of draft nodes are running means over the
earlier steps of this generation that had both. G is measured, not predicted: the tokens a step committed beyond the
deepest accepted lookup branch (what the draft's nodes added); until such a step has been seen, the summed scores of
the draft's nodes stand in. The draft's probabilities are over-confident where a copy is long (they add ~0.1 tokens
per step on code, while their scores promise more), which a predicted G would not notice. When the draft cannot pay
for itself (a long, reliable copy), the step verifies the lookup branches alone; the draft's context is still
extended with every accepted token, so the next step can use it again, and after EXPLORE_ROW skips in a row one
step runs the draft anyway, so that G keeps being measured as the text changes. A step without the draft verifies
the first lookup branch alone (prompt lookup's own proposal) as a causal chain, priced by the calibration's chain
curve: a second branch's running rate overstates it where the context has been followed by two different
continuations (measured on code, same text: tau 7.9 with the chain against 5.8 with both branches).

Both choices read measured times, so with a chosen budget a seeded sampling run is reproducible only as far as the
timings repeat (the output distribution is exact either way); a fixed `budget` makes seeded runs repeat exactly.
"""

from __future__ import annotations

import copy
import time
from typing import Callable

import torch

from ...config import SamplingParams
from ..tree import Tree, build_tree
from ..policy import EXPLORE_ROW, CallTime, Explorer, RunningMean, TreeStepCosts, lookup_draft_pays
from . import Proposer
from .dflash import DFlashProposer
from ...models.ngram import find_continuations

MAX_BUDGET = 63  # nodes below the root: verify widths up to 64, the calibrated range
PRIOR_HITS, PRIOR_TRIALS = 1.0, 2.0  # lookup acceptance prior: rate 1/2, worth two observations
SCALE_PRIOR = 2.0  # the draft-confidence factor starts at 1, worth this many predicted acceptances


class TreeProposer(Proposer):
    adapts_width = False  # the node budget below sizes each tree

    def __init__(self, draft: DFlashProposer | None, *, lookup: bool = False, budget: int | None = None,
                 top_k: int = 8, verify_cost: Callable[[int], float] | None = None, max_budget: int = MAX_BUDGET,
                 lookup_depth: int = 15, lookup_branches: int = 2, max_ngram: int = 3, min_ngram: int = 1) -> None:
        """draft: the DFlash proposer whose distributions grow the tree (its block size sets the draft's depth);
        None with lookup=True: lookup branches only. budget: a fixed number of nodes below the root; None: chosen
        per step from verify_cost(width) -> seconds (required then). top_k: draft children per node."""
        if draft is None and not lookup:
            raise ValueError("a tree needs a draft, prompt lookup, or both")
        if budget is None and verify_cost is None:
            raise ValueError("give a fixed node budget or a verify-cost calibration to choose it")
        if budget is not None and not 0 <= budget <= 1023:
            raise ValueError(f"tree budget must be in 0..1023 nodes, got {budget}")
        if top_k < 1 or lookup_depth < 1 or lookup_branches < 1 or max_budget < 0:
            raise ValueError("top_k, lookup_depth and lookup_branches must be >= 1 and max_budget >= 0")
        self.draft, self.lookup = draft, lookup
        self.name = "dflash+lookup" if lookup and draft is not None else ("dflash-tree" if draft else "lookup-tree")
        self.layer_ids = draft.layer_ids if draft is not None else ()
        self.budget, self.top_k, self.verify_cost, self.max_budget = budget, top_k, verify_cost, max_budget
        self.draft_depth = draft.block_size - 1 if draft is not None else 0
        self.lookup_depth = lookup_depth if lookup else 0
        self.lookup_branches, self.max_ngram, self.min_ngram = lookup_branches, max_ngram, min_ngram
        self.block_size = max(self.draft_depth, self.lookup_depth) + 1  # the engine's depth limit is block_size - 1
        self.max_nodes = 1 + (budget if budget is not None else max_budget)
        self._draft_s = CallTime()  # the draft forward's price, for the budget choice
        self._cost_base: dict[tuple[bool, int], list[float]] = {}  # verify times per node count (`_costs`)
        self._lookups: list[list[int]] = []
        self._ngrams: list[int] = []  # the matched n-gram length of each lookup branch
        self._reset_rates()
        self.draft_skips = 0  # steps of the last generation that verified lookup branches without the draft

    def fork(self) -> "TreeProposer":
        """Another sequence's tree proposer: the same settings and draft weights, its own rates and draft state."""
        other = copy.copy(self)
        other.draft = self.draft.fork() if self.draft is not None else None
        other._draft_s, other._lookups, other._ngrams = CallTime(), [], []
        other._reset_rates()
        return other

    def _reset_rates(self) -> None:
        # [matched n-gram length][0: a branch's first token, 1: the tokens after it]
        self._hits = [[0.0, 0.0] for _ in range(self.max_ngram + 1)]
        self._trials = [[0.0, 0.0] for _ in range(self.max_ngram + 1)]
        # steps with both lookup branches and draft nodes: the draft's predicted G and its node count, and the
        # measured G (tokens committed beyond the lookup branches)
        self._predicted, self._draft_nodes, self.measured_gain = RunningMean(), RunningMean(), RunningMean()
        self._both = False  # this step's tree holds lookup branches and draft nodes
        # per draft depth: accepted draft nodes, and the draft's summed probability of them, over the nodes whose
        # parent was accepted (greedy runs only); their ratio scales the draft's probabilities as node scores
        self._d_hits = [0.0] * max(1, self.draft_depth)
        self._d_pred = [0.0] * max(1, self.draft_depth)
        self._q: torch.Tensor | None = None
        self._greedy = True
        self._explorer = Explorer(EXPLORE_ROW)  # draft skips in a row
        self.draft_skips = 0

    # ---------------------------------------------------------------------------------------------- life cycle
    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        if self.draft is not None:
            self.draft.start(prompt_ids, features)
        # acceptance rates are learnt per generation, so that a seeded sampling run is reproducible
        self._reset_rates()

    def lookup_rate(self, ngram: int, first: bool) -> float:
        """Estimated P(a lookup token is accepted | its parent was) for a branch found by an n-gram match of this
        length, for the branch's first token or for a later one."""
        c = 0 if first else 1
        return (self._hits[ngram][c] + PRIOR_HITS) / (self._trials[ngram][c] + PRIOR_TRIALS)

    def _lookup_conf(self, ngram: int, length: int) -> list[float]:
        return [self.lookup_rate(ngram, d == 0) for d in range(length)]

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, max_depth: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Tree:
        """tokens [n] committed (the last one becomes the root) -> a tree of depth <= max_depth."""
        d_lookup = min(max_depth, self.lookup_depth)
        found = (find_continuations(tokens, d_lookup, self.max_ngram, self.min_ngram, self.lookup_branches)
                 if d_lookup > 0 else [])
        self._lookups, self._ngrams = [c for c, _ in found], [n for _, n in found]
        conf = [self._lookup_conf(n, len(c)) for c, n in found]
        budget = self.budget if self.budget is not None else self.max_budget
        root = int(tokens[-1])
        q, top = None, None
        d_draft = min(max_depth, self.draft_depth)
        if d_draft > 0 and self._lookups and self.budget is None and self._predicted.value is not None:
            if self._draft_pays(root, budget, conf, max_depth):
                self._explorer.draft()
            elif self._explorer.due:
                self._explorer.explore()
            else:
                self._explorer.skip()
                d_draft = 0
                self.draft_skips += 1
        self._both = d_draft > 0 and bool(self._lookups)
        self._q = None
        if d_draft == 0 and self._lookups and self.budget is None:
            # the first branch alone (pld's proposal), verified causally: a second branch rarely pays for the
            # masked attention path it forces (measured on code: tau 7.9 vs 5.8 on the same text)
            self._lookups, self._ngrams, conf = self._lookups[:1], self._ngrams[:1], conf[:1]
            return build_tree(root, None, budget=budget, top_k=self.top_k, lookups=self._lookups, lookup_conf=conf,
                              max_depth=max_depth, sample=not sampling.greedy, generator=generator,
                              costs=self._costs(0.0, budget, chain=True))
        if d_draft > 0:
            t0 = time.perf_counter()
            q, top = self.draft.distributions_top(tokens, d_draft, sampling, self.top_k + len(self._lookups))
            dt = time.perf_counter() - t0
            self._draft_s.update(dt)
        self._q, self._greedy = q, sampling.greedy
        tree = build_tree(root, q, budget=budget, top_k=self.top_k, lookups=self._lookups, lookup_conf=conf,
                          max_depth=max_depth, sample=not sampling.greedy, generator=generator,
                          costs=None if self.budget is not None else self._costs(self._draft_s.value or 0.0, budget),
                          draft_scale=self.draft_scale() if sampling.greedy else None, top=top)
        if q is not None and self._lookups:
            drafted = ~tree.point_mass[1:]
            g, n = float(tree.score[1:][drafted].sum()), float(drafted.sum())
            self._predicted.update(g)
            self._draft_nodes.update(n)
        return tree

    def _lookup_only(self, root: int, budget: int, conf: list[list[float]], max_depth: int) -> float:
        """The best expected tokens per second of a step without the draft: the first lookup branch alone (prompt
        lookup's own proposal), verified as a causal chain."""
        costs = self._costs(0.0, budget, chain=True)
        t = build_tree(root, None, budget=budget, top_k=self.top_k, lookups=self._lookups[:1], lookup_conf=conf[:1],
                       max_depth=max_depth, costs=costs)
        return t.expected / costs[t.num_nodes - 1]

    def _draft_pays(self, root: int, budget: int, conf: list[list[float]], max_depth: int) -> bool:
        """Whether running the draft is expected to raise tokens per second over the lookup branches alone."""
        t = build_tree(root, None, budget=budget, top_k=self.top_k, lookups=self._lookups, lookup_conf=conf,
                       max_depth=max_depth, costs=self._costs(0.0, budget))
        measured = self.measured_gain.value
        costs = TreeStepCosts(lookup_expected=t.expected, lookup_nodes=t.num_nodes - 1,
                              lookup_rate=self._lookup_only(root, budget, conf, max_depth),
                              gain=measured if measured is not None else self._predicted.value,
                              draft_nodes=self._draft_nodes.value, draft_seconds=self._draft_s.value or 0.0)
        return lookup_draft_pays(costs, self.verify_cost)

    def _costs(self, fixed: float, budget: int, chain: bool = False) -> list[float]:
        """[fixed + verify time of b nodes and the root] for b = 0..budget (build_tree's `costs`); the calibration's
        values are read once per proposer."""
        key = (chain, budget)
        base = self._cost_base.get(key)
        if base is None:
            cost = getattr(self.verify_cost, "chain", self.verify_cost) if chain else self.verify_cost
            base = self._cost_base[key] = [cost(b + 1) for b in range(budget + 1)]
        return [fixed + c for c in base]

    def draft_scale(self) -> list[float]:
        """Per draft depth: measured acceptance of the draft's nodes over their predicted acceptance (the draft's
        probability of the token), shrunk toward 1 by SCALE_PRIOR. An over-confident draft (this one is, where the
        text copies) would otherwise buy wider trees than its tokens pay for."""
        return [(h + SCALE_PRIOR) / (p + SCALE_PRIOR) for h, p in zip(self._d_hits, self._d_pred)]

    @property
    def max_width(self) -> int:
        return self.max_nodes

    def accept(self, tree: Tree, path: list[int], features: torch.Tensor | None) -> None:
        """After verification: path = the accepted nodes from the root; features [1, len(path), K*H] of them."""
        if self.draft is not None:
            self.draft.accept(tree, path, features)
        kids, tokens, on_path = tree.children(), tree.tokens.tolist(), set(path)
        if self._q is not None and self._greedy:  # the draft's own nodes under an accepted parent: trials
            q, pm, depth = self._q, tree.point_mass.tolist(), tree.depth.tolist()
            for node in path:
                for c in kids[node]:
                    if not pm[c] and depth[c] <= q.shape[0]:
                        self._d_pred[depth[c] - 1] += float(q[depth[c] - 1, tokens[c]])
                        self._d_hits[depth[c] - 1] += float(c in on_path)
        if not self._lookups:
            return
        reach = 0  # the most tokens a lookup branch alone got accepted
        for cont, ngram in zip(self._lookups, self._ngrams):
            node = 0  # walk the branch while the target accepted it: each verified token is a trial
            for d, tok in enumerate(cont):
                child = next((c for c in kids[node] if tokens[c] == tok), None)
                if child is None:
                    break
                c = 0 if d == 0 else 1
                self._trials[ngram][c] += 1
                if child not in on_path:
                    break
                self._hits[ngram][c] += 1
                node = child
                reach = max(reach, d + 1)
        if self._both:  # what the draft's nodes added this step (path[0] is the root)
            extra = float(len(path) - 1 - reach)
            self.measured_gain.update(extra)

    def describe(self) -> dict:
        """What the stats report about this proposer's tree settings."""
        d = {"method": self.name, "top_k": self.top_k, "draft_depth": self.draft_depth,
             "lookup_depth": self.lookup_depth, "budget": self.budget if self.budget is not None else "auto"}
        if self.budget is None and hasattr(self.verify_cost, "summary"):
            d["calibration"] = self.verify_cost.summary()
        if self.draft is not None and self.lookup:
            d["draft_skips"] = self.draft_skips
        if self.draft is not None:
            d["draft_scale"] = [round(f, 3) for f in self.draft_scale()]
        return d
