"""The engine with many rows: every request's output equals what it gets alone (a batch of one) and what a naive
recomputation gives (fp32, token-exact), with continuous batching, ragged acceptance and widths, trees, per-row
stops, sampling, streaming and cancellation; the native stack's rows are bit-identical to solo forwards."""

import pytest
import torch

from blockdraft.models.cache import KVCache
from blockdraft.config import GenerationConfig, SamplingParams
from blockdraft.decode.engine import Engine
from blockdraft.decode.proposers import Proposer
from blockdraft.decode.tree import Tree
from blockdraft.decode.proposers.dflash import DFlashProposer
from blockdraft.decode.proposers.lookup import PromptLookupProposer
from blockdraft.decode.proposers.tree import TreeProposer
from blockdraft.models.quant import WeightPlan
from blockdraft.models.target import TargetModel
from conftest import ToyTokenizer, naive_greedy, seeded, tiny_draft, tiny_llama, tiny_llama_q


pytestmark = pytest.mark.usefixtures("one_thread")


LENGTHS = (5, 11, 17, 3, 29)
MAX_NEW = (40, 23, 31, 40, 9)


def _prompts(lengths=LENGTHS):
    return [torch.randint(0, 90, (n,), generator=torch.Generator().manual_seed(100 + n)) for n in lengths]


class RowOracle(Proposer):
    """Per-row oracle: knows the true continuation of every prompt and proposes it (full acceptance)."""

    name = "oracle"
    layer_ids = ()

    def __init__(self, refs: dict, block_size: int = 6) -> None:
        self.refs, self.block_size = refs, block_size
        self.cont, self.n0 = [], 0

    def fork(self):
        return RowOracle(self.refs, self.block_size)

    def start(self, prompt_ids, features):
        self.cont, self.n0 = self.refs[tuple(prompt_ids.tolist())], prompt_ids.numel()

    def propose(self, tokens, num_draft, sampling, generator):
        done = tokens.numel() - self.n0
        nxt = self.cont[done: done + min(num_draft, self.block_size - 1)]
        return Tree.chain(tokens[-1], torch.tensor(nxt, dtype=torch.long))

    def accept(self, tree, path, features):
        pass


def _setup(target: TargetModel, kind: str, prompts):
    """-> (make_solo_proposer, batched engine kwargs) for a proposer kind."""
    if kind == "ar":
        return (lambda: None), {}
    if kind == "selector":  # rows chosen in order by a chain selector (random weights, so it changes choices)
        with seeded(3):
            draft = tiny_draft(target, block_size=8).with_selector(6, 5).eval()
        with torch.no_grad():
            draft.selector.w_out.weight.normal_(0, 4.0, generator=torch.Generator().manual_seed(3))
        return (lambda: DFlashProposer(draft, target, block_size=5)), {"proposer": DFlashProposer(draft, target,
                                                                                                   block_size=5)}
    if kind.startswith("dflash"):
        draft = tiny_draft(target, block_size=16)
        bs = int(kind[len("dflash"):])
        proposer = DFlashProposer(draft, target, block_size=bs)
        return (lambda: DFlashProposer(draft, target, block_size=bs)), {"proposer": proposer}
    if kind == "pld":
        make = lambda: PromptLookupProposer(max_ngram=2, block_size=5)  # noqa: E731
        return make, {"proposer": make()}
    if kind == "oracle":
        refs = {tuple(p.tolist()): naive_greedy(target, p, 45) for p in prompts}
        return (lambda: RowOracle(refs)), {"proposer": RowOracle(refs)}
    if kind == "tree":  # a fixed budget: the trees do not depend on timings
        draft = tiny_draft(target, block_size=5)
        make = lambda: TreeProposer(DFlashProposer(draft, target), lookup=True, budget=9, top_k=3)  # noqa: E731
        return make, {"proposer": make()}
    raise ValueError(kind)


def _solo(target, make_proposer, requests):
    return [Engine(target, make_proposer()).generate(*req) for req in requests]


def _assert_same(batched, solo, stats=True):
    for i, (b, s) in enumerate(zip(batched, solo)):
        assert b.token_ids == s.token_ids, f"row {i}: batched tokens differ from solo"
        assert (b.text, b.finish_reason) == (s.text, s.finish_reason), f"row {i}"
        if stats:
            assert b.stats.accept_lengths == s.stats.accept_lengths, f"row {i}"
            assert b.stats.target_forwards == s.stats.target_forwards, f"row {i}"
            assert b.stats.position_trials == s.stats.position_trials, f"row {i}"
            assert b.stats.new_tokens == s.stats.new_tokens and b.stats.prompt_tokens == s.stats.prompt_tokens


