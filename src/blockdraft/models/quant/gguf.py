"""GGUF's quant blocks mapped exactly onto the formats (formats.py), GGUF tensor names onto HF ones, and a GGUF
file's weights read as such."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from .formats import BLOCK, Factored, Q4Weight, Q5Weight, Q8Weight, QWeight, pack_q5

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


def _k_factors(d: np.ndarray, sc: np.ndarray, dmin: np.ndarray, mn: np.ndarray) -> Factored:
    """A Q4_K / Q5_K tensor's super-block floats d, dmin [N, S] and 6-bit scales and mins [N, S, 8] (as float32)
    -> its factored scales (the weight's scale and offset are their products)."""
    n = d.shape[0]
    return Factored(torch.from_numpy(np.ascontiguousarray(d)), torch.from_numpy(sc.astype(np.uint8).reshape(n, -1)),
                    torch.from_numpy(np.ascontiguousarray(dmin)), torch.from_numpy(mn.astype(np.uint8).reshape(n, -1)))


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
        return Q5Weight(*pack_q5(torch.from_numpy(codes)), torch.from_numpy(scale), torch.from_numpy(off),
                        _k_factors(d, sc, dmin, mn))
    if kind == "Q4_K":  # super-blocks of 256: d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        b = data.reshape(n, k // 256, 144)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k4_scales(b[..., 4:16])  # [N, S, 8]
        q = b[..., 16:].reshape(n, k // 256, 4, 2, 16)  # 4 chunks of 64 inputs: low nibbles 0..31, high 32..63
        lo, hi = q[..., 0, :], q[..., 1, :]  # bytes 0..15 and 16..31 of a chunk
        # straight into our layout (byte j of a block of 32: input j low, j + 16 high): inputs 0..31 are the low
        # nibbles, 32..63 the high ones (unpacking every code to a byte and packing again cost ~15% more)
        codes = np.stack([(lo & 15) | (hi << 4), (lo >> 4) | (hi & 0xF0)], axis=3).reshape(n, k // 2)
        scale = (d[..., None] * sc).reshape(n, k // BLOCK)
        off = -(dmin[..., None] * mn).reshape(n, k // BLOCK)
        return Q4Weight(torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(off),
                        _k_factors(d, sc, dmin, mn))
    if kind == "Q6_K":  # super-blocks of 256: ql[128], qh[64], 16 int8 scales, d
        b = data.reshape(n, k // 256, 210)
        ql, qh = b[..., :128].reshape(n, -1, 2, 64), b[..., 128:192].reshape(n, -1, 2, 32)
        sc = b[..., 192:208].copy().view(np.int8).astype(np.float32)
        d = _f16(b[..., 208:210])
        lo = np.concatenate([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)
        hi = np.concatenate([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, (qh >> 6) & 3], axis=-1)
        codes = ((lo | (hi << 4)) - np.uint8(32)).view(np.int8).reshape(n, k)  # 0..63 - 32, wrapped as int8
        scale = (d[..., None] * sc).reshape(n, k // 16)
        return Q8Weight(torch.from_numpy(codes), torch.from_numpy(scale),
                        Factored(torch.from_numpy(np.ascontiguousarray(d)),
                                 torch.from_numpy(sc.astype(np.int8).reshape(n, k // 16))))
    return None


class GGUFTensor(NamedTuple):
    """One tensor of a GGUF file as its header lists it: dims in GGUF's order (the contiguous one first), where its
    bytes start in the file, and how many there are (None for a type without a known size)."""
    name: str
    kind: str
    dims: tuple[int, ...]
    start: int
    nbytes: int | None


# GGUF's metadata value types of a fixed size (gguf.GGUFValueType: 8 is a string, 9 an array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_index(path: str | Path) -> list[GGUFTensor]:
    """The tensors a GGUF file (version 2 or 3) lists, read from its header alone. gguf-py's reader also turns every
    metadata value into numpy objects: on a 150k-token vocabulary (its tokens and merges) that took ~11 s of a
    target's load; here the metadata is skipped but for the data alignment. A truncated or corrupt file is a
    ValueError naming it."""
    import gguf

    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # an empty file
            raise ValueError(f"{path}: not a readable GGUF file ({e})") from None
    with buf:
        size = len(buf)
        pos = 0

        def take(fmt: str):
            nonlocal pos
            v = struct.unpack_from(fmt, buf, pos)[0]
            pos += struct.calcsize(fmt)
            return v

        def string() -> str:
            nonlocal pos
            n = take("<Q")
            if pos + n > size:
                raise ValueError("a string runs past the end")
            pos += n
            return bytes(buf[pos - n:pos]).decode("utf-8", errors="replace")

        def skip(vtype: int) -> None:
            nonlocal pos
            if vtype in _SCALARS:
                pos += struct.calcsize(_SCALARS[vtype])
            elif vtype == 8:
                n = take("<Q")  # read before the sum: `pos += take(...)` would add to pos as it was before
                pos += n
            elif vtype == 9:
                item, count = take("<I"), take("<Q")
                if item in _SCALARS:
                    pos += count * struct.calcsize(_SCALARS[item])
                else:
                    for _ in range(count):
                        skip(item)
            else:
                raise ValueError(f"unknown metadata value type {vtype}")
            if pos > size:
                raise ValueError("the metadata runs past the end")

        try:
            if take("<I") != gguf.GGUF_MAGIC:
                raise ValueError("no GGUF magic")
            version = take("<I")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (2 and 3 are read)")
            n_tensors, n_kv = take("<Q"), take("<Q")
            if 8 * (n_tensors + n_kv) > size:  # each entry takes at least 8 bytes: garbage counts stop here
                raise ValueError(f"{n_tensors} tensors and {n_kv} metadata entries cannot fit the file")
            alignment = gguf.GGUF_DEFAULT_ALIGNMENT
            for _ in range(n_kv):
                key, vtype = string(), take("<I")
                if key == gguf.Keys.General.ALIGNMENT and vtype in _SCALARS:
                    alignment = int(take(_SCALARS[vtype]))
                    if alignment <= 0:
                        raise ValueError(f"data alignment {alignment}")
                else:
                    skip(vtype)
            listed = []
            for _ in range(n_tensors):
                name, n_dims = string(), take("<I")
                if n_dims > 4:  # GGML_MAX_DIMS
                    raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
                dims = tuple(take("<Q") for _ in range(n_dims))
                listed.append((name, dims, take("<I"), take("<Q")))
        except (struct.error, ValueError, OverflowError) as e:
            raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
        data = -(-pos // alignment) * alignment
        tensors = []
        for name, dims, code, offset in listed:
            try:
                kind = gguf.GGMLQuantizationType(code).name
                block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(code)]
                nbytes = int(np.prod(dims, dtype=np.int64)) // block * block_bytes
            except (ValueError, KeyError):
                kind, nbytes = f"type {code}", None
            if nbytes is not None and data + offset + nbytes > size:
                raise ValueError(f"{path}: not a readable GGUF file (tensor {name!r} runs past the end: truncated)")
            tensors.append(GGUFTensor(name, kind, dims, data + offset, nbytes))
        return tensors


class GGUFBlocks:
    """A GGUF file's 2-D tensors in our formats, each converted when it is asked for (`blocks[name]`): a plan that
    checks and keeps them one by one never holds the whole file converted beside the float model (on the 1.5B
    target that was ~2 GB of a load's peak, the unused token embedding's blocks included). The file is opened, and
    a truncated or corrupt one refused, at construction; `other` maps the tensors of types that do not map to their
    type."""

    def __init__(self, path: str | Path) -> None:
        self.path = path
        self._tensors: dict[str, GGUFTensor] = {}
        self.other: dict[str, str] = {}
        for t in read_gguf_index(path):
            if len(t.dims) != 2:
                continue
            kind, k = t.kind, t.dims[0]  # GGUF lists the contiguous (input) dimension first
            if (kind in _SUPER_BLOCK_KINDS and k % 256 == 0) or (kind in _BLOCK_KINDS and k % BLOCK == 0):
                self._tensors[t.name] = t
            else:
                self.other[t.name] = kind
        self._data: np.ndarray | None = None  # the file mapped read-only, on first use

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def __iter__(self):
        return iter(self._tensors)

    def __getitem__(self, name: str) -> QWeight:
        t = self._tensors[name]
        if self._data is None:
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._data[t.start:t.start + t.nbytes].reshape(t.dims[1], -1)
        try:
            return gguf_block_weight(t.kind, raw, t.dims[0])
        except Exception as e:  # noqa: BLE001 - name the tensor whose blocks do not fit
            raise ValueError(f"{self.path}: tensor {t.name!r} ({t.kind}, shape {list(t.dims)}) cannot be read: "
                             f"{type(e).__name__}: {e}") from None


_BLOCK_KINDS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # blocks of 32 inputs
_SUPER_BLOCK_KINDS = ("Q4_K", "Q5_K", "Q6_K")  # super-blocks of 256


def read_gguf_weights(path: str | Path) -> tuple[dict[str, QWeight], dict[str, str]]:
    """The 2-D tensors of a GGUF file, all converted -> ({gguf name: weight} for those that map, {gguf name: type}
    for the rest). A target's plan reads them one by one (`GGUFBlocks`)."""
    blocks = GGUFBlocks(path)
    return {name: blocks[name] for name in blocks}, dict(blocks.other)


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


def match_rows(w: QWeight, reference: torch.Tensor, head_counts: tuple[int, ...],
               sample: int = 512) -> QWeight | None:
    """w as the model's own weight `reference` [N, K]: as is, or with llama.cpp's q/k row permutation undone (for
    one of `head_counts`), whichever reproduces it; None if none does. The tolerance is relative (1e-3 of the
    weight's norm): the model holds the same values rounded to its dtype, a wrong row order is off by ~1.4.
    The check reads `sample` rows spread evenly over N (all of them when N is smaller): it is there for the name
    and the row order, and a wrong tensor or order differs on nearly every row (a head's permutation moves all but
    two of its rows), while dequantizing every row of every weight took ~10 s of the 1.5B target's load."""
    if tuple(w.shape) != tuple(reference.shape):
        return None
    n = w.shape[0]
    rows = torch.arange(n) if n <= sample else torch.linspace(0, n - 1, sample).round().long().unique()
    ref = reference.detach()[rows]
    norm = _distance(None, ref) or 1.0

    def close(x: QWeight) -> bool:
        return _distance(x, ref) <= 1e-3 * norm

    if close(w if n <= sample else w.select(rows)):
        return w
    for h in head_counts:
        if h and n % (2 * h) == 0:
            perm = llama_rope_rows(n, h)
            if close(w.select(perm[rows])):
                return w.select(perm)
    return None


def _distance(x: QWeight | None, ref: torch.Tensor, rows: int = 4096) -> float:
    """|x dequantized to ref's dtype - ref| (x None: |ref|) in float32, `rows` rows at a time: a 150k-row LM head
    dequantized whole, beside its float32 reference and their difference, was ~3 GB of a load's peak."""
    total = 0.0
    for i in range(0, ref.shape[0], rows):
        r = ref[i:i + rows].float()
        if x is not None:
            part = x if ref.shape[0] <= rows else x.select(torch.arange(i, i + r.shape[0]))
            r = part.dequantize().to(ref.dtype).float() - r
        total += float(r.pow(2).sum())
    return total ** 0.5
