"""Candidate trees (tree.py), their verifier (verify.py), the verify-cost calibration and the budget choice:
pure functions on hand-built inputs, a brute-force reference for best-first expansion, and a distribution-level
losslessness test of multi-candidate rejection sampling."""

import itertools
import json

import pytest
import torch

from blockdraft.decode.calibrate import VerifyCost, load_or_measure, measure_verify_cost, monotone
from blockdraft.models.ngram import find_continuations
from blockdraft.decode.proposers.tree import TreeProposer
from blockdraft.models.target import TargetModel
from blockdraft.decode.tree import MalformedTree, Tree, ancestor_mask, build_tree, check_tree
from blockdraft.decode.verify import greedy_verify, rejection_verify
from conftest import tiny_llama

V = 7
HI, LO = 100.0, -100.0  # one-hot logits: the target is certain
ROOT = 6


def _q(seed: int, depth: int, v: int = V) -> torch.Tensor:
    """[depth, v] draft distributions with distinct probabilities (no ties in the rankings)."""
    return torch.softmax(torch.randn(depth, v, generator=torch.Generator().manual_seed(seed)) * 2, -1)


def _paths(tree: Tree) -> set[tuple[int, ...]]:
    return {tuple(tree.path_tokens(i)) for i in range(1, tree.num_nodes)}


def _tree(tokens, parents, point_mass=None, q=None) -> Tree:
    parents = torch.tensor(parents)
    depth = [0] * len(tokens)
    for i in range(1, len(tokens)):
        depth[i] = depth[int(parents[i])] + 1 if 0 <= parents[i] < len(tokens) else 1
    n = len(tokens)
    return Tree(torch.tensor(tokens), parents, torch.tensor(depth),
                torch.tensor(point_mass or [False] * n), torch.ones(n), q)


# ------------------------------------------------------------------------------------------------ building
@pytest.mark.parametrize("budget,top_k", [(1, 1), (5, 2), (12, 3), (40, 3)])
def test_best_first_keeps_the_highest_scoring_paths(budget, top_k):
    """Against brute force: enumerate every path through the top-k tokens of each depth, score = product of q,
    keep the `budget` best. Best-first expansion must pick the same set (q has no ties)."""
    q = _q(0, 3)
    tree = build_tree(ROOT, q, budget=budget, top_k=top_k)
    check_tree(tree, V)
    top = q.topk(top_k, -1).indices.tolist()
    scored = {}
    for d in range(1, 4):
        for path in itertools.product(*top[:d]):
            scored[path] = float(torch.prod(torch.stack([q[i, t] for i, t in enumerate(path)])))
    want = set(sorted(scored, key=scored.get, reverse=True)[:budget])
    assert _paths(tree) == want
    assert tree.num_nodes == 1 + min(budget, len(scored))
    kids = tree.children()
    assert all(len(k) <= top_k for k in kids)
    for i in range(1, tree.num_nodes):  # scores are products along the path
        assert tree.score[i].item() == pytest.approx(scored[tuple(tree.path_tokens(i))], rel=1e-5)


def test_tree_is_breadth_first_and_choose_cuts_the_worst_nodes():
    q = _q(1, 4)
    full = build_tree(ROOT, q, budget=20, top_k=3)
    assert full.depth.tolist() == sorted(full.depth.tolist())  # breadth-first numbering
    seen = []
    cut = build_tree(ROOT, q, budget=20, top_k=3, choose=lambda s: seen.append(s) or 6)
    assert seen[0] == sorted(seen[0], reverse=True) and len(seen[0]) == 20  # offered best-first
    assert cut.num_nodes == 7
    best6 = sorted(range(1, 21), key=lambda i: -full.score[i].item())[:6]
    assert _paths(cut) == {tuple(full.path_tokens(i)) for i in best6}


def _best_count(scores, costs):
    """The naive rule that build_tree's `costs` stands for: the first b maximising (1 + s_1 + ... + s_b) / costs[b]."""
    best_b, best_rate, expected = 0, 1.0 / costs[0], 1.0
    for b, s in enumerate(scores, start=1):
        expected += s
        if expected / costs[b] > best_rate:
            best_b, best_rate = b, expected / costs[b]
    return best_b


