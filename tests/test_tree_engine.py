"""Tree verification in the engine: the target's tree forward against chain forwards of each path (lean
and HF paths), cache compaction against a naive rebuild, and greedy token-exactness (fp32) with oracle, useless and
random drafts, with and without a prompt-lookup branch."""

import pytest
import torch

from blockdraft.models.cache import KVCache
from blockdraft.config import GenerationConfig, SamplingParams
from blockdraft.decode.engine import Engine
from blockdraft.decode.proposers.dflash import DFlashProposer
from blockdraft.decode.proposers.tree import TreeProposer
from blockdraft.models.target import TargetCache, TargetModel
from blockdraft.decode.tree import MalformedTree, Tree, ancestor_mask, build_tree
from conftest import VOCAB, ToyTokenizer, naive_greedy, tiny_draft, tiny_llama, tiny_qwen3

N_NEW = 40
TOL = dict(rtol=1e-4, atol=1e-4)  # fp32; a tree forward sums attention over a masked, longer key range
# features of these random targets reach ~200 (initializer_range 0.5), and the reference runs through the HF modules
# (cache None), whose unfused matmuls sum in another order: an absolute error of ~1e-6 of that scale
FEAT_TOL = dict(rtol=1e-4, atol=2e-3)


def _prompt(seed=0, n=11):
    return torch.randint(0, 90, (n,), generator=torch.Generator().manual_seed(seed))


def _targets(kind: str) -> tuple[TargetModel, TargetModel]:
    """The same weights behind the lean path and the HF path, tapping three layers."""
    hf = tiny_llama() if kind == "llama" else tiny_qwen3()
    return (TargetModel(hf, ToyTokenizer(), layer_ids=(0, 1, 3)),
            TargetModel(hf, ToyTokenizer(), layer_ids=(0, 1, 3), lean=False))


def _random_tree(seed: int, root: int, budget: int = 14) -> Tree:
    q = torch.softmax(torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3, -1)
    return build_tree(root, q, budget=budget, top_k=3, lookups=[[5, 6, 7, 8, 9]], lookup_conf=[0.5])


def _tree_forward(target: TargetModel, cache, tree: Tree, start: int):
    pos = (tree.depth + start).unsqueeze(0)
    return target.forward(tree.tokens.unsqueeze(0), cache, positions=pos, tree_mask=ancestor_mask(tree.parents))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_tree_forward_equals_a_chain_forward_of_every_path(kind, one_thread):
    ctx = _prompt(1, 9)
    for target in _targets(kind):
        tree = _random_tree(2, int(ctx[-1]))
        cache = target.new_decode_cache(64)
        target.forward(ctx[:-1].unsqueeze(0), cache)
        out = _tree_forward(target, cache, tree, ctx.numel() - 1)
        kids = tree.children()
        for leaf in (i for i in range(tree.num_nodes) if not kids[i]):
            nodes = [leaf]
            while nodes[-1] > 0:
                nodes.append(int(tree.parents[nodes[-1]]))
            nodes = nodes[::-1]  # root .. leaf
            ref = target.forward(torch.cat([ctx, tree.tokens[nodes[1:]]]).unsqueeze(0), None)
            k = ctx.numel() - 1
            torch.testing.assert_close(out.logits[0, nodes], ref.logits[0, k:], **TOL)
            torch.testing.assert_close(out.features[0, nodes], ref.features[0, k:], **FEAT_TOL)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_compaction_equals_a_naive_rebuild(kind, one_thread):
    """After a tree verify the cache keeps only the accepted path. Decoding on from it must match a cache rebuilt
    from scratch over context + path, for the lean KVCache and the HF cache alike; so must the kept K/V."""
    ctx = _prompt(3, 10)
    for target in _targets(kind):
        tree = _random_tree(4, int(ctx[-1]))
        kids = tree.children()
        path = [0]
        while kids[path[-1]]:
            path.append(kids[path[-1]][-1])  # the last child at each level: nodes far apart in the tree's order
        cache = target.new_decode_cache(64)
        target.forward(ctx[:-1].unsqueeze(0), cache)
        _tree_forward(target, cache, tree, ctx.numel() - 1)
        cache.compact(ctx.numel() - 1, torch.tensor(path))
        assert cache.length == ctx.numel() + len(path) - 1
        nxt = torch.tensor([[17, 4]])
        got = target.forward(nxt, cache)
        fresh = target.new_decode_cache(64)
        target.forward(torch.cat([ctx, tree.tokens[path[1:]]]).unsqueeze(0), fresh)
        want = target.forward(nxt, fresh)
        torch.testing.assert_close(got.logits, want.logits, **TOL)
        assert cache.length == fresh.length
        if isinstance(cache, KVCache):
            torch.testing.assert_close(cache.k[:, :, :, : cache.length], fresh.k[:, :, :, : fresh.length], **TOL)
        else:
            assert isinstance(cache, TargetCache)
            for a, b in zip(cache.hf.layers, fresh.hf.layers):
                torch.testing.assert_close(a.values, b.values, **TOL)


