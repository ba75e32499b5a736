"""The quantized linear (`QuantLinear`) and the loading of its C++ kernels (csrc/, compiled once per machine), with
the dequantized `F.linear` fallback where they cannot be built."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ...atomic import file_lock
from .formats import Q4Weight, Q5Weight, QWeight, Stacked, bits_of, qweight_tensors

log = logging.getLogger(__name__)

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

            csrc = Path(__file__).resolve().parents[1] / "csrc"
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
        self.weight: QWeight | None = weight  # None once released (`release_source`): only the packed copy is left
        self.out_features, self.in_features = weight.shape
        self.bits = bits_of(weight)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._dense: dict[torch.dtype, torch.Tensor] = {}
        self._call = None  # the packed kernel once bound (False: none, use the fallback)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., K] -> [..., N]; the kernel checks x (shape, float32 / bf16, CPU) and refuses what it cannot run
        if self._call is None:
            self._bind()
        if self._call is False:
            return self._fallback(x)
        return self._call(x)

    def _bind(self) -> None:
        # the weights are repacked once into the kernels' panel layout; a decode step then makes ~120 direct calls
        k = _load_kernels()
        self._call = False if k is None else _native(k, self.weight, self.bias)

    def native(self):
        """This linear as the kernels hold it (csrc/qlinear.h `QLin`, also what the native decoder takes), packed
        once: the native decoder and direct calls share one copy."""
        if self._call is None:
            self._bind()
        if self._call is False:
            raise RuntimeError(f"the quantized kernels are not in use: {kernel_status()}")
        return self._call

    def release_source(self) -> list[torch.Tensor]:
        """Drop the unpacked weight once the kernels hold their packed copy (everything a product reads from then
        on): -> the tensors it held (none where the linear runs the dequantized fallback, which needs them)."""
        if not self._call or self.weight is None:
            return []
        held = qweight_tensors(self.weight)
        self.weight = None
        return held

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        assert x.shape[-1] == self.in_features, f"x must be [..., {self.in_features}], got {tuple(x.shape)}"
        dense = self._dense.get(x.dtype)
        if dense is None:
            assert self.weight is not None, "a released linear runs on the kernels only"
            dense = self._dense[x.dtype] = self.weight.dequantize().to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, dense, bias)


def _native(k, w: QWeight, bias: torch.Tensor | None):
    """w (and its float32 bias [N]) packed for the kernels `k`: a stack part by part, each with its slice of the
    bias; factored K-quant scales passed on (the kernels then stream a byte per block instead of a float)."""
    if isinstance(w, Stacked):
        parts, start = [], 0
        for p in w.parts:
            parts.append(_native(k, p, None if bias is None else bias[start:start + p.shape[0]].contiguous()))
            start += p.shape[0]
        return k.stack_qlin(parts)
    f = w.factored
    factors = {} if f is None else {"sub": f.sub, "super_scale": f.d, "sub_min": f.sub_min, "super_min": f.dmin}
    if isinstance(w, Q4Weight):
        return k.make_qlin(4, w.codes, w.scale, w.offset, bias, **factors)
    if isinstance(w, Q5Weight):
        return k.make_qlin(5, w.codes, w.scale, w.offset, bias, w.high, **factors)
    return k.make_qlin(8, w.codes, w.scale, None, bias, **factors)