def test_costs_stop_early_and_keep_the_tree_that_full_expansion_chooses(monkeypatch):
    import random

    import blockdraft.decode.tree as tree_mod

    stops = []
    settled = tree_mod._settled
    monkeypatch.setattr(tree_mod, "_settled", lambda *a: stops.append(settled(*a)) or stops[-1])
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    for trial in range(400):
        d, v = rng.randint(1, 5), rng.choice([7, 50])
        q = torch.softmax(torch.randn(d, v, generator=gen) * rng.uniform(0.5, 6), -1) if rng.random() < 0.8 else None
        branches = rng.randint(0 if q is not None else 1, 2)
        lookups = [[rng.randrange(v) for _ in range(rng.randint(1, 6))] for _ in range(branches)]
        budget, fixed = rng.choice([0, 3, 20, 63]), rng.uniform(0, 2)
        slope, flat = rng.uniform(1e-3, 0.5), rng.randint(1, 8)  # a verify cost flat for a few nodes, then linear
        costs = [fixed + 1 + slope * max(0, b + 1 - flat) for b in range(budget + 1)]
        kw = dict(budget=budget, top_k=rng.randint(1, 6), lookups=lookups,
                  lookup_conf=[[rng.uniform(0.1, 0.95) for _ in c] for c in lookups], sample=rng.random() < 0.3)
        full = build_tree(ROOT, q, choose=lambda s: _best_count(s, costs),
                          generator=torch.Generator().manual_seed(trial), **kw)
        fast = build_tree(ROOT, q, costs=costs, generator=torch.Generator().manual_seed(trial), **kw)
        for f in ("tokens", "parents", "depth", "point_mass", "score"):
            assert torch.equal(getattr(full, f), getattr(fast, f)), (trial, f)
        assert fast.expected == pytest.approx(1 + fast.score[1:].double().sum().item(), rel=1e-6)
    assert sum(stops) > 100  # the expansion did end early, often
    with pytest.raises(ValueError, match="costs"):
        build_tree(ROOT, _q(1, 4), budget=5, top_k=2, costs=[1.0] * 3)


def test_lookup_branch_merges_with_the_draft_where_prefixes_coincide():
    q = _q(2, 3)
    top1 = q.argmax(-1).tolist()
    other = next(t for t in range(V) if t not in q[2].topk(2).indices.tolist())
    lookup = [top1[0], top1[1], other, 5, 1]  # agrees with the draft's best path for two tokens, then leaves it
    tree = build_tree(ROOT, q, budget=30, top_k=2, lookups=[lookup], lookup_conf=[0.9])
    check_tree(tree, V)
    paths = _paths(tree)
    for d in range(1, len(lookup) + 1):
        assert tuple(lookup[:d]) in paths  # the whole continuation, beyond the draft's depth 3 too
    # one node per distinct prefix: the lookup tokens the draft also proposed did not create twins
    assert len(paths) == tree.num_nodes - 1
    node = next(i for i in range(tree.num_nodes) if tree.path_tokens(i) == lookup[:1])
    # a merged node scores the higher of the draft's probability and the lookup confidence
    assert tree.score[node].item() == pytest.approx(max(0.9, q[0, lookup[0]].item()), rel=1e-5)
    assert tree.point_mass[node] and not tree.point_mass[tree.children()[node][-1]]


def test_draft_scale_reranks_depths_but_leaves_q_alone():
    """A factor on depth-2 probabilities: unscaled, the second node is the depth-2 child (0.6 * 0.9 > 0.3); scaled
    by 0.3 it scores 0.6 * 0.27 < 0.3 and the depth-1 runner-up takes its place. q itself is what sampling uses."""
    q = torch.zeros(2, V)
    q[0, :3] = torch.tensor([0.6, 0.3, 0.1])
    q[1, 4], q[1, 5] = 0.9, 0.1
    plain = build_tree(ROOT, q, budget=2, top_k=2)
    assert _paths(plain) == {(0,), (0, 4)}
    scaled = build_tree(ROOT, q, budget=2, top_k=2, draft_scale=[1.0, 0.3])
    assert _paths(scaled) == {(0,), (1,)}
    assert scaled.score.tolist() == pytest.approx([1.0, 0.6, 0.3])
    up = build_tree(ROOT, q, budget=1, top_k=1, draft_scale=[5.0])  # a factor never lifts a score above 1
    assert up.score.tolist() == [1.0, 1.0]
    sampled = build_tree(ROOT, q, budget=2, top_k=2, sample=True, draft_scale=[1.0, 0.3],
                         generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampled.q, q)


