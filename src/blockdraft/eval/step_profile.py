"""Time one target step of the fast path at a fixed context, per weights mode and decoder path, methods interleaved.

A step is `TargetModel.forward` over W new tokens after `--context` cached positions (LM head included, features of
the draft's tapped layers included), the cache cropped back after each. Configurations:
- `bf16-python`: float weights through lean.py's Python layers (the path before quantized weights);
- `auto-python`: the GGUF's own 4/8-bit blocks through the same Python layers;
- `auto-native`: the same weights through the native stack (csrc/decoder.cpp), what decoding uses (on the best
  kernels this CPU has: AVX512-VNNI where it has them);
- `auto-native-avx2`: the same with the AVX2 kernels (the same bits, fewer multiply-adds per instruction).
Each configuration runs `--reps` timed steps per round, rounds rotate the order, the median is reported; one
`torch.profiler` table per configuration (W = 1) shows where the time goes.

    blockdraft step-profile --dtype bf16 --widths 1,4,8,16 --out benchmarks/step-profile/run.json
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from ..models.loading import load_target
from ..models.quant import quant_kernels
from ..models.target import TargetModel
from .machine import machine_info


def run(args) -> int:
    """`blockdraft step-profile`: time the configurations of args.paths (see above)."""
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    widths = [int(w) for w in args.widths.split(",")]
    taps = tuple(int(x) for x in args.layers.split(","))

    auto, _ = load_target(args.target, args.dtype, weights="auto")
    auto.set_layer_ids(taps)
    python = TargetModel(auto.hf, auto.tokenizer, layer_ids=taps, weights=auto.weights)
    python.lean.native = None  # the same quantized weights through the Python layers
    bf16 = TargetModel(auto.hf, auto.tokenizer, layer_ids=taps)
    configs = {"bf16-python": bf16, "auto-python": python, "auto-native": auto, "auto-native-avx2": auto}
    kernels = quant_kernels()
    best_isa = kernels.kernel_isa() if kernels is not None else None
    isa = {"auto-native-avx2": "avx2"}
    configs = {name: configs[name] for name in args.paths.split(",")}
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, auto.vocab_size, (1, args.context), generator=gen)
    caches = {}
    for name, t in configs.items():
        caches[name] = t.new_decode_cache(args.context + max(widths) + 8)
        t.forward(prompt, caches[name], last_only=True)
    if best_isa is not None:
        print(f"kernels: {best_isa} (auto-native), avx2 (auto-native-avx2)")

    def step(name: str, w: int) -> float:
        t, c = configs[name], caches[name]
        if kernels is not None:
            kernels.set_kernel_isa(isa.get(name, best_isa))
        ids = torch.randint(0, auto.vocab_size, (1, w), generator=gen)
        t0 = time.perf_counter()
        t.forward(ids, c)
        dt = time.perf_counter() - t0
        c.crop(args.context)
        return dt

    for name in configs:  # warm-up: first calls allocate and touch every weight
        for w in widths:
            step(name, w)
    times: dict[str, dict[int, list[float]]] = {n: {w: [] for w in widths} for n in configs}
    names = list(configs)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for w in widths:
                times[name][w] += [step(name, w) for _ in range(args.reps)]
    table = {n: {w: 1e3 * statistics.median(v) for w, v in ws.items()} for n, ws in times.items()}
    profiles = {}
    from torch.profiler import ProfilerActivity, profile

    for name in names:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.reps):
                step(name, 1)
        profiles[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    print(f"target step at context {args.context}, ms (median of {args.rounds * args.reps}), dtype {args.dtype}")
    print("| path | " + " | ".join(f"{w} tok" for w in widths) + " |")
    print("|---|" + "---:|" * len(widths))
    for n in names:
        print(f"| {n} | " + " | ".join(f"{table[n][w]:.1f}" for w in widths) + " |")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"command": "blockdraft step-profile " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
            "machine": machine_info(), "weights": auto.weights.describe(), "kernel_isa": best_isa, "ms": table,
            "profiles": profiles}, indent=1))
        print(f"wrote {out}")
    return 0