@pytest.mark.parametrize("kind", ["ar", "dflash4", "dflash16", "selector", "pld", "oracle", "tree"])
def test_batched_greedy_equals_solo(target: TargetModel, kind: str):
    prompts = _prompts()
    requests = [(p, GenerationConfig(max_new_tokens=m, ignore_eos=True)) for p, m in zip(prompts, MAX_NEW)]
    make, kw = _setup(target, kind, prompts)
    solo = _solo(target, make, requests)
    eng = Engine(target, max_batch=3, **kw)  # 5 rows through 3 slots: rows join as others leave
    batched = eng.run(requests)
    _assert_same(batched, solo)
    verify_steps = sum(len(r.stats.accept_lengths) for r in solo)
    assert eng.batched_forwards < verify_steps, "rows shared target forwards"
    assert not eng.has_work and eng.cache_positions == 0
    if kind == "oracle":
        assert max(a for r in batched for a in r.stats.accept_lengths) == 6, "ragged multi-token commits"


def test_a_step_token_budget_keeps_greedy_output(llama_target):
    prompts = _prompts()
    requests = [(p, GenerationConfig(max_new_tokens=m, ignore_eos=True)) for p, m in zip(prompts, MAX_NEW)]
    make, kw = _setup(llama_target, "oracle", prompts)
    solo = _solo(llama_target, make, requests)
    eng = Engine(llama_target, max_batch=4, max_step_tokens=8, **kw)
    out = eng.run(requests)
    _assert_same(out, solo, stats=False)
    # 4 rows share 8 positions: 1 draft each (2 committed) until rows leave and the share grows
    assert max(r.stats.accept_lengths[0] for r in out) == 2 and max(a for r in out for a in r.stats.accept_lengths) > 2


def test_batched_equals_naive_recomputation(llama_target):
    """A reference with no cache at all: recompute the whole sequence for every token."""
    prompts = _prompts((7, 2, 13))
    eng = Engine(llama_target, DFlashProposer(tiny_draft(llama_target), llama_target, block_size=5))
    out = eng.run([(p, GenerationConfig(max_new_tokens=20, ignore_eos=True)) for p in prompts])
    for p, r in zip(prompts, out):
        assert r.token_ids == naive_greedy(llama_target, p, 20)


def test_rows_join_mid_flight_and_every_cache_holds_its_committed_tokens(llama_target):
    prompts = _prompts((9, 4, 21, 15, 6, 12))
    make, kw = _setup(llama_target, "dflash16", prompts)  # untrained draft, G = 15: mostly rejected
    reqs = [(p, GenerationConfig(max_new_tokens=30 + 3 * i, ignore_eos=True)) for i, p in enumerate(prompts)]
    solo = _solo(llama_target, make, reqs)
    eng = Engine(llama_target, max_batch=4, **kw)
    ids = [eng.add(*r) for r in reqs[:2]]
    results = {}
    for step in range(40):
        if step in (3, 5, 9):  # later arrivals (the 6th waits for a free row)
            ids += [eng.add(*r) for r in reqs[len(ids): len(ids) + (2 if step == 5 else 1)]]
        for ev in eng.step():
            if ev.finished:
                results[ev.request_id] = ev.result
        assert eng.num_active <= 4
        # the invariant of the step: a row's cache holds its committed tokens but the last, nothing else
        assert all(r.cache.length == r.tokens.numel() - 1 for r in eng._active)
    while eng.has_work:
        for ev in eng.step():
            if ev.finished:
                results[ev.request_id] = ev.result
    assert len(ids) == 6
    _assert_same([results[i] for i in ids], solo)