def test_sibling_scores_never_sum_past_one():
    """Two lookup branches that diverge at depth 1, each with a running rate of 0.8: at most one is accepted, so the
    second is worth 0.2 (and its subtree scales with it), not 0.8. Where they agree (depth 1 of a shared prefix)
    they are one node. A draft child next to them gets what is left, none here."""
    tree = build_tree(ROOT, None, budget=10, top_k=2, lookups=[[1, 2], [3, 4]], lookup_conf=[0.8, 0.8])
    score = {tuple(tree.path_tokens(i)): round(float(tree.score[i]), 6) for i in range(1, tree.num_nodes)}
    assert score == {(1,): 0.8, (1, 2): 0.64, (3,): 0.2, (3, 4): 0.16}
    q = torch.zeros(2, V)
    q[0, 5] = 0.5
    q[1, 5] = 0.5
    with_draft = build_tree(ROOT, q, budget=10, top_k=1, lookups=[[1, 2], [3, 4]], lookup_conf=[0.6, 0.3])
    score = {tuple(with_draft.path_tokens(i)): round(float(with_draft.score[i]), 6)
             for i in range(1, with_draft.num_nodes)}
    assert score[(1,)] == 0.6 and score[(5,)] == 0.4 and score[(3,)] == 0.0  # 0.6 + 0.5 -> 0.6 + 0.4, then 0
    same = build_tree(ROOT, None, budget=10, top_k=2, lookups=[[1, 2], [1, 4]], lookup_conf=[0.8, 0.8])
    assert _paths(same) == {(1,), (1, 2), (1, 4)} and float(same.score[1]) == pytest.approx(0.8)


def test_is_chain_means_every_parent_is_the_node_before():
    assert _tree([ROOT, 4, 5, 6], [-1, 0, 1, 2]).is_chain
    assert _tree([ROOT], [-1]).is_chain
    assert not _tree([ROOT, 4, 5, 6], [-1, 0, 0, 2]).is_chain  # a branch at the root


def test_lookup_only_tree_is_a_chain_per_branch():
    tree = build_tree(ROOT, None, budget=10, top_k=4, lookups=[[1, 2, 3], [1, 4]], lookup_conf=[0.6, 0.5])
    assert _paths(tree) == {(1,), (1, 2), (1, 2, 3), (1, 4)}


def test_sampled_tree_shape_does_not_depend_on_the_draws():
    """The shape (who has how many children, which are lookup tokens) is fixed before any token is drawn."""
    q = _q(3, 3)
    trees = [build_tree(ROOT, q, budget=9, top_k=3, lookups=[[2, 2, 2]], lookup_conf=[0.5], sample=True,
                        generator=torch.Generator().manual_seed(s)) for s in range(6)]
    for t in trees:
        check_tree(t, V)
        assert t.parents.tolist() == trees[0].parents.tolist()
        assert t.point_mass.tolist() == trees[0].point_mass.tolist()
    assert len({tuple(t.tokens.tolist()) for t in trees}) > 1, "different seeds draw different tokens"


def test_sampled_slots_never_exceed_the_support_of_q():
    q = torch.zeros(2, V)
    q[:, 1], q[:, 4] = 0.7, 0.3  # two tokens possible per depth
    tree = build_tree(ROOT, q, budget=20, top_k=5, lookups=[[4]], lookup_conf=[0.9], sample=True,
                      generator=torch.Generator().manual_seed(0))
    check_tree(tree, V)
    kids = tree.children()
    assert [tree.tokens[c].item() for c in kids[0]] == [4, 1]  # the lookup token, then the only token left