def test_kv_cache_compact_moves_the_kept_positions():
    c = KVCache(2, 1, 1, 3, capacity=4, dtype=torch.float32)
    vals = torch.arange(8.0).view(1, 1, 1, 8, 1).expand(2, 1, 1, 8, 3)
    c.append(vals, vals)  # grows past its capacity of 4
    c.compact(3, torch.tensor([0, 2, 4]))
    assert c.length == 6 and c.k[0, 0, 0, :6, 0].tolist() == [0, 1, 2, 3, 5, 7]
    with pytest.raises(ValueError, match="cannot keep"):
        c.compact(3, torch.tensor([0, 5]))
    with pytest.raises(AssertionError):
        c.compact(1, torch.tensor([2, 1]))


# ------------------------------------------------------------------------------------------------ the engine
class FakeDraft:
    """Stands in for DFlashProposer in a TreeProposer: `distributions_top` returns whatever `rows(n, g)` says (and no
    top entries: the tree takes its own topk of them)."""

    layer_ids = ()

    def __init__(self, rows, block_size: int = 6) -> None:
        self.rows, self.block_size = rows, block_size

    def start(self, prompt_ids, features):
        pass

    def accept(self, tree, path, features):
        pass

    def distributions_top(self, tokens, num_draft, sampling, k):
        return self.rows(tokens.numel(), min(num_draft, self.block_size - 1)), None


def _second_best_oracle(prompt_len: int, truth: list[int]):
    """Each row ranks the true token second (the top-1 chain would fail at once; a tree with top_k >= 2 follows)."""
    def rows(n, g):
        q = torch.full((g, VOCAB), 0.01)
        for j in range(g):
            t = truth[n - prompt_len + j] if n - prompt_len + j < len(truth) else 0
            q[j, t] = 0.3
            q[j, (t + 1) % VOCAB] = 0.6
        return q / q.sum(-1, keepdim=True)
    return rows


