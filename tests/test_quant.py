"""Quantized weights: the kernels against a naive reference, GGUF blocks against gguf-py's own dequantization, the
exact mapping of a GGUF file onto a model, and decoding on quantized weights (token-exact, lossless).

Sizes: input widths are multiples of 32 (the block size the formats are defined on; Q4_K / Q6_K need 256), output
widths stay odd (37, 99) so that a row/column mix-up fails loudly."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from blockdraft.models import quant
from blockdraft.config import GenerationConfig
from blockdraft.decode.engine import Engine
from blockdraft.models.quant import Q4Weight, Q5Weight, Q8Weight, QuantLinear, WeightPlan
from blockdraft.models.target import TargetModel
from conftest import ToyTokenizer, tiny_draft, tiny_llama_q, tiny_qwen2_with_biases

pytestmark = pytest.mark.skipif(quant.kernel_status() is not None,
                                reason=f"no quantized kernels: {quant.kernel_status()}")


def _isas() -> list[str]:
    """The kernel instruction sets this CPU runs: AVX2 always, AVX512-VNNI where it has them."""
    k = quant.quant_kernels()
    return ["avx2"] + (["avx512-vnni"] if k is not None and k.cpu_has_vnni() else [])


@pytest.fixture(params=["avx2", "avx512-vnni"])
def isa(request):
    """Run the test on one kernel instruction set (skipped where the CPU lacks it), then restore the default."""
    if request.param not in _isas():
        pytest.skip(f"this CPU has no {request.param}")
    k = quant.quant_kernels()
    before = k.kernel_isa()
    k.set_kernel_isa(request.param)
    yield request.param
    k.set_kernel_isa(before)


def _activations(x: torch.Tensor):
    """What the kernels do to x [M, K]: per block of 32, scale = max|x| / 127 and int8 codes round(x / scale), both
    in float32 as the kernel computes them; plus each block's exact sum."""
    m, k = x.shape
    g = x.float().view(m, k // 32, 32)
    dx = g.abs().amax(-1) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    xq = (g * inv[..., None]).round()
    return xq.double(), dx.double(), g.double().sum(-1)


def naive_qlinear(x: torch.Tensor, w: quant.QWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: x [M, K] -> [M, N] in float64 from the kernels' definition (quant/ and csrc/)."""
    xq, dx, xs = _activations(x)
    n, k = w.shape
    if isinstance(w, (Q4Weight, Q5Weight)):
        c = w.unpacked().double()  # [N, G, 32]
        centre = 8 if isinstance(w, Q4Weight) else 16
        d, o = w.scale.double(), w.offset.double()
        dots = torch.einsum("mgj,ngj->mng", xq, c - centre)
        y = (dots * d[None] * dx[:, None] + (o + centre * d)[None] * xs[:, None]).sum(-1)
    elif isinstance(w, quant.Stacked):
        return torch.cat([naive_qlinear(x, p) for p in w.parts], dim=1) + (0 if bias is None else bias.double())
    else:
        c = w.codes.double().view(n, k // 16, 16)
        xh = xq.reshape(xq.shape[0], k // 16, 16)
        dots = torch.einsum("mhj,nhj->mnh", xh, c)
        y = (dots * w.scale.double()[None] * dx.repeat_interleave(2, 1)[:, None]).sum(-1)
    return y if bias is None else y + bias.double()


def _weights(kind: str, n: int, k: int, gen: torch.Generator, half_scales: bool = False) -> quant.QWeight:
    """Random weights quantized; half_scales rounds the scales (and offsets) to float16 values, as GGUF's Q4_0 /
    Q4_1 / Q8_0 blocks have them: the kernels then hold them in float16, else in float32."""
    w = torch.randn(n, k, generator=gen) * 0.3
    q = {"q4": quant.quantize_q4, "q5": quant.quantize_q5, "q8": quant.quantize_q8}[kind](w)
    if not half_scales:
        return q
    h = lambda t: t.half().float()  # noqa: E731
    if kind == "q4":
        return Q4Weight(q.codes, h(q.scale), h(q.offset))
    if kind == "q5":
        return Q5Weight(q.codes, q.high, h(q.scale), h(q.offset))
    return Q8Weight(q.codes, h(q.scale))


@pytest.mark.parametrize("kind", ["q4", "q5", "q8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("half_scales", [False, True])
def test_kernel_matches_naive_reference(kind, dtype, half_scales, isa):
    gen = torch.Generator().manual_seed(0)
    # K = 224 = 7 blocks; N = 37 leaves the last panel of 8 columns part-filled; rows go in groups of up to 4
    # (AVX2) or 8 (VNNI), so m = 1, 3, 6, 16, 21 take every group size of both
    w = _weights(kind, 37, 224, gen, half_scales)
    bias = torch.randn(37, generator=gen)
    lin = QuantLinear(w, bias)
    for m in (1, 3, 6, 16, 21):
        x = torch.randn(m, 224, generator=gen).to(dtype)
        y = lin(x)
        assert y.dtype == dtype and y.shape == (m, 37)
        ref = naive_qlinear(x, w, bias)
        # float32 accumulation over 7 block terms against a float64 reference: ~1e-6 relative; a bf16 output
        # rounds to 2^-8 relative
        tol = 1e-5 if dtype == torch.float32 else 2 ** -8
        err = (y.double() - ref).abs().max() / ref.abs().max()
        assert err < tol, f"{kind} {dtype} m={m}: {err:.2e}"


@pytest.mark.parametrize("kind", ["q4", "q5", "q8"])
@pytest.mark.parametrize("half_scales", [False, True])
def test_kernel_rows_do_not_depend_on_the_batch_or_threads(kind, half_scales, isa):
    gen = torch.Generator().manual_seed(1)
    # 1,099 columns: enough 16-column tiles that two threads split them into several chunks of work
    lin = QuantLinear(_weights(kind, 1099, 96, gen, half_scales))
    assert lin.native().scale_bits == (16 if half_scales else 32)
    # 45 rows: from 32 rows on the activations are quantized by the threads, row ranges split between them
    x = torch.randn(45, 96, generator=gen)
    torch.set_num_threads(2)
    full = lin(x)
    for i in (0, 4, 10, 18, 33, 44):
        assert torch.equal(lin(x[i:i + 1])[0], full[i])  # bitwise: the exactness of speculative decoding rests on it
    assert torch.equal(lin(x[3:8]), full[3:8])
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(lin(x), full)
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("kind", ["q4", "q5", "q8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_instruction_sets_give_the_same_bits(kind, dtype):
    # a machine with VNNI and one without decode the same tokens: the integer dot products are exact either way and
    # every float operation after them is the same
    if len(_isas()) < 2:
        pytest.skip("this CPU has no AVX512-VNNI: there is one instruction set to run")
    k = quant.quant_kernels()
    gen = torch.Generator().manual_seed(2)
    lin = QuantLinear(_weights(kind, 37, 224, gen, True), torch.randn(37, generator=gen))
    x = (torch.randn(21, 224, generator=gen) * 4).to(dtype)
    before = k.kernel_isa()
    try:
        outs = {}
        for name in _isas():
            k.set_kernel_isa(name)
            outs[name] = lin(x)
    finally:
        k.set_kernel_isa(before)
    assert torch.equal(outs["avx2"], outs["avx512-vnni"])


def test_kernel_instruction_set_is_chosen_and_can_be_forced():
    k = quant.quant_kernels()
    assert k.kernel_isa() in _isas()
    with pytest.raises(RuntimeError, match="must be 'avx2' or 'avx512-vnni'"):
        k.set_kernel_isa("sse2")
    if "avx512-vnni" not in _isas():
        with pytest.raises(RuntimeError, match="no AVX512-VNNI"):
            k.set_kernel_isa("avx512-vnni")


def test_kernel_refuses_bad_shapes():
    lin = QuantLinear(_weights("q4", 37, 64, torch.Generator().manual_seed(0)))
    with pytest.raises(RuntimeError, match=r"\[\.\.\., 64\]"):
        lin(torch.randn(2, 32))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        lin(torch.randn(2, 64, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        quant.kernels._load_kernels().make_qlin(4, torch.zeros(37, 24, dtype=torch.uint8), torch.zeros(37, 1),
                                        torch.zeros(37, 1), None)


def test_quantizers_error_is_bounded_by_half_a_step():
    w = torch.randn(37, 128, generator=torch.Generator().manual_seed(2))
    q4, q5, q8 = quant.quantize_q4(w), quant.quantize_q5(w), quant.quantize_q8(w)
    for q in (q4, q5):
        step = q.scale.repeat_interleave(32, 1)
        assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    assert int(q5.unpacked().max()) == 31 and int(q5.unpacked().min()) == 0  # the fifth bit is used
    step8 = q8.scale.repeat_interleave(16, 1)
    assert ((q8.dequantize() - w).abs() <= step8 / 2 + 1e-6).all()
    assert torch.equal(quant.concat([q4.select(torch.arange(5)), q4.select(torch.arange(5, 37))]).codes, q4.codes)
    q5_again = quant.concat([q5.select(torch.arange(7)), q5.select(torch.arange(7, 37))])
    assert torch.equal(q5_again.high, q5.high) and torch.equal(q5_again.dequantize(), q5.dequantize())


def test_fused_parts_take_the_narrowest_format_that_holds_them_exactly():
    rng = np.random.default_rng(4)
    kinds = {k: quant.gguf_block_weight(k, _gguf_blocks(k, n, 64, rng), 64)
             for k, n in (("Q4_0", 5), ("Q4_1", 6), ("Q5_0", 7), ("Q5_1", 3), ("Q8_0", 4))}

    def check(parts, kind):
        w = quant.fuse([kinds[p] for p in parts])
        assert isinstance(w, kind), (parts, type(w))
        assert torch.equal(w.dequantize(), torch.cat([kinds[p].dequantize() for p in parts]))

    check(["Q5_0", "Q5_0"], Q5Weight)
    check(["Q4_1", "Q5_1"], Q5Weight)  # 4-bit codes are 5-bit codes with a zero fifth bit
    check(["Q5_0", "Q5_0", "Q8_0"], Q8Weight)  # Qwen2.5-0.5B's q/k/v in half its layers: Q5_0 is d (c - 16)
    check(["Q4_0", "Q8_0"], Q8Weight)
    # an offset of its own: no 8-bit code holds Q4_1 or Q5_1, so the parts stay side by side in their own formats
    for parts, formats in ((["Q4_1", "Q8_0"], [Q4Weight, Q8Weight]),
                           (["Q5_1", "Q4_1", "Q8_0"], [Q5Weight, Q8Weight])):  # neighbours of one format joined
        w = quant.fuse([kinds[p] for p in parts])
        assert isinstance(w, quant.Stacked) and [type(p) for p in w.parts] == formats
        assert torch.equal(w.dequantize(), torch.cat([kinds[p].dequantize() for p in parts]))


# ------------------------------------------------------------------------------------- K-quant layouts, stacks
def _k_weight(kind: str, n: int, k: int, seed: int):
    """A GGUF K-quant tensor (random blocks) as loaded: its factored scales set."""
    w = quant.gguf_block_weight(kind, _gguf_blocks(kind, n, k, np.random.default_rng(seed)), k)
    assert w.factored is not None
    return w


def _unfactored(w):
    """w with float scales only: the layout the kernels held K-quants in before, the reference for their bits."""
    return dataclasses.replace(w, factored=None)


def _eight_bit(w: Q8Weight) -> Q8Weight:
    """w and one more row whose code 100 does not fit 6 bits: the whole linear then takes the 8-bit kernels, and
    its first N columns are the reference for the 6-bit ones."""
    extra = torch.full((1, w.shape[1]), 100, dtype=torch.int8)
    return Q8Weight(torch.cat([w.codes, extra]), torch.cat([w.scale, w.scale[:1]]))


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k_quant_layouts_give_the_float_layouts_bits(kind, dtype, isa):
    # K = 768: three super-blocks; N = 37: a part-filled last tile; m up to 21 takes every row-group size
    gen = torch.Generator().manual_seed(5)
    w = _k_weight(kind, 37, 768, 5)
    bias = torch.randn(37, generator=gen)
    lin = QuantLinear(w, bias)
    ref = QuantLinear(_eight_bit(w), torch.cat([bias, bias[:1]])) if kind == "Q6_K" else (
        QuantLinear(_unfactored(w), bias))
    assert lin.native().layout == {"Q4_K": "q4", "Q5_K": "q5", "Q6_K": "q6"}[kind]
    assert lin.native().scale_bits == 8 and ref.native().scale_bits == 32
    assert ref.native().layout == {"Q4_K": "q4", "Q5_K": "q5", "Q6_K": "q8"}[kind]
    # the point of it: fewer bytes to stream (per block and 16 columns: q4 296 against 384, q5 360 against 448, q6
    # 424 against 640)
    assert lin.native().weight_bytes < 0.85 * ref.native().weight_bytes
    for m in (1, 3, 6, 16, 21):
        x = (torch.randn(m, 768, generator=gen) * 3).to(dtype)
        y = lin(x)
        assert torch.equal(y, ref(x)[:, :37])  # bitwise: the same scales, the same integers, the same float steps
        err = (y.double() - naive_qlinear(x, w, bias)).abs().max() / naive_qlinear(x, w, bias).abs().max()
        assert err < (1e-5 if dtype == torch.float32 else 2 ** -8), f"{kind} m={m}: {err:.2e}"


def test_k_quant_rows_do_not_depend_on_the_batch_or_threads(isa):
    # 1,099 columns split over threads into chunks; 45 rows cross the 32-row threshold of the activations' split
    gen = torch.Generator().manual_seed(6)
    for kind in ("Q4_K", "Q6_K"):
        lin = QuantLinear(_k_weight(kind, 1099, 512, 6))
        x = torch.randn(45, 512, generator=gen)
        torch.set_num_threads(2)
        full = lin(x)
        for i in (0, 7, 33, 44):
            assert torch.equal(lin(x[i:i + 1])[0], full[i]), kind
        n = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(lin(x), full), kind
        finally:
            torch.set_num_threads(n)


def test_stacked_parts_compute_what_each_computes_alone(isa):
    # Qwen2.5's q/k/v in a Q4_K_M file: Q4_K q and k beside a Q6_K v, one input quantized once for all three
    gen = torch.Generator().manual_seed(7)
    parts = [_k_weight("Q4_K", 37, 512, 1), _k_weight("Q4_K", 9, 512, 2), _k_weight("Q6_K", 9, 512, 3)]
    w = quant.fuse(parts)
    assert isinstance(w, quant.Stacked) and w.shape == (55, 512) and len(w.parts) == 2  # q and k joined
    bias = torch.randn(55, generator=gen)
    lin = QuantLinear(w, bias)
    assert lin.native().layout == "q4+q6"
    for m in (1, 5, 12):
        x = torch.randn(m, 512, generator=gen)
        alone = torch.cat([QuantLinear(p, b)(x) for p, b in zip(parts, bias.split([37, 9, 9]))], dim=1)
        assert torch.equal(lin(x), alone)
        err = (lin(x).double() - naive_qlinear(x, w, bias)).abs().max() / alone.abs().max()
        assert err < 1e-5


def test_factored_scales_that_do_not_multiply_out_are_refused():
    w = _k_weight("Q4_K", 16, 256, 8)
    k = quant.quant_kernels()
    f = w.factored
    with pytest.raises(RuntimeError, match="do not multiply out to scale"):
        k.make_qlin(4, w.codes, w.scale * 1.5, w.offset, None, None, f.sub, f.sub_min, f.d, f.dmin)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        k.make_qlin(4, w.codes[:, :64], w.scale[:, :4], w.offset[:, :4], None, None, f.sub[:, :4], f.sub_min[:, :4],
                    f.d, f.dmin)
    with pytest.raises(AssertionError, match="do not multiply out"):
        Q4Weight(w.codes, w.scale * 2, w.offset, f)


# ------------------------------------------------------------------------------------------------ GGUF blocks
def _gguf_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw blocks [N, bytes per row] of one GGUF type: quantized by gguf-py where it can, else random bytes with
    sane half-float scales (any such bytes are a valid K-quant block)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    t = GGMLQuantizationType[kind]
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return quants.quantize(rng.standard_normal((n, k)).astype(np.float32), t)
    block, size = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    halves = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[kind]
    for off in halves:
        raw[..., off:off + 2] = rng.uniform(0.01, 0.1, (n, k // block)).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_blocks_decode_as_gguf_py_does(kind):
    from gguf import GGMLQuantizationType, quants

    raw = _gguf_blocks(kind, 37, 512, np.random.default_rng(3))
    w = quant.gguf_block_weight(kind, raw, 512)
    assert isinstance(w, Q8Weight if kind in ("Q8_0", "Q6_K") else Q5Weight if kind.startswith("Q5") else Q4Weight)
    ref = quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(37, 512)
    # the same float32 products, maybe in another association order: a few ulp
    np.testing.assert_allclose(w.dequantize().numpy(), ref, rtol=1e-6, atol=1e-6)


def test_unmapped_gguf_type_returns_none():
    assert quant.gguf_block_weight("Q3_K", np.zeros((4, 110), np.uint8), 256) is None


def _write_gguf_with_metadata(path) -> None:
    """A GGUF file with what makes gguf-py's reader slow or a parser trip: string arrays (a vocabulary with
    multi-byte characters), a nested array, a 64-byte data alignment, and tensors of several types and ranks."""
    from gguf import GGMLQuantizationType, GGUFWriter

    rng = np.random.default_rng(11)
    writer = GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_token_list([f"tok{i}" + "é" * (i % 5) for i in range(300)])
    writer.add_token_scores([float(i) for i in range(300)])
    writer.add_array("test.nested", [[1, 2], [3, 4, 5]])
    writer.add_string("test.name", "a model ✓")
    for name, kind, n, k in (("blk.0.attn_q.weight", "Q4_K", 37, 512), ("blk.0.ffn_down.weight", "Q6_K", 5, 256),
                             ("output.weight", "Q8_0", 99, 64), ("blk.0.attn_k.weight", "Q5_1", 3, 96)):
        writer.add_tensor(name, _gguf_blocks(kind, n, k, rng), raw_dtype=GGMLQuantizationType[kind])
    writer.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.add_tensor("token_embd.weight", rng.standard_normal((7, 64)).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_gguf_index_lists_what_gguf_py_reads(tmp_path):
    from gguf import GGUFReader

    from blockdraft.models.quant.gguf import read_gguf_index

    path = tmp_path / "meta.gguf"
    _write_gguf_with_metadata(path)
    ours = read_gguf_index(path)
    theirs = GGUFReader(str(path)).tensors
    assert [t.name for t in ours] == [t.name for t in theirs]
    for a, b in zip(ours, theirs):
        assert (a.kind, a.dims, a.start, a.nbytes) == (b.tensor_type.name, tuple(int(d) for d in b.shape),
                                                        b.data_offset, b.n_bytes), a.name
    blocks = quant.GGUFBlocks(path)
    assert sorted(blocks) == ["blk.0.attn_k.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight", "output.weight"]
    assert blocks.other == {"token_embd.weight": "F16"}  # 2-D but not a block type; the 1-D norm is not listed
    for t in theirs:
        if t.name in blocks:
            raw = np.asarray(t.data).reshape(int(t.shape[1]), -1)
            ref = quant.gguf_block_weight(t.tensor_type.name, raw, int(t.shape[0]))
            got = blocks[t.name]
            assert all(torch.equal(x, y) for x, y in zip(quant.qweight_tensors(got), quant.qweight_tensors(ref)))


@pytest.mark.parametrize("damage", ["magic", "header", "data", "version", "counts", "empty", "alignment"])
def test_a_damaged_gguf_is_a_clear_error_naming_the_file(tmp_path, damage):
    path = tmp_path / "meta.gguf"
    _write_gguf_with_metadata(path)
    raw = bytearray(path.read_bytes())
    bad = tmp_path / "damaged.gguf"
    if damage == "magic":
        raw[:4] = b"GGML"
    elif damage == "version":
        raw[4:8] = (1).to_bytes(4, "little")
    elif damage == "counts":  # a tensor count no file could hold: refused at once, not read until the end
        raw[8:16] = (1 << 60).to_bytes(8, "little")
    elif damage == "alignment":  # the value after the key "general.alignment" and its type
        at = raw.find(b"general.alignment") + len(b"general.alignment") + 4
        raw[at:at + 4] = (0).to_bytes(4, "little")
    cut = {"header": 200, "data": len(raw) - 100, "empty": 0}.get(damage, len(raw))
    bad.write_bytes(raw[:cut])
    with pytest.raises(ValueError, match=r"damaged\.gguf: not a readable GGUF file"):
        quant.GGUFBlocks(bad)


def test_match_rows_finds_the_row_order_from_a_sample_of_rows():
    """Above `sample` rows the check reads a spread of them: it still tells llama.cpp's q/k order from the model's
    and another tensor of the same shape from this one."""
    gen = torch.Generator().manual_seed(8)
    n, k, heads = 1536, 64, 12  # 1536 rows > the 512 sampled
    ref = quant.quantize_q8(torch.randn(n, k, generator=gen)).dequantize()  # the model's weight, its own order
    in_file = quant.quantize_q8(ref[quant.llama_rope_rows(n, heads).argsort()])  # rows as llama.cpp writes them
    got = quant.match_rows(in_file, ref, (heads, 2))
    assert got is not None and torch.equal(got.dequantize(), ref)
    assert quant.match_rows(quant.quantize_q8(ref), ref, (heads, 2)) is not None  # already in order
    other = quant.quantize_q8(torch.randn(n, k, generator=gen))
    assert quant.match_rows(other, ref, (heads, 2)) is None
    assert quant.match_rows(in_file, ref, (0,)) is None  # no head count that undoes the order


# --------------------------------------------------------------------------------------- a GGUF file, mapped
def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's row order for q/k (its RoPE pairs adjacent rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_of(model, path, kinds=("Q4_1", "Q8_0")):
    """Write the model's linears to a GGUF file as llama.cpp's converter would lay them out (layer linears as
    kinds[0], the head as kinds[1]), and set the model's weights to the file's dequantized values: afterwards the
    model *is* the file's model, as for a target loaded from a GGUF."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    cfg = model.config
    writer = GGUFWriter(str(path), "llama")
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i, layer in enumerate(model.model.layers):
        for hf, gg in names.items():
            mod = layer.get_submodule(hf)
            w = mod.weight.float().numpy()
            heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(gg)
            file_w = _llamacpp_permute(w, heads) if heads else w
            t = GGMLQuantizationType[kinds[0]]
            blocks = quants.quantize(file_w, t)
            deq = quants.dequantize(blocks, t).reshape(file_w.shape)
            if heads:  # back to the model's row order
                deq = deq.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
            mod.weight.copy_(torch.from_numpy(deq))
            writer.add_tensor(f"blk.{i}.{gg}.weight", blocks, raw_dtype=t)
    head = model.lm_head
    t = GGMLQuantizationType[kinds[1]]
    blocks = quants.quantize(head.weight.float().numpy(), t)
    head.weight.copy_(torch.from_numpy(quants.dequantize(blocks, t).reshape(head.weight.shape)))
    writer.add_tensor("token_embd.weight" if cfg.tie_word_embeddings else "output.weight", blocks, raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _patch_naive(model, plan: WeightPlan) -> None:
    """Replace each mapped linear's forward by the naive reference on the plan's weight."""
    head = model.get_output_embeddings()
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            w = plan.exact["lm_head" if mod is head else name]

            def fwd(x, w=w, b=mod.bias):
                flat = x.reshape(-1, x.shape[-1])
                return naive_qlinear(flat, w, b).to(x.dtype).view(*x.shape[:-1], w.shape[0])

            mod.forward = fwd


@pytest.mark.parametrize(("tied", "layers"), [(False, "Q4_1"), (True, "Q4_1"), (False, "Q5_0"), (True, "Q5_1")])
def test_gguf_plan_maps_every_linear_and_computes_the_files_model(tmp_path, tied, layers, one_thread):
    model = tiny_llama_q(tied=tied)
    path = tmp_path / "tiny.gguf"
    write_gguf_of(model, path, kinds=(layers, "Q8_0"))
    plan = quant.plan_weights("auto", model, path)
    assert plan.mode == "gguf" and not plan.kept
    assert len(plan.exact) == 3 * 7 + 1
    # q/k came permuted in the file: the plan holds them in the model's order
    for name in ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"):
        assert torch.equal(plan.exact[name].dequantize(), model.get_submodule(name).weight)
    assert isinstance(plan.exact["lm_head"], Q8Weight)

    target = TargetModel(model, ToyTokenizer(), weights=plan)
    ids = torch.randint(0, 99, (1, 9), generator=torch.Generator().manual_seed(4))
    got = target.forward(ids, target.new_decode_cache()).logits
    assert plan.describe()["quantized"] == {f"q{layers[1]}": 21} and not plan.describe()["kept"]
    assert target.lean.native is not None, target.lean.native_reason  # the whole stack in the native decoder
    ref_model = tiny_llama_q(tied=tied)
    ref_model.load_state_dict(model.state_dict())
    _patch_naive(ref_model, plan)
    ref = ref_model(ids).logits
    # the same arithmetic in float32 (fast path) and float64 (reference) between the same quantization points;
    # an activation that lands within ~1e-7 of a rounding boundary of its int8 code could flip it, which these
    # seeded inputs do not hit
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_a_decode_only_gguf_plan_frees_each_float_weight_it_checked_and_decodes_the_same(tmp_path, one_thread):
    """release_matched: the layers' float weights go as the plan checks the file's blocks against them (the float
    model and the blocks are never held side by side); the target built on that plan decodes what a target on the
    ordinary plan decodes, plain and drafted, token for token."""
    from blockdraft.decode.proposers.dflash import DFlashProposer

    prompt = torch.tensor([3, 17, 42, 5, 8, 61, 2, 9])
    cfg = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    out = []
    for release in (False, True):
        model = tiny_llama_q()
        write_gguf_of(model, tmp_path / f"tiny-{release}.gguf", kinds=("Q4_1", "Q8_0"))
        plan = quant.plan_weights("auto", model, tmp_path / f"tiny-{release}.gguf", release_matched=release)
        linears = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
        assert all(m.weight.is_meta == release for m in linears) and not model.lm_head.weight.is_meta
        target = TargetModel(model, ToyTokenizer(), weights=plan)
        draft = tiny_draft(target, block_size=5)
        out.append((Engine(target).generate(prompt, cfg).token_ids,
                    Engine(target, DFlashProposer(draft, target, draft_weights="int8")).generate(prompt, cfg).token_ids))
    assert out[0] == out[1] and out[0][0] == out[0][1]


def test_gguf_plan_keeps_what_does_not_match(tmp_path):
    model = tiny_llama_q()
    path = tmp_path / "tiny.gguf"
    write_gguf_of(model, path)
    model.model.layers[0].mlp.up_proj.weight.mul_(2)  # the file no longer holds this model's weight
    plan = quant.plan_weights("auto", model, path)
    assert "model.layers.0.mlp.up_proj" in plan.kept and "model.layers.0.mlp.up_proj" not in plan.exact
    target = TargetModel(model, ToyTokenizer(), weights=plan)
    assert target.lean is not None  # gate/up of layer 0 stay float; everything else is quantized
    assert plan.describe()["quantized"]["q4"] == 3 * 7 - 2
    assert "model.layers.0.mlp.gate_proj" in plan.kept


def test_weights_modes():
    model = tiny_llama_q()
    assert quant.plan_weights("auto", model, None).mode == "bf16"  # no GGUF file: float
    assert quant.plan_weights("int4", model).mode == "int4"
    with pytest.raises(ValueError, match="unknown weights mode"):
        quant.plan_weights("int3", model)


def test_quantized_head_rows_equal_the_full_heads_columns(one_thread):
    target = TargetModel(tiny_llama_q(), ToyTokenizer(), weights=WeightPlan("int8"))
    h = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(5))
    rows = torch.tensor([3, 97, 50, 0, 11])
    with torch.no_grad():  # as decoding calls it; with grad on (training) the head stays float
        full = target.logits(h)
        assert torch.equal(full, QuantLinear(quant.quantize_q8(target.lm_head.weight))(h))
        assert torch.equal(target.logits(h, rows), full[..., rows])


def test_reduced_heads_are_gathered_once_per_vocabulary(one_thread):
    """Engines take turns on one target, each proposer with its own tensor of its draft's vocabulary: equal
    vocabularies share one gathered head and different ones keep theirs, so that no turn gathers again; a
    vocabulary edited in place is a new one."""
    target = TargetModel(tiny_llama_q(), ToyTokenizer(), weights=WeightPlan("int8"))
    h = torch.randn(2, 64, generator=torch.Generator().manual_seed(6))
    a, b, c = torch.tensor([3, 97, 50]), torch.tensor([3, 97, 50]), torch.tensor([1, 2])
    with torch.no_grad():
        full = target.logits(h)
        for rows in (a, c, b, c, a):
            assert torch.equal(target.logits(h, rows), full[..., rows])
        head = target._quant_head()
        assert target._quant_head_rows(head, a) is target._quant_head_rows(head, b)
        assert target._quant_head_rows(head, c) is not target._quant_head_rows(head, a)
        a[0] = 4
        assert torch.equal(target.logits(h, a), full[..., a])


# ------------------------------------------------------------------------------------------ decoding on them
@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculative_greedy_is_token_exact_on_quantized_weights(mode, dtype, one_thread):
    """Greedy DFlash decoding equals plain greedy decoding on the same quantized weights, token for token.

    In fp32 this holds as it does for float weights. In bf16 it holds here because the kernels compute each row
    alike whatever the number of rows; the float ops around them (norms, attention) can still round a multi-token
    step differently, so bf16 exactness is shown for this model, not promised for every one."""
    target = TargetModel(tiny_llama_q(dtype=dtype), ToyTokenizer(), weights=WeightPlan(mode))
    from blockdraft.decode.proposers.dflash import DFlashProposer

    prompt = torch.tensor([3, 17, 42, 5, 8, 61, 2, 9])
    cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = Engine(target).generate(prompt, cfg)
    draft = tiny_draft(target, block_size=5, dtype=dtype)
    weights = "int8" if mode != "bf16" else "bf16"  # the 8-bit draft a quantized target gets (DecodeSpec)
    spec = Engine(target, DFlashProposer(draft, target, draft_weights=weights)).generate(prompt, cfg)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.target_forwards < plain.stats.target_forwards or spec.stats.tau == 1.0
    assert target.lean.layers[0].qkv_proj.bits == (4 if mode == "int4" else 8)


def test_engines_and_batch_rows_of_one_reduced_draft_share_one_gathered_head(one_thread, monkeypatch):
    """Two engines of one reduced-vocabulary draft taking turns on a quantized target, and one engine's batch rows
    (each with its own copy of the proposer): one gathered head serves them all, and every output is plain greedy's."""
    from blockdraft.decode.proposers.dflash import DFlashProposer
    from blockdraft.models.draft import DFlashDraftModel
    from blockdraft.models.draft_config import DFlashConfig
    from conftest import MASK_ID

    target = TargetModel(tiny_llama_q(), ToyTokenizer(), weights=WeightPlan("int8"))
    cfg = DFlashConfig.from_target(target.config, num_hidden_layers=1, block_size=5, mask_token_id=MASK_ID,
                                   num_target_features=3, draft_vocab_size=30)
    with torch.random.fork_rng():
        torch.manual_seed(4)
        draft = DFlashDraftModel(cfg).eval()
    draft.set_draft_vocab(torch.arange(0, 90, 3))
    gcfg = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    prompts = [torch.tensor([3, 17, 42, 5, 8]), torch.tensor([61, 2, 9, 30])]
    plain = [Engine(target).generate(p, gcfg).token_ids for p in prompts]
    engines = [Engine(target, DFlashProposer(draft, target, draft_weights="int8")) for _ in range(2)]
    assert engines[0].generate(prompts[0], gcfg).token_ids == plain[0]  # gathers the head
    built = []

    class Counted(QuantLinear):
        def __init__(self, *a, **k):
            built.append(1)
            super().__init__(*a, **k)

    monkeypatch.setattr("blockdraft.models.target.QuantLinear", Counted)
    for p, want in zip(prompts, plain):
        for eng in engines:
            assert eng.generate(p, gcfg).token_ids == want
    assert [r.token_ids for r in engines[0].run([(p, gcfg) for p in prompts])] == plain
    assert not built, f"the head was gathered again {len(built)} times"


def test_a_linear_is_packed_once_and_serves_after_its_source_is_released(one_thread):
    """The native decoder and direct calls share one packed copy; once it exists the unpacked weight can go, and
    every product after that gives the bits it gave before."""
    g = torch.Generator().manual_seed(5)
    lin = QuantLinear(quant.quantize(torch.randn(70, 64, generator=g), "int4"))
    x = torch.randn(3, 64, generator=g)
    assert lin.release_source() == [], "nothing is released before the kernels hold their copy"
    y = lin(x)
    assert lin.native() is lin.native()
    held = lin.release_source()
    assert lin.weight is None and sum(t.numel() for t in held) == 70 * 32 + 2 * 70 * 2  # codes, scales, offsets
    assert torch.equal(lin(x), y) and lin.bits == 4
    assert lin.release_source() == []


@pytest.mark.parametrize("mode", ["int8", "bf16"])
def test_a_released_target_decodes_as_before_and_refuses_what_needs_the_freed_weights(mode, one_thread):
    """release_float_weights frees the HF layers' float weights (and, under the native stack, the unpacked quantized
    ones): greedy plain and DFlash decoding give an unreleased twin's tokens, and what would read the freed weights
    (the HF path, a lean path rebuilt for another dtype, the weight plan) fails with a message instead."""
    from blockdraft.decode.proposers.dflash import DFlashProposer

    twin, target = (TargetModel(tiny_llama_q(), ToyTokenizer(), weights=WeightPlan(mode)) for _ in range(2))
    prompt = torch.tensor([3, 17, 42, 5, 8, 61, 2, 9])
    cfg = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    weights = "int8" if mode == "int8" else "bf16"

    def decode(t: TargetModel) -> tuple[list[int], list[int]]:
        draft = tiny_draft(t, block_size=5)
        return (Engine(t).generate(prompt, cfg).token_ids,
                Engine(t, DFlashProposer(draft, t, draft_weights=weights)).generate(prompt, cfg).token_ids)

    want = decode(twin)
    float_bytes = sum(m.weight.numel() * m.weight.element_size() for m in target.layers.modules()
                      if isinstance(m, torch.nn.Linear))
    freed = target.release_float_weights()
    assert all(m.weight.is_meta for m in target.layers.modules() if isinstance(m, torch.nn.Linear))
    if mode == "int8":
        assert target.lean.native is not None, target.lean.native_reason
        assert all(lin.weight is None for layer in target.lean.layers
                   for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up, layer.down))
        assert freed > float_bytes and target.quantized_head  # the head keeps its weight (reduced heads gather it)
    else:
        assert freed == float_bytes
    assert decode(target) == want
    with pytest.raises(RuntimeError, match="released its float weights"):
        target.forward(prompt[None], target.new_cache())
    if mode == "int8":
        with pytest.raises(RuntimeError, match="released its layers' weights"):
            target.weights.weight_for(["model.layers.0.mlp.down_proj"], [torch.zeros(64, 96)])
    target.hf.to(torch.float64)  # the meta weights follow; the lean path cannot
    with pytest.raises(RuntimeError, match="released its float weights"):
        target.lean


# ------------------------------------------------------------------------------------- the native decoder stack
def _python_path(target: TargetModel):
    """The same target decoding through lean.py's Python layers (the native stack switched off)."""
    lean = target.lean
    native, lean.native = lean.native, None
    return native


@pytest.mark.parametrize("bits", ["int4", "int8"])
def test_native_stack_matches_the_python_layers(bits, one_thread):
    target = TargetModel(tiny_llama_q(), ToyTokenizer(), layer_ids=(0, 2), weights=WeightPlan(bits))
    assert target.lean.native is not None, target.lean.native_reason
    gen = torch.Generator().manual_seed(6)
    prompt, steps = torch.randint(0, 99, (1, 11), generator=gen), torch.randint(0, 99, (1, 4), generator=gen)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)  # 0 -> {1, 2 -> 3}
    depth = torch.tensor([[0, 1, 1, 2]])

    def run():
        cache = target.new_decode_cache(8)  # small: the stack must see the cache grow
        outs = [target.forward(prompt, cache)]
        outs.append(target.forward(steps[:, :1], cache))
        outs.append(target.forward(steps, cache, positions=cache.length + depth, tree_mask=tree))
        return outs, cache

    with torch.no_grad():
        native_outs, native_cache = run()
        saved = _python_path(target)
        try:
            ref_outs, ref_cache = run()
        finally:
            target.lean.native = saved
    # float32 both ways; the stack sums norms and attention in another order than torch's kernels: ~1e-6 relative
    for a, b in zip(native_outs, ref_outs):
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a.features, b.features, rtol=1e-4, atol=1e-4)
    n = ref_cache.length
    assert native_cache.length == n
    torch.testing.assert_close(native_cache.k[:, :, :, :n], ref_cache.k[:, :, :, :n], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(native_cache.v[:, :, :, :n], ref_cache.v[:, :, :, :n], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_stack_rows_equal_one_token_steps(dtype, one_thread):
    """A T-token forward gives, row for row, the bits of T one-token steps: what makes a verify exact."""
    target = TargetModel(tiny_llama_q(dtype=dtype), ToyTokenizer(), layer_ids=(1,), weights=WeightPlan("int4"))
    assert target.lean.native is not None
    ids = torch.randint(0, 99, (1, 14), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        c1 = target.new_decode_cache(32)
        target.forward(ids[:, :9], c1)
        block = target.forward(ids[:, 9:], c1)
        c2 = target.new_decode_cache(32)
        target.forward(ids[:, :9], c2)
        for j in range(5):
            one = target.forward(ids[:, 9 + j:10 + j], c2)
            assert torch.equal(one.logits[0, 0], block.logits[0, j])
            assert torch.equal(one.features[0, 0], block.features[0, j])


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_prefill_rows_equal_one_token_steps_from_an_empty_cache(dtype, threads):
    """A prefill's causal queries stop at their own slot (no scores for the keys after it) and are dealt to the
    threads round-robin: every position still gets the bits of feeding the prompt one token at a time."""
    target = TargetModel(tiny_llama_q(dtype=dtype), ToyTokenizer(), layer_ids=(1,), weights=WeightPlan("int4"))
    assert target.lean.native is not None
    ids = torch.randint(0, 99, (1, 37), generator=torch.Generator().manual_seed(11))
    saved = torch.get_num_threads()
    with torch.no_grad():
        torch.set_num_threads(threads)
        try:
            whole = target.forward(ids, target.new_decode_cache(48))
            c = target.new_decode_cache(48)
            steps = [target.forward(ids[:, j:j + 1], c) for j in range(ids.shape[1])]
        finally:
            torch.set_num_threads(saved)
    for j, one in enumerate(steps):
        assert torch.equal(one.logits[0, 0], whole.logits[0, j]), j
        assert torch.equal(one.features[0, 0], whole.features[0, j]), j


def test_native_stack_with_biases_and_refusals(one_thread):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hf = tiny_qwen2_with_biases(hidden=64, intermediate=96)
    target = TargetModel(hf, ToyTokenizer(), weights=WeightPlan("int8"))
    assert target.lean.native is not None
    ids = torch.randint(0, 99, (1, 6), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        got = target.forward(ids, target.new_decode_cache()).logits
        saved = _python_path(target)
        ref = target.forward(ids, target.new_decode_cache()).logits
        target.lean.native = saved
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)  # as above

    q3 = Qwen3Config(vocab_size=99, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16)
    assert "Qwen3" in TargetModel(Qwen3ForCausalLM(q3).eval(), weights=WeightPlan("int4")).lean.native_reason
    plain = TargetModel(tiny_llama_q(), ToyTokenizer())
    assert plain.lean.native is None and "quantized" in plain.lean.native_reason


@pytest.mark.parametrize("layers,mix", [(1, False), (3, False), (3, True)])
def test_native_draft_matches_the_python_layers(layers, mix, one_thread):
    """The draft's native stack (csrc/decoder.cpp DraftStack) against LeanDraft's Python layers on the same int8
    weights: context keys / values appended in two pieces (the cache grows), then a block over all of it. With a
    layer mix the context is projected in Python (the stack knows one fused context) and the block runs natively."""
    from blockdraft.models.cache import KVCache
    from blockdraft.models.draft_lean import LeanDraft

    target = TargetModel(tiny_llama_q(), ToyTokenizer(), weights=WeightPlan("int8"))
    draft = tiny_draft(target, layers=layers, layer_mix=mix)
    with torch.no_grad():  # norms away from 1, as a trained draft's are
        for i, p in enumerate(draft.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.05)
    lean = LeanDraft(draft, weights="int8")
    assert lean.native is not None
    cfg = draft.config
    gen = torch.Generator().manual_seed(9)
    feats = torch.randn(1, 9, cfg.num_target_features * target.hidden_size, generator=gen)
    pos = torch.arange(9).unsqueeze(0)
    block = target.embed(torch.tensor([[7, 3, 3, 3, 3]]))
    bpos = torch.arange(9, 14).unsqueeze(0)

    def run():
        ctx = KVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.head_dim, 6, torch.float32, "cpu")
        lean.append_context(feats[:, :4], pos[:, :4], ctx)
        lean.append_context(feats[:, 4:], pos[:, 4:], ctx)
        out = lean.forward(block, bpos, ctx)
        assert ctx.length == 9  # the block's keys were written after the context but not kept
        assert torch.equal(lean.forward(block, bpos, ctx), out)
        return out, ctx

    with torch.no_grad():
        got, ctx = run()
        native, lean.native = lean.native, None
        ref, ref_ctx = run()
        lean.native = native
    # float32 both ways, the same quantized weights; norms, softmax and exp summed in another order: ~1e-6 relative
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ctx.k[:, :, :, :9], ref_ctx.k[:, :, :, :9], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ctx.v[:, :, :, :9], ref_ctx.v[:, :, :, :9], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_stack_bits_do_not_depend_on_threads_or_batch(dtype, threads):
    """The attention splits each row's queries into runs by the thread count, and a batch changes every split: a
    row's numbers must not move. One-token steps on one thread are the reference."""
    target = TargetModel(tiny_llama_q(dtype=dtype), ToyTokenizer(), layer_ids=(1,), weights=WeightPlan("int4"))
    assert target.lean.native is not None
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 99, (n,), generator=gen) for n in (9, 5, 12)]
    news = [torch.randint(0, 99, (n,), generator=gen) for n in (7, 1, 4)]
    saved = torch.get_num_threads()
    with torch.no_grad():
        torch.set_num_threads(1)
        ref = []
        for p, x in zip(prompts, news):
            c = target.new_decode_cache(32)
            target.forward(p[None], c)
            ref.append(torch.cat([target.forward(x[None, j:j + 1], c).logits[0] for j in range(len(x))]))
        torch.set_num_threads(threads)
        try:
            caches = [target.new_decode_cache(32) for _ in prompts]
            for p, c in zip(prompts, caches):
                target.forward(p[None], c)
            rows = target.forward_rows(news, caches)
            solo_cache = target.new_decode_cache(32)
            target.forward(prompts[0][None], solo_cache)
            solo = target.forward(news[0][None], solo_cache).logits[0]
        finally:
            torch.set_num_threads(saved)
    for r, out in zip(ref, rows):
        assert torch.equal(out.logits[0], r)
    assert torch.equal(solo, ref[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_verify_on_the_native_stack_is_token_exact(dtype, one_thread):
    """A draft + lookup tree verified through the native stack (tree mask) commits plain greedy decoding's tokens.
    A node's keys sit at other cache slots than in a chain, so its sums run in another order: fp32 keeps the argmax
    here by a wide margin; bf16 is shown for this model, not promised for every one (README, quantized weights)."""
    from blockdraft.decode.proposers.dflash import DFlashProposer
    from blockdraft.decode.proposers.tree import TreeProposer

    target = TargetModel(tiny_llama_q(dtype=dtype), ToyTokenizer(), weights=WeightPlan("int4"))
    assert target.lean.native is not None
    prompt = torch.tensor([3, 17, 42, 5, 8, 61, 2, 9, 3, 17, 42])
    cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = Engine(target).generate(prompt, cfg)
    draft = tiny_draft(target, block_size=5, dtype=dtype)
    tree = TreeProposer(DFlashProposer(draft, target, draft_weights="int8"), lookup=True, budget=10, top_k=3)
    spec = Engine(target, tree).generate(prompt, cfg)
    assert spec.token_ids == plain.token_ids
    assert max(spec.stats.tree_nodes) > 1  # real trees were verified (branches beside the chain), not only chains


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_tree_rows_equal_one_token_steps_along_their_paths(dtype, one_thread):
    """A tree verify gives each node the bits of one-token steps along its own path, although the node's ancestors
    sit at other cache slots than in a chain: what keeps tree verification exact on quantized weights, where
    activations are rounded to int8 and a last-bit difference can move a code."""
    target = TargetModel(tiny_llama_q(dtype=dtype), ToyTokenizer(), layer_ids=(1,), weights=WeightPlan("int4"))
    gen = torch.Generator().manual_seed(10)
    prefix, nodes = torch.randint(0, 99, (1, 9), generator=gen), torch.randint(0, 99, (5,), generator=gen)
    parents = [-1, 0, 0, 2, 1]  # 0 -> {1 -> 4, 2 -> 3}
    mask = torch.zeros(5, 5, dtype=torch.bool)
    depth = []
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
        depth.append(0 if p < 0 else depth[p] + 1)
    with torch.no_grad():
        cache = target.new_decode_cache(32)
        target.forward(prefix, cache)
        tree = target.forward(nodes[None], cache, positions=9 + torch.tensor([depth]), tree_mask=mask)
        for leaf in (3, 4):
            path = [leaf]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            c = target.new_decode_cache(32)
            target.forward(prefix, c)
            for i in reversed(path):  # root first
                one = target.forward(nodes[i].view(1, 1), c)
                assert torch.equal(one.logits[0, 0], tree.logits[0, i]), (leaf, i)
                assert torch.equal(one.features[0, 0], tree.features[0, i])


def test_a_dead_builds_lock_is_removed_while_a_live_build_keeps_others_waiting(tmp_path, monkeypatch):
    """torch's build lock left by a killed build would hang every later start; it is removed (whatever its age)
    under blockdraft's own build lock, which a live build holds for its whole build, so a live build's files are
    never touched: a second process cannot take the build lock while the first holds it."""
    import subprocess
    import sys

    from blockdraft.atomic import file_lock
    from blockdraft.models import quant

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "dead_build" / "lock"
    lock.parent.mkdir()
    lock.touch()
    quant.kernels._clear_stale_build_lock("dead_build")
    assert not lock.exists()
    quant.kernels._clear_stale_build_lock("never_built")  # no lock: nothing to do
    build_lock = quant.kernels._build_lock_path("live_build")
    assert build_lock.parent == tmp_path
    probe = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
             "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('free')\n"
             "except BlockingIOError:\n    print('held')")
    with file_lock(build_lock):
        held = subprocess.run([sys.executable, "-c", probe, str(build_lock) + ".lock"], capture_output=True, text=True)
    free = subprocess.run([sys.executable, "-c", probe, str(build_lock) + ".lock"], capture_output=True, text=True)
    assert (held.stdout.strip(), free.stdout.strip()) == ("held", "free")


def test_int8_ceiling_counts_multiply_adds_and_refuses_bad_arguments():
    """The ceiling the linears are read against: multiply-adds per second over torch's threads (a figure, not a
    timing assertion: any positive rate passes), and a clear error for an unknown ISA or no rounds."""
    kernels = quant.quant_kernels()
    if kernels is None:
        pytest.skip("kernels not built")
    isas = ["avx2"] + (["avx512-vnni"] if kernels.cpu_has_vnni() else [])
    for isa in isas:
        rate = kernels.int8_peak(isa, 20_000)
        assert math.isfinite(rate) and rate > 0
    with pytest.raises(RuntimeError, match="isa must be"):
        kernels.int8_peak("sse2", 10)
    with pytest.raises(RuntimeError, match="iters must be"):
        kernels.int8_peak("avx2", 0)


def test_native_argmax_returns_torch_argmax_indices():
    """The native row argmax (what greedy verification reads the target's tokens with beside quantized weights) gives
    torch.argmax's index on every kind of row: ties (the first), NaN (the first NaN), all -inf, +-0, the maximum in
    the tail past the vector width, rows shorter than a vector, and batched shapes."""
    from blockdraft.decode.sampling import argmax

    k = quant.quant_kernels()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 101, generator=g)
    x[0, 5] = x[0, 50] = 100.0
    x[1, 33] = x[1, 90] = float("nan")
    x[2] = float("-inf")
    x[3] = 0.0
    x[3, 7] = -0.0
    x[4, 100] = 1e9
    x[5] = torch.round(x[5] * 2)  # many ties
    x[6, 3] = float("inf")
    x[6, 80] = float("inf")
    x[7, 96] = float("nan")  # a NaN in the scalar tail only
    cases = [x, torch.randn(3, 7, generator=g), torch.randn(5, 1, generator=g), torch.randn(2, 3, 17, generator=g),
             torch.randn(19, generator=g), torch.randn(4, 1999, generator=g)[:, ::2]]  # strided: copied first
    for c in cases:
        want = c.argmax(-1)
        assert torch.equal(k.argmax_rows(c), want)
        assert torch.equal(argmax(c), want)
    assert torch.equal(argmax(x.double()), x.double().argmax(-1))  # other dtypes: torch's own
    with pytest.raises(RuntimeError, match="float32"):
        k.argmax_rows(x.double())


def test_each_wrong_native_argument_is_a_python_error():
    """The native boundary checks shape, dtype, device and sizes of every tensor it keeps: a wrong argument raises
    (RuntimeError from the checks), never a crash or silent wrong numbers. Each case changes one argument of a
    call that works."""
    k = quant.quant_kernels()
    g = torch.Generator().manual_seed(0)
    n, kk = 48, 64
    codes = torch.randint(0, 256, (n, kk // 2), dtype=torch.uint8, generator=g)
    scale, offset = torch.rand(n, kk // 32, generator=g), torch.rand(n, kk // 32, generator=g)
    k.make_qlin(4, codes, scale, offset, None)  # the working call
    bad_q4 = {
        "a transposed scale (same element count)": dict(scale=scale.t().contiguous()),
        "a flattened offset": dict(offset=offset.reshape(-1)),
        "an integer scale": dict(scale=torch.ones(n, kk // 32, dtype=torch.int32)),
        "a scale off the CPU": dict(scale=torch.empty(n, kk // 32, device="meta")),
        "a short bias": dict(bias=torch.zeros(n - 1)),
        "a 2-d bias": dict(bias=torch.zeros(1, n)),
    }
    for why, change in bad_q4.items():
        args = dict(scale=scale, offset=offset, bias=None) | change
        with pytest.raises(RuntimeError):
            k.make_qlin(4, codes, args["scale"], args["offset"], args["bias"])
            pytest.fail(why)
    codes8 = torch.randint(-127, 128, (n, kk), dtype=torch.int8, generator=g)
    k.make_qlin(8, codes8, torch.rand(n, kk // 16, generator=g), None, None)
    with pytest.raises(RuntimeError, match="scale must have shape"):
        k.make_qlin(8, codes8, torch.rand(kk // 16, n, generator=g), None, None)
    with pytest.raises(RuntimeError, match="must not be empty"):
        k.make_qlin(8, torch.zeros(0, kk, dtype=torch.int8), torch.zeros(0, kk // 16), None, None)

    h, heads, kv, d, inter = 64, 4, 2, 16, 96
    k.Decoder(h, heads, kv, d, inter, torch.ones(h), 1e-6)  # the working call
    for args in ((h, heads, 0, d, inter, torch.ones(h), 1e-6),  # n_kv 0 used to divide by zero (SIGFPE)
                 (h, 0, kv, d, inter, torch.ones(h), 1e-6),
                 (h, heads, kv, d, inter, torch.ones(h - 1), 1e-6),  # a short norm used to be read past its end
                 (h, heads, kv, d, inter, torch.ones(h, dtype=torch.int64), 1e-6)):
        with pytest.raises(RuntimeError):
            k.Decoder(*args)
    fc = k.make_qlin(8, torch.zeros(h, 2 * h, dtype=torch.int8), torch.ones(h, 2 * h // 16), None, None)
    ctx = k.make_qlin(8, torch.zeros(2 * kv * d, h, dtype=torch.int8), torch.ones(2 * kv * d, h // 16), None, None)
    k.DraftStack(h, heads, kv, d, inter, fc, torch.ones(h), 1e-6, ctx, torch.ones(h), 1e-6)
    for hidden_norm, final_norm in ((torch.ones(h // 2), torch.ones(h)), (torch.ones(h), torch.ones(h + 1))):
        with pytest.raises(RuntimeError, match="must have shape"):
            k.DraftStack(h, heads, kv, d, inter, fc, hidden_norm, 1e-6, ctx, final_norm, 1e-6)
    with pytest.raises(RuntimeError, match="must be > 0"):
        k.DraftStack(h, heads, 0, d, inter, fc, torch.ones(h), 1e-6, ctx, torch.ones(h), 1e-6)


def test_a_truncated_gguf_is_a_clear_error_naming_the_file(tmp_path):
    from blockdraft.models.loading import packaged_default_gguf
    from blockdraft.models.quant import read_gguf_weights

    try:
        src = packaged_default_gguf()
    except FileNotFoundError:
        pytest.skip("the default target's package is not installed")
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    with pytest.raises(ValueError, match=r"cut\.gguf"):
        read_gguf_weights(cut)