# ------------------------------------------------------------------------------------------- malformed trees
@pytest.mark.parametrize("tree,match", [
    (_tree([ROOT, 1, 2], [-1, 2, 0]), "earlier node"),
    (_tree([ROOT, 1, 1], [-1, 0, 0]), "siblings must differ"),
    (_tree([ROOT, 1, 9], [-1, 0, 0]), "outside the vocabulary"),
    (_tree([ROOT, 1, 2], [0, 0, 0]), "root"),
    (Tree(torch.tensor([ROOT, 1]), torch.tensor([-1, 0]), torch.tensor([0, 2]), torch.zeros(2, dtype=torch.bool),
          torch.ones(2)), "depth"),
    (Tree(torch.tensor([ROOT, 1]), torch.tensor([-1, 0, 0]), torch.tensor([0, 1]), torch.zeros(2, dtype=torch.bool),
          torch.ones(2)), "shape"),
    (_tree([ROOT, 1, 2], [-1, 0, 0], [False, False, True], _q(0, 1)), "point-mass children must precede"),
    (_tree([ROOT, 1, 2], [-1, 0, 1], q=_q(0, 1)), r"q must be \[D >= 2"),
])
def test_malformed_trees_are_rejected_with_a_reason(tree, match):
    with pytest.raises(MalformedTree, match=match):
        check_tree(tree, V)


def test_ancestor_mask_matches_a_naive_walk():
    tree = build_tree(ROOT, _q(4, 4), budget=15, top_k=3)
    par = tree.parents.tolist()
    want = torch.zeros(tree.num_nodes, tree.num_nodes, dtype=torch.bool)
    for i in range(tree.num_nodes):
        j = i
        while j >= 0:
            want[i, j] = True
            j = par[j]
    assert torch.equal(ancestor_mask(tree.parents), want)


# ------------------------------------------------------------------------------------------------ greedy verify
def _one_hot(argmax: list[int]) -> torch.Tensor:
    x = torch.full((len(argmax), V), LO)
    x[torch.arange(len(argmax)), torch.tensor(argmax)] = HI
    return x


#               root  a=1  b=2  c=3 (child of a)  d=4 (child of a)  e=5 (child of d)
SMALL = _tree([ROOT, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 4])


def test_greedy_tree_follows_the_target_through_a_second_child():
    path, committed = greedy_verify(SMALL, _one_hot([1, 4, 0, 0, 5, 3]))
    assert path == [0, 1, 4, 5] and committed == [1, 4, 5, 3]  # 3 accepted, bonus 3 at the leaf


def test_greedy_tree_recovers_when_no_child_matches():
    path, committed = greedy_verify(SMALL, _one_hot([1, 6, 0, 0, 0, 0]))
    assert path == [0, 1] and committed == [1, 6]
    path, committed = greedy_verify(SMALL, _one_hot([0, 0, 0, 0, 0, 0]))
    assert path == [0] and committed == [0]


def test_verifiers_check_shapes():
    with pytest.raises(AssertionError):
        greedy_verify(SMALL, _one_hot([1, 2, 3]))


def test_rejection_tree_with_a_certain_target_behaves_like_greedy():
    g = torch.Generator().manual_seed(0)
    tree = _tree([ROOT, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 4], q=torch.full((3, V), 1.0 / V))
    for _ in range(20):
        path, committed = rejection_verify(tree, _one_hot([2, 4, 0, 0, 5, 3]).softmax(-1), g)
        assert path == [0, 2] and committed == [2, 0]


def _bigram(seed: int, v: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(v, v, generator=g) * 1.5, dim=-1)  # P[prev, next]