def test_tree_rows_compact_their_caches_to_a_rebuilt_cache(llama_target):
    """After every batched tree step, each row's compacted cache equals a cache rebuilt from scratch over its
    committed tokens. fp32; tolerance: a tree verify and a prefill sum in other orders, and this random llama carries
    the roundings to ~3e-5 in the deep layers' keys (as in test_lean); a wrong path or slot would move them by ~1."""
    prompts = _prompts((7, 13, 4))
    make, kw = _setup(llama_target, "tree", prompts)
    eng = Engine(llama_target, max_batch=3, **kw)
    for p in prompts:
        eng.add(p, GenerationConfig(max_new_tokens=24, ignore_eos=True))
    checked = 0
    while eng.has_work:
        eng.step()
        for row in eng._active:
            n = row.tokens.numel() - 1
            fresh = llama_target.new_decode_cache(64)
            llama_target.forward(row.tokens[:n].unsqueeze(0), fresh, tap=False)
            torch.testing.assert_close(row.cache.k[:, :, :, :n], fresh.k[:, :, :, :n], rtol=1e-3, atol=2e-4)
            torch.testing.assert_close(row.cache.v[:, :, :, :n], fresh.v[:, :, :, :n], rtol=1e-3, atol=2e-4)
            checked += 1
    assert checked > 10


def test_per_row_stops_never_emit_past_a_stop(llama_target):
    prompts = _prompts((8, 14, 5, 10, 3))
    refs = {tuple(p.tolist()): naive_greedy(llama_target, p, 45) for p in prompts}
    tok = ToyTokenizer()
    r0, r1, r4 = (refs[tuple(prompts[i].tolist())] for i in (0, 1, 4))
    stop_str = tok.decode(r1[9:11])
    configs = [
        GenerationConfig(max_new_tokens=40, ignore_eos=True, stop_token_ids=(r0[6],)),  # a stop id mid-block
        GenerationConfig(max_new_tokens=40, ignore_eos=True, stop_strings=(stop_str, "zz9")),  # stop strings
        GenerationConfig(max_new_tokens=13, ignore_eos=True),  # max tokens mid-block
        GenerationConfig(max_new_tokens=1),  # finished by the prefill's token
        GenerationConfig(max_new_tokens=40, stop_token_ids=(r4[3],)),  # EOS rules + a stop id
    ]
    reqs = list(zip(prompts, configs))
    for kind in ("oracle", "dflash8", "ar"):
        make, kw = _setup(llama_target, kind, prompts)
        solo = [Engine(llama_target, make(), tok).stream(*r) for r in reqs]
        solo_deltas = [list(g) for g in solo]
        eng = Engine(llama_target, tokenizer=tok, max_batch=4, **kw)
        ids = [eng.add(*r, text=True) for r in reqs]
        deltas = {i: [] for i in ids}
        results = {}
        while eng.has_work:
            for ev in eng.step():
                assert ev.request_id not in results, "no event after a row finished"
                if ev.text:
                    deltas[ev.request_id].append(ev.text)
                if ev.finished:
                    results[ev.request_id] = ev.result
        _assert_same([results[i] for i in ids], [g.result for g in solo])
        for i, s in zip(ids, solo_deltas):
            assert "".join(deltas[i]) == results[i].text == "".join(s)
        res = [results[i] for i in ids]
        assert res[0].token_ids == r0[: r0.index(r0[6]) + 1] and res[0].finish_reason == "stop"
        assert stop_str not in res[1].text and res[1].finish_reason == "stop"
        assert len(res[2].token_ids) == 13 and res[2].finish_reason == "length"
        assert len(res[3].token_ids) == 1
        assert res[4].token_ids == r4[: r4.index(r4[3]) + 1] and res[4].finish_reason == "stop"


def test_seeded_sampling_per_row_matches_solo(llama_target):
    prompts = _prompts((6, 12, 9))
    draft = tiny_draft(llama_target)
    make = lambda: DFlashProposer(draft, llama_target, denoise_steps=2)  # noqa: E731
    samplings = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7),
                 SamplingParams(temperature=1.3, seed=11), SamplingParams()]
    reqs = [(p, GenerationConfig(max_new_tokens=25, ignore_eos=True), s) for p, s in zip(prompts, samplings)]
    solo = _solo(llama_target, make, reqs)
    a = Engine(llama_target, make()).run(reqs)
    b = Engine(llama_target, make()).run(reqs)
    assert [r.token_ids for r in a] == [r.token_ids for r in b], "seeded rows are reproducible"
    _assert_same(a, solo, stats=False)
    other = Engine(llama_target, make()).run([(prompts[0], reqs[0][1], SamplingParams(temperature=0.8, seed=8))])
    assert other[0].token_ids != a[0].token_ids


