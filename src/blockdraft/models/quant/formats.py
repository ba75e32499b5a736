"""The quantized weight formats (Q4 / Q5 / Q8 blocks of 32 inputs), GGUF's K-quant scales kept factored, packing,
quantizing float weights, and fusing weights of different kinds (see the package docstring)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

BLOCK = 32  # inputs per quant block (GGUF's Q4_0/Q4_1/Q8_0 block; Q4_K/Q6_K sub-blocks are 32 / 16)
WEIGHT_MODES = ("auto", "bf16", "int8", "int4")


@dataclass(frozen=True)
class Factored:
    """A weight's block scales as GGUF's K-quants hold them: an integer per block times a float per super-block of
    256 inputs. Q4 / Q5: scale = d * sub and offset = -(dmin * sub_min) per block of 32 (sub, sub_min uint8
    [N, K/32]); Q8 (from Q6_K): scale = d * sub per 16 inputs (sub int8 [N, K/16]); d, dmin float32 [N, K/256].
    The products are exact in float32, so the weight's `scale` / `offset` are these products; the kernels stream a
    byte per block instead of a float (`csrc/qlinear.h`)."""

    d: torch.Tensor
    sub: torch.Tensor
    dmin: torch.Tensor | None = None
    sub_min: torch.Tensor | None = None

    def per(self) -> int:
        """sub-scales per super-block"""
        return self.sub.shape[1] // self.d.shape[1]

    def scale(self) -> torch.Tensor:
        return self.d.repeat_interleave(self.per(), dim=1) * self.sub.float()

    def offset(self) -> torch.Tensor:
        assert self.dmin is not None and self.sub_min is not None, "a Q8 weight's factored scales have no offset"
        return -(self.dmin.repeat_interleave(self.per(), dim=1) * self.sub_min.float())

    def select(self, rows: torch.Tensor) -> "Factored":
        return Factored(*(None if t is None else t[rows].contiguous() for t in (self.d, self.sub, self.dmin,
                                                                                 self.sub_min)))

    @staticmethod
    def cat(fs: "list[Factored | None]") -> "Factored | None":
        """Stacked along the output; None unless every part has them."""
        if any(f is None for f in fs):
            return None
        fields = [[getattr(f, n) for f in fs] for n in ("d", "sub", "dmin", "sub_min")]
        return Factored(*(None if any(t is None for t in ts) else torch.cat(ts) for ts in fields))


def _check_factored(f: Factored | None, scale: torch.Tensor, offset: torch.Tensor | None) -> None:
    """f, when given, must multiply out to the weight's scales exactly: the kernels use f instead of them."""
    if f is None:
        return
    assert scale.shape[1] % f.d.shape[1] == 0 and f.sub.shape == scale.shape, "factored scales of the wrong shape"
    assert torch.equal(f.scale(), scale), "factored scales do not multiply out to the scales"
    if offset is not None:
        assert torch.equal(f.offset(), offset), "factored offsets do not multiply out to the offsets"


@dataclass(frozen=True)
class Q4Weight:
    """w [N, K] = scale * code + offset per block of 32 inputs.
    codes uint8 [N, K/2]: byte j of a block holds input j in its low nibble and input j + 16 in its high nibble;
    scale, offset float32 [N, K/32]."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    factored: Factored | None = None

    def __post_init__(self) -> None:
        _check_nibble_blocks(self.codes, self.scale, self.offset)
        _check_factored(self.factored, self.scale, self.offset)

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
        return Q4Weight(self.codes[rows].contiguous(), self.scale[rows].contiguous(), self.offset[rows].contiguous(),
                        None if self.factored is None else self.factored.select(rows))


def _check_nibble_blocks(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> tuple[int, int]:
    """Q4Weight's and Q5Weight's shared layout: codes uint8 [N, K/2], scale and offset [N, K/32] -> (N, K/32)."""
    n, half = codes.shape
    g = 2 * half // BLOCK
    assert codes.dtype == torch.uint8 and 2 * half % BLOCK == 0, "codes must be uint8 [N, K/2], K % 32 == 0"
    assert scale.shape == offset.shape == (n, g), (
        f"scale/offset must be [N, K/32] = [{n}, {g}], got {tuple(scale.shape)} / {tuple(offset.shape)}")
    return n, g


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
    factored: Factored | None = None

    def __post_init__(self) -> None:
        n, g = _check_nibble_blocks(self.codes, self.scale, self.offset)
        assert self.high.dtype == torch.uint8 and tuple(self.high.shape) == (n, 4 * g), (
            f"high must be uint8 [N, K/8] = [{n}, {4 * g}], got {tuple(self.high.shape)}")
        _check_factored(self.factored, self.scale, self.offset)

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
        return Q5Weight(*(getattr(self, f)[rows].contiguous() for f in ("codes", "high", "scale", "offset")),
                        None if self.factored is None else self.factored.select(rows))


@dataclass(frozen=True)
class Q8Weight:
    """w [N, K] = scale * code per 16 inputs. codes int8 [N, K] (-127..127), scale float32 [N, K/16]."""

    codes: torch.Tensor
    scale: torch.Tensor
    factored: Factored | None = None

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        assert self.codes.dtype == torch.int8 and k % BLOCK == 0, "codes must be int8 [N, K] with K % 32 == 0"
        assert self.scale.shape == (n, k // 16), (
            f"scale must be [N, K/16] = [{n}, {k // 16}]: {tuple(self.scale.shape)}")
        _check_factored(self.factored, self.scale, None)

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        return (self.codes.view(n, k // 16, 16).float() * self.scale[..., None]).view(n, k)

    def select(self, rows: torch.Tensor) -> "Q8Weight":
        return Q8Weight(self.codes[rows].contiguous(), self.scale[rows].contiguous(),
                        None if self.factored is None else self.factored.select(rows))


@dataclass(frozen=True)
class Stacked:
    """A fused linear (q/k/v, gate/up) whose parts no one format holds exactly (GGUF's Q4_K q and k beside a Q6_K
    v): the parts side by side along the output, each in its own format. The kernels quantize the input once and
    run each part's own kernel into its columns, so each part computes what it would alone."""

    parts: tuple

    def __post_init__(self) -> None:
        assert len(self.parts) >= 2 and len({p.shape[1] for p in self.parts}) == 1, (
            "a stack needs two or more parts of one input width")

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def dequantize(self) -> torch.Tensor:
        """-> w [N, K] float32"""
        return torch.cat([p.dequantize() for p in self.parts])


