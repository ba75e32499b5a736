"""Prompt-lookup drafting: n-gram matches on hand-made sequences, and greedy losslessness through the engine."""

import pytest
import torch

from blockdraft.config import GenerationConfig, SamplingParams
from blockdraft.decode.engine import Engine
from blockdraft.models.ngram import find_continuation
from blockdraft.decode.proposers.lookup import PromptLookupProposer
from conftest import naive_greedy


pytestmark = pytest.mark.usefixtures("one_thread")


def cont(seq, k=10, **kw):
    return find_continuation(torch.tensor(seq), k, **kw).tolist()


def test_copies_what_followed_the_earlier_occurrence():
    assert cont([1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2, 3]  # continuation runs up to the end of the sequence
    assert cont([1, 2, 3, 4, 1, 2, 3], k=2) == [4, 1]


def test_most_recent_match_wins():
    # [5, 6] occurs at 0 (-> 7) and at 3 (-> 8); the 3-gram [8, 5, 6] never occurred before
    assert cont([5, 6, 7, 5, 6, 8, 5, 6]) == [8, 5, 6]


def test_longest_ngram_first():
    seq = [7, 2, 9, 4, 8, 2, 9, 5, 7, 2, 9]
    assert cont(seq, k=3) == [4, 8, 2]  # the 3-gram [7, 2, 9] at 0, not the later 2-gram [2, 9] at 5
    assert cont(seq, k=3, max_ngram=2) == [5, 7, 2]


def test_no_match_and_limits():
    assert cont([1, 2, 3]) == []
    assert cont([4]) == []
    assert cont([3, 1, 2, 3], k=0) == []
    assert cont([3, 1, 2, 3]) == [1, 2, 3]
    assert cont([3, 1, 2, 3], min_ngram=2) == []  # only a unigram matches
    assert cont([3, 3]) == [3]  # a repeat: the only earlier occurrence is followed by the last token


def test_proposer_protocol():
    p = PromptLookupProposer()
    assert p.name == "pld" and p.layer_ids == () and p.block_size == 16
    toks = torch.tensor([1, 2, 3, 4, 5, 6, 1, 2])
    prop = p.propose(toks, 3, SamplingParams(), None)
    assert prop.candidates.tolist() == [3, 4, 5] and prop.tokens.dtype == torch.long and prop.q is None
    assert prop.is_chain and int(prop.tokens[0]) == 2  # rooted at the last committed token
    assert PromptLookupProposer(num_pred=2).propose(toks, 5, SamplingParams(), None).candidates.tolist() == [3, 4]
    with pytest.raises(ValueError):
        PromptLookupProposer(max_ngram=1, min_ngram=2)


@pytest.mark.parametrize("block_size", [3, 16])
def test_greedy_pld_is_token_exact(target, block_size):

    prompt = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 9, 10, 11, 12, 9, 10, 11])
    ref = naive_greedy(target, prompt, 40)
    cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    res = Engine(target, PromptLookupProposer(block_size=block_size)).generate(prompt, cfg)
    assert res.token_ids == ref
    assert sum(res.stats.accept_lengths) + 1 == 40
    assert all(1 <= a <= block_size for a in res.stats.accept_lengths)
    assert res.stats.target_forwards == 1 + len(res.stats.accept_lengths)


def test_sampled_pld_is_reproducible(llama_target):
    eng = Engine(llama_target, PromptLookupProposer())
    prompt = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5, 6])
    s = SamplingParams(temperature=1.0, seed=3)
    cfg = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    a, b = eng.generate(prompt, cfg, s), eng.generate(prompt, cfg, s)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 30
