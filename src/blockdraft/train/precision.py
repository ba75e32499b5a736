"""Which float type training computes in.

bf16 autocast halves the bytes a step moves, but only pays where the CPU multiplies bf16 natively (AVX512-BF16 or
AMX on x86, the BF16 extension on Arm). Elsewhere torch emulates it: on an AVX2 EPYC a [2048, 896] x [896, 4864]
matmul ran at 17 GFLOPS in bf16 against 91 in fp32 (2 threads), so training there computes in fp32.
"""

from __future__ import annotations

import contextlib
import functools

import torch

PRECISIONS = ("auto", "bf16", "fp32")


@functools.lru_cache(maxsize=1)
def native_bf16() -> bool:
    """True when this CPU has bf16 matrix instructions (read from /proc/cpuinfo; False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("flags", "features"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    except OSError:
        pass
    return False


def compute_dtype(precision: str, device_type: str = "cpu") -> torch.dtype:
    """'bf16' / 'fp32', or 'auto': bf16 on a GPU and where the CPU multiplies it natively, else fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        return torch.bfloat16 if device_type == "cuda" or native_bf16() else torch.float32
    return torch.bfloat16 if precision == "bf16" else torch.float32


def autocast(dtype: torch.dtype, device_type: str = "cpu"):
    """bf16 autocast (on `device_type`) for dtype bf16; a no-op context for fp32."""
    if dtype == torch.bfloat16:
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def dtype_name(dtype: torch.dtype) -> str:
    """torch dtype -> the name `load_target` takes."""
    return "bf16" if dtype == torch.bfloat16 else "fp32"
