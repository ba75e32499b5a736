"""The lean target path (fused, prepacked weights on a preallocated KV cache) against its naive twin, the HF modules
on their own cache: same logits and features, same rollback behaviour, same greedy tokens."""

from __future__ import annotations

import pytest
import torch

from blockdraft.models import lean as lean_module
from blockdraft.models.cache import KVCache
from blockdraft.config import GenerationConfig
from blockdraft.decode.engine import Engine
from blockdraft.models.lean import LeanDecoder, Linear, packed_linear_available
from blockdraft.models.target import TargetCache, TargetModel

from conftest import ToyTokenizer, naive_greedy, tiny_draft, tiny_llama, tiny_qwen2_with_biases, tiny_qwen3


def _pair(kind: str, dtype=torch.float32) -> tuple[TargetModel, TargetModel]:
    """The same weights behind a lean target and an HF-only target."""
    hf = (tiny_llama() if kind == "llama" else tiny_qwen3()).to(dtype)
    return TargetModel(hf, ToyTokenizer(), layer_ids=(0, 2, 3)), TargetModel(hf, ToyTokenizer(), layer_ids=(0, 2, 3),
                                                                           lean=False)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("grouped_from", [0, 10 ** 6])  # q = 1 steps through grouped_decode_attention / torch's SDPA
def test_lean_matches_hf_forward_with_rollback(kind, grouped_from, one_thread, monkeypatch):
    monkeypatch.setattr(lean_module, "GROUPED_MIN_KEYS", grouped_from)
    lean, ref = _pair(kind)
    assert lean.lean is not None and ref.lean is None and ref.lean_reason == "disabled"
    c_lean, c_ref = lean.new_decode_cache(capacity=8), ref.new_decode_cache()  # capacity 8: growth is exercised
    assert isinstance(c_lean, KVCache) and isinstance(c_ref, TargetCache)
    g = torch.Generator().manual_seed(0)
    steps = [11, 1, 5, 1, 7]  # prefill, then decode steps of q = 1 and verify blocks of q > 1
    keep = [11, 1, 2, 1, 4]  # positions kept after each step: a rejected tail is cropped away
    for q, k in zip(steps, keep):
        ids = torch.randint(0, 99, (1, q), generator=g)
        a = lean.forward(ids, c_lean, tap=True)
        b = ref.forward(ids, c_ref, tap=True)
        # fp32 on one thread; fused matmuls sum in another order, and q = 1 steps attend through
        # `grouped_decode_attention`, not HF's kernel (as accurate against float64: see the test below). This
        # llama (random weights, no q/k norm, logits ~10) carries the roundings to ~3e-5 on logits and ~2e-4 on
        # the residual stream (float64 does not help: HF's RMSNorm computes in fp32). A wrong mask or position
        # moves them by ~1.
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(a.features, b.features, rtol=1e-4, atol=1e-3)
        assert a.features.shape == (1, q, 3 * lean.hidden_size)
        n = c_ref.length - q + k
        c_lean.crop(n)
        c_ref.crop(n)
        assert c_lean.length == c_ref.length == n


def test_lean_bf16_close_to_hf(one_thread):
    lean, ref = _pair("llama", torch.bfloat16)
    ids = torch.randint(0, 99, (1, 9), generator=torch.Generator().manual_seed(1))
    a = lean.forward(ids, lean.new_decode_cache(16))
    b = ref.forward(ids, ref.new_decode_cache())
    # bf16: packed matmuls and fused projections may round differently from the separate HF ones
    assert (a.logits.float() - b.logits.float()).abs().max() < 0.1 * b.logits.float().abs().max()


def test_packed_linear_is_bit_identical():
    if not packed_linear_available(torch.bfloat16, "cpu"):
        pytest.skip("no oneDNN prepacked linear in this torch build")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 29, generator=g).bfloat16()
    b = torch.randn(37, generator=g).bfloat16()
    for rows in (1, 5, 16):
        x = torch.randn(rows, 29, generator=g).bfloat16()
        assert torch.equal(Linear(w, b, packed=True)(x), torch.nn.functional.linear(x, w, b))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("lean", [True, False])