QWeight = Q4Weight | Q5Weight | Q8Weight | Stacked


def bits_of(w: QWeight) -> int:
    """The kernels' name for a weight's format: 4, 5 or 8 (a stack: its widest part's)."""
    if isinstance(w, Stacked):
        return max(bits_of(p) for p in w.parts)
    return 4 if isinstance(w, Q4Weight) else 5 if isinstance(w, Q5Weight) else 8


def qweight_tensors(w) -> list[torch.Tensor]:
    """The tensors a weight holds (codes, scales, factored scales; a stack: its parts')."""
    if isinstance(w, Stacked):
        return [t for p in w.parts for t in qweight_tensors(p)]
    out = []
    for f in dataclasses.fields(w):
        v = getattr(w, f.name)
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif dataclasses.is_dataclass(v):  # Factored
            out += qweight_tensors(v)
    return out


def tensor_bytes(tensors) -> int:
    """The bytes held by these tensors, each counted once however often it is listed."""
    seen = {(t.data_ptr(), t.numel()): t.numel() * t.element_size() for t in tensors}
    return sum(seen.values())


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
    """Stack weights of one kind along the output dimension (fused q/k/v, gate/up); factored scales are kept where
    every part has them."""
    kinds = {type(w) for w in ws}
    assert len(kinds) == 1 and len({w.shape[1] for w in ws}) == 1, "concat needs one kind and one input width"
    fields = {Q4Weight: ("codes", "scale", "offset"), Q5Weight: ("codes", "high", "scale", "offset"),
              Q8Weight: ("codes", "scale")}[type(ws[0])]
    return type(ws[0])(*(torch.cat([getattr(w, f) for w in ws]) for f in fields),
                       Factored.cat([w.factored for w in ws]))


def as_kind(w: QWeight, kind: type) -> QWeight | None:
    """w in another format holding exactly the same values, or None where that format cannot: 4-bit codes are
    5-bit codes with a zero fifth bit; 4- and 5-bit codes are signed 8-bit ones where the offset is the centre's
    (o = -8d, -16d: GGUF's Q4_0 / Q5_0)."""
    if isinstance(w, kind):
        return w
    if isinstance(w, Q4Weight) and kind is Q5Weight:
        return Q5Weight(w.codes, torch.zeros(w.shape[0], w.shape[1] // 8, dtype=torch.uint8), w.scale, w.offset,
                        w.factored)
    if isinstance(w, (Q4Weight, Q5Weight)) and kind is Q8Weight:
        centre = 8 if isinstance(w, Q4Weight) else 16
        if not torch.equal(w.offset, -centre * w.scale):
            return None
        codes = (w.unpacked().to(torch.int16) - centre).to(torch.int8).view(w.shape)
        return Q8Weight(codes, w.scale.repeat_interleave(2, dim=1).contiguous())
    return None


def fuse(ws: list[QWeight]) -> QWeight:
    """Stack the parts of a fused linear along the output in the narrowest format that holds every part exactly
    (4 < 5 < 8 bits), or, where none does (a Q4_K part beside a Q6_K one), as a `Stacked` of the parts in their
    own formats, neighbours that share a format joined (q and k as one part beside v)."""
    one = _one_format(ws)
    if one is not None:
        return one
    groups = [ws[0]]
    for w in ws[1:]:
        joined = _one_format([groups[-1], w])
        if joined is None:
            groups.append(w)
        else:
            groups[-1] = joined
    return Stacked(tuple(groups))


def _one_format(ws: list[QWeight]) -> QWeight | None:
    """ws stacked in the narrowest format that holds every part exactly (4 < 5 < 8 bits), or None."""
    for kind in (Q4Weight, Q5Weight, Q8Weight):
        parts = [as_kind(w, kind) for w in ws]
        if all(p is not None for p in parts):
            return concat(parts) if len(parts) > 1 else parts[0]
    return None


def quantize(w: torch.Tensor, mode: str) -> QWeight:
    """w [N, K] -> the weight of an opt-in mode: 'int4' (groups of 32, min/max) or 'int8' (groups of 32, absmax)."""
    if mode == "int4":
        return quantize_q4(w)
    if mode == "int8":
        return quantize_q8(w)
    raise ValueError(f"no quantizer for weights mode {mode!r}")
