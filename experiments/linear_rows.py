#!/usr/bin/env python
"""Every linear of a target's layers on its GGUF weights (the native kernels), one call each with M rows, M = 1 ..
64: milliseconds per pass, per row, and GMAC/s (best of 5 passes). The calls are `step-profile --parts linears`'
(float32 activations, as the native stack feeds them; the figures in docs dated before 2026-12-04 fed bf16). Shows
where batched rows stop being free on this CPU: the kernels read each weight once per call, so at 1 row they are
bound by memory and from a few rows on by the int8 multiply-adds.

With --onednn the same shapes also run through oneDNN, which uses AMX tiles where the CPU has them (its verbose log,
ONEDNN_VERBOSE=1, names the kernel): 8-bit weights per output channel with 8-bit activations (torch's quantized
linear, engine 'onednn') and bf16 weights (`F.linear`). Random weights of the same shapes: what is timed is how the
cost grows with M on this CPU's matrix units, not those weights' values (8 bits a weight read, against the GGUF's
4-6: the absolute times are not comparable, the growth with M is).

    .venv/bin/python experiments/linear_rows.py --threads 2
    .venv/bin/python experiments/linear_rows.py --target qwen2.5-coder-1.5b --onednn --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from blockdraft.eval.step_profile import Linears
from blockdraft.models.loading import load_target


class OneDnn:
    """The shapes of `lins` through oneDNN: int8 ('int8': per-channel s8 weights, u8 activations) or 'bf16'."""

    def __init__(self, lins: list, widths: list[int], mode: str, gen: torch.Generator) -> None:
        self.mode, self.weights, self.xs = mode, [], {}
        for lin in lins:
            w = torch.randn(lin.out_features, lin.in_features, generator=gen) * 0.02
            if mode == "int8":
                scale = (w.abs().amax(1) / 127).clamp_min(1e-8)
                q = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
                self.weights.append(torch.ops.quantized.linear_prepack(q, None))
            else:
                self.weights.append(w.to(torch.bfloat16))
        for m in widths:
            xs = [torch.randn(m, lin.in_features, generator=gen) for lin in lins]
            self.xs[m] = ([torch.quantize_per_tensor(x, float(x.abs().max() / 127), 128, torch.quint8) for x in xs]
                          if mode == "int8" else [x.to(torch.bfloat16) for x in xs])

    def __call__(self, m: int) -> float:
        t0 = time.perf_counter()
        for w, x in zip(self.weights, self.xs[m]):
            if self.mode == "int8":
                torch.ops.quantized.linear(x, w, 1.0, 128)
            else:
                F.linear(x, w)
        return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="a packaged target (default: the default target)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--onednn", action="store_true", help="also oneDNN's int8 and bf16 products of the same shapes")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    target, _ = load_target(args.target, "bf16")
    widths = [1, 2, 4, 8, 16, 64]
    gen = torch.Generator().manual_seed(0)
    lins = Linears(target, widths, gen)
    runs = {"ours": lins}
    if args.onednn:
        torch.backends.quantized.engine = "onednn"
        runs["onednn-int8"] = OneDnn(lins.lins, widths, "int8", gen)
        runs["onednn-bf16"] = OneDnn(lins.lins, widths, "bf16", gen)
    print(f"{len(lins.lins)} linears, {lins.macs / 1e6:.1f} M multiply-adds per row, {args.threads} threads")
    for name, f in runs.items():
        one = None
        for m in widths:
            best = min(f(m) for _ in range(5))
            one = one or best
            print(f"{name:12s} M={m:3d}: {best * 1e3:7.2f} ms ({best / one:5.2f}x M=1), {best * 1e3 / m:6.2f} ms/row, "
                  f"{lins.macs * m / best / 1e9:6.1f} GMAC/s")


if __name__ == "__main__":
    main()