def test_cancellation_drops_the_row_at_the_next_step(llama_target):
    prompts = _prompts((6, 9, 4, 7))
    reqs = [(p, GenerationConfig(max_new_tokens=30, ignore_eos=True)) for p in prompts]
    solo = _solo(llama_target, lambda: None, reqs)
    eng = Engine(llama_target, max_batch=3)
    ids = [eng.add(*r) for r in reqs]
    results, seen_after = {}, []
    eng.step()
    eng.step()
    assert eng.cancel(ids[1]) and eng.cancel(ids[3])  # one decoding, one still waiting
    evs = eng.step()
    cancelled = [e for e in evs if e.finished and e.result.finish_reason == "cancelled"]
    assert {e.request_id for e in cancelled} == {ids[1], ids[3]}
    got = {e.request_id: e.result for e in cancelled}
    assert got[ids[1]].token_ids == solo[1].token_ids[:3] and got[ids[3]].token_ids == []
    assert eng.num_active == 2
    while eng.has_work:
        for ev in eng.step():
            seen_after.append(ev.request_id)
            if ev.finished:
                results[ev.request_id] = ev.result
    assert ids[1] not in seen_after and ids[3] not in seen_after
    assert not eng.cancel(ids[1])
    _assert_same([results[ids[0]], results[ids[2]]], [solo[0], solo[2]])


def test_the_context_end_is_respected_per_row():
    t = TargetModel(tiny_llama(), ToyTokenizer())  # max_position_embeddings 256
    prompts = [_prompts((250,))[0], _prompts((5,))[0]]
    reqs = [(p, GenerationConfig(max_new_tokens=50, ignore_eos=True)) for p in prompts]
    draft = tiny_draft(t)
    make = lambda: DFlashProposer(draft, t, block_size=8)  # noqa: E731
    out = Engine(t, make()).run(reqs)
    _assert_same(out, _solo(t, make, reqs))
    assert len(out[0].token_ids) <= 256 - 250 + 1 and len(out[1].token_ids) == 50


def test_bad_input_is_a_clear_error(llama_target):
    eng = Engine(llama_target)
    with pytest.raises(ValueError, match="context"):
        eng.add(torch.zeros(300, dtype=torch.long))
    with pytest.raises(ValueError, match="non-empty"):
        eng.add([])
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add([1, 2, 500])
    eng.add([1, 2], request_id="a")
    with pytest.raises(ValueError, match="in use"):
        eng.add([1, 2], request_id="a")
    with pytest.raises(ValueError, match="max_batch"):
        Engine(llama_target, max_batch=0)
    with pytest.raises(ValueError, match="draft_max_batch"):
        Engine(llama_target, draft_max_batch=0)
    with pytest.raises(TypeError, match="not a Proposer"):
        Engine(llama_target, object())
    with pytest.raises(RuntimeError, match="idle"):
        eng.stream([1, 2])  # "a" is still waiting


def test_forks_share_the_prepacked_draft(llama_target):
    """A DFlash proposer forked for another row has its own context cache and rates but the same lean draft."""
    proto = DFlashProposer(tiny_draft(llama_target), llama_target)
    a, b = proto.fork(), proto.fork()
    assert a is not b and a.ctx is not b.ctx and a.lean is proto.lean and b.lean is proto.lean
    assert DFlashProposer(tiny_draft(llama_target), llama_target, lean=False).fork().lean is None
    tree = TreeProposer(proto, lookup=True, budget=5)
    t = tree.fork()
    assert t.draft is not proto and t.draft.lean is proto.lean and t._hits is not tree._hits


def test_draft_max_batch_verifies_plainly_and_keeps_the_output(llama_target):
    prompts = _prompts((5, 11, 17))
    make, kw = _setup(llama_target, "oracle", prompts)
    reqs = [(p, GenerationConfig(max_new_tokens=m, ignore_eos=True)) for p, m in zip(prompts, (6, 30, 40))]
    solo = _solo(llama_target, make, reqs)
    eng = Engine(llama_target, max_batch=3, draft_max_batch=2, **kw)
    out = eng.run(reqs)
    _assert_same(out, solo, stats=False)
    assert eng.plain_steps > 0
    # while all three decode, nobody drafts (one token per step); once one leaves, the oracle's blocks come back
    assert all(r.stats.accept_lengths[0] == 1 for r in out)
    assert max(a for r in out for a in r.stats.accept_lengths) > 1