def test_engine_greedy_exact_on_both_paths(kind, lean, one_thread, monkeypatch):
    monkeypatch.setattr(lean_module, "GROUPED_MIN_KEYS", 0)  # plain decoding's steps through grouped attention too
    hf = tiny_llama() if kind == "llama" else tiny_qwen3()
    target = TargetModel(hf, ToyTokenizer(), lean=lean)
    prompt = torch.tensor([3, 17, 42, 5, 8, 61, 2])
    want = naive_greedy(target, prompt, 30)
    cfg = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    plain = Engine(target).generate(prompt, cfg)
    spec = Engine(target, _dflash(target)).generate(prompt, cfg)
    assert plain.token_ids == want
    assert spec.token_ids == want


def _dflash(target):
    from blockdraft.decode.proposers.dflash import DFlashProposer

    return DFlashProposer(tiny_draft(target, block_size=6), target)


def test_supports_reports_what_it_cannot_run():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    assert LeanDecoder.supports(tiny_llama()) is None
    assert LeanDecoder.supports(tiny_qwen3()) is None
    cfg = Qwen2Config(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    reason = LeanDecoder.supports(Qwen2ForCausalLM(cfg))
    assert reason is not None and "sliding" in reason
    target = TargetModel(Qwen2ForCausalLM(cfg).eval(), ToyTokenizer())
    assert target.lean is None and isinstance(target.new_decode_cache(), TargetCache)


def test_qwen2_biases_on_lean_path(one_thread):
    hf = tiny_qwen2_with_biases()
    lean, ref = TargetModel(hf), TargetModel(hf, lean=False)
    assert lean.lean is not None
    ids = torch.randint(0, 99, (1, 6), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(lean.forward(ids, lean.new_decode_cache()).logits,
                               ref.forward(ids, ref.new_decode_cache()).logits, rtol=1e-5, atol=1e-5)  # as above


def test_lean_rebuilds_after_dtype_change(one_thread):
    target = TargetModel(tiny_llama(), ToyTokenizer())
    first = target.lean
    target.to(torch.bfloat16)
    second = target.lean
    assert second is not first and second.dtype == torch.bfloat16
    out = target.forward(torch.tensor([[1, 2, 3]]), target.new_decode_cache())
    assert out.logits.dtype == torch.bfloat16


def test_kv_cache_write_reserve_and_views():
    c = KVCache(num_layers=2, batch=1, num_kv_heads=3, head_dim=5, capacity=2, dtype=torch.float32)
    k = torch.randn(1, 3, 4, 5, generator=torch.Generator().manual_seed(0))
    c.reserve(4)
    assert c.capacity >= 4
    for layer in range(2):
        keys, values = c.write(layer, k + layer, -k)
        assert keys.shape == (1, 3, 4, 5)
        assert torch.equal(keys, k + layer) and torch.equal(values, -k)
    c.length = 4
    c.crop(1)
    c.reserve(3)
    keys, _ = c.write(0, k[:, :, :2], k[:, :, :2])
    assert keys.shape == (1, 3, 3, 5)
    assert torch.equal(keys[:, :, :1], k[:, :, :1]) and torch.equal(keys[:, :, 1:], k[:, :, :2])


@pytest.mark.slow
def test_compiled_lean_matches_eager(one_thread):
    """The opt-in torch.compile path (slow tier: compiling takes a while) computes what the eager lean path does,
    for the compiled widths and for an eager-only prefill width."""
    hf = tiny_llama()
    eager = TargetModel(hf, ToyTokenizer(), layer_ids=(1, 3))
    comp = TargetModel(hf, ToyTokenizer(), layer_ids=(1, 3), compile=True)
    if not comp.lean.compiled:
        pytest.skip("torch.compile is unavailable here (the lean path fell back to eager, as designed)")
    ca, cb = eager.new_decode_cache(64), comp.new_decode_cache(64)
    g = torch.Generator().manual_seed(3)
    for q in (9, 1, 16, 1):
        ids = torch.randint(0, 99, (1, q), generator=g)
        a, b = eager.forward(ids, ca, tap=True), comp.forward(ids, cb, tap=True)
        # inductor fuses the elementwise ops and reorders sums: fp32 rounding differs at the 1e-4 level
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(b.features, a.features, rtol=1e-3, atol=1e-3)


def test_grouped_decode_attention_equals_sdpa():
    """The single-query decode step's attention against torch's reference kernel (fp32; tolerance: float rounding of the
    two summation orders). Odd sizes: 6 query heads over 2 key/value heads, head dim 5, 13 keys, ragged padding."""
    from blockdraft.models.lean import grouped_decode_attention

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
    from blockdraft.models.lean import grouped_decode_attention

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
