"""The decode loop: greedy losslessness (fp32, token-exact) at both extremes, stops, streaming, bad input."""

import math

import pytest
import torch

from blockdraft.config import GenerationConfig, SamplingParams
from blockdraft.decode.engine import Engine
from blockdraft.decode.proposers import Proposer
from blockdraft.decode.tree import Tree
from blockdraft.decode.proposers.dflash import DFlashProposer
from blockdraft.models.target import TargetModel
from conftest import ToyTokenizer, naive_greedy, seeded, tiny_draft, tiny_llama

N_NEW = 40


class OracleProposer(Proposer):
    """Always right: proposes the true continuation (what a perfect drafter would)."""

    name = "oracle"
    layer_ids = ()

    def __init__(self, prompt_len: int, continuation: list[int], block_size: int) -> None:
        self.prompt_len, self.cont, self.block_size = prompt_len, continuation, block_size

    def start(self, prompt_ids, features):
        pass

    def propose(self, tokens, num_draft, sampling, generator):
        done = tokens.numel() - self.prompt_len
        nxt = self.cont[done: done + min(num_draft, self.block_size - 1)]
        return Tree.chain(tokens[-1], torch.tensor(nxt, dtype=torch.long))

    def accept(self, tree, path, features):
        pass


def _prompt(seed=0, n=11):
    return torch.randint(0, 90, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_greedy_dflash_is_token_exact(target: TargetModel, block_size: int):
    prompt = _prompt()
    ref = naive_greedy(target, prompt, N_NEW)
    cfg = GenerationConfig(max_new_tokens=N_NEW, ignore_eos=True)
    plain = Engine(target).generate(prompt, cfg)
    assert plain.token_ids == ref
    draft = tiny_draft(target, block_size=16)  # an untrained, essentially useless drafter
    res = Engine(target, DFlashProposer(draft, target, block_size=block_size)).generate(prompt, cfg)
    assert res.token_ids == ref
    assert len(res.stats.accept_lengths) >= 2, "several verify rounds"
    assert sum(res.stats.accept_lengths) + 1 == N_NEW
    assert all(1 <= a <= block_size for a in res.stats.accept_lengths)


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_greedy_oracle_is_token_exact_and_accepts_everything(target: TargetModel, block_size: int):
    prompt = _prompt(1)
    ref = naive_greedy(target, prompt, N_NEW)
    proposer = OracleProposer(prompt.numel(), ref, block_size)
    res = Engine(target, proposer).generate(prompt, GenerationConfig(max_new_tokens=N_NEW,
                                                                                ignore_eos=True))
    assert res.token_ids == ref
    # every step but the last (which is cut by max_new_tokens) commits a full block
    assert all(a == block_size for a in res.stats.accept_lengths[:-1])
    assert res.stats.target_forwards == 1 + len(res.stats.accept_lengths)
    assert res.stats.position_accepted == res.stats.position_trials


def test_multi_step_denoising_stays_lossless(llama_target):
    prompt = _prompt(2)
    ref = naive_greedy(llama_target, prompt, N_NEW)
    draft = tiny_draft(llama_target)
    eng = Engine(llama_target, DFlashProposer(draft, llama_target, denoise_steps=3))
    assert eng.generate(prompt, GenerationConfig(max_new_tokens=N_NEW, ignore_eos=True)).token_ids == ref


def test_sampling_is_reproducible_with_a_seed(llama_target):
    draft = tiny_draft(llama_target)
    eng = Engine(llama_target, DFlashProposer(draft, llama_target, denoise_steps=2))
    cfg = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    s = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7)
    a, b = eng.generate(_prompt(), cfg, s), eng.generate(_prompt(), cfg, s)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 30