def test_a_stream_abandoned_midway_leaves_the_engine_usable(llama_target):
    p = _prompts((6,))[0]
    cfg = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    eng = Engine(llama_target, DFlashProposer(tiny_draft(llama_target), llama_target), ToyTokenizer())
    gen = eng.stream(p, cfg)
    next(gen)
    gen.close()
    assert not eng.has_work
    assert eng.generate(p, cfg).token_ids == naive_greedy(llama_target, p, 12)


@pytest.mark.parametrize("selector", [False, True])
def test_sampling_inside_a_batch_keeps_the_target_distribution(selector):
    """Many seeded rows decoded together with an untrained draft (rejection sampling at the second token), alone or
    with a chain selector of random weights (its rows drawn from its own distribution): the joint distribution of
    the first two new tokens against the target's own, by a chi-square test. top_k = 3 leaves 9 cells (df = 8);
    threshold 31.8 is the 0.9999 quantile of chi2(8): with a random seed the false-failure rate would be 1e-4; the
    seeds are fixed, so the test is deterministic."""
    target = TargetModel(tiny_llama(layers=3, init=0.1), ToyTokenizer())
    draft = tiny_draft(target, block_size=4)
    if selector:
        with seeded(3):
            draft = draft.with_selector(6, 5).eval()
        with torch.no_grad():
            draft.selector.w_out.weight.normal_(0, 4.0, generator=torch.Generator().manual_seed(3))
    prompt = torch.tensor([4, 8, 15, 16, 23])
    smp = lambda s: SamplingParams(temperature=1.0, top_k=3, seed=s)  # noqa: E731
    cfg = GenerationConfig(max_new_tokens=3, ignore_eos=True)  # the prefill's token, then one drafted position
    n = 600
    eng = Engine(target, DFlashProposer(draft, target), max_batch=64)
    out = eng.run([(prompt, cfg, smp(s)) for s in range(n)])
    assert eng.batched_forwards > 0
    from blockdraft.decode.sampling import logits_to_probs

    with torch.no_grad():
        p1 = logits_to_probs(target.hf(prompt[None]).logits[0, -1], smp(0))
        firsts = p1.nonzero().squeeze(1).tolist()
        expected, cells = [], []
        for a in firsts:
            p2 = logits_to_probs(target.hf(torch.cat([prompt, torch.tensor([a])])[None]).logits[0, -1], smp(0))
            for b in p2.nonzero().squeeze(1).tolist():
                cells.append((a, b))
                expected.append(n * float(p1[a]) * float(p2[b]))
    counts = {c: 0 for c in cells}
    for r in out:
        counts[tuple(r.token_ids[:2])] += 1  # a pair outside the top-3 cells would raise KeyError: also a failure
    chi2 = sum((counts[c] - e) ** 2 / e for c, e in zip(cells, expected))
    assert len(cells) == 9 and chi2 < 31.8, (chi2, counts)


# ------------------------------------------------------------------------------------ the native stack's rows
def _clone(cache):
    c = type(cache).__new__(type(cache))
    c.k, c.v, c.length = cache.k.clone(), cache.v.clone(), cache.length
    return c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rows_equal_solo_forwards_bit_for_bit(dtype, one_thread):
    """One forward over three rows (a 4-token chain, a single token, a 4-node tree; caches of 9, 3 and 14
    positions) gives each row the bits of its own forward, logits, features and cache alike: the kernels compute
    each row alike whatever the batch, and every row attends over its own cache."""
    target = TargetModel(tiny_llama_q(dtype=dtype), ToyTokenizer(), layer_ids=(0, 2), weights=WeightPlan("int4"))
    assert target.lean.native is not None, target.lean.native_reason
    g = torch.Generator().manual_seed(12)
    caches = []
    for n in (9, 3, 14):
        c = target.new_decode_cache(8)  # small: rows grow their caches independently
        target.forward(torch.randint(0, 99, (1, n), generator=g), c)
        caches.append(c)
    ids = [torch.randint(0, 99, (t,), generator=g) for t in (4, 1, 4)]
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    pos = [torch.arange(9, 13), torch.tensor([3]), 14 + torch.tensor([0, 1, 1, 2])]
    masks = [None, None, tree]
    solo_caches = [_clone(c) for c in caches]
    batched = target.forward_rows(ids, caches, positions=pos, tree_masks=masks)
    for i in range(3):
        one = target.forward(ids[i][None], solo_caches[i], positions=pos[i][None], tree_mask=masks[i])
        assert torch.equal(batched[i].logits, one.logits), f"row {i}"
        assert torch.equal(batched[i].features, one.features), f"row {i}"
        n = caches[i].length
        assert n == solo_caches[i].length
        assert torch.equal(caches[i].k[:, :, :, :n], solo_caches[i].k[:, :, :, :n])
        assert torch.equal(caches[i].v[:, :, :, :n], solo_caches[i].v[:, :, :, :n])


