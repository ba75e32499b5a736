#!/usr/bin/env python
"""All 120 linears of the default target on its GGUF weights (the native q4 kernels), one call each with M rows,
M = 1 .. 64: milliseconds per pass, per row, and GMAC/s (best of 5 passes). The calls are `step-profile --parts
linears`' (float32 activations, as the native stack feeds them; the figures in docs dated before 2026-12-04 fed
bf16). Shows where batched rows stop being free on this CPU: the kernels read each weight once per call, so at 1
row they are bound by memory and from a few rows on by the int8 multiply-adds.

    .venv/bin/python experiments/linear_rows.py --threads 2
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    from blockdraft.eval.step_profile import Linears
    from blockdraft.models.loading import load_target

    target, _ = load_target(None, "bf16")
    widths = [1, 2, 4, 8, 16, 64]
    lins = Linears(target, widths, torch.Generator().manual_seed(0))
    print(f"{len(lins.lins)} linears, {lins.macs / 1e6:.1f} M multiply-adds per row, {args.threads} threads")
    for m in widths:
        best = min(lins(m) for _ in range(5))
        print(f"M={m:3d}: {best * 1e3:7.2f} ms, {best * 1e3 / m:5.2f} ms/row, {lins.macs * m / best / 1e9:5.1f} GMAC/s")


if __name__ == "__main__":
    main()