def test_stops_on_eos_and_never_emits_past_it(llama_target):
    prompt = _prompt(3)
    ref = naive_greedy(llama_target, prompt, N_NEW)
    stop_tok = ref[7]
    first = ref.index(stop_tok)
    draft = tiny_draft(llama_target)
    for prop in (None, DFlashProposer(draft, llama_target), OracleProposer(prompt.numel(), ref, 8)):
        res = Engine(llama_target, prop).generate(
            prompt, GenerationConfig(max_new_tokens=N_NEW, ignore_eos=True, stop_token_ids=(stop_tok,)))
        assert res.token_ids == ref[: first + 1] and res.finish_reason == "stop"


def test_stop_strings_cut_text_and_tokens(llama_target):
    prompt = _prompt(4)
    ref = naive_greedy(llama_target, prompt, N_NEW)
    tok = ToyTokenizer()
    full = tok.decode(ref)
    stop = tok.decode(ref[10:12])
    cut = full.find(stop)
    eng = Engine(llama_target, OracleProposer(prompt.numel(), ref, 8))
    res = eng.generate(prompt, GenerationConfig(max_new_tokens=N_NEW, ignore_eos=True, stop_strings=(stop,)))
    assert res.text == full[:cut] and res.finish_reason == "stop"
    assert stop not in res.text and len(res.token_ids) <= 12


def test_streaming_equals_non_streaming(llama_target):
    prompt = _prompt(5)
    draft = tiny_draft(llama_target)
    eng = Engine(llama_target, DFlashProposer(draft, llama_target))
    cfg = GenerationConfig(max_new_tokens=N_NEW, ignore_eos=True, stop_strings=("zz",))
    gen = eng.stream(prompt, cfg)
    deltas = list(gen)
    assert len(deltas) > 1
    assert "".join(deltas) == gen.result.text == eng.generate(prompt, cfg).text


def test_max_new_tokens_is_exact(llama_target):
    prompt = _prompt(6)
    ref = naive_greedy(llama_target, prompt, 13)
    eng = Engine(llama_target, OracleProposer(prompt.numel(), ref + [0] * 20, 16))
    res = eng.generate(prompt, GenerationConfig(max_new_tokens=13, ignore_eos=True))
    assert res.token_ids == ref and res.finish_reason == "length"


def test_generation_stops_at_the_context_end():
    t = TargetModel(tiny_llama())  # max_position_embeddings 256
    prompt = _prompt(n=250)
    res = Engine(t).generate(prompt, GenerationConfig(max_new_tokens=50, ignore_eos=True))
    assert len(res.token_ids) <= 256 - 250 + 1 and res.finish_reason == "length"


def test_bad_input_is_a_clear_error(llama_target):
    eng = Engine(llama_target)
    with pytest.raises(ValueError, match="context"):
        eng.generate(_prompt(n=300))
    with pytest.raises(ValueError, match="non-empty"):
        eng.generate([])
    with pytest.raises(ValueError, match="vocabulary"):
        eng.generate([1, 2, 500])
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(temperature=float("nan"))):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError):
        GenerationConfig(max_new_tokens=0)


def test_reduced_draft_vocabulary_stays_lossless(llama_target, tmp_path):
    """A draft proposing among 20 of the 99 tokens: greedy output is still the target's, and the vocabulary
    mapping survives save/load (stored as vLLM's `d2t` offsets)."""
    from blockdraft.models.draft import DFlashDraftModel
    from blockdraft.models.draft_config import DFlashConfig

    cfg = DFlashConfig.from_target(llama_target.config, num_hidden_layers=1, block_size=8, mask_token_id=98,
                                   num_target_features=2, draft_vocab_size=20)
    with seeded(3):
        draft = DFlashDraftModel(cfg).eval()
    ids = torch.arange(0, 99, 5)[:20]
    draft.set_draft_vocab(ids)
    assert draft.vocab_ids.tolist() == ids.tolist()
    draft.save_pretrained(tmp_path, dtype=torch.float32)
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert loaded.vocab_ids.tolist() == ids.tolist() and loaded.d2t.dtype == torch.long
    prompt = _prompt(7)
    ref = naive_greedy(llama_target, prompt, N_NEW)
    eng = Engine(llama_target, DFlashProposer(loaded, llama_target))
    res = eng.generate(prompt, GenerationConfig(max_new_tokens=N_NEW, ignore_eos=True))
    assert res.token_ids == ref
    prop = DFlashProposer(loaded, llama_target)
    prop.start(prompt, llama_target(prompt.unsqueeze(0), None, tap=prop.layer_ids).features)
    p = prop.propose(torch.cat([prompt, torch.tensor([ref[0]])]), 7, SamplingParams(temperature=1.0),
                     torch.Generator().manual_seed(0))
    assert set(p.candidates.tolist()) <= set(ids.tolist())
    assert p.q.shape == (7, 99) and torch.allclose(p.q[:, ids].sum(-1), torch.ones(7))


