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


def test_grouped_decode_attention_equals_sdpa():
    """The single-query decode step's attention against torch's reference kernel (fp32; tolerance: float rounding of the
    two summation orders). Odd sizes: 6 query heads over 2 key/value heads, head dim 5, 13 keys, ragged padding."""
    from blockdraft.lean import grouped_decode_attention

    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(4, h, n, 5, generator=g) for h, n in ((6, 1), (2, 13), (2, 13)))
    real = torch.arange(13) >= torch.tensor([0, 5, 12, 3]).unsqueeze(1)  # row r's first real key
    mask = real[:, None, None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    got = grouped_decode_attention(q, k, v, mask)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    # a padded key must not count: moving it changes nothing
    k2 = k.clone()
    k2[1, :, :5] = 100.0
    torch.testing.assert_close(grouped_decode_attention(q, k2, v, mask), got, rtol=0, atol=0)
    # unmasked (a plain decode step): every key counts
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(grouped_decode_attention(q, k, v), ref, rtol=1e-5, atol=1e-6)


def test_grouped_decode_attention_as_accurate_as_sdpa():
    """Against a float64 reference, the fp32 grouped attention errs no more than torch's fp32 kernel does (up to a
    small slack for rounding luck), also with large scores (x20: near one-hot softmax), where rounding matters most."""
    from blockdraft.lean import grouped_decode_attention

    sdpa = torch.nn.functional.scaled_dot_product_attention
    g = torch.Generator().manual_seed(5)
    for scale in (1.0, 5.0, 20.0):
        q = torch.randn(3, 6, 1, 16, generator=g) * scale
        k = torch.randn(3, 2, 37, 16, generator=g) * scale
        v = torch.randn(3, 2, 37, 16, generator=g)
        exact = sdpa(q.double(), k.double(), v.double(), enable_gqa=True)
        err_sdpa = (sdpa(q, k, v, enable_gqa=True).double() - exact).abs().max().item()
        err_grouped = (grouped_decode_attention(q, k, v).double() - exact).abs().max().item()
        assert err_grouped <= 4 * err_sdpa + 1e-6, (scale, err_grouped, err_sdpa)
