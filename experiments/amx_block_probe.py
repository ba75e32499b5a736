#!/usr/bin/env python
"""Does a matrix-unit kernel make a verify's rows free on the project's block-scaled weights? A first AMX kernel on
the 8-bit format (codes with one scale per 32 weights, as `quantize(w, "int8")` and the GGUF's blocks have them)
against the project's AVX512-VNNI kernel on the same format, M = 1 / 4 / 8 / 16 rows of one 8960 x 1536 matrix (the
1.5B target's gate), several copies rotated so that the weights come from memory (`--copies 1 --rows 1024`: from
the cache). Each 32-wide block's tile sums leave the tile unit through memory to be scaled by that block's weight
and activation scales (a tile could otherwise sum the whole K, as oneDNN's per-column-scaled int8 does), four
column tiles sharing one activation tile per pass. Prints the time per matrix and the largest difference from the
exact block-scaled product (float32 rounding only). Needs a CPU with AMX (Intel Sapphire Rapids and later) and
Linux's permission to use it; it says so and stops otherwise.
First it times the tile multiply alone (TDPBSSD back to back on four independent result tiles, no memory) at 1 / 4
/ 16 rows and 32 / 64 inputs: the unit's rate on this machine, the floor under any kernel built on it.

    .venv/bin/python experiments/amx_block_probe.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.cpp_extension import load_inline

from blockdraft.models.quant import QuantLinear, quantize

SRC = r'''
#include <torch/extension.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <ATen/Parallel.h>
#include <chrono>

// the tile configuration LDTILECFG reads (palette 1)
struct TileCfg { uint8_t palette, start; uint8_t r0[14]; uint16_t colsb[16]; uint8_t rows[16]; };

// LDTILECFG on the whole 64 bytes: GCC's _tile_loadconfig tells the compiler it reads 8, so the stores that fill
// the rest could be dropped
static inline void load_tile_config(const TileCfg& c) { __asm__ volatile("ldtilecfg %0" ::"m"(c)); }

// Linux hands the tile state to a process only once asked (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA)
static bool amx_ok() {
  static int ok = -1;
  if (ok < 0) ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// packed: [N/16][K/32][8 rows][64 bytes]: row r, column j holds w[n0 + j][k0 + 4r .. 4r + 3]
torch::Tensor pack(torch::Tensor w) {
  int64_t N = w.size(0), K = w.size(1);
  auto out = torch::empty({N / 16, K / 32, 8, 64}, torch::kInt8);
  auto W = w.accessor<int8_t, 2>(); int8_t* o = out.data_ptr<int8_t>();
  for (int64_t t = 0; t < N / 16; ++t) for (int64_t b = 0; b < K / 32; ++b) for (int r = 0; r < 8; ++r)
    for (int j = 0; j < 16; ++j) for (int q = 0; q < 4; ++q)
      o[(((t * (K / 32) + b) * 8 + r) * 64) + j * 4 + q] = W[t * 16 + j][b * 32 + 4 * r + q];
  return out;
}

// ns per tile multiply, register-only: `iters` rounds of four TDPBSSD into tiles 0-3 (independent accumulators,
// so the rate is the unit's throughput, not one multiply's latency), A [rows, k bytes] and B [k / 4, 64 bytes]
__attribute__((target("amx-tile,amx-int8")))
double tile_multiply_ns(int64_t rows, int64_t k, int64_t iters) {
  TORCH_CHECK(amx_ok(), "AMX not permitted");
  TORCH_CHECK(rows >= 1 && rows <= 16 && (k == 32 || k == 64), "rows 1..16, k 32 or 64");
  TileCfg cfg{}; cfg.palette = 1;
  for (int i = 0; i < 4; ++i) { cfg.rows[i] = rows; cfg.colsb[i] = 64; }
  cfg.rows[4] = rows; cfg.colsb[4] = k;
  cfg.rows[5] = k / 4; cfg.colsb[5] = 64;
  load_tile_config(cfg);
  alignas(64) int8_t zeros[1024] = {};
  _tile_loadd(4, zeros, 64); _tile_loadd(5, zeros, 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbssd(0, 4, 5); _tile_dpbssd(1, 4, 5); _tile_dpbssd(2, 4, 5); _tile_dpbssd(3, 4, 5);
  }
  alignas(64) int32_t sink[16][16];
  _tile_stored(0, sink, 64);  // the multiplies' results are used
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  _tile_release();
  static volatile int32_t kept;
  kept = sink[0][0];
  return s * 1e9 / (4.0 * iters);
}

// a [M, K] int8, sa [M, K/32] f32, packed, sw [N/16][K/32][16] f32 -> [M, N] f32; four column tiles per pass so
// that one A tile serves four products and four tile stores overlap
__attribute__((target("avx512f,amx-tile,amx-int8")))
torch::Tensor matmul(torch::Tensor a, torch::Tensor sa, torch::Tensor packed, torch::Tensor sw) {
  TORCH_CHECK(amx_ok(), "AMX not permitted");
  const int64_t M = a.size(0), K = a.size(1), NT = packed.size(0), KB = K / 32;
  TORCH_CHECK(NT % 4 == 0 && M <= 16, "rows of 64 columns, at most 16 activation rows (one tile)");
  auto out = torch::empty({M, NT * 16}, torch::kFloat32);
  const int8_t* A = a.data_ptr<int8_t>(); const float* SA = sa.data_ptr<float>();
  const int8_t* P = packed.data_ptr<int8_t>(); const float* SW = sw.data_ptr<float>(); float* O = out.data_ptr<float>();
  at::parallel_for(0, NT / 4, 1, [&](int64_t g0, int64_t g1) {
    TileCfg cfg{}; cfg.palette = 1;
    for (int i = 0; i < 4; ++i) { cfg.rows[i] = M; cfg.colsb[i] = 64; }
    cfg.rows[4] = M; cfg.colsb[4] = 32;
    for (int i = 5; i < 8; ++i) { cfg.rows[i] = 8; cfg.colsb[i] = 64; }
    load_tile_config(cfg);
    alignas(64) int32_t buf[4][16][16];
    alignas(64) float acc[4][16][16];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t t = g * 4;
      std::memset(acc, 0, sizeof(acc));
      for (int64_t b = 0; b < KB; ++b) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        _tile_loadd(4, A + b * 32, K);
        _tile_loadd(5, P + (((t + 0) * KB + b) * 512), 64); _tile_dpbssd(0, 4, 5);
        _tile_loadd(6, P + (((t + 1) * KB + b) * 512), 64); _tile_dpbssd(1, 4, 6);
        _tile_loadd(7, P + (((t + 2) * KB + b) * 512), 64); _tile_dpbssd(2, 4, 7);
        _tile_loadd(5, P + (((t + 3) * KB + b) * 512), 64); _tile_dpbssd(3, 4, 5);
        _tile_stored(0, buf[0], 64); _tile_stored(1, buf[1], 64);
        _tile_stored(2, buf[2], 64); _tile_stored(3, buf[3], 64);
        for (int j = 0; j < 4; ++j) {
          const __m512 w = _mm512_loadu_ps(SW + ((t + j) * KB + b) * 16);
          for (int m = 0; m < M; ++m)
            _mm512_store_ps(acc[j][m], _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(buf[j][m])),
                                                       _mm512_mul_ps(w, _mm512_set1_ps(SA[m * KB + b])),
                                                       _mm512_load_ps(acc[j][m])));
        }
      }
      for (int j = 0; j < 4; ++j)
        for (int m = 0; m < M; ++m) _mm512_storeu_ps(O + m * NT * 16 + (t + j) * 16, _mm512_load_ps(acc[j][m]));
    }
    _tile_release();
  });
  return out;
}
'''


def _block_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (int8 codes [R, K], scales [R, K/32]): one absmax scale per 32 values."""
    r, k = x.shape
    xb = x.view(r, k // 32, 32)
    s = (xb.abs().amax(-1) / 127).clamp_min(1e-12)
    return torch.round(xb / s[..., None]).clamp(-127, 127).to(torch.int8).view(r, k), s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8960, help="output rows of the matrix (a multiple of 64)")
    ap.add_argument("--cols", type=int, default=1536, help="input columns (a multiple of 64)")
    ap.add_argument("--copies", type=int, default=8, help="matrices rotated per timing")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if "amx_int8" not in open("/proc/cpuinfo").read():
        raise SystemExit("this CPU has no AMX tiles")
    ext = load_inline("blockdraft_amx_block_probe", cpp_sources=SRC, functions=["pack", "matmul", "tile_multiply_ns"],
                      extra_cflags=["-O3", "-mamx-tile", "-mamx-int8", "-mavx512f"])
    print("one tile multiply alone (TDPBSSD, 4 independent results, best of 5 x 200k), ns:")
    for rows in (1, 4, 16):
        ns = {k: min(ext.tile_multiply_ns(rows, k, 200_000) for _ in range(5)) for k in (32, 64)}
        print(f"  {rows:2d} rows: {ns[32]:.2f} at 32 inputs, {ns[64]:.2f} at 64 "
              f"({rows * 16 * 64 / ns[64]:.0f} G int8 multiply-adds/s at 64)")
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    g = torch.Generator().manual_seed(0)
    n, k = args.rows, args.cols
    mats = []
    for _ in range(args.copies):
        w = torch.randn(n, k, generator=g) * 0.02
        q, s = _block_quantize(w)
        sw = s.view(n // 16, 16, k // 32).transpose(1, 2).contiguous()  # [N/16][K/32][16]
        mats.append((ext.pack(q), sw, q, s, QuantLinear(quantize(w, "int8"))))
    print(f"{n} x {k}, {args.copies} copies, {args.threads} threads: ms per matrix (median of 15)")
    for m in (1, 4, 8, 16):
        x = torch.randn(m, k, generator=g)
        qa, sa = _block_quantize(x)
        packed, sw, q, s, _ = mats[0]
        exact = torch.einsum("mbk,nbk,mb,nb->mn", qa.view(m, k // 32, 32).double(),
                             q.view(n, k // 32, 32).double(), sa.double(), s.double())
        err = (ext.matmul(qa, sa, packed, sw).double() - exact).abs().max().item()
        runs = {"amx": lambda: [ext.matmul(qa, sa, p, w_) for p, w_, *_ in mats],
                "vnni": lambda: [lin(x) for *_, lin in mats]}
        ms = {}
        for name, f in runs.items():
            for _ in range(3):
                f()
            ts = []
            for _ in range(15):
                t0 = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t0)
            ms[name] = sorted(ts)[7] * 1e3 / args.copies
        print(f"M={m:2d}: amx {ms['amx']:.3f}  vnni {ms['vnni']:.3f}  (amx: largest difference from exact {err:.1e})")


if __name__ == "__main__":
    main()
