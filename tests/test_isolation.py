"""One row's trouble stays in its row: a fault in any phase of a step (admission, drafting, verification) fails that
row alone while rows finishing, cancelled and waiting beside it go on with the tokens they get alone; a step that
fails outside every row still hands over what it produced; the scheduler leaves no handle waiting."""

import pytest
import torch

from blockdraft.config import GenerationConfig, SamplingParams
from blockdraft.decode.engine import Engine, StepError
from blockdraft.decode.proposers import Proposer
from blockdraft.decode.tree import Tree

POISON = 77  # a prompt whose first token is this one is the faulty row


class FaultyProposer(Proposer):
    """Drafts the next tokens as repeats of the last one (often wrong, always lossless), and raises in `phase` for
    a row whose prompt starts with POISON."""

    name = "faulty"
    block_size = 4
    layer_ids = (1,)  # read features, so that the engine hands them over in `accept` (after verification)

    def __init__(self, phase: str) -> None:
        self.phase, self.poisoned = phase, False

    def fork(self) -> "FaultyProposer":
        return FaultyProposer(self.phase)

    def start(self, prompt_ids, features):
        self.poisoned = int(prompt_ids[0]) == POISON
        if self.poisoned and self.phase == "admission":
            raise RuntimeError("injected admission fault")

    def propose(self, tokens, num_draft, sampling, generator):
        if self.poisoned and self.phase == "drafting":
            raise RuntimeError("injected drafting fault")
        return Tree.chain(tokens[-1], tokens[-1:].repeat(num_draft))

    def accept(self, tree, path, features):
        if self.poisoned and self.phase == "verification":
            raise RuntimeError("injected verification fault")


def _prompts():
    g = torch.Generator().manual_seed(5)
    out = [torch.randint(1, 90, (n,), generator=g) for n in (7, 11, 9, 6, 8)]
    out[2][0] = POISON
    return out


def _solo(target, prompt, cfg):
    return Engine(target).generate(prompt, cfg).token_ids


@pytest.mark.parametrize("phase", ["admission", "drafting", "verification"])
def test_a_fault_in_one_row_fails_that_row_alone(llama_target, phase):
    prompts = _prompts()
    cfgs = [GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in (12, 1, 12, 9, 12)]
    eng = Engine(llama_target, FaultyProposer(phase), max_batch=3)  # two rows wait in the queue at first
    ids = [eng.add(p, c) for p, c in zip(prompts, cfgs)]
    cancelled = eng.add(prompts[0], cfgs[0])
    eng.cancel(cancelled)
    finished: dict = {}
    for _ in range(200):
        for ev in eng.step():
            if ev.finished:
                assert ev.request_id not in finished, "a row finished twice"
                finished[ev.request_id] = ev.result
        if not eng.has_work:
            break
    assert set(finished) == set(ids) | {cancelled}
    assert finished[cancelled].finish_reason == "cancelled"
    bad = finished[ids[2]]
    assert bad.finish_reason == "error" and f"injected {phase} fault" in bad.error
    for i in (0, 1, 3, 4):
        assert finished[ids[i]].finish_reason == "length"
        assert finished[ids[i]].token_ids == _solo(llama_target, prompts[i], cfgs[i])


def test_a_row_with_non_finite_probabilities_fails_alone(llama_target, monkeypatch):
    """A sampled row whose distribution is not finite (here: the sampler forced to see NaN for one seed) fails with
    a clear error; a greedy row beside it finishes with its solo tokens."""
    import blockdraft.decode.engine as engine_mod

    real = engine_mod.pick_token

    def pick(logits, sampling, generator):
        if sampling.seed == 13:
            logits = torch.full_like(logits, float("nan"))
        return real(logits, sampling, generator)

    monkeypatch.setattr(engine_mod, "pick_token", pick)
    prompts = _prompts()
    cfg = GenerationConfig(max_new_tokens=10, ignore_eos=True)
    eng = Engine(llama_target)
    bad = eng.add(prompts[0], cfg, SamplingParams(temperature=0.7, seed=13))
    good = eng.add(prompts[1], cfg)
    done = {}
    while eng.has_work:
        done.update({ev.request_id: ev.result for ev in eng.step() if ev.finished})
    assert done[bad].finish_reason == "error" and "not finite" in done[bad].error
    assert done[good].token_ids == _solo(llama_target, prompts[1], cfg)


