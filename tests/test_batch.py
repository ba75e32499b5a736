"""BatchedEngine: every request's output equals what it gets alone through SpeculativeEngine (fp32, token-exact),
with continuous batching, ragged acceptance, per-row stops, sampling, streaming and cancellation."""

import pytest
import torch

from blockdraft.batch import BatchedEngine
from blockdraft.config import GenerationConfig, SamplingParams
from blockdraft.engine import SpeculativeEngine
from blockdraft.proposers import Proposal
from blockdraft.proposers.dflash import DFlashProposer
from blockdraft.proposers.lookup import PromptLookupProposer
from blockdraft.target import TargetModel
from conftest import ToyTokenizer, naive_greedy, tiny_draft, tiny_llama


pytestmark = pytest.mark.usefixtures("one_thread")


LENGTHS = (5, 11, 17, 3, 29)
MAX_NEW = (40, 23, 31, 40, 9)


def _prompts(lengths=LENGTHS):
    return [torch.randint(0, 90, (n,), generator=torch.Generator().manual_seed(100 + n)) for n in lengths]


class RowOracle:
    """Per-row oracle: knows the true continuation of every prompt and proposes it (full acceptance)."""

    name = "oracle"
    layer_ids = ()

    def __init__(self, refs: dict, block_size: int = 6) -> None:
        self.refs, self.block_size = refs, block_size
        self.cont, self.n0 = [], 0

    def start(self, prompt_ids, features):
        self.cont, self.n0 = self.refs[tuple(prompt_ids.tolist())], prompt_ids.numel()

    def propose(self, tokens, num_draft, sampling, generator):
        done = tokens.numel() - self.n0
        nxt = self.cont[done: done + min(num_draft, self.block_size - 1)]
        return Proposal(torch.tensor(nxt, dtype=torch.long), None)

    def accept(self, features, num_committed):
        pass


def _setup(target: TargetModel, kind: str, prompts):
    """-> (make_solo_proposer, batched engine kwargs) for a proposer kind."""
    if kind == "ar":
        return (lambda: None), {}
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
        return (lambda: RowOracle(refs)), {"proposer_factory": lambda: RowOracle(refs)}
    raise ValueError(kind)


def _solo(target, make_proposer, requests):
    return [SpeculativeEngine(target, make_proposer()).generate(*req) for req in requests]


def _assert_same(batched, solo, stats=True):
    for i, (b, s) in enumerate(zip(batched, solo)):
        assert b.token_ids == s.token_ids, f"row {i}: batched tokens differ from solo"
        assert (b.text, b.finish_reason) == (s.text, s.finish_reason), f"row {i}"
        if stats:
            assert b.stats.accept_lengths == s.stats.accept_lengths, f"row {i}"
            assert b.stats.target_forwards == s.stats.target_forwards, f"row {i}"
            assert b.stats.position_trials == s.stats.position_trials, f"row {i}"
            assert b.stats.new_tokens == s.stats.new_tokens and b.stats.prompt_tokens == s.stats.prompt_tokens


@pytest.mark.parametrize("kind", ["ar", "dflash4", "dflash16", "pld", "oracle"])
def test_batched_greedy_equals_solo(target: TargetModel, kind: str):
    prompts = _prompts()
    requests = [(p, GenerationConfig(max_new_tokens=m, ignore_eos=True)) for p, m in zip(prompts, MAX_NEW)]
    make, kw = _setup(target, kind, prompts)
    solo = _solo(target, make, requests)
    eng = BatchedEngine(target, max_batch=3, **kw)  # 5 rows through 3 slots: rows join as others leave
    batched = eng.run(requests)
    _assert_same(batched, solo)
    verify_steps = sum(len(r.stats.accept_lengths) for r in solo)
    assert eng.batched_forwards < verify_steps, "rows shared target forwards"
    assert not eng.has_work and eng.cache_slots == 0
    if kind == "oracle":
        assert max(a for r in batched for a in r.stats.accept_lengths) == 6, "ragged multi-token commits"


def test_a_step_token_budget_keeps_greedy_output(llama_target):
    prompts = _prompts()
    requests = [(p, GenerationConfig(max_new_tokens=m, ignore_eos=True)) for p, m in zip(prompts, MAX_NEW)]
    make, kw = _setup(llama_target, "oracle", prompts)
    solo = _solo(llama_target, make, requests)
    eng = BatchedEngine(llama_target, max_batch=4, max_step_tokens=8, **kw)
    out = eng.run(requests)
    _assert_same(out, solo, stats=False)
    # 4 rows share 8 positions: 1 draft each (2 committed) until rows leave and the share grows
    assert max(r.stats.accept_lengths[0] for r in out) == 2 and max(a for r in out for a in r.stats.accept_lengths) > 2


