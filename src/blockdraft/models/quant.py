"""Weight-only quantized linears for the fast decode path, and the exact mapping of GGUF's quant blocks onto them.

Why: a decode step of a small target is bound by the bytes of weights it reads. A Q4_1 GGUF holds ~4.5 bits per
weight; dequantized to bf16 the same model reads 16. Three formats cover what GGUF files hold (`csrc/qlinear.h`):
- `Q4Weight`: 4-bit codes c with a scale d and an offset o per block of 32 along the input: w = d * c + o. GGUF's
  Q4_0 (o = -8d), Q4_1 (o = m) and Q4_K (per sub-block d * sc and -dmin * m) map onto it exactly.
- `Q5Weight`: the same with a fifth bit per code (c in 0..31; 6 bits per weight as the kernels hold it, scale and
  offset in float16): GGUF's Q5_0 (o = -16d), Q5_1 (o = m) and Q5_K (per sub-block, as Q4_K) map onto it exactly.
- `Q8Weight`: signed 8-bit codes with a scale per 16 inputs: w = s * c. GGUF's Q8_0 (one scale per 32) and Q6_K
  (codes - 32, one scale per 16) map onto it exactly.
A fused linear whose parts differ in kind (a Q5_0 q/k beside a Q8_0 v) takes the narrowest format that holds every
part exactly (`fuse`).
A bf16 / fp32 model can be quantized into 4 or 8 bits (`quantize_q4`, `quantize_q8`: groups of 32, min/max and
absmax; the `int4` / `int8` weights modes), opt-in, at some cost in quality; `quantize_q5` does the same in 5 bits.

The kernels quantize activations per row and block of 32 to int8 (as llama.cpp does) and compute integer dot
products with AVX2. Each output element is computed the same way whatever the number of rows, so a multi-token
verify and a one-token step agree exactly on the same row (what keeps greedy speculative decoding token-exact on
these weights). The extension is compiled once per machine on first use (torch's C++ extension loader, cached under
$TORCH_EXTENSIONS_DIR); without a compiler or AVX2 the same weights run dequantized through `F.linear` instead
(`kernel_status` says which).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..atomic import file_lock

log = logging.getLogger(__name__)

BLOCK = 32  # inputs per quant block (GGUF's Q4_0/Q4_1/Q8_0 block; Q4_K/Q6_K sub-blocks are 32 / 16)
WEIGHT_MODES = ("auto", "bf16", "int8", "int4")


@dataclass(frozen=True)
class Q4Weight:
    """w [N, K] = scale * code + offset per block of 32 inputs.
    codes uint8 [N, K/2]: byte j of a block holds input j in its low nibble and input j + 16 in its high nibble;
    scale, offset float32 [N, K/32]."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    def __post_init__(self) -> None:
        n, half = self.codes.shape
        g = 2 * half // BLOCK
        assert self.codes.dtype == torch.uint8 and 2 * half % BLOCK == 0, "codes must be uint8 [N, K/2], K % 32 == 0"
        assert self.scale.shape == self.offset.shape == (n, g), (
            f"scale/offset must be [N, K/32] = [{n}, {g}], got {tuple(self.scale.shape)} / {tuple(self.offset.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1]) * 2

    def unpacked(self) -> torch.Tensor:
        """-> codes [N, K/32, 32] uint8 in input order."""
        return _nibbles(self.codes)

    def dequantize(self) -> torch.Tensor:
        """-> w [N, K] float32."""
        n, k = self.shape
        return (self.scale[..., None] * self.unpacked().float() + self.offset[..., None]).view(n, k)

    def select(self, rows: torch.Tensor) -> "Q4Weight":
        return Q4Weight(self.codes[rows].contiguous(), self.scale[rows].contiguous(), self.offset[rows].contiguous())


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Q4Weight's byte layout [N, K/2] -> the 4-bit codes [N, K/32, 32] uint8 in input order."""
    n, half = codes.shape
    lo, hi = codes & 15, codes >> 4  # inputs j and j + 16 of each block
    return torch.cat([lo.view(n, 2 * half // BLOCK, 16), hi.view(n, 2 * half // BLOCK, 16)], dim=-1)


def _bits(high: torch.Tensor) -> torch.Tensor:
    """[N, K/8] uint8, 4 bytes per block of 32 (bit j, little-endian, = input j) -> [N, K/32, 32] uint8 of 0 / 1."""
    n, nbytes = high.shape
    b = high.view(n, nbytes // 4, 4, 1) >> torch.arange(8, dtype=torch.uint8)  # [N, G, byte, bit]
    return (b & 1).view(n, nbytes // 4, 32)


@dataclass(frozen=True)
class Q5Weight:
    """w [N, K] = scale * code + offset per block of 32 inputs, codes 0..31: Q4Weight's nibbles plus a fifth bit.
    codes uint8 [N, K/2]: the low 4 bits, laid out as Q4Weight's; high uint8 [N, K/8]: 4 bytes per block, bit j of
    their little-endian 32-bit word is input j's fifth bit (GGUF's qh); scale, offset float32 [N, K/32]."""

    codes: torch.Tensor
    high: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    def __post_init__(self) -> None:
        n, half = self.codes.shape
        g = 2 * half // BLOCK
        assert self.codes.dtype == torch.uint8 and 2 * half % BLOCK == 0, "codes must be uint8 [N, K/2], K % 32 == 0"
        assert self.high.dtype == torch.uint8 and tuple(self.high.shape) == (n, 4 * g), (
            f"high must be uint8 [N, K/8] = [{n}, {4 * g}], got {tuple(self.high.shape)}")
        assert self.scale.shape == self.offset.shape == (n, g), (
            f"scale/offset must be [N, K/32] = [{n}, {g}], got {tuple(self.scale.shape)} / {tuple(self.offset.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1]) * 2

    def unpacked(self) -> torch.Tensor:
        """-> codes [N, K/32, 32] uint8 (0..31) in input order."""
        return _nibbles(self.codes) | (_bits(self.high) << 4)

    def dequantize(self) -> torch.Tensor:
        """-> w [N, K] float32."""
        n, k = self.shape
        return (self.scale[..., None] * self.unpacked().float() + self.offset[..., None]).view(n, k)

    def select(self, rows: torch.Tensor) -> "Q5Weight":
        return Q5Weight(*(getattr(self, f)[rows].contiguous() for f in ("codes", "high", "scale", "offset")))


@dataclass(frozen=True)
class Q8Weight:
    """w [N, K] = scale * code per 16 inputs. codes int8 [N, K] (-127..127), scale float32 [N, K/16]."""

    codes: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        assert self.codes.dtype == torch.int8 and k % BLOCK == 0, "codes must be int8 [N, K] with K % 32 == 0"
        assert self.scale.shape == (n, k // 16), (
            f"scale must be [N, K/16] = [{n}, {k // 16}]: {tuple(self.scale.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        return (self.codes.view(n, k // 16, 16).float() * self.scale[..., None]).view(n, k)

    def select(self, rows: torch.Tensor) -> "Q8Weight":
        return Q8Weight(self.codes[rows].contiguous(), self.scale[rows].contiguous())


QWeight = Q4Weight | Q5Weight | Q8Weight


def bits_of(w: QWeight) -> int:
    """The kernels' name for a weight's format: 4, 5 or 8."""
    return 4 if isinstance(w, Q4Weight) else 5 if isinstance(w, Q5Weight) else 8


def pack_q4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in 0..15 (any integer dtype) -> the Q4Weight byte layout [N, K/2] uint8."""
    n, k = codes.shape
    c = codes.to(torch.uint8).view(n, k // BLOCK, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2)


def pack_q5(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [N, K] in 0..31 (any integer dtype) -> the Q5Weight layout: (low nibbles [N, K/2], high bits [N, K/8])."""
    n, k = codes.shape
    c = codes.to(torch.uint8)
    fifth = ((c >> 4) & 1).view(n, k // 8, 8) << torch.arange(8, dtype=torch.uint8)
    return pack_q4(c & 15), fifth.sum(-1, dtype=torch.uint8)


def _minmax_codes(w: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] (K % 32 == 0) -> (codes [N, K] in 0..top, scale [N, K/32], offset [N, K/32]) from each block's min
    and max (asymmetric): w ~ scale * code + offset."""
    n, k = w.shape
    assert k % BLOCK == 0, f"K = {k} is not a multiple of {BLOCK}"
    g = w.detach().float().view(n, k // BLOCK, BLOCK)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / top
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = ((g - lo[..., None]) * inv[..., None]).round().clamp(0, top).view(n, k)
    return codes, scale.contiguous(), lo.contiguous()


def quantize_q4(w: torch.Tensor) -> Q4Weight:
    """w [N, K] (K % 32 == 0) -> 4-bit codes per block of 32 from each block's min and max (asymmetric)."""
    codes, scale, offset = _minmax_codes(w, 15)
    return Q4Weight(pack_q4(codes), scale, offset)


def quantize_q5(w: torch.Tensor) -> Q5Weight:
    """w [N, K] (K % 32 == 0) -> 5-bit codes per block of 32 from each block's min and max (as GGUF's Q5_1)."""
    codes, scale, offset = _minmax_codes(w, 31)
    return Q5Weight(*pack_q5(codes), scale, offset)


def quantize_q8(w: torch.Tensor) -> Q8Weight:
    """w [N, K] (K % 32 == 0) -> 8-bit codes per block of 32 from each block's absolute max (symmetric)."""
    n, k = w.shape
    assert k % BLOCK == 0, f"K = {k} is not a multiple of {BLOCK}"
    g = w.detach().float().view(n, k // BLOCK, BLOCK)
    scale = g.abs().amax(-1) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = (g * inv[..., None]).round().clamp(-127, 127).to(torch.int8).view(n, k)
    return Q8Weight(codes, scale.repeat_interleave(2, dim=1).contiguous())


def concat(ws: list[QWeight]) -> QWeight:
    """Stack weights of one kind along the output dimension (fused q/k/v, gate/up)."""
    kinds = {type(w) for w in ws}
    assert len(kinds) == 1 and len({w.shape[1] for w in ws}) == 1, "concat needs one kind and one input width"
    fields = {Q4Weight: ("codes", "scale", "offset"), Q5Weight: ("codes", "high", "scale", "offset"),
              Q8Weight: ("codes", "scale")}[type(ws[0])]
    return type(ws[0])(*(torch.cat([getattr(w, f) for w in ws]) for f in fields))


def as_kind(w: QWeight, kind: type) -> QWeight | None:
    """w in another format holding exactly the same values, or None where that format cannot: 4-bit codes are
    5-bit codes with a zero fifth bit; 4- and 5-bit codes are signed 8-bit ones where the offset is the centre's
    (o = -8d, -16d: GGUF's Q4_0 / Q5_0)."""
    if isinstance(w, kind):
        return w
    if isinstance(w, Q4Weight) and kind is Q5Weight:
        return Q5Weight(w.codes, torch.zeros(w.shape[0], w.shape[1] // 8, dtype=torch.uint8), w.scale, w.offset)
    if isinstance(w, (Q4Weight, Q5Weight)) and kind is Q8Weight:
        centre = 8 if isinstance(w, Q4Weight) else 16
        if not torch.equal(w.offset, -centre * w.scale):
            return None
        codes = (w.unpacked().to(torch.int16) - centre).to(torch.int8).view(w.shape)
        return Q8Weight(codes, w.scale.repeat_interleave(2, dim=1).contiguous())
    return None


def fuse(ws: list[QWeight]) -> QWeight | None:
    """Stack the parts of a fused linear along the output in the narrowest format that holds every part exactly
    (4 < 5 < 8 bits), or None where none does (a Q4_1 part beside a Q8_0 one)."""
    for kind in (Q4Weight, Q5Weight, Q8Weight):
        parts = [as_kind(w, kind) for w in ws]
        if all(p is not None for p in parts):
            return concat(parts) if len(parts) > 1 else parts[0]
    return None


# ------------------------------------------------------------------------------------------------- the kernels
_kernels = None
_kernel_reason: str | None = "not loaded yet"
_kernel_lock = threading.Lock()


def _load_kernels():
    """Compile (once per machine; torch caches the build) and import the kernels (AVX2, and AVX512-VNNI variants
    chosen at run time on CPUs that have them); None + a reason if not."""
    global _kernels, _kernel_reason
    with _kernel_lock:
        if _kernels is not None or _kernel_reason != "not loaded yet":
            return _kernels
        if os.environ.get("BLOCKDRAFT_QUANT_KERNELS", "1") == "0":
            _kernel_reason = "disabled by BLOCKDRAFT_QUANT_KERNELS=0"
            return None
        cap = torch.backends.cpu.get_cpu_capability()
        if "AVX2" not in cap and "AVX512" not in cap:
            _kernel_reason = f"this CPU reports {cap}, the kernels need AVX2"
            return None
        try:
            from torch.utils.cpp_extension import load

            csrc = Path(__file__).with_name("csrc")
            files = sorted(csrc.glob("*.[ch]*"))
            # the name carries a hash of every source and header: torch's build cache keys on the sources listed
            # to it only, so an edited header would otherwise reuse a stale build
            digest = hashlib.sha1(b"".join(f.read_bytes() for f in files)).hexdigest()[:10]
            # -mavx2 -mfma, not -march=native: a build cache may be shared by machines of different CPUs.
            # -fopenmp: at::parallel_for runs on torch's OpenMP pool only when the extension is built with it
            # (without, it silently runs on one thread); torch's own libgomp is already loaded and is reused.
            name = f"blockdraft_qlinear_{digest}"
            # our own lock around torch's builder: while it is held no other process is building, so a torch
            # lock file found then was left by a build that died, and is removed whatever its age
            with file_lock(_build_lock_path(name)):
                _clear_stale_build_lock(name)
                _kernels = load(name, [str(f) for f in files if f.suffix == ".cpp"],
                                extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
                                extra_ldflags=["-fopenmp"], extra_include_paths=[str(csrc)], verbose=False)
            _kernel_reason = None
        except Exception as e:  # noqa: BLE001 - any build failure means the dequantized fallback
            last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
            _kernel_reason = (f"could not build the quantized kernels ({type(e).__name__}: {last[:300]}; the "
                              "compiler's whole output is in the log)")
            # the compiler's own messages, whole: the reason above keeps one line of them
            log.warning("%s; quantized weights run dequantized through F.linear. Build output:\n%s",
                        _kernel_reason, e)
        return _kernels


def _build_lock_path(name: str) -> Path:
    """The lock around one kernel build: beside torch's build directory of that name."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False)).with_name(f".{name}")


def _clear_stale_build_lock(name: str) -> None:
    """Remove the lock file of an interrupted kernel build: torch's builder waits on it forever (no message), so a
    build killed mid-way would hang every later start. Called with the build lock held (`_load_kernels`): no
    build of this process's kind is running then, so the file is a dead build's."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
        age = time.time() - lock.stat().st_mtime
    except (ImportError, OSError):
        return
    log.warning("removing %s, left %.0f min ago by an interrupted kernel build", lock, age / 60)
    lock.unlink(missing_ok=True)


def quant_kernels():
    """The compiled kernel module (make_qlin, the native Decoder), or None (see kernel_status)."""
    return _load_kernels()


def loaded_kernels():
    """The compiled kernel module if something has loaded it already, else None (never builds: for helpers that
    only pay off beside a quantized model, which loads them)."""
    return _kernels


def kernel_isa(build: bool = False) -> str | None:
    """The instruction set the quantized products run on ('avx512-vnni' or 'avx2'; both give the same bits), or
    None when the kernels are not loaded (build=True loads them first, compiling them if needed)."""
    k = _load_kernels() if build else _kernels
    return k.kernel_isa() if k is not None else None


def kernel_status() -> str | None:
    """None when the quantized kernels are in use, else why not (they are built on first call)."""
    _load_kernels()
    return _kernel_reason


class QuantLinear:
    """y [..., N] = x [..., K] W^T + b for a quantized W, through the kernels (float32 or bf16 x; y in x's dtype).
    Without the kernels, W is dequantized once to x's dtype and applied with `F.linear`."""

    def __init__(self, weight: QWeight, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._dense: dict[torch.dtype, torch.Tensor] = {}
        self._call = None  # the packed kernel once bound (False: none, use the fallback)

    @property
    def bits(self) -> int:
        return bits_of(self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., K] -> [..., N]; the kernel checks x (shape, float32 / bf16, CPU) and refuses what it cannot run
        if self._call is None:
            self._bind()
        if self._call is False:
            return self._fallback(x)
        return self._call(x)

    def _bind(self) -> None:
        # the weights are repacked once into the kernels' panel layout; a decode step then makes ~120 direct calls
        self._call = False if _load_kernels() is None else self.native()

    def native(self):
        """This linear as the kernels hold it (csrc/qlinear.h `QLin`, also what the native decoder takes)."""
        if self._call:
            return self._call
        k, w = _load_kernels(), self.weight
        if isinstance(w, Q4Weight):
            return k.make_qlin(4, w.codes, w.scale, w.offset, self.bias)
        if isinstance(w, Q5Weight):
            return k.make_qlin(5, w.codes, w.scale, w.offset, self.bias, w.high)
        return k.make_qlin(8, w.codes, w.scale, None, self.bias)

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        assert x.shape[-1] == self.in_features, f"x must be [..., {self.in_features}], got {tuple(x.shape)}"
        dense = self._dense.get(x.dtype)
        if dense is None:
            dense = self._dense[x.dtype] = self.weight.dequantize().to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, dense, bias)


def quantize(w: torch.Tensor, mode: str) -> QWeight:
    """w [N, K] -> the weight of an opt-in mode: 'int4' (groups of 32, min/max) or 'int8' (groups of 32, absmax)."""
    if mode == "int4":
        return quantize_q4(w)
    if mode == "int8":
        return quantize_q8(w)
    raise ValueError(f"no quantizer for weights mode {mode!r}")


# ---------------------------------------------------------------------------------------------------- GGUF blocks
def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 little-endian half floats -> [...] float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _k4_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 packed bytes [..., 12] -> 6-bit scales and mins [..., 8] (ggml's get_scale_min_k4)."""
    sc = sc.astype(np.uint8)
    s = np.empty(sc.shape[:-1] + (8,), np.uint8)
    m = np.empty_like(s)
    s[..., :4], m[..., :4] = sc[..., 0:4] & 63, sc[..., 4:8] & 63
    s[..., 4:] = (sc[..., 8:12] & 0xF) | ((sc[..., 0:4] >> 6) << 4)
    m[..., 4:] = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return s.astype(np.float32), m.astype(np.float32)


def gguf_block_weight(kind: str, data: np.ndarray, k: int) -> QWeight | None:
    """One GGUF tensor's raw blocks, data [N, bytes per row] uint8 for K inputs -> its weight in our formats,
    value for value (None for a type that does not map)."""
    n = data.shape[0]
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        b = data.reshape(n, k // BLOCK, size)
        d = _f16(b[..., 0:2])
        off = -8 * d if kind == "Q4_0" else _f16(b[..., 2:4])
        codes = b[..., size - 16:].reshape(n, k // 2)  # already our layout: low nibble j, high nibble j + 16
        return Q4Weight(torch.from_numpy(codes.copy()), torch.from_numpy(d),
                        torch.from_numpy(np.ascontiguousarray(off)))
    if kind == "Q8_0":
        b = data.reshape(n, k // BLOCK, 34)
        d = _f16(b[..., 0:2])
        codes = b[..., 2:].copy().view(np.int8).reshape(n, k)
        return Q8Weight(torch.from_numpy(codes), torch.from_numpy(np.repeat(d, 2, axis=1)))
    if kind in ("Q5_0", "Q5_1"):  # d (, m), 32 fifth bits qh, 16 bytes of nibbles (byte j: inputs j, j + 16)
        size = 22 if kind == "Q5_0" else 24
        b = data.reshape(n, k // BLOCK, size)
        d = _f16(b[..., 0:2])
        off = -16 * d if kind == "Q5_0" else _f16(b[..., 2:4])  # Q5_0: w = d (q - 16); Q5_1: w = d q + m
        qh = b[..., size - 20:size - 16].reshape(n, k // 8)  # already our layout, as are the nibbles
        codes = b[..., size - 16:].reshape(n, k // 2)
        return Q5Weight(torch.from_numpy(codes.copy()), torch.from_numpy(qh.copy()), torch.from_numpy(d),
                        torch.from_numpy(np.ascontiguousarray(off)))
    if kind == "Q5_K":  # super-blocks of 256: d, dmin, 12 bytes of 6-bit scales/mins, qh[32], 128 bytes of nibbles
        b = data.reshape(n, k // 256, 176)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k4_scales(b[..., 4:16])  # [N, S, 8]
        qh = b[..., 16:48][:, :, None, None, :]  # [N, S, 1, 1, 32]: bit 2c (2c + 1) of byte l is the fifth bit of
        q = b[..., 48:].reshape(n, k // 256, 4, 1, 32)  # input l (32 + l) of chunk c of 64
        lo = np.concatenate([q & 15, q >> 4], axis=3)  # [N, S, 4, 2, 32]
        shift = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)[None, None, :, :, None]
        codes = (lo | (((qh >> shift) & 1) << 4)).reshape(n, k)
        scale = (d[..., None] * sc).reshape(n, k // BLOCK)
        off = -(dmin[..., None] * mn).reshape(n, k // BLOCK)
        return Q5Weight(*pack_q5(torch.from_numpy(codes)), torch.from_numpy(scale), torch.from_numpy(off))
    if kind == "Q4_K":  # super-blocks of 256: d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        b = data.reshape(n, k // 256, 144)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k4_scales(b[..., 4:16])  # [N, S, 8]
        q = b[..., 16:].reshape(n, k // 256, 4, 32)  # 4 chunks of 64 inputs: low nibbles 0..31, high 32..63
        codes = np.stack([q & 15, q >> 4], axis=3).reshape(n, k)  # [N, S, 4, 2, 32] -> input order
        scale = (d[..., None] * sc).reshape(n, k // BLOCK)
        off = -(dmin[..., None] * mn).reshape(n, k // BLOCK)
        return Q4Weight(pack_q4(torch.from_numpy(codes)), torch.from_numpy(scale), torch.from_numpy(off))
    if kind == "Q6_K":  # super-blocks of 256: ql[128], qh[64], 16 int8 scales, d
        b = data.reshape(n, k // 256, 210)
        ql, qh = b[..., :128].reshape(n, -1, 2, 64), b[..., 128:192].reshape(n, -1, 2, 32)
        sc = b[..., 192:208].copy().view(np.int8).astype(np.float32)
        d = _f16(b[..., 208:210])
        lo = np.concatenate([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)
        hi = np.concatenate([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, (qh >> 6) & 3], axis=-1)
        codes = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, k)
        scale = (d[..., None] * sc).reshape(n, k // 16)
        return Q8Weight(torch.from_numpy(codes), torch.from_numpy(scale))
    return None


def read_gguf_weights(path: str | Path) -> tuple[dict[str, QWeight], dict[str, str]]:
    """The 2-D tensors of a GGUF file -> ({gguf name: weight} for those that map, {gguf name: type} for the rest)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt file: say which, not a numpy traceback
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    mapped: dict[str, QWeight] = {}
    other: dict[str, str] = {}
    for t in reader.tensors:
        if len(t.shape) != 2:
            continue
        kind = t.tensor_type.name
        k = int(t.shape[0])  # GGUF lists the contiguous (input) dimension first
        try:
            w = gguf_block_weight(kind, np.asarray(t.data).reshape(int(t.shape[1]), -1), k) if k % 256 == 0 or (
                kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0") and k % BLOCK == 0) else None
        except Exception as e:  # noqa: BLE001 - name the tensor whose blocks do not fit
            raise ValueError(f"{path}: tensor {t.name!r} ({kind}, shape {list(t.shape)}) cannot be read: "
                             f"{type(e).__name__}: {e}") from None
        if w is None:
            other[t.name] = kind
        else:
            mapped[t.name] = w
    return mapped, other


def gguf_name(hf_name: str) -> str | None:
    """HF parameter name of a LLaMA-family model (`model.layers.3.self_attn.q_proj.weight`) -> its GGUF tensor name
    (`blk.3.attn_q.weight`); None for names without one here."""
    table = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    parts = hf_name.split(".")
    if hf_name in ("lm_head.weight",):
        return "output.weight"
    if hf_name.endswith("embed_tokens.weight"):
        return "token_embd.weight"
    if "layers" in parts:
        i = parts.index("layers")
        key = ".".join(parts[i + 2:-1])
        if key in table and parts[-1] == "weight":
            return f"blk.{parts[i + 1]}.{table[key]}.weight"
    return None


def llama_rope_rows(n_rows: int, n_heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation (its converter interleaves the two halves of each
    head for its RoPE): HF row r is GGUF row perm[r]."""
    dim = n_rows // n_heads // 2
    return torch.arange(n_rows).view(n_heads, dim, 2).transpose(1, 2).reshape(n_rows)


def match_rows(w: QWeight, reference: torch.Tensor, head_counts: tuple[int, ...]) -> QWeight | None:
    """w as the model's own weight `reference` [N, K]: as is, or with llama.cpp's q/k row permutation undone (for
    one of `head_counts`), whichever reproduces it; None if none does. The tolerance is relative (1e-3 of the
    weight's norm): the model holds the same values rounded to its dtype, a wrong row order is off by ~1.4."""
    if tuple(w.shape) != tuple(reference.shape):
        return None
    ref = reference.detach().float()
    norm = float(ref.norm()) or 1.0

    def close(x: QWeight) -> bool:
        return float((x.dequantize().to(reference.dtype).float() - ref).norm()) <= 1e-3 * norm

    if close(w):
        return w
    for h in head_counts:
        if h and w.shape[0] % (2 * h) == 0:
            p = w.select(llama_rope_rows(w.shape[0], h))
            if close(p):
                return p
    return None


# ---------------------------------------------------------------------------------------------------- the plan
@dataclass
class WeightPlan:
    """Which weights of a target the fast path holds quantized, and how.

    mode: 'bf16' (the model's float weights, whatever its dtype), 'int8' / 'int4' (quantized from them, groups of
    32; the LM head 8-bit in both), or 'gguf' (the GGUF file's own blocks, mapped exactly: `exact`, keyed by the
    model's module names, e.g. `model.layers.0.self_attn.q_proj` and `lm_head`).
    A fused linear (q/k/v, gate/up) is quantized only when every part is; what stays float is listed in `kept`."""

    mode: str
    exact: dict[str, QWeight] | None = None
    source: str | None = None
    kept: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("bf16", "int8", "int4", "gguf"):
            raise ValueError(f"unknown weight plan mode {self.mode!r}")
        self.exact = dict(self.exact or {})
        self.kept = dict(self.kept or {})
        self._quantized: dict[str, str] = {}  # module name -> 'q4' / 'q8', for every linear built quantized

    def weight_for(self, names: list[str], weights: list[torch.Tensor]) -> QWeight | None:
        """The quantized weight of the linear made of `names` (their float weights stacked along the output), or
        None where it stays float."""
        if self.mode == "bf16":
            return None
        if self.mode == "gguf":
            parts = [self.exact.get(n) for n in names]
            w = fuse(parts) if all(p is not None for p in parts) else None
            if w is None:
                for n, p in zip(names, parts):
                    self.kept.setdefault(n, "no exact block mapping" if p is None else
                                         "fused with a kind no common format holds exactly")
                return None
        else:
            if any(int(x.shape[1]) % BLOCK for x in weights):
                for n in names:
                    self.kept[n] = f"input width not a multiple of {BLOCK}"
                return None
            w = quantize(torch.cat([x.detach() for x in weights]), self.mode)
        for n in names:
            self._quantized[n] = f"q{bits_of(w)}"
        return w

    def head_weight(self, weight: torch.Tensor) -> QWeight | None:
        """The LM head's quantized weight [V, H] (8-bit in the int8 / int4 modes: 4-bit logits lose too much), or
        None where it stays float."""
        if self.mode == "bf16":
            return None
        if self.mode == "gguf":
            w = self.exact.get("lm_head")
            if w is None:
                self.kept.setdefault("lm_head", "no exact block mapping")
            return w
        if int(weight.shape[1]) % BLOCK:
            self.kept["lm_head"] = f"input width not a multiple of {BLOCK}"
            return None
        return quantize_q8(weight)

    def describe(self) -> dict:
        """What the plan did so far: mode, source, linears per kind, what stayed float and why, kernel status."""
        kinds: dict[str, int] = {}
        for k in self._quantized.values():
            kinds[k] = kinds.get(k, 0) + 1
        return {"mode": self.mode, "source": self.source, "quantized": kinds, "kept": dict(self.kept),
                "kernels": kernel_status() or kernel_isa()}


def plan_weights(mode: str, model: torch.nn.Module, gguf_path: str | Path | None = None) -> WeightPlan:
    """--weights MODE for a loaded HF model: 'auto' keeps a GGUF target's own quantization (every linear whose
    blocks map exactly; the rest stays float, logged) and leaves any other target float; 'bf16' keeps the float
    weights; 'int8' / 'int4' quantize them (opt-in: their quality cost is in the docs)."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"unknown weights mode {mode!r}; choose one of {WEIGHT_MODES}")
    if mode == "auto":
        return gguf_plan(model, gguf_path) if gguf_path is not None else WeightPlan("bf16")
    return WeightPlan(mode)


def gguf_plan(model: torch.nn.Module, gguf_path: str | Path) -> WeightPlan:
    """Map the GGUF file's blocks onto the model's linears, each checked against the model's own (dequantized)
    weight so that a name or row-order mismatch can never slip through: it stays float instead."""
    blocks, other = read_gguf_weights(gguf_path)
    cfg = getattr(model.config, "text_config", None) or model.config
    heads = (int(getattr(cfg, "num_attention_heads", 0) or 0), int(getattr(cfg, "num_key_value_heads", 0) or 0))
    exact: dict[str, QWeight] = {}
    kept: dict[str, str] = {}
    head = model.get_output_embeddings()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, module in linears.items():
        key = "lm_head" if module is head else name
        g = "output.weight" if module is head else gguf_name(f"{name}.weight")
        if module is head and g not in blocks and g not in other:
            g = "token_embd.weight"  # a tied head: the file stores the embedding only
        if g is None:
            continue
        if g not in blocks:
            kept[key] = f"{other.get(g, 'missing')} in the file"
            continue
        w = match_rows(blocks[g], module.weight, heads)
        if w is None:
            kept[key] = f"{g} does not reproduce the model's weight"
        else:
            exact[key] = w
    plan = WeightPlan("gguf", exact, str(gguf_path), kept)
    kinds: dict[str, int] = {}
    for w in exact.values():
        kind = f"{bits_of(w)}-bit"
        kinds[kind] = kinds.get(kind, 0) + 1
    log.info("weights auto: %s from %s; float: %s", ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())),
             Path(gguf_path).name, ", ".join(f"{k} ({v})" for k, v in kept.items()) or "none")
    return plan