def test_a_step_failing_outside_any_row_still_hands_over_its_events(llama_target, monkeypatch):
    """Rows finished during admission reach the caller through StepError.events even though the decode part of
    the same step raised; after reset() the engine serves again."""
    prompts = _prompts()
    eng = Engine(llama_target)
    one = eng.add(prompts[0], GenerationConfig(max_new_tokens=1))
    eng.add(prompts[1], GenerationConfig(max_new_tokens=8))

    def broken(*a, **k):
        raise RuntimeError("injected engine fault")

    monkeypatch.setattr(eng, "_limits", broken)
    with pytest.raises(StepError, match="injected engine fault") as info:
        eng.step()
    done = [ev for ev in info.value.events if ev.finished]
    assert [ev.request_id for ev in done] == [one] and done[0].result.finish_reason == "length"
    monkeypatch.undo()
    eng.reset()
    cfg = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    assert eng.generate(prompts[3], cfg).token_ids == _solo(llama_target, prompts[3], cfg)


def test_the_scheduler_fails_or_completes_every_handle(llama_target, monkeypatch):
    """A step that fails outside the rows: the row it finished completes, every other handle fails with an error
    (none is left waiting), and the next requests are served normally."""
    from blockdraft.serve.scheduler import Scheduler

    prompts = _prompts()
    eng = Engine(llama_target, max_batch=4)
    sched = Scheduler(eng, max_queue=8)
    sched.start()
    try:
        real = eng._limits
        fired = []

        def flaky(rows, events):
            # once, when the three 8-token rows decode together (however the worker happened to admit them)
            if len(rows) >= 3 and not fired:
                fired.append(1)
                raise RuntimeError("injected engine fault")
            return real(rows, events)

        monkeypatch.setattr(eng, "_limits", flaky)
        handles = [sched.submit(prompts[0].tolist(), GenerationConfig(max_new_tokens=1), SamplingParams())]
        handles += [sched.submit(p.tolist(), GenerationConfig(max_new_tokens=8, ignore_eos=True), SamplingParams())
                    for p in prompts[1:4]]
        outcomes = []
        for h in handles:
            try:
                outcomes.append(h.wait(timeout=60).finish_reason)
            except RuntimeError as e:
                outcomes.append(f"error: {e}")
        assert outcomes[0] == "length"
        assert all(o.startswith("error") and "injected engine fault" in o for o in outcomes[1:])
        cfg = GenerationConfig(max_new_tokens=6, ignore_eos=True)
        again = sched.submit(prompts[4].tolist(), cfg, SamplingParams()).wait(timeout=60)
        assert again.token_ids == _solo(llama_target, prompts[4], cfg)
        m = sched.metrics()
        assert m["active"] == 0 and m["queued"] == 0 and m["errors"] == 3 and m["completed"] == 2
    finally:
        sched.stop()


def test_a_long_prompt_is_prefilled_between_the_running_rows_steps(llama_target):
    """While a row decodes, a newly admitted long prompt is prefilled one chunk per step: the running row commits
    tokens in every one of those steps instead of waiting for the whole prefill, and both rows get exactly the
    tokens they get alone (the same chunks, in the same order, as a prefill on an idle engine)."""
    g = torch.Generator().manual_seed(9)
    short, long = torch.randint(1, 90, (6,), generator=g), torch.randint(1, 90, (41,), generator=g)
    cfg = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    eng = Engine(llama_target, max_batch=4, prefill_chunk=8)
    a = eng.add(short, cfg)
    eng.step()  # the short row is admitted and decoding
    b = eng.add(long, cfg)
    progress, results = [], {}
    while eng.has_work:
        events = eng.step()
        counts = {ev.request_id: ev.num_tokens for ev in events}
        results.update({ev.request_id: ev.result.token_ids for ev in events if ev.finished})
        progress.append((counts.get(a), counts.get(b)))
    for ev_a, ev_b in progress[:5]:  # 41 tokens in chunks of 8: the long row's first token comes in step 6
        assert ev_a is not None and ev_b is None
    assert progress[5][1] is not None  # its prompt is in: first token, and it decodes in the same step
    for rid, prompt in ((a, short), (b, long)):
        assert results[rid] == Engine(llama_target, prefill_chunk=8).generate(prompt, cfg).token_ids