def _random_rows(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return lambda n, g: torch.softmax(torch.randn(g, VOCAB, generator=gen) * 2, -1)


@pytest.mark.parametrize("lookup", [False, True])
def test_tree_with_an_oracle_is_token_exact_and_accepts_its_whole_depth(target, lookup):
    prompt = _prompt(5)
    ref = naive_greedy(target, prompt, N_NEW)
    # depth 3, two draft children per node: the full binary tree has 14 nodes; the two lookup branches give their
    # nodes a third child, at most 4 + 10 + 22 = 36 nodes
    budget = 36 if lookup else 14
    draft = FakeDraft(_second_best_oracle(prompt.numel() + 1, ref[1:]), block_size=4)
    prop = TreeProposer(draft, lookup=lookup, budget=budget, top_k=2, lookup_depth=3)
    res = Engine(target, prop).generate(prompt, GenerationConfig(max_new_tokens=N_NEW, ignore_eos=True))
    assert res.token_ids == ref
    steps = res.stats.accept_lengths
    assert all(a == 4 for a in steps[:-1]), steps  # depth 3 + the bonus, every step
    assert res.stats.target_forwards == 1 + len(steps) and len(res.stats.tree_nodes) == len(steps)
    assert res.stats.tree["budget"] == budget and res.stats.to_dict()["tree_nodes"] == res.stats.tree_nodes


def test_draft_scale_is_measured_acceptance_over_predicted(llama_target):
    """The second-best oracle with a fixed full binary tree: at every depth each step tries both top-2 children of
    the accepted node (predicted q_true + q_wrong) and accepts one, so the factor is (steps + prior) over
    (steps * (q_true + q_wrong) + prior); sampling runs keep the factor at 1."""
    from blockdraft.decode.proposers.tree import SCALE_PRIOR

    prompt = _prompt(5)
    ref = naive_greedy(llama_target, prompt, N_NEW)
    draft = FakeDraft(_second_best_oracle(prompt.numel() + 1, ref[1:]), block_size=4)
    prop = TreeProposer(draft, budget=14, top_k=2)
    res = Engine(llama_target, prop).generate(prompt, GenerationConfig(max_new_tokens=N_NEW,
                                                                                  ignore_eos=True))
    assert res.token_ids == ref
    steps = res.stats.accept_lengths
    pair = 0.9 / (0.9 + 0.01 * (VOCAB - 2))  # both children's normalised probabilities
    for d in (1, 2, 3):
        # the oracle's trees are accepted to their full depth a - 1 (the last step's is cut by the tokens left)
        n = sum(1 for a in steps if a - 1 >= d)
        assert prop.draft_scale()[d - 1] == pytest.approx((n + SCALE_PRIOR) / (n * pair + SCALE_PRIOR), rel=1e-5)
    assert res.stats.tree["draft_scale"] == [round(f, 3) for f in prop.draft_scale()]
    prop.start(prompt, None)
    assert prop.draft_scale() == [1.0, 1.0, 1.0]  # a new generation starts from the prior


@pytest.mark.parametrize("lookup", [False, True])
@pytest.mark.parametrize("draft", ["useless", "random"])
def test_tree_is_token_exact_with_poor_drafts(target, draft, lookup):
    prompt = _prompt(6)
    ref = naive_greedy(target, prompt, N_NEW)
    if draft == "useless":  # an untrained DFlash draft on the target's features
        d = DFlashProposer(tiny_draft(target, block_size=8), target)
    else:
        d = FakeDraft(_random_rows(7))
    prop = TreeProposer(d, lookup=lookup, budget=10, top_k=3)
    res = Engine(target, prop).generate(prompt, GenerationConfig(max_new_tokens=N_NEW, ignore_eos=True))
    assert res.token_ids == ref
    assert len(res.stats.accept_lengths) >= 5 and sum(res.stats.accept_lengths) + 1 == N_NEW


def test_tree_on_the_hf_path_and_with_a_chosen_budget_is_token_exact(one_thread):
    _, hf_target = _targets("qwen3")
    prompt = _prompt(8)
    ref = naive_greedy(hf_target, prompt, N_NEW)
    d = DFlashProposer(tiny_draft(hf_target, block_size=8), hf_target)
    cost = lambda w: 1.0 + 0.02 * w  # noqa: E731 - a flat-ish synthetic verify cost: wide trees are cheap
    prop = TreeProposer(d, lookup=True, verify_cost=cost, max_budget=20)
    res = Engine(hf_target, prop).generate(prompt, GenerationConfig(max_new_tokens=N_NEW,
                                                                               ignore_eos=True))
    assert res.token_ids == ref
    assert max(res.stats.tree_nodes) <= 20 and res.stats.tree["budget"] == "auto"


def test_tree_sampling_is_reproducible_with_a_seed(llama_target):
    prop = TreeProposer(DFlashProposer(tiny_draft(llama_target), llama_target), lookup=True, budget=12, top_k=3)
    eng = Engine(llama_target, prop)
    s = SamplingParams(temperature=0.9, top_k=30, seed=11)
    cfg = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    a, b = eng.generate(_prompt(9), cfg, s), eng.generate(_prompt(9), cfg, s)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 30


def test_engine_rejects_a_malformed_tree(llama_target):
    class Bad(TreeProposer):
        def propose(self, tokens, max_depth, sampling, generator):
            tree = super().propose(tokens, max_depth, sampling, generator)
            tree.parents[-1] = tree.num_nodes - 1  # a node that is its own parent
            return tree

    prop = Bad(FakeDraft(_random_rows(0)), budget=5, top_k=2)
    with pytest.raises(MalformedTree, match="earlier node"):
        Engine(llama_target, prop).generate(_prompt(), GenerationConfig(max_new_tokens=8))
    with pytest.raises(ValueError, match="budget"):
        TreeProposer(FakeDraft(_random_rows(0)))


# ------------------------------------------------------------------------------------------------ the benchmark
class _ChatTokenizer(ToyTokenizer):
    """ToyTokenizer plus a chat template, as the benchmark encodes prompts (ids stay inside the vocabulary of 99)."""

    chat_template = "stub"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [0] + [1 + ord(c) % 89 for m in messages for c in m["content"]] + [92]


def test_bench_runs_the_tree_methods(tmp_path, monkeypatch):
    """`dflash-tree` and `dflash+lookup` in `blockdraft bench`: a verify-cost calibration measured at start (into a
    temporary cache dir), greedy fp32 outputs equal to ar's, nodes per step in the records and the report."""
    import json

    from blockdraft.eval.bench import BenchConfig, run_bench

    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(tmp_path / "cache"))
    pfile = tmp_path / "p.jsonl"
    pfile.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": t}) for i, t in
                               enumerate(["abc abc abc xyz abc", "one two one two one"])) + "\n")
    tok = _ChatTokenizer()
    target = TargetModel(tiny_qwen3(), tok)
    cfg = BenchConfig(prompts=str(pfile), n=None, max_new_tokens=16, methods=("ar", "dflash-tree", "dflash+lookup"),
                      dtype="fp32", out=str(tmp_path / "out"), progress=False, plots=False, threads=1)
    res = run_bench(cfg, target=target, tokenizer=tok, draft=tiny_draft(target, block_size=6))
    assert res["methods"] == ["ar", "dflash-tree", "dflash+lookup"]
    assert any("verify-cost calibration" in n for n in res["notes"])
    assert list((tmp_path / "cache" / "calibration").glob("verify-cost-*.json"))
    recs = [r for r in res["records"] if r["method"] != "ar"]
    assert len(recs) == 4 and all(r["match_ar"] for r in recs)
    assert all(len(r["tree_nodes"]) == len(r["accept_lengths"]) for r in recs)
    rows = [r for r in res["summary"]["0"]["rows"] if r["method"] == "dflash+lookup"]
    assert rows and all(r["tree_nodes_mean"] > 0 and r["draft_skip_share"] is not None for r in rows)
    assert "### Tree verification" in (tmp_path / "out" / "report.md").read_text()