def test_native_draft_rows_equal_solo_blocks(one_thread):
    from blockdraft.models.draft_lean import LeanDraft

    target = TargetModel(tiny_llama_q(), ToyTokenizer(), weights=WeightPlan("int8"))
    draft = tiny_draft(target, block_size=5)
    lean = LeanDraft(draft, weights="int8")
    assert lean.native is not None
    g = torch.Generator().manual_seed(13)
    ctxs = []
    for n in (6, 11):
        c = KVCache(draft.config.num_hidden_layers, 1, draft.config.num_key_value_heads, draft.config.head_dim, 4,
                    draft.dtype)
        feats = torch.randn(1, n, draft.config.num_fused_inputs * draft.config.hidden_size, generator=g)
        lean.append_context(feats, torch.arange(n)[None], c)
        ctxs.append(c)
    blocks = [torch.randn(t, draft.config.hidden_size, generator=g) for t in (5, 3)]
    pos = [torch.arange(5, 10), torch.arange(10, 13)]
    solo = [lean.forward(b[None], p[None], _clone(c))[0] for b, p, c in zip(blocks, pos, ctxs)]
    both = lean.forward_rows(torch.cat(blocks), torch.cat(pos), ctxs, [5, 3])
    assert torch.equal(both, torch.cat(solo))
    assert [c.length for c in ctxs] == [6, 11], "a block's keys are written after the context, not kept"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_engine_batched_equals_solo_in_every_statistic(dtype, one_thread):
    """On the native stack a batched row is its solo run bit for bit, so even in bf16 every row's tokens and
    acceptance match its run alone (drafts batched in one draft forward too)."""
    target = TargetModel(tiny_llama_q(dtype=dtype), ToyTokenizer(), weights=WeightPlan("int4"))
    draft = tiny_draft(target, block_size=5, dtype=dtype)
    prompts = _prompts((7, 19, 3, 12))
    reqs = [(p, GenerationConfig(max_new_tokens=m, ignore_eos=True)) for p, m in zip(prompts, (30, 22, 35, 9))]
    proto = DFlashProposer(draft, target, draft_weights="int8")  # what DecodeSpec gives a quantized target
    assert proto.lean.native is not None
    solo = [Engine(target, proto.fork()).generate(*r) for r in reqs]
    eng = Engine(target, proto, max_batch=3)
    out = eng.run(reqs)
    _assert_same(out, solo)
    assert eng.batched_forwards > 0


def test_the_measured_batch_policy_drafts_only_where_it_pays(llama_target):
    """With two or more rows, a step drafts when the verify cost says drafting commits more tokens per second: a
    cost that grows steeply with the width makes every step plain (until an exploring step), a flat one keeps
    drafting. Greedy output is the same either way."""
    from blockdraft.decode.calibrate import VerifyCost
    from blockdraft.decode.policy import EXPLORE_BATCH

    prompts = _prompts((5, 11, 17))
    make, kw = _setup(llama_target, "oracle", prompts)
    reqs = [(p, GenerationConfig(max_new_tokens=30, ignore_eos=True)) for p in prompts]
    solo = _solo(llama_target, make, reqs)
    steep = VerifyCost(seconds=[float(w) ** 2 for w in range(1, 65)])  # w tokens cost w^2: never worth a block
    flat = VerifyCost(seconds=[1.0] * 64)
    eng = Engine(llama_target, max_batch=3, batch_cost=steep, **kw)
    out = eng.run(reqs)
    _assert_same(out, solo, stats=False)
    assert all(r.stats.accept_lengths[0] == 1 for r in out)  # three rows from the first step on: plain
    assert eng.plain_steps >= EXPLORE_BATCH
    make, kw = _setup(llama_target, "oracle", prompts)
    eng = Engine(llama_target, max_batch=3, batch_cost=flat, **kw)
    _assert_same(eng.run(reqs), solo)
    assert eng.plain_steps == 0