def test_engines_sharing_one_target_each_tap_their_own_layers(one_thread):
    """Two DFlash drafts reading different target layers (2 vs 4 features) on one shared target, used alternately
    (as the benchmark and draft comparisons do): each generation taps its own draft's layers and stays lossless."""
    from blockdraft.models.draft import DFlashDraftModel
    from blockdraft.models.draft_config import DFlashConfig
    from conftest import MASK_ID

    target = TargetModel(tiny_llama(), ToyTokenizer())
    cfg = DFlashConfig.from_target(target.config, num_hidden_layers=1, block_size=5, mask_token_id=MASK_ID,
                                   target_layer_ids=[0, 4, 2, 3])
    with seeded(5):
        second = DFlashDraftModel(cfg).eval()
    engines = [Engine(target, DFlashProposer(tiny_draft(target, block_size=6), target)),
               Engine(target, DFlashProposer(second, target))]
    prompt = torch.tensor([4, 9, 33, 2, 71])
    want = naive_greedy(target, prompt, 12)
    for eng in engines + engines:
        assert eng.generate(prompt, GenerationConfig(max_new_tokens=12, ignore_eos=True)).token_ids == want


def test_adaptive_width_follows_the_verify_cost_and_stays_lossless(llama_target):
    """With a verify cost that makes every extra token dear, the width policy stops drafting once a draft call is
    priced (the second: the first pays one-time costs), exploring again every EXPLORE_ROW steps; with a flat one it
    drafts full blocks. The output is plain decoding's either way: only the number of drafted tokens changes,
    verification does not."""
    from blockdraft.decode.calibrate import VerifyCost
    from blockdraft.decode.policy import EXPLORE_ROW
    from blockdraft.decode.proposers.dflash import DFlashProposer

    prompt = torch.tensor([3, 17, 42, 5, 8, 61, 2])
    cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    want = Engine(llama_target).generate(prompt, cfg).token_ids
    draft = tiny_draft(llama_target, block_size=5)
    dear = VerifyCost([1.0] + [1000.0] * 15)
    # flat at 1000 s a verify: the measured draft time (ms, more on a busy machine) can never outweigh a drafted
    # token's expected gain, so the choice does not depend on how fast the machine is today
    flat = VerifyCost([1000.0] * 16)
    for cost in (dear, flat):
        res = Engine(llama_target, DFlashProposer(draft, llama_target), width_cost=cost).generate(prompt, cfg)
        assert res.token_ids == want
        widths = res.stats.widths
        if cost is dear:
            assert widths[:2] == [4, 4] and widths.count(0) > len(widths) // 2
            # a drafting step only to measure again: the first two, then one after each full run of skips (its
            # width is the block, or what is left of max_new_tokens)
            for i, w in enumerate(widths[2:], start=2):
                assert w == 0 or widths[i - EXPLORE_ROW:i] == [0] * EXPLORE_ROW, widths
        else:  # every step drafts what a fixed width drafts: the block, or what max_new_tokens leaves
            fixed = Engine(llama_target, DFlashProposer(draft, llama_target)).generate(prompt, cfg)
            assert widths == fixed.stats.widths and widths[0] == 4


