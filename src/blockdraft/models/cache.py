"""Preallocated key/value caches: write in place, crop by moving a length pointer, no concatenation.

`KVCache` holds, for each layer, keys and values of shape [B, H_kv, capacity, D]. The draft keeps only the
projected *context* K/V here (the block's own K/V are recomputed every step, as in DFlash); the target cache is an
adapter around the model's own cache (see target.py).
"""

from __future__ import annotations

import torch


def keeps_prefix(start: int, keep: torch.Tensor, length: int) -> bool:
    """Check a cache's `compact(start, keep)` (keep [M] int64 increasing, start + keep[-1] < length); True when keep
    is 0, 1, .., M-1 (a chain's accepted path), which is a crop: nothing moves."""
    m = keep.numel()
    assert keep.dim() == 1 and m >= 1, "keep must be [M], M >= 1"
    # a plain step keeps one position: skip the order check's tensor ops (a few per cent of a small target's step)
    assert m == 1 or bool((keep[1:] > keep[:-1]).all()), "keep must be increasing"
    last = int(keep[-1])
    if start + last >= length:
        raise ValueError(f"cannot keep position {start + last} of a cache of length {length}")
    return last == m - 1


class KVCache:
    """Per-layer K/V buffers of fixed capacity with a shared fill length.

    append(ks, vs): ks/vs are [num_layers, B, H_kv, T, D]; written at [length, length+T).
    write(layer, k, v) + length update: the same, one layer at a time (a decoder writes as it goes).
    view(layer) -> (k, v) of [B, H_kv, length, D] (views, no copies).
    crop(n): keep the first n positions. compact(start, keep): keep a subset of the positions after start.
    reset(): length 0. select_rows(rows): keep those batch rows.
    Capacity grows by doubling if exceeded.
    """

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
        assert num_layers >= 1 and capacity >= 1
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    def _grow(self, needed: int) -> None:
        new_cap = max(needed, 2 * self.capacity)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[:3] + (new_cap,) + old.shape[4:])
            new[:, :, :, : self.length] = old[:, :, :, : self.length]
            setattr(self, name, new)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` [B'] (int64), in that order: finished rows leave a batched generation."""
        self.k = self.k[:, rows].contiguous()
        self.v = self.v[:, rows].contiguous()

    def reserve(self, total: int) -> None:
        """Make room for `total` positions (doubling the capacity, so growth costs amortised O(1) per position)."""
        if total > self.capacity:
            self._grow(total)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, H_kv, T, D] for positions length .. length+T-1 of one layer (capacity reserved first).
        Returns that layer's keys/values through the new positions, [B, H_kv, length+T, D] views. The caller
        moves `length` once every layer is written."""
        end = self.length + k.shape[2]
        assert end <= self.capacity, "reserve() the cache before writing"
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def append(self, ks: torch.Tensor, vs: torch.Tensor) -> None:
        """ks, vs: [num_layers, B, H_kv, T, D] for T new positions."""
        assert ks.shape == vs.shape and ks.dim() == 5 and ks.shape[0] == self.num_layers, tuple(ks.shape)
        assert ks.shape[1:3] == self.k.shape[1:3] and ks.shape[4] == self.k.shape[4], (
            f"append shape {tuple(ks.shape)} does not fit cache {tuple(self.k.shape)}"
        )
        t = ks.shape[3]
        if self.length + t > self.capacity:
            self._grow(self.length + t)
        self.k[:, :, :, self.length : self.length + t] = ks
        self.v[:, :, :, self.length : self.length + t] = vs
        self.length += t

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer, :, :, : self.length], self.v[layer, :, :, : self.length]

    def crop(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {n}")
        self.length = n

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Keep positions start + keep[j] at start + j and crop to start + len(keep): after a tree verify, the
        accepted path's K/V move next to the committed context, whatever the order of the tree's nodes.
        keep [M] int64, increasing (a parent precedes its child), start + keep[-1] < length."""
        m = keep.numel()
        if keeps_prefix(start, keep, self.length):
            self.crop(start + m)
            return
        src = keep + start
        # index_select copies first, so overlapping source and destination ranges are safe
        self.k[:, :, :, start:start + m] = self.k.index_select(3, src)
        self.v[:, :, :, start:start + m] = self.v.index_select(3, src)
        self.length = start + m

    def reset(self) -> None:
        self.length = 0