def test_lookup_rates_are_learnt_per_position_class():
    """accept counts, per matched n-gram length, a branch's first token and its later tokens apart: trials
    while the parent was accepted, hits when the token was."""
    prop = TreeProposer(None, lookup=True, budget=20, lookup_depth=4)
    prop.start(torch.tensor([1]), None)
    tokens = torch.tensor([7, 1, 2, 3, 4, 9, 7, 1])  # the 2-gram "7 1" occurred before: the continuation is 2 3 4 9
    tree = prop.propose(tokens, 4, SamplingParams(), None)
    assert prop._lookups[0] == [2, 3, 4, 9] and prop._ngrams[0] == 2
    node = {tuple(tree.path_tokens(i)): i for i in range(tree.num_nodes)}
    prop.accept(tree, [0, node[(2,)], node[(2, 3)]], None)  # 2 and 3 accepted, 4 rejected
    assert prop._trials[2] == [1.0, 2.0] and prop._hits[2] == [1.0, 1.0]
    assert prop.lookup_rate(2, first=True) == pytest.approx(2 / 3) and prop.lookup_rate(2, first=False) == 0.5
    assert prop.lookup_rate(1, first=True) == 0.5  # other match lengths keep the prior
    prop.start(torch.tensor([1]), None)  # a new generation starts from the prior again
    assert prop.lookup_rate(2, first=True) == 0.5


def test_draft_is_skipped_when_a_lookup_branch_is_worth_more_than_it_costs(llama_target):
    """A slow draft (5 ms a call) against a near-free verify: once a lookup continuation exists the draft cannot
    pay for itself and is skipped, and the output stays token-exact."""
    import time as _time

    calls = []

    def slow_rows(n, g):
        calls.append(n)
        _time.sleep(0.005)
        return _random_rows(n)(n, g)

    prompt = torch.tensor([3, 14, 15, 92, 65, 35, 3, 14, 15, 92, 65, 35, 3, 14])
    ref = naive_greedy(llama_target, prompt, N_NEW)
    prop = TreeProposer(FakeDraft(slow_rows, block_size=4), lookup=True, verify_cost=lambda w: 1e-4 * (1 + w))
    res = Engine(llama_target, prop).generate(prompt, GenerationConfig(max_new_tokens=N_NEW,
                                                                                  ignore_eos=True))
    assert res.token_ids == ref
    skips, steps = res.stats.tree["draft_skips"], len(res.stats.accept_lengths)
    # every step drafts or skips, but a last step with one token left to make has nothing to draft
    assert skips > 0 and len(calls) + skips in (steps - 1, steps)