def test_choose_width_maximises_expected_tokens_per_second():
    from blockdraft.decode.calibrate import VerifyCost
    from blockdraft.decode.policy import WidthPolicy

    cost = VerifyCost([1.0, 1.2, 1.5, 2.5, 3.0])
    prop = WidthPolicy(5, cost)
    for _ in range(2):  # the first call prices nothing (it pays one-time costs)
        prop.draft_seconds.update(0.3)
    prop.acceptance.accepted = [8.0, 5.0, 0.0, 4.0]  # with the one-in-two prior: rates .9 .6 .1 .5 over 10 trials
    prop.acceptance.trials = [8.0, 8.0, 8.0, 8.0]

    def naive(limit):
        # the policy reads each rate optimistically, by one standard error over its 10 (pseudo-)trials
        rates = [r + math.sqrt(r * (1 - r) / 10) for r in (0.9, 0.6, 0.1, 0.5)]
        best, best_rate = 0, 1 / cost.chain(1)
        for g in range(1, limit + 1):
            expected = 1 + sum(math.prod(rates[:i]) for i in range(1, g + 1))
            if expected / (cost.chain(g + 1) + 0.3) > best_rate:
                best, best_rate = g, expected / (cost.chain(g + 1) + 0.3)
        return best

    for limit in range(5):
        assert prop.choose(limit) == naive(limit)
    assert prop.choose(4) == 2  # the third position's 10% does not pay for its verify


def test_a_temperature_below_the_floor_decodes_greedily(llama_target):
    """1e-40 would divide the logits into inf and NaN; below GREEDY_BELOW the engine decodes greedily instead, with
    and without a draft, and gives exactly the greedy tokens."""
    from blockdraft.config import GREEDY_BELOW

    prompt = _prompt(3)
    greedy = Engine(llama_target).generate(prompt, GenerationConfig(max_new_tokens=20)).token_ids
    for t in (1e-40, GREEDY_BELOW / 2):
        assert SamplingParams(temperature=t).greedy
        for proposer in (None, DFlashProposer(tiny_draft(llama_target), llama_target)):
            got = Engine(llama_target, proposer).generate(prompt, GenerationConfig(max_new_tokens=20),
                                                          SamplingParams(temperature=t, seed=1)).token_ids
            assert got == greedy
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy


def test_draw_follows_the_weights_and_never_draws_a_zero(monkeypatch):
    """Each row's draws follow its weights (8,000 draws: index 1 holds a quarter, its binomial sd is ~39, so 5 sd of
    slack), zero weights are never drawn, and a draw at the very top of the cumulative sum still lands on a weight."""
    from blockdraft.decode.sampling import draw

    g = torch.Generator().manual_seed(3)
    w = torch.tensor([[0.0, 1.0, 0.0, 3.0, 0.0], [2.0, 0.0, 0.0, 0.0, 0.0]])
    counts = torch.zeros(2, 5)
    n = 8000
    for _ in range(n):
        d = draw(w, g)
        counts[0, d[0]] += 1
        counts[1, d[1]] += 1
    assert counts[0, [0, 2, 4]].sum() == 0 and counts[1, 0] == n
    assert abs(float(counts[0, 1]) - n / 4) < 5 * (n * 0.25 * 0.75) ** 0.5
    # u * total rounded up to the total (u = 1 stands for it): the row's last weighted index, not the zeros past it
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.ones(shape, dtype=torch.float64))
    assert draw(w, g).tolist() == [3, 0]


def test_sampling_refuses_a_row_that_is_not_a_distribution():
    from blockdraft.decode.sampling import sample

    g = torch.Generator().manual_seed(0)
    ok = torch.tensor([[0.25, 0.75]])
    assert sample(ok, g).shape == (1,)
    for bad in ([[float("nan"), 1.0]], [[0.0, 0.0]], [[float("inf"), 0.0]], [[-0.5, 1.5]]):
        with pytest.raises(ValueError, match="not finite or have no mass"):
            sample(torch.tensor(bad), g)
