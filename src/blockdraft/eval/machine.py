"""What a results file records about the machine that produced it: CPU, SIMD features, kernel ISA, versions."""

from __future__ import annotations

import datetime
import os
import platform

import torch
import transformers

from ..models.quant import kernel_isa

SIMD_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_flags() -> list[str]:
    """The SIMD features that decide which kernels run (one model name, e.g. "AMD EPYC", covers CPUs with and
    without AVX-512)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return []
    return [x for x in SIMD_FLAGS if x in flags]


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    tf = transformers.__version__
    return {"cpu": cpu, "cpu_flags": cpu_flags(), "kernel_isa": kernel_isa(), "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": tf,
            "threads": torch.get_num_threads(), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
