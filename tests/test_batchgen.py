"""Batched left-padded generation on the lean path (data regeneration) against its naive reference: each row alone,
recomputed from scratch every token."""

from __future__ import annotations

import pytest
import torch

from blockdraft.batchgen import generate_batch
from blockdraft.target import TargetModel

from conftest import ToyTokenizer, naive_greedy, tiny_llama, tiny_qwen3


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3])
def test_batch_rows_equal_their_naive_greedy(make, one_thread):
    target = TargetModel(make(), ToyTokenizer())
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 99, (n,), generator=g).tolist() for n in (7, 1, 12, 4)]  # padding of 5, 11, 0, 8
    outs = generate_batch(target, prompts, 9, eos_ids=[])
    for p, o in zip(prompts, outs):
        assert o == naive_greedy(target, torch.tensor(p), 9)


def test_rows_stop_at_their_own_eos(one_thread):
    target = TargetModel(tiny_llama(), ToyTokenizer())
    prompts = [[5, 6, 7], [40, 41], [9]]
    free = generate_batch(target, prompts, 8, eos_ids=[])
    stop = free[1][2]  # row 1's third token becomes an end-of-sequence token
    outs = generate_batch(target, prompts, 8, eos_ids=[stop])
    for f, o in zip(free, outs):
        cut = f.index(stop) + 1 if stop in f else len(f)
        assert o == f[:cut]  # ended rows keep their eos and nothing after it; the others run on unchanged
    assert outs[1][-1] == stop and len(outs[1]) <= 3


def test_sampling_is_reproducible_and_checked(one_thread):
    target = TargetModel(tiny_llama(), ToyTokenizer())
    a = generate_batch(target, [[1, 2], [3]], 6, [], temperature=1.0, generator=torch.Generator().manual_seed(0))
    b = generate_batch(target, [[1, 2], [3]], 6, [], temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert a == b
    with pytest.raises(ValueError, match="temperature"):
        generate_batch(target, [[1]], 2, [], temperature=-1.0)
    with pytest.raises(ValueError, match="at least one token"):
        generate_batch(target, [[1], []], 2, [])
    with pytest.raises(ValueError, match="lean"):
        generate_batch(TargetModel(tiny_llama(), ToyTokenizer(), lean=False), [[1]], 2, [])