def test_batched_equals_naive_recomputation(llama_target):
    """A reference with no cache at all: recompute the whole sequence for every token."""
    prompts = _prompts((7, 2, 13))
    eng = BatchedEngine(llama_target, DFlashProposer(tiny_draft(llama_target), llama_target, block_size=5))
    out = eng.run([(p, GenerationConfig(max_new_tokens=20, ignore_eos=True)) for p in prompts])
    for p, r in zip(prompts, out):
        assert r.token_ids == naive_greedy(llama_target, p, 20)


def test_rows_join_mid_flight_and_the_cache_is_compacted(llama_target):
    prompts = _prompts((9, 4, 21, 15, 6, 12))
    make, kw = _setup(llama_target, "dflash16", prompts)  # untrained draft, G = 15: mostly holes
    reqs = [(p, GenerationConfig(max_new_tokens=30 + 3 * i, ignore_eos=True)) for i, p in enumerate(prompts)]
    solo = _solo(llama_target, make, reqs)
    eng = BatchedEngine(llama_target, max_batch=4, **kw)
    ids = [eng.add(*r) for r in reqs[:2]]
    results = {}
    for step in range(40):
        if step in (3, 5, 9):  # later arrivals (the 6th waits for a free row)
            ids += [eng.add(*r) for r in reqs[len(ids): len(ids) + (2 if step == 5 else 1)]]
        for ev in eng.step():
            if ev.finished:
                results[ev.request_id] = ev.result
        assert eng.num_active <= 4
    while eng.has_work:
        for ev in eng.step():
            if ev.finished:
                results[ev.request_id] = ev.result
    assert len(ids) == 6
    _assert_same([results[i] for i in ids], solo)
    assert eng.compactions > 0
    # holes never pile up: the cache stays within the longest sequence plus a bounded slack
    assert eng.max_cache_slots <= 21 + 45 + 2 * 16 + 8


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
        solo = [SpeculativeEngine(llama_target, make(), tok).stream(*r) for r in reqs]
        solo_deltas = [list(g) for g in solo]
        eng = BatchedEngine(llama_target, tokenizer=tok, max_batch=4, **kw)
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
    a = BatchedEngine(llama_target, make()).run(reqs)
    b = BatchedEngine(llama_target, make()).run(reqs)
    assert [r.token_ids for r in a] == [r.token_ids for r in b], "seeded rows are reproducible"
    _assert_same(a, solo, stats=False)
    other = BatchedEngine(llama_target, make()).run([(prompts[0], reqs[0][1], SamplingParams(temperature=0.8, seed=8))])
    assert other[0].token_ids != a[0].token_ids


def test_cancellation_drops_the_row_at_the_next_step(llama_target):
    prompts = _prompts((6, 9, 4, 7))
    reqs = [(p, GenerationConfig(max_new_tokens=30, ignore_eos=True)) for p in prompts]
    solo = _solo(llama_target, lambda: None, reqs)
    eng = BatchedEngine(llama_target, max_batch=3)
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
    out = BatchedEngine(t, make()).run(reqs)
    _assert_same(out, _solo(t, make, reqs))
    assert len(out[0].token_ids) <= 256 - 250 + 1 and len(out[1].token_ids) == 50


def test_bad_input_is_a_clear_error(llama_target):
    eng = BatchedEngine(llama_target)
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
        BatchedEngine(llama_target, max_batch=0)
    with pytest.raises(ValueError, match="proposer_factory"):
        BatchedEngine(llama_target, RowOracle({}))


def test_per_row_dflash_clones_share_the_prepacked_draft(llama_target):
    """The batched engine clones the DFlash proposer per row (each row needs its own context cache) but not its
    lean draft weights: every clone uses the prototype's LeanDraft."""
    from blockdraft.batch import proposer_factory_for

    proto = DFlashProposer(tiny_draft(llama_target), llama_target)
    make = proposer_factory_for(proto)
    a, b = make(), make()
    assert a is not b and a.ctx is not b.ctx and a.lean is proto.lean and b.lean is proto.lean
    plain = proposer_factory_for(DFlashProposer(tiny_draft(llama_target), llama_target, lean=False))()
    assert plain.lean is None