def test_tree_rejection_sampling_is_lossless_over_two_tokens():
    """Decode against a bigram target with sampled trees (top-k slots drawn without replacement from a mismatched
    q, plus a point-mass lookup branch) until two tokens are committed, and compare their joint distribution with
    the target's by a chi-square test on 16 cells (df = 15).

    Threshold 42.6 is the 0.9999 quantile of chi2(15): with a random seed the false-failure rate would be 1e-4; the
    seeds are fixed, so the test is deterministic. 6000 samples put ~60 or more in the rarest cell, enough for the
    chi-square approximation and to catch a sibling rule that skips the without-replacement renormalisation."""
    v, n = 4, 6000
    target = _bigram(1, v)
    q = torch.softmax(torch.randn(3, v, generator=torch.Generator().manual_seed(2)), -1)
    gen = torch.Generator().manual_seed(3)
    start = 0
    counts = torch.zeros(v, v)
    for i in range(n):
        out: list[int] = []
        prev = start
        while len(out) < 2:
            tree = build_tree(prev, q, budget=6, top_k=2, lookups=[[i % v, (i // v) % v]], lookup_conf=[0.4],
                              sample=True, generator=gen)
            p = target[tree.tokens]  # row i: the target's distribution after node i (a bigram looks one back)
            _, committed = rejection_verify(tree, p, gen)
            out += committed
            prev = out[-1]
        counts[out[0], out[1]] += 1
    expected = n * target[start].unsqueeze(1) * target
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 42.6, chi2


# ------------------------------------------------------------------------------------------------ lookup
def test_find_continuations_returns_distinct_branches_most_recent_first():
    toks = torch.tensor([5, 1, 2, 9, 5, 1, 3, 4, 7, 5, 1])
    # "5 1" occurred twice before; then the 1-gram "1" adds nothing new (its matches are the same two places)
    assert find_continuations(toks, 3, max_ngram=2, max_branches=3) == [([3, 4, 7], 2), ([2, 9, 5], 2)]
    assert find_continuations(toks, 3, max_ngram=2, max_branches=1) == [([3, 4, 7], 2)]
    toks = torch.tensor([8, 1, 6, 5, 1])  # "5 1" is new: the 1-gram "1" matches, at position 1
    assert find_continuations(toks, 2, max_ngram=3) == [([6, 5], 1)]
    assert find_continuations(torch.tensor([1, 2, 3]), 4) == []


# ------------------------------------------------------------------------------------ calibration, budget choice
def test_budget_choice_maximises_expected_tokens_per_second():
    """The proposer's cost table (draft time + the calibration's verify time) under the rule build_tree applies
    (`_best_count`, checked against build_tree above) keeps the node count with the best tokens per second."""

    def choose(prop, scores, chain=False):
        fixed = 0.0 if chain else prop._draft_s.value or 0.0
        return _best_count(scores, prop._costs(fixed, len(scores), chain=chain))

    flat = VerifyCost([1.0] * 64)  # verifying more costs nothing: keep every node with a positive score
    prop = TreeProposer(None, lookup=True, verify_cost=flat)
    assert choose(prop, [0.5, 0.2, 0.01]) == 3
    linear = VerifyCost([float(w) for w in range(1, 65)])  # cost grows with width like plain decoding
    prop = TreeProposer(None, lookup=True, verify_cost=linear)
    # b nodes: (1 + sum s) / (b + 1) < 1 for scores < 1, so verifying nothing is best
    assert choose(prop, [0.9, 0.8]) == 0
    step = VerifyCost([1.0] * 8 + [2.0] * 56)  # a jump after 8 tokens: 7 nodes fit under it
    prop = TreeProposer(None, lookup=True, verify_cost=step)
    weak_tail = [0.3] * 7 + [0.05] * 13
    assert choose(prop, weak_tail) == 7  # 3.1 tokens per unit of time, against 3.75 / 2 with all 20
    assert choose(prop, [0.3] * 20) == 20  # 7 tokens in 2 units beat 3.1 in 1
    for _ in range(2):  # a slow draft makes the verify cost negligible: verify all it drafted (two calls: the
        prop._draft_s.update(100.0)  # first prices nothing)
    assert choose(prop, weak_tail) == 20
    assert choose(prop, weak_tail, chain=True) == 7  # a lookup-only chain carries no draft time
    assert prop._costs(1.5, 3) == [1.5 + step(b + 1) for b in range(4)]
    assert step(100) > step(64) and linear(1) == 1.0


def test_verify_cost_is_measured_and_cached(tmp_path, one_thread):
    target = TargetModel(tiny_llama(layers=2))
    cost = measure_verify_cost(target, max_width=5, context=7, reps=1)
    assert cost.max_width == 5 and all(s > 0 for s in cost.seconds) and cost.context == 7
    assert cost.meta["tree_mask"] is True  # timed as tree verifies (explicit ancestor mask), what the budget buys
    assert len(cost.chain_seconds) == 5 and all(s > 0 for s in cost.chain_seconds)  # causal chains, timed apart
    assert cost.chain(3) == cost.chain_seconds[2] and cost(3) == cost.seconds[2]
    chain = measure_verify_cost(target, max_width=5, context=7, reps=1, tree=False)
    assert chain.meta["tree_mask"] is False and chain.max_width == 5 and chain.chain_seconds is None
    assert chain.chain(4) == chain(4)  # without a chain curve a chain costs what the one curve says
    path = tmp_path / "cal.json"
    first = load_or_measure(target, path=path, max_width=4, context=6, reps=1)
    assert json.loads(path.read_text())["seconds"] == first.seconds
    assert json.loads(path.read_text())["chain_seconds"] == first.chain_seconds
    again = load_or_measure(target, path=path, max_width=9)  # read back: the new arguments are not used
    assert again.seconds == first.seconds and again.max_width == 4 and again.chain_seconds == first.chain_seconds
    path.write_text("{not json")
    assert load_or_measure(target, path=path, max_width=3, context=5, reps=1).max_width == 3  # corrupt: remeasured
    with pytest.raises(ValueError):
        VerifyCost([0.1, 0.0])
    with pytest.raises(ValueError, match="same widths"):
        VerifyCost([0.1, 0.2], chain_seconds=[0.1])


def test_monotone_fit_pools_decreasing_runs():
    assert monotone([1.0, 0.8, 0.9, 2.0, 1.5, 3.0]) == pytest.approx([0.9, 0.9, 0.9, 1.75, 1.75, 3.0])
    assert monotone([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    cost = measure_verify_cost(TargetModel(tiny_llama(layers=2)), max_width=20, context=5, reps=1)
    assert all(a <= b for a, b in zip(cost.seconds, cost.seconds[1:]))


def test_rejection_verify_tree_takes_rows_on_demand():
    """A function node -> probs gives the same draws as the full [N, V] tensor, and is asked for the rows of the
    accepted path only, once each."""
    tree = _tree([ROOT, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 4], q=torch.full((3, V), 1.0 / V))
    probs = torch.softmax(torch.randn(6, V, generator=torch.Generator().manual_seed(5)) * 2, -1)
    paths = set()
    for seed in range(30):
        asked: list[int] = []
        a = rejection_verify(tree, probs, torch.Generator().manual_seed(seed))
        b = rejection_verify(tree, lambda i: asked.append(i) or probs[i], torch.Generator().manual_seed(seed))
        assert a == b and asked == a[0]
        paths.add(tuple(a[0]))
    assert len(paths) > 1, "the seeds reach more than one path"


@pytest.mark.parametrize("sample", [False, True])
def test_given_top_entries_build_the_tree_a_topk_over_q_builds(sample):
    """build_tree with `top` (the caller's own top-k of q, e.g. from a reduced draft vocabulary) builds the same tree
    as its own topk over q: same tokens, parents and scores, with lookups merged and sampled slots alike."""
    g = torch.Generator().manual_seed(11)
    q = torch.zeros(4, 50)
    for d in range(4):  # sparse rows: mass on 12 random tokens, as a reduced vocabulary leaves them
        cols = torch.randperm(50, generator=g)[:12]
        q[d, cols] = torch.rand(12, generator=g)
    q = q / q.sum(-1, keepdim=True)
    kw = dict(budget=12, top_k=3, lookups=[[int(q[0].argmax()), 7, 9]], lookup_conf=[0.6], sample=sample)
    vals, idx = q.topk(3 + 1, dim=-1)
    ref = build_tree(ROOT, q, generator=torch.Generator().manual_seed(2), **kw)
    got = build_tree(ROOT, q, generator=torch.Generator().manual_seed(2), top=(vals, idx), **kw)
    for name in ("tokens", "parents", "depth", "point_mass", "score"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name


def test_a_chain_built_as_one_answers_like_any_tree():
    """`Tree.chain` skips the per-step structure checks by construction: its answers (depth, chain-ness, children,
    the checker's verdict on its tokens) equal those of the same tree built field by field."""
    gen = torch.Generator().manual_seed(5)
    for g in (0, 1, 4):
        drafts = torch.randint(0, 50, (g,), generator=gen)
        fast = Tree.chain(7, drafts)
        idx = torch.arange(g + 1)
        slow = Tree(torch.cat([torch.tensor([7]), drafts]), idx - 1, idx, torch.ones(g + 1, dtype=torch.bool),
                    torch.ones(g + 1))
        assert fast.built_as_chain and not slow.built_as_chain
        assert (fast.max_depth, fast.is_chain, fast.children()) == (slow.max_depth, slow.is_chain, slow.children())
        check_tree(fast, 50)
        with pytest.raises(MalformedTree):
            check_tree(Tree.chain(7, torch.tensor([50])), 50)  # outside the vocabulary: still checked