def test_draft_skip_uses_the_measured_gain_not_the_drafts_confidence(llama_target):
    """A fast but confidently wrong draft (0.99 on a token the target never picks here): its scores promise ~1
    token per node, but the tokens it adds beyond the lookup branches are measured as 0, so once measured the draft
    runs on a step with a lookup branch only to explore (one step in EXPLORE_ROW + 1), and the output stays
    token-exact."""
    from blockdraft.decode.policy import EXPLORE_ROW

    calls = []

    def wrong_rows(n, g):
        calls.append(n)
        q = torch.full((g, VOCAB), 0.01 / (VOCAB - 1))
        q[:, VOCAB - 1] = 0.99
        return q

    class Logged(TreeProposer):
        steps = []

        def propose(self, tokens, max_depth, sampling, generator):
            before, measured = len(calls), self.measured_gain.value is not None
            tree = super().propose(tokens, max_depth, sampling, generator)
            self.steps.append((bool(self._lookups), measured, len(calls) > before))
            return tree

    prompt = torch.tensor([3, 14, 15, 92, 65, 35, 3, 14, 15, 92, 65, 35, 3, 14])
    ref = naive_greedy(llama_target, prompt, N_NEW)
    assert VOCAB - 1 not in ref  # the draft's token is indeed never right
    prop = Logged(FakeDraft(wrong_rows, block_size=6), lookup=True, top_k=1,
                  verify_cost=lambda w: 1e-3 * (1 + 0.3 * w))
    res = Engine(llama_target, prop).generate(prompt, GenerationConfig(max_new_tokens=N_NEW,
                                                                                  ignore_eos=True))
    assert res.token_ids == ref
    assert prop.measured_gain.value is not None and prop.measured_gain.value < 0.05
    with_lookup = [ran for lk, measured, ran in prop.steps if lk and measured]
    assert len(with_lookup) >= 10  # enough steps for the rule to show
    assert sum(with_lookup) <= len(with_lookup) // (EXPLORE_ROW + 1) + 1
    assert res.stats.tree["draft_skips"] == len(with_lookup) - sum(with_lookup)


def test_lookup_only_steps_verify_the_first_branch_as_a_causal_chain(llama_target):
    """Two lookup branches, no draft: the step proposes the first branch alone (prompt lookup's proposal), its length
    chosen from the calibration's chain curve (not the masked-tree one); the engine verifies it without an explicit
    mask, and the output stays token-exact."""
    from blockdraft.decode.calibrate import VerifyCost

    tokens = torch.tensor([7, 1, 2, 3, 9, 7, 1, 4, 5, 8, 7, 1])  # "7 1" was followed by "4 5 8 ..." and "2 3 9 ..."
    widths = range(1, 65)
    cheap_chain = VerifyCost([1.0 + 1.0 * w for w in widths], chain_seconds=[1.0 + 0.01 * w for w in widths])
    prop = TreeProposer(None, lookup=True, verify_cost=cheap_chain, lookup_depth=4)
    prop.start(tokens, None)
    tree = prop.propose(tokens, 4, SamplingParams(), None)
    assert tree.is_chain and tree.path_tokens(tree.num_nodes - 1) == [4, 5, 8, 7]  # all 4: the chain is cheap
    dear_chain = VerifyCost([1.0 + 0.01 * w for w in widths], chain_seconds=[1.0 + 1.0 * w for w in widths])
    prop = TreeProposer(None, lookup=True, verify_cost=dear_chain, lookup_depth=4)
    prop.start(tokens, None)
    tree = prop.propose(tokens, 4, SamplingParams(), None)
    assert tree.num_nodes == 1  # each token costs as much as a step: verify none (priced as a chain, not a tree)

    masks = []
    forward = llama_target.forward_rows

    def logged(ids, caches, **kw):
        masks.extend(m is not None for m in (kw.get("tree_masks") or [None] * len(ids)))
        return forward(ids, caches, **kw)

    prompt = torch.tensor([3, 14, 15, 92, 65, 35, 3, 14, 15, 92, 65, 35, 3, 14, 60, 61, 3, 14])
    ref = naive_greedy(llama_target, prompt, N_NEW)
    llama_target.forward_rows = logged
    try:
        prop = TreeProposer(None, lookup=True, verify_cost=cheap_chain)
        res = Engine(llama_target, prop).generate(prompt, GenerationConfig(max_new_tokens=N_NEW,
                                                                                      ignore_eos=True))
    finally:
        del llama_target.forward_rows
    assert res.token_ids == ref
    assert len(masks) > 3 and not any(masks)  # every verify was a causal chain (the prefill passes no mask either)
