// Weight-only quantized linears for CPU decoding: y [M, N] = x [M, K] W^T, W stored in blocks of 32 along K.
//
// Three weight formats, chosen so that GGUF's own blocks map onto them without requantization (quant/):
//   q4: unsigned 4-bit codes c in 0..15 with a scale d and an offset o per block: w = d * c + o
//       (GGUF Q4_0: o = -8d; Q4_1: o = m; Q4_K: d = d*sc, o = -dmin*m per sub-block of 32).
//   q5: the same with a fifth bit, c in 0..31 (GGUF Q5_0: o = -16d; Q5_1: o = m; Q5_K as Q4_K).
//   q8: signed 8-bit codes with a scale per 16 elements: w = s * c (GGUF Q8_0: one scale repeated for both
//       halves of a block; Q6_K: codes - 32 with its per-16 scales). Codes that fit 6 bits (Q6_K's) are held in 6
//       ("q6": the q8 kernels' integers from unsigned codes, see Q8Packed).
// GGUF's K-quants keep their scales factored, an integer per block times a float per 256 inputs (Q4Packed,
// Q8Packed): the kernels multiply them out exactly and stream about the bits per weight the file holds. A fused
// linear whose parts need different formats is a stack of linears over one quantized input (QLin::parts).
//
// Layout: the kernels read weights repacked once into panels of 8 output columns (`pack_q4`, `pack_q8`). Within a
// panel and block, one 32-bit lane of a vector register holds 4 consecutive inputs of one column, so a vector of
// 8 lanes is 8 columns. Panels are stored in pairs ("tiles" of 16 columns), interleaved every 32 bytes, so that a
// 512-bit register loads the same 4 inputs of 16 columns from one address and the weights stream from one place.
// The activations' 4 matching inputs are broadcast to every lane, and the integer
// multiply-adds leave each column's dot product in its own lane: no horizontal sums, the block's scales apply to 8
// columns in one instruction, and with several rows each unpacked weight register serves every row. That is what
// makes a multi-token verify cost little more than one token where the weights, not the arithmetic, are the bound.
//
// Activations are quantized per row and block of 32 to int8 (scale = max|x| / 127), as llama.cpp does for its
// integer dot products; the q4 offset term uses the exact float sum of each block of x.
//
// Why the result does not depend on M: the integer parts are exact, and every output y[m, n] gets the same
// sequence of float operations whatever the number of rows and however rows are grouped, so a multi-token verify
// step and a one-token step produce the same numbers for the same row. Greedy speculative decoding on these
// kernels is therefore token-exact against plain decoding on them, in bf16 as in fp32.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace blockdraft {

constexpr int64_t kBlock = 32;  // inputs per block
constexpr int64_t kPanel = 8;   // output columns per panel (one per 32-bit lane of an AVX2 register)
constexpr int64_t kTile = 2;    // panels per tile: their 32-byte chunks alternate, one 512-bit register holds both

// Panel pi's first element in an array of tiles [P / 2][G][unit per tile and block], when the panel's half of a
// block starts `half` elements into the tile's (32 bytes of codes, kPanel scales).
inline int64_t panel_base(int64_t pi, int64_t g, int64_t unit, int64_t half) {
  return (pi / kTile) * g * unit + (pi % kTile) * half;
}
// panels for n columns: whole tiles (padding columns get zero codes and scales)
inline int64_t panel_count(int64_t n) { return (n + kTile * kPanel - 1) / (kTile * kPanel) * kTile; }
// Weights stream from memory once per step; the kernels ask for them this far ahead (panels follow each other).
// Measured on an AVX2 EPYC, 4-token target step: ~8% faster with it, 512-2048 bytes alike.
constexpr int64_t kPrefetch = 1024;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // bf16 is the top half of a float32
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float hsum128(__m128 s) {
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float hsum256(__m256 v) { return hsum128(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))); }
inline float hmax256(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline int hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// the 4 int8 activations at p in every 32-bit lane
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Rows from which the per-row work around the matmuls (quantizing activations, norms, RoPE, SiLU) runs across the
// threads: serial, it would leave one of two cores idle for about a tenth of a 512-token prefill (an estimate from
// its operation counts). Below this a parallel region costs more than it saves, so a decode step's few rows stay
// on the calling thread.
constexpr int64_t kParallelRows = 32;

// f(begin, end) over the rows [0, m), split across the threads from kParallelRows rows on. Rows are independent, so
// the split changes no bits.
template <typename F>
inline void for_rows(int64_t m, const F& f) {
  if (m < kParallelRows || at::get_num_threads() <= 1 || at::in_parallel_region()) {
    f(0, m);
    return;
  }
  at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) { f(begin, end); });
}

// Activations of M rows, quantized per block of 32: codes xq, scales dx, exact block sums xs and 8 dx times the sum of
// each block's codes, dxs8 (the q4 kernel's centring term). Stored block-major (xq [G, M, 32], the others [G, M]):
// a kernel on rows row .. row + R - 1 finds every row of block b at a fixed distance from the first, so the
// addresses cost no integer work per row (row-major, they cost a multiply and several adds per row and block, and
// spilled the integer registers of the 8-row VNNI kernels).
// The q6 kernels also read hs, the integer sum of each half block's codes ([G, M, 2]): their unsigned codes u = c + 32
// give dot(c, xq) = dot(u, xq) - 32 sum(xq) exactly, per half block as the q8 scales are.
struct QuantRows {
  int64_t m = 0, k = 0, g = 0;
  std::vector<int8_t> xq;
  std::vector<float> dx, xs, dxs8;
  std::vector<int32_t> hs;

  // block b's codes of row `row` (the rows after it follow every kBlock bytes), and its per-block values
  const int8_t* codes(int64_t row, int64_t b) const { return xq.data() + (b * m + row) * kBlock; }
  const float* scales(int64_t row, int64_t b) const { return dx.data() + b * m + row; }

  template <typename T>
  QuantRows(const T* x, int64_t m_, int64_t k_) : m(m_), k(k_), g(k_ / kBlock), xq(m_ * k_), dx(m_ * g),
                                                   xs(m_ * g), dxs8(m_ * g), hs(2 * m_ * g) {
    for_rows(m, [&](int64_t r0, int64_t r1) { quantize(x, r0, r1); });
  }

 private:
  template <typename T>
  void quantize(const T* x, int64_t r0, int64_t r1) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t row = r0; row < r1; ++row)
      for (int64_t b = 0; b < g; ++b) {
        const T* src = x + row * k + b * kBlock;
        const int64_t i = b * m + row;
        __m256 v[4];
        for (int j = 0; j < 4; ++j) v[j] = load8(src + 8 * j);
        const __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                          _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        const float d = hmax256(amax) / 127.f;
        const __m256 id = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
        __m256i q[4];
        for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));  // round to nearest even
        const __m256i packed = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq.data() + i * kBlock), packed);
        const int lsum = hsum_epi32(_mm256_add_epi32(q[0], q[1])), hsum = hsum_epi32(_mm256_add_epi32(q[2], q[3]));
        const int csum = lsum + hsum;
        hs[2 * i] = lsum;
        hs[2 * i + 1] = hsum;
        dx[i] = d;
        xs[i] = hsum256(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
        dxs8[i] = 8.f * d * static_cast<float>(csum);
      }
  }
};

// ------------------------------------------------------------------------------------------------------- q4
// Panel layout of q4 codes: [P/2 tiles][G blocks][4 chunks][2 panels][8 columns][4 bytes]. Byte i of column c in
// chunk t holds input 4t + i in its low nibble and input 16 + 4t + i in its high nibble: chunk t's low nibbles are
// the inputs 4t..4t+3 of 8 columns, its high nibbles the inputs 16+4t..16+4t+3. Per tile and block the scales are
// d [2][8] and o [2][8], stored as float16 when every value is one exactly (GGUF's Q4_0 / Q4_1 scales are), else
// float32.
//
// GGUF's K-quants give each block's scale and offset as an integer times a float per super-block of 256 inputs
// (Q4_K / Q5_K: d = D sc, o = -Dmin mn, sc and mn 6-bit): those are held factored, a byte per block and column
// instead of a float, and multiplied out in the kernel (`Q45Factored`). Each product is exact in float32 (an 11-bit
// significand times a 6-bit integer), so the kernel sees the very scales the float layout holds: the same bits,
// about a quarter fewer bytes to stream per 4-bit weight (18.5 against 24 per block and column).
struct Q4Packed {
  int64_t n = 0, k = 0, g = 0, panels = 0;
  torch::Tensor codes, d, o;  // uint8 [P/2, G, 256]; float16 or float32 [P/2, G, 16], [P/2, G, 16]
  // factored scales (d, o then undefined): sc, mn uint8 [P/2, G, 16]; sd, sm float32 [P/2, G/8, 16] (D and Dmin)
  torch::Tensor sc, mn, sd, sm;
  bool factored() const { return sc.defined(); }
};

// t as float16 when that loses nothing, else as it is (float32): the scales are a fifth of a 4-bit model's bytes
inline torch::Tensor compact_scales(const torch::Tensor& t) {
  const torch::Tensor h = t.to(torch::kHalf);
  return torch::equal(h.to(torch::kFloat), t) ? h : t;
}

inline __m256 load_scales(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_scales(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// qw uint8 [N, K/2] (byte j of a block: input j low, j + 16 high), d / o float32 [N, K/32] -> panels; columns
// past N (the last panel's padding) get zero codes and scales
inline Q4Packed pack_q4(const torch::Tensor& qw, const torch::Tensor& d, const torch::Tensor& o) {
  Q4Packed p;
  p.n = qw.size(0);
  p.k = qw.size(1) * 2;
  p.g = p.k / kBlock;
  p.panels = panel_count(p.n);
  p.codes = torch::zeros({p.panels / kTile, p.g, 256}, torch::kByte);
  p.d = torch::zeros({p.panels / kTile, p.g, 2 * kPanel}, torch::kFloat);
  p.o = torch::zeros({p.panels / kTile, p.g, 2 * kPanel}, torch::kFloat);
  const uint8_t* src = qw.data_ptr<uint8_t>();
  const float *ds = d.data_ptr<float>(), *os = o.data_ptr<float>();
  uint8_t* dst = p.codes.data_ptr<uint8_t>();
  float *dd = p.d.data_ptr<float>(), *dof = p.o.data_ptr<float>();
  for (int64_t col = 0; col < p.n; ++col) {
    const int64_t pi = col / kPanel, c = col % kPanel;
    for (int64_t b = 0; b < p.g; ++b) {
      const uint8_t* blk = src + col * (p.k / 2) + b * 16;  // GGUF's byte j = inputs j, j + 16: byte 4t + i here
      uint8_t* out = dst + panel_base(pi, p.g, 256, 32) + b * 256;
      for (int t = 0; t < 4; ++t)
        for (int i = 0; i < 4; ++i) out[t * 64 + c * 4 + i] = blk[4 * t + i];
      dd[panel_base(pi, p.g, 2 * kPanel, kPanel) + b * 2 * kPanel + c] = ds[col * p.g + b];
      dof[panel_base(pi, p.g, 2 * kPanel, kPanel) + b * 2 * kPanel + c] = os[col * p.g + b];
    }
  }
  p.d = compact_scales(p.d);
  p.o = p.d.scalar_type() == at::kHalf ? compact_scales(p.o) : p.o;
  if (p.o.scalar_type() != p.d.scalar_type()) p.d = p.d.to(torch::kFloat);
  return p;
}

// per-column values v [N, G'] (any dtype) -> panels [P/2, G', 16] of that dtype (padding columns zero)
inline torch::Tensor pack_columns(const torch::Tensor& v, int64_t panels) {
  const int64_t n = v.size(0), g = v.size(1);
  torch::Tensor out = torch::zeros({panels * kPanel, g}, v.options());
  out.narrow(0, 0, n).copy_(v);
  // column col = (tile, panel, c) -> [tile][g][panel][c]
  return out.view({panels / kTile, kTile, kPanel, g}).permute({0, 3, 1, 2}).reshape({panels / kTile, g, kTile * kPanel})
      .contiguous();
}

// p's scales held factored instead (see Q4Packed): sc, mn uint8 [N, G]; sd, sm float32 [N, G/8]. The caller has
// checked that they multiply out to the float scales exactly (`make_qlin`).
inline void factor_q4(Q4Packed& p, const torch::Tensor& sc, const torch::Tensor& mn, const torch::Tensor& sd,
                      const torch::Tensor& sm) {
  p.sc = pack_columns(sc, p.panels);
  p.mn = pack_columns(mn, p.panels);
  p.sd = pack_columns(sd, p.panels);
  p.sm = pack_columns(sm, p.panels);
  p.d = p.o = torch::Tensor();
}

// The scales of one tile (16 columns, the VNNI kernels) or one panel (8 columns, AVX2; its pointers start 8 values
// into the tile's) at block b, held as floats (S: float or at::Half): d and o [G][16].
template <typename S>
struct Q45Plain {
  const S *d, *o;
  const void* ahead(int64_t b, int64_t bytes) const { return d + b * 2 * kPanel + bytes / 8; }
  __m256 d8(int64_t b) const { return load_scales(d + b * 2 * kPanel); }
  __m256 o8(int64_t b) const { return load_scales(o + b * 2 * kPanel); }
};

inline __m256 u8_ps(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 negu8_ps(const uint8_t* p) {
  const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_setzero_si256(), u));
}

// The same, factored: d = D sc and o = Dmin (-mn), sc / mn [G][16] bytes and D / Dmin [G/8][16] floats. The offset
// is formed as Dmin times -mn (the same float as -(Dmin mn)): one multiply whose only consumer is a fused
// multiply-add intrinsic, so the compiler has nothing to contract.
struct Q45Factored {
  const uint8_t *sc, *mn;
  const float *sd, *sm;
  const void* ahead(int64_t b, int64_t bytes) const { return sc + b * 2 * kPanel + bytes / 16; }
  __m256 d8(int64_t b) const {
    return _mm256_mul_ps(_mm256_loadu_ps(sd + (b >> 3) * 2 * kPanel), u8_ps(sc + b * 2 * kPanel));
  }
  __m256 o8(int64_t b) const {
    return _mm256_mul_ps(_mm256_loadu_ps(sm + (b >> 3) * 2 * kPanel), negu8_ps(mn + b * 2 * kPanel));
  }
};

// the scales of panel pi (half: 0 for a whole tile's, the VNNI kernels; kPanel for one panel's, AVX2)
template <typename S>
inline Q45Plain<S> q45_scales(const Q4Packed& w, int64_t pi, int64_t half) {
  return {w.d.data_ptr<S>() + panel_base(pi, w.g, 2 * kPanel, half),
          w.o.data_ptr<S>() + panel_base(pi, w.g, 2 * kPanel, half)};
}
inline Q45Factored q45_factored(const Q4Packed& w, int64_t pi, int64_t half) {
  return {w.sc.data_ptr<uint8_t>() + panel_base(pi, w.g, 2 * kPanel, half),
          w.mn.data_ptr<uint8_t>() + panel_base(pi, w.g, 2 * kPanel, half),
          w.sd.data_ptr<float>() + panel_base(pi, w.g / 8, 2 * kPanel, half),
          w.sm.data_ptr<float>() + panel_base(pi, w.g / 8, 2 * kPanel, half)};
}

// out[r] = acc[r] + the offset terms of row + r. They need no codes: a second pass keeps the main loop's registers for
// the codes. Its rows run side by side (2R independent chains of multiply-adds instead of 2 at a time, the scales
// loaded once for all rows); each row's chain is the same sequence of operations as alone, so the result does not
// depend on R.
// Centre: the codes' midpoint, 8 for q4 and 16 for q5 (whose centring term, 16 dx sum(xq) = 2 dxs8, is exact).
template <int R, typename Sc, int Centre = 8>
inline void q4_offsets(const Sc& sc, int64_t g, const QuantRows& x, int64_t row, const __m256* acc, __m256* out) {
  const __m256 centre = _mm256_set1_ps(static_cast<float>(Centre));
  constexpr float times = Centre / 8;
  __m256 offp[R], offn[R];
  for (int r = 0; r < R; ++r) offp[r] = offn[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < g; ++b) {
    const __m256 d8 = sc.d8(b);
    const __m256 a8 = _mm256_fmadd_ps(centre, d8, sc.o8(b));
    const float *xs = x.xs.data() + b * x.m + row, *dxs8 = x.dxs8.data() + b * x.m + row;
    for (int r = 0; r < R; ++r) {
      offp[r] = _mm256_fmadd_ps(a8, _mm256_set1_ps(xs[r]), offp[r]);
      offn[r] = _mm256_fmadd_ps(d8, _mm256_set1_ps(times * dxs8[r]), offn[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm256_add_ps(acc[r], _mm256_sub_ps(offp[r], offn[r]));
}

// Block b of a q4 panel: ask for the weights kPrefetch bytes ahead, and unpack its codes into 8 registers (chunk t's
// low nibbles in w[t], its high nibbles in w[t + 4]), the same for every instruction set.
template <typename Sc>
inline void q4_block_codes(const uint8_t* pc, const Sc& sc, int64_t b, __m256i* w) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int i = 0; i < 4; ++i)
    _mm_prefetch(reinterpret_cast<const char*>(pc + b * 256 + kPrefetch + 64 * i), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(sc.ahead(b, kPrefetch)), _MM_HINT_T0);
  for (int t = 0; t < 4; ++t) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pc + b * 256 + t * 64));
    w[t] = _mm256_and_si256(raw, m4);
    w[t + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
  }
}

// R rows x one panel: out[r] = the 8 columns' dot products with row r. Per block, with the codes centred,
// w = d (c - 8) + (o + 8d): dot(w, x) = d dx (dot(c, xq) - 8 sum(xq)) + (o + 8d) sum(x). Centring halves the span
// the integer part covers, so quantizing x costs half the error it would with d c + o. The integer dot of a block
// is exact in int16 before its one widening multiply-add: |c x| <= 15 * 127, 16 products per lane <= 30480.
template <int R, typename Sc>
inline void q4_panel(const uint8_t* pc, const Sc& sc, int64_t g, const QuantRows& x, int64_t row, __m256* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < g; ++b) {
    __m256i w[8];
    q4_block_codes(pc, sc, b, w);
    const __m256 d8 = sc.d8(b);
    const int8_t* xr = x.codes(row, b);
    const float* dxr = x.scales(row, b);
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xr + r * kBlock;
      __m256i s = _mm256_maddubs_epi16(w[0], bcast4(xb));
      for (int j = 1; j < 8; ++j) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[j], bcast4(xb + 4 * j)));
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d8, _mm256_set1_ps(dxr[r])), acc[r]);
    }
  }
  q4_offsets<R>(sc, g, x, row, acc, out);
}

// ------------------------------------------------------------------------------------------------------- q5
// Panel layout of q5: the q4 panels' codes (the low 4 bits) plus, per panel and block, 32 bytes of fifth bits laid
// out like one chunk of codes (a tile's two panels after each other, [P/2][G][2][32]): byte 4c + i (column c)
// holds in bit t the fifth bit of the input whose low bits sit in byte 4c + i of unpacked register t (inputs 4t + i
// for t < 4, 16 + 4(t - 4) + i for t >= 4). Register t's fifth bits are then one shift and one mask away. Scales and
// offsets as q4's.
struct Q5Packed {
  Q4Packed low;        // the low 4 bits, scales and offsets
  torch::Tensor high;  // uint8 [P/2, G, 64]
};

// hb uint8 [N, K/8] (per block, bit j of a little-endian 32-bit word = input j's fifth bit; GGUF's qh) -> panels
// one bit per input, hb uint8 [N, K/8] (per block, bit j of a little-endian 32-bit word = input j's) -> a plane
// uint8 [P/2, G, 64] laid out as q5's fifth bits, for panels of q's geometry
inline torch::Tensor pack_plane(const torch::Tensor& hb, const Q4Packed& q) {
  torch::Tensor plane = torch::zeros({q.panels / kTile, q.g, 64}, torch::kByte);
  const uint8_t* src = hb.data_ptr<uint8_t>();
  uint8_t* dst = plane.data_ptr<uint8_t>();
  for (int64_t col = 0; col < q.n; ++col) {
    const int64_t pi = col / kPanel, c = col % kPanel;
    for (int64_t b = 0; b < q.g; ++b) {
      const uint8_t* w = src + col * (q.k / 8) + b * 4;
      uint8_t* out = dst + panel_base(pi, q.g, 64, 32) + b * 64 + c * 4;
      for (int t = 0; t < 8; ++t)
        for (int i = 0; i < 4; ++i) {
          const int input = (t < 4 ? 4 * t : 16 + 4 * (t - 4)) + i;
          out[i] |= static_cast<uint8_t>(((w[input / 8] >> (input % 8)) & 1) << t);
        }
    }
  }
  return plane;
}

inline Q5Packed pack_q5(const torch::Tensor& qw, const torch::Tensor& hb, const torch::Tensor& d,
                        const torch::Tensor& o) {
  Q5Packed p;
  p.low = pack_q4(qw, d, o);
  p.high = pack_plane(hb, p.low);
  return p;
}

// Register t's fifth bits as 16 / 0 per byte: bit t of each byte moved to bit 4. The 16-bit shifts carry bits
// across bytes only into positions other than 4 (at most 4 places, from the far end of the neighbouring byte).
template <int T>
inline __m256i fifth_bit(__m256i hb, __m256i m16) {
  if constexpr (T < 4) return _mm256_and_si256(_mm256_slli_epi16(hb, 4 - T), m16);
  else if constexpr (T == 4) return _mm256_and_si256(hb, m16);
  else return _mm256_and_si256(_mm256_srli_epi16(hb, T - 4), m16);
}

// Block b of a q5 panel unpacked into 8 registers of codes 0..31 (q4's registers with the fifth bits added), the
// same for every instruction set.
template <typename Sc>
inline void q5_block_codes(const uint8_t* pc, const uint8_t* ph, const Sc& sc, int64_t b, __m256i* w) {
  q4_block_codes(pc, sc, b, w);
  _mm_prefetch(reinterpret_cast<const char*>(ph + b * 64 + kPrefetch / 4), _MM_HINT_T0);
  const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ph + b * 64));
  const __m256i m16 = _mm256_set1_epi8(0x10);
  w[0] = _mm256_or_si256(w[0], fifth_bit<0>(hb, m16));
  w[1] = _mm256_or_si256(w[1], fifth_bit<1>(hb, m16));
  w[2] = _mm256_or_si256(w[2], fifth_bit<2>(hb, m16));
  w[3] = _mm256_or_si256(w[3], fifth_bit<3>(hb, m16));
  w[4] = _mm256_or_si256(w[4], fifth_bit<4>(hb, m16));
  w[5] = _mm256_or_si256(w[5], fifth_bit<5>(hb, m16));
  w[6] = _mm256_or_si256(w[6], fifth_bit<6>(hb, m16));
  w[7] = _mm256_or_si256(w[7], fifth_bit<7>(hb, m16));
}

// R rows x one panel, q5: q4's arithmetic centred at 16. Codes up to 31 overflow int16 over a whole block
// (16 products of 31 * 127 per lane), so each half of the registers widens on its own: 8 products <= 31496.
template <int R, typename Sc>
inline void q5_panel(const uint8_t* pc, const uint8_t* ph, const Sc& sc, int64_t g, const QuantRows& x, int64_t row,
                     __m256* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < g; ++b) {
    __m256i w[8];
    q5_block_codes(pc, ph, sc, b, w);
    const __m256 d8 = sc.d8(b);
    const int8_t* xr = x.codes(row, b);
    const float* dxr = x.scales(row, b);
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xr + r * kBlock;
      __m256i s0 = _mm256_maddubs_epi16(w[0], bcast4(xb)), s1 = _mm256_maddubs_epi16(w[4], bcast4(xb + 16));
      for (int j = 1; j < 4; ++j) {
        s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w[j], bcast4(xb + 4 * j)));
        s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w[j + 4], bcast4(xb + 16 + 4 * j)));
      }
      const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d8, _mm256_set1_ps(dxr[r])),
                               acc[r]);
    }
  }
  q4_offsets<R, Sc, 16>(sc, g, x, row, acc, out);
}

// ------------------------------------------------------------------------------------------------------- q8
// Panel layout of q8 codes: [P/2 tiles][G blocks][8 groups][2 panels][8 columns][4 bytes]: group j holds inputs
// 4j..4j+3 of 8 columns. Scales per tile and block: s [2][2][8], per half of the block (inputs 0..15, 16..31) the
// two panels' 8 columns.
//
// Codes that fit 6 bits (GGUF's Q6_K: c in -32..31) are held as u = c + 32 in the q5 layout plus a second bit plane
// (the "q6" kernels): 6.5 bits a weight to stream instead of 8. dot(c, xq) = dot(u, xq) - 32 sum(xq) per half block,
// exactly, so they compute the q8 kernels' integers and then the same float operations: the same bits.
// Q6_K's scales are factored as the K-quants' q4 scales are (an int8 per 16 inputs times a float per 256, exact).
struct Q8Packed {
  int64_t n = 0, k = 0, g = 0, panels = 0;
  // int8 [P/2, G, 512]; float16 (when exact, as GGUF's Q8_0 scales are) or float32 [P/2, G, 32]
  torch::Tensor codes, s;
  // six-bit codes (codes then undefined): low uint8 [P/2, G, 256] as q4's, planes uint8 [P/2, G, 128]: per tile and
  // block the fifth bits (64 bytes, as q5's) then the sixth bits (laid out the same)
  torch::Tensor low, planes;
  // factored scales (s then undefined): sub int8 [P/2, G, 32] in s's layout, sd float32 [P/2, G/8, 16]
  torch::Tensor sub, sd;
  bool six() const { return low.defined(); }
  bool factored() const { return sub.defined(); }
};

// qw int8 [N, K], s float32 [N, K/16] -> panels (padding columns: zero codes and scales)
inline Q8Packed pack_q8(const torch::Tensor& qw, const torch::Tensor& s) {
  Q8Packed p;
  p.n = qw.size(0);
  p.k = qw.size(1);
  p.g = p.k / kBlock;
  p.panels = panel_count(p.n);
  p.s = torch::zeros({p.panels / kTile, p.g, 4 * kPanel}, torch::kFloat);
  const float* ss = s.data_ptr<float>();
  float* ds = p.s.data_ptr<float>();
  for (int64_t col = 0; col < p.n; ++col) {
    const int64_t pi = col / kPanel, c = col % kPanel;
    for (int64_t b = 0; b < p.g; ++b) {
      float* sb = ds + panel_base(pi, p.g, 4 * kPanel, kPanel) + b * 4 * kPanel;
      for (int h = 0; h < 2; ++h) sb[h * 2 * kPanel + c] = ss[col * (p.k / 16) + 2 * b + h];
    }
  }
  p.s = compact_scales(p.s);
  const bool six = qw.ge(-32).all().item<bool>() && qw.le(31).all().item<bool>();
  if (six) {
    const torch::Tensor u = (qw.to(torch::kShort) + 32).to(torch::kByte);  // [N, K], 0..63
    const torch::Tensor half = u.view({p.n, p.g, 2, 16});
    // GGUF's q4 byte layout: byte j of a block holds input j (low nibble) and j + 16 (high)
    const torch::Tensor nib = (half.select(2, 0).bitwise_and(15) |
                               half.select(2, 1).bitwise_and(15).bitwise_left_shift(4)).reshape({p.n, p.k / 2});
    const torch::Tensor bit = torch::arange(8, torch::kByte);
    auto bits = [&](int i) {  // bit i of every input -> [N, K/8], bit j of byte q = input 8q + j
      return u.bitwise_right_shift(i).bitwise_and(1).view({p.n, p.k / 8, 8}).bitwise_left_shift(bit).sum(-1)
          .to(torch::kByte).contiguous();
    };
    const torch::Tensor zero = torch::zeros({p.n, p.g}, torch::kFloat);
    Q4Packed geometry = pack_q4(nib.contiguous(), zero, zero);
    p.low = geometry.codes;
    p.planes = torch::cat({pack_plane(bits(4), geometry), pack_plane(bits(5), geometry)}, 2).contiguous();
    return p;
  }
  p.codes = torch::zeros({p.panels / kTile, p.g, 512}, torch::kChar);
  const int8_t* src = qw.data_ptr<int8_t>();
  int8_t* dst = p.codes.data_ptr<int8_t>();
  for (int64_t col = 0; col < p.n; ++col) {
    const int64_t pi = col / kPanel, c = col % kPanel;
    for (int64_t b = 0; b < p.g; ++b) {
      int8_t* out = dst + panel_base(pi, p.g, 512, 32) + b * 512;
      for (int j = 0; j < 8; ++j)
        for (int i = 0; i < 4; ++i) out[j * 64 + c * 4 + i] = src[col * p.k + b * kBlock + 4 * j + i];
    }
  }
  return p;
}

// p's scales held factored instead: sub int8 [N, K/16], sd float32 [N, K/256], checked by the caller to multiply
// out to the float scales exactly (`make_qlin`)
inline void factor_q8(Q8Packed& p, const torch::Tensor& sub, const torch::Tensor& sd) {
  // sub [N, 2G] -> [N, G, 2] halves -> s's layout [P/2][G][half][2 panels][8]
  const torch::Tensor lo = pack_columns(sub.view({p.n, p.g, 2}).select(2, 0), p.panels);
  const torch::Tensor hi = pack_columns(sub.view({p.n, p.g, 2}).select(2, 1), p.panels);
  p.sub = torch::cat({lo, hi}, 2).contiguous();
  p.sd = pack_columns(sd, p.panels);
  p.s = torch::Tensor();
}

// The scales of a q8 / q6 tile or panel at block b, per half block (lo: inputs 0..15, hi: 16..31), as floats ...
template <typename S>
struct Q8Plain {
  const S* s;
  const void* ahead(int64_t b, int64_t bytes) const { return s + b * 4 * kPanel + bytes / 8; }
  __m256 lo8(int64_t b) const { return load_scales(s + b * 4 * kPanel); }
  __m256 hi8(int64_t b) const { return load_scales(s + b * 4 * kPanel + 2 * kPanel); }
};

inline __m256 i8_ps(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// ... or factored: D (per 256 inputs) times an int8 per half block
struct Q8Factored {
  const int8_t* sub;
  const float* sd;
  const void* ahead(int64_t b, int64_t bytes) const { return sub + b * 4 * kPanel + bytes / 16; }
  __m256 lo8(int64_t b) const {
    return _mm256_mul_ps(_mm256_loadu_ps(sd + (b >> 3) * 2 * kPanel), i8_ps(sub + b * 4 * kPanel));
  }
  __m256 hi8(int64_t b) const {
    return _mm256_mul_ps(_mm256_loadu_ps(sd + (b >> 3) * 2 * kPanel), i8_ps(sub + b * 4 * kPanel + 2 * kPanel));
  }
};

template <typename S>
inline Q8Plain<S> q8_scales(const Q8Packed& w, int64_t pi, int64_t half) {
  return {w.s.data_ptr<S>() + panel_base(pi, w.g, 4 * kPanel, half)};
}
inline Q8Factored q8_factored(const Q8Packed& w, int64_t pi, int64_t half) {
  return {w.sub.data_ptr<int8_t>() + panel_base(pi, w.g, 4 * kPanel, half),
          w.sd.data_ptr<float>() + panel_base(pi, w.g / 8, 2 * kPanel, half)};
}

// Block b of a q8 panel: ask for the weights kPrefetch bytes ahead.
template <typename Sc>
inline void q8_prefetch(const int8_t* pc, const Sc& sc, int64_t b) {
  for (int i = 0; i < 8; ++i)
    _mm_prefetch(reinterpret_cast<const char*>(pc + b * 512 + kPrefetch + 64 * i), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(sc.ahead(b, kPrefetch)), _MM_HINT_T0);
}

// acc[r] += the integer dots of block b's halves (lo, hi) times their scales and row r's activation scale
template <int R, typename Sc>
inline void q8_scale_block(const __m256i* lo, const __m256i* hi, const Sc& sc, int64_t b, const QuantRows& x,
                           int64_t row, __m256* acc) {
  const __m256 slo = sc.lo8(b), shi = sc.hi8(b);
  const float* dxr = x.scales(row, b);
  for (int r = 0; r < R; ++r) {
    const __m256 dxv = _mm256_set1_ps(dxr[r]);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[r]), _mm256_mul_ps(slo, dxv), acc[r]);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[r]), _mm256_mul_ps(shi, dxv), acc[r]);
  }
}

// R rows x one panel, q8: per block and half, s dx dot(c, xq). AVX2 multiplies unsigned by signed bytes, so the
// codes enter as |c| and their signs move onto x; each pair sum <= 2 * 128 * 127 fits int16 before widening.
template <int R, typename Sc>
inline void q8_panel(const int8_t* pc, const Sc& sc, int64_t g, const QuantRows& x, int64_t row, __m256* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < g; ++b) {
    __m256i lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
    q8_prefetch(pc, sc, b);
    const int8_t* xr = x.codes(row, b);
    // the halves in two loops, each unrolled: a test on j inside one loop kept it rolled and spilled accumulators
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pc + b * 512 + j * 64));
      const __m256i aw = _mm256_sign_epi8(w, w);
      for (int r = 0; r < R; ++r)
        lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(
            _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast4(xr + r * kBlock + 4 * j), w)), ones));
    }
#pragma GCC unroll 4
    for (int j = 4; j < 8; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pc + b * 512 + j * 64));
      const __m256i aw = _mm256_sign_epi8(w, w);
      for (int r = 0; r < R; ++r)
        hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(
            _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast4(xr + r * kBlock + 4 * j), w)), ones));
    }
    q8_scale_block<R>(lo, hi, sc, b, x, row, acc);
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// Block b of a q6 panel unpacked into 8 registers of codes u in 0..63: q4's registers, the fifth bits of the first
// plane and the sixth bits of the second (bit t of each byte moved to bit 5; the 16-bit shifts carry bits across
// bytes only into other positions, as in fifth_bit).
template <int T>
inline __m256i sixth_bit(__m256i hb, __m256i m32) {
  if constexpr (T < 5) return _mm256_and_si256(_mm256_slli_epi16(hb, 5 - T), m32);
  else if constexpr (T == 5) return _mm256_and_si256(hb, m32);
  else return _mm256_and_si256(_mm256_srli_epi16(hb, T - 5), m32);
}

template <typename Sc>
inline void q6_block_codes(const uint8_t* pc, const uint8_t* ph, const Sc& sc, int64_t b, __m256i* w) {
  q4_block_codes(pc, sc, b, w);
  _mm_prefetch(reinterpret_cast<const char*>(ph + b * 128 + kPrefetch / 2), _MM_HINT_T0);
  const __m256i h5 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ph + b * 128));
  const __m256i h6 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ph + b * 128 + 64));
  const __m256i m16 = _mm256_set1_epi8(0x10), m32 = _mm256_set1_epi8(0x20);
  w[0] = _mm256_or_si256(w[0], _mm256_or_si256(fifth_bit<0>(h5, m16), sixth_bit<0>(h6, m32)));
  w[1] = _mm256_or_si256(w[1], _mm256_or_si256(fifth_bit<1>(h5, m16), sixth_bit<1>(h6, m32)));
  w[2] = _mm256_or_si256(w[2], _mm256_or_si256(fifth_bit<2>(h5, m16), sixth_bit<2>(h6, m32)));
  w[3] = _mm256_or_si256(w[3], _mm256_or_si256(fifth_bit<3>(h5, m16), sixth_bit<3>(h6, m32)));
  w[4] = _mm256_or_si256(w[4], _mm256_or_si256(fifth_bit<4>(h5, m16), sixth_bit<4>(h6, m32)));
  w[5] = _mm256_or_si256(w[5], _mm256_or_si256(fifth_bit<5>(h5, m16), sixth_bit<5>(h6, m32)));
  w[6] = _mm256_or_si256(w[6], _mm256_or_si256(fifth_bit<6>(h5, m16), sixth_bit<6>(h6, m32)));
  w[7] = _mm256_or_si256(w[7], _mm256_or_si256(fifth_bit<7>(h5, m16), sixth_bit<7>(h6, m32)));
}

// R rows x one panel, q6: the q8 kernel's integers from unsigned codes (two maddubs pairs <= 2 * 2 * 63 * 127 fit
// int16 before widening), then its float operations.
template <int R, typename Sc>
inline void q6_panel(const uint8_t* pc, const uint8_t* ph, const Sc& sc, int64_t g, const QuantRows& x, int64_t row,
                     __m256* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < g; ++b) {
    __m256i w[8];
    q6_block_codes(pc, ph, sc, b, w);
    const int8_t* xr = x.codes(row, b);
    const int32_t* hs = x.hs.data() + 2 * (b * x.m + row);
    __m256i lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xr + r * kBlock;
      const __m256i l0 = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], bcast4(xb)),
                                          _mm256_maddubs_epi16(w[1], bcast4(xb + 4)));
      const __m256i l1 = _mm256_add_epi16(_mm256_maddubs_epi16(w[2], bcast4(xb + 8)),
                                          _mm256_maddubs_epi16(w[3], bcast4(xb + 12)));
      const __m256i h0 = _mm256_add_epi16(_mm256_maddubs_epi16(w[4], bcast4(xb + 16)),
                                          _mm256_maddubs_epi16(w[5], bcast4(xb + 20)));
      const __m256i h1 = _mm256_add_epi16(_mm256_maddubs_epi16(w[6], bcast4(xb + 24)),
                                          _mm256_maddubs_epi16(w[7], bcast4(xb + 28)));
      lo[r] = _mm256_sub_epi32(_mm256_add_epi32(_mm256_madd_epi16(l0, ones), _mm256_madd_epi16(l1, ones)),
                               _mm256_set1_epi32(32 * hs[2 * r]));
      hi[r] = _mm256_sub_epi32(_mm256_add_epi32(_mm256_madd_epi16(h0, ones), _mm256_madd_epi16(h1, ones)),
                               _mm256_set1_epi32(32 * hs[2 * r + 1]));
    }
    q8_scale_block<R>(lo, hi, sc, b, x, row, acc);
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}


// ------------------------------------------------------------------------------------- AVX512-VNNI variants
// On CPUs with AVX512-VNNI (AMD Zen 4 and later, Intel Ice Lake / Sapphire Rapids and later) one vpdpbusd
// multiplies 64 unsigned by signed bytes and adds them, in groups of 4, into 16 int32 lanes: the work of AVX2's
// maddubs + add + madd chain in one instruction, exact (no int16 stage), over a whole tile (two panels) at once.
// The extra vector registers of AVX-512 let one unpacked weight register serve up to 8 rows. The same packed weights
// as the AVX2 kernels; every integer dot product is the same exact value and every float operation after it is the
// same, so both instruction sets give the same bits. Measured on an AMD EPYC (Zen 4, 2 threads), Qwen2.5-Coder-0.5B
// target step against the 256-bit form of these kernels: about equal at 1 token, 0.9x at 6-8 tokens.
// They are compiled for that target per function (the build stays portable) and chosen at run time (`kernel_isa`).
#define BLOCKDRAFT_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))

enum class Isa : int { kAvx2 = 0, kVnni = 1 };

inline bool cpu_has_vnni() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
}

// The instruction set the products use: the best this CPU has, unless BLOCKDRAFT_KERNEL_ISA=avx2 (or set_kernel_isa)
// asks for AVX2.
inline std::atomic<int>& isa_slot() {
  static std::atomic<int> isa([] {
    const char* env = std::getenv("BLOCKDRAFT_KERNEL_ISA");
    const bool want_avx2 = env != nullptr && std::strcmp(env, "avx2") == 0;
    return static_cast<int>(!want_avx2 && cpu_has_vnni() ? Isa::kVnni : Isa::kAvx2);
  }());
  return isa;
}
inline Isa kernel_isa() { return static_cast<Isa>(isa_slot().load(std::memory_order_relaxed)); }

// The tile kernels take twice the bytes per block: asked for twice as far ahead (the same number of blocks), a
// one-token step matched the 256-bit kernels' (1024 bytes ahead it was ~10% slower).
constexpr int64_t kPrefetchTile = 2048;
constexpr int64_t kGroupRowsVnni = 8;  // rows per weight register: 8 accumulators and 8 codes fit 32 registers

// The VNNI kernels run on 512-bit registers, one tile (two panels, 16 columns) at a time: one broadcast of the
// activations, one vpdpbusd and one unpacking instruction serve 16 columns. Each lane gets the same operations in
// the same order as in the AVX2 kernels, so the bits are the same.
BLOCKDRAFT_VNNI inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }
BLOCKDRAFT_VNNI inline __m512 load_scales16(const float* p) { return _mm512_loadu_ps(p); }
BLOCKDRAFT_VNNI inline __m512 load_scales16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
BLOCKDRAFT_VNNI inline __m512i bcast4_512(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// the scale policies' values for a whole tile (16 columns)
template <typename S>
BLOCKDRAFT_VNNI inline __m512 d16(const Q45Plain<S>& sc, int64_t b) { return load_scales16(sc.d + b * 2 * kPanel); }
template <typename S>
BLOCKDRAFT_VNNI inline __m512 o16(const Q45Plain<S>& sc, int64_t b) { return load_scales16(sc.o + b * 2 * kPanel); }
BLOCKDRAFT_VNNI inline __m512 u8_ps16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
BLOCKDRAFT_VNNI inline __m512 d16(const Q45Factored& sc, int64_t b) {
  return _mm512_mul_ps(_mm512_loadu_ps(sc.sd + (b >> 3) * 2 * kPanel), u8_ps16(sc.sc + b * 2 * kPanel));
}
BLOCKDRAFT_VNNI inline __m512 o16(const Q45Factored& sc, int64_t b) {
  const __m512i mn = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc.mn + b * 2 * kPanel)));
  return _mm512_mul_ps(_mm512_loadu_ps(sc.sm + (b >> 3) * 2 * kPanel),
                       _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_setzero_si512(), mn)));
}
template <typename S>
BLOCKDRAFT_VNNI inline __m512 lo16(const Q8Plain<S>& sc, int64_t b) { return load_scales16(sc.s + b * 4 * kPanel); }
template <typename S>
BLOCKDRAFT_VNNI inline __m512 hi16(const Q8Plain<S>& sc, int64_t b) {
  return load_scales16(sc.s + b * 4 * kPanel + 2 * kPanel);
}
BLOCKDRAFT_VNNI inline __m512 i8_ps16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
BLOCKDRAFT_VNNI inline __m512 lo16(const Q8Factored& sc, int64_t b) {
  return _mm512_mul_ps(_mm512_loadu_ps(sc.sd + (b >> 3) * 2 * kPanel), i8_ps16(sc.sub + b * 4 * kPanel));
}
BLOCKDRAFT_VNNI inline __m512 hi16(const Q8Factored& sc, int64_t b) {
  return _mm512_mul_ps(_mm512_loadu_ps(sc.sd + (b >> 3) * 2 * kPanel), i8_ps16(sc.sub + b * 4 * kPanel + 2 * kPanel));
}

// R rows x one tile, q4 (ph null) or q5 (ph: its fifth bits): the codes are unsigned, so vpdpbusd takes them as they
// are; the offsets pass centres them (at 8 or 16) as on AVX2. out[r]: the tile's 16 columns of row + r.
template <int R, int Bits, typename Sc>
BLOCKDRAFT_VNNI inline void q45_tile_vnni(const uint8_t* pc, const uint8_t* ph, const Sc& sc, int64_t g,
                                          const QuantRows& x, int64_t row, __m512* out) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m16 = _mm512_set1_epi8(0x10);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < g; ++b) {
    for (int i = 0; i < 4; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(pc + b * 256 + kPrefetchTile + 64 * i), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(sc.ahead(b, kPrefetchTile)), _MM_HINT_T0);
    __m512i w[8];
    for (int t = 0; t < 4; ++t) {
      const __m512i raw = load512(pc + b * 256 + t * 64);
      w[t] = _mm512_and_si512(raw, m4);
      w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
    }
    if constexpr (Bits == 5) {  // as fifth_bit: bit t of each byte moved to bit 4
      _mm_prefetch(reinterpret_cast<const char*>(ph + b * 64 + kPrefetchTile / 4), _MM_HINT_T0);
      const __m512i hb = load512(ph + b * 64);
      w[0] = _mm512_or_si512(w[0], _mm512_and_si512(_mm512_slli_epi16(hb, 4), m16));
      w[1] = _mm512_or_si512(w[1], _mm512_and_si512(_mm512_slli_epi16(hb, 3), m16));
      w[2] = _mm512_or_si512(w[2], _mm512_and_si512(_mm512_slli_epi16(hb, 2), m16));
      w[3] = _mm512_or_si512(w[3], _mm512_and_si512(_mm512_slli_epi16(hb, 1), m16));
      w[4] = _mm512_or_si512(w[4], _mm512_and_si512(hb, m16));
      w[5] = _mm512_or_si512(w[5], _mm512_and_si512(_mm512_srli_epi16(hb, 1), m16));
      w[6] = _mm512_or_si512(w[6], _mm512_and_si512(_mm512_srli_epi16(hb, 2), m16));
      w[7] = _mm512_or_si512(w[7], _mm512_and_si512(_mm512_srli_epi16(hb, 3), m16));
    }
    const __m512 dv = d16(sc, b);
    const int8_t* xr = x.codes(row, b);
    const float* dxr = x.scales(row, b);
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xr + r * kBlock;
      // two chains: each vpdpbusd waits on the one before it in its chain
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], bcast4_512(xb));
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], bcast4_512(xb + 4));
      for (int j = 2; j < 8; j += 2) {
        s0 = _mm512_dpbusd_epi32(s0, w[j], bcast4_512(xb + 4 * j));
        s1 = _mm512_dpbusd_epi32(s1, w[j + 1], bcast4_512(xb + 4 * j + 4));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, _mm512_set1_ps(dxr[r])), acc[r]);
    }
  }
  // the offset terms, a second pass: q4_offsets on 512-bit registers (a copy, not a shared template: the AVX2 one
  // must compile without AVX-512, and GCC compiles these per function for the VNNI target)
  constexpr int Centre = Bits == 5 ? 16 : 8;
  constexpr float times = Centre / 8;
  const __m512 centre = _mm512_set1_ps(static_cast<float>(Centre));
  __m512 offp[R], offn[R];
  for (int r = 0; r < R; ++r) offp[r] = offn[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < g; ++b) {
    const __m512 dv = d16(sc, b);
    const __m512 a16 = _mm512_fmadd_ps(centre, dv, o16(sc, b));
    const float *xs = x.xs.data() + b * x.m + row, *dxs8 = x.dxs8.data() + b * x.m + row;
    for (int r = 0; r < R; ++r) {
      offp[r] = _mm512_fmadd_ps(a16, _mm512_set1_ps(xs[r]), offp[r]);
      offn[r] = _mm512_fmadd_ps(dv, _mm512_set1_ps(times * dxs8[r]), offn[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_add_ps(acc[r], _mm512_sub_ps(offp[r], offn[r]));
}

// acc[r] += the integer dots of block b's halves times their scales and row r's activation scale (q8_scale_block)
template <int R, typename Sc>
BLOCKDRAFT_VNNI inline void q8_scale_tile(const __m512i* lo, const __m512i* hi, const Sc& sc, int64_t b,
                                          const QuantRows& x, int64_t row, __m512* acc) {
  const __m512 slo = lo16(sc, b), shi = hi16(sc, b);
  const float* dxr = x.scales(row, b);
  for (int r = 0; r < R; ++r) {
    const __m512 dxv = _mm512_set1_ps(dxr[r]);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[r]), _mm512_mul_ps(slo, dxv), acc[r]);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[r]), _mm512_mul_ps(shi, dxv), acc[r]);
  }
}

// R rows x one tile, q8: per block and half, s dx dot(c, xq), as on AVX2 with |c| as unsigned bytes and the signs of
// c moved onto x (negated where c < 0; where c == 0 the product is 0 either way).
template <int R, typename Sc>
BLOCKDRAFT_VNNI inline void q8_tile_vnni(const int8_t* pc, const Sc& sc, int64_t g, const QuantRows& x, int64_t row,
                                         __m512* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < g; ++b) {
    __m512i lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(pc + b * 512 + kPrefetchTile + 64 * i), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(sc.ahead(b, kPrefetchTile)), _MM_HINT_T0);
    const int8_t* xr = x.codes(row, b);
    // the halves in two unrolled loops (see q8_panel)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i w = load512(pc + b * 512 + j * 64);
      const __m512i aw = _mm512_abs_epi8(w);
      const __mmask64 neg = _mm512_movepi8_mask(w);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = bcast4_512(xr + r * kBlock + 4 * j);
        lo[r] = _mm512_dpbusd_epi32(lo[r], aw, _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv));
      }
    }
#pragma GCC unroll 4
    for (int j = 4; j < 8; ++j) {
      const __m512i w = load512(pc + b * 512 + j * 64);
      const __m512i aw = _mm512_abs_epi8(w);
      const __mmask64 neg = _mm512_movepi8_mask(w);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = bcast4_512(xr + r * kBlock + 4 * j);
        hi[r] = _mm512_dpbusd_epi32(hi[r], aw, _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv));
      }
    }
    q8_scale_tile<R>(lo, hi, sc, b, x, row, acc);
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// R rows x one tile, q6: unsigned codes u straight into vpdpbusd, per half block, less 32 sum(xq): q8's integers,
// then its float operations (q8_scale_tile)
template <int R, typename Sc>
BLOCKDRAFT_VNNI inline void q6_tile_vnni(const uint8_t* pc, const uint8_t* ph, const Sc& sc, int64_t g,
                                         const QuantRows& x, int64_t row, __m512* out) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m16 = _mm512_set1_epi8(0x10), m32 = _mm512_set1_epi8(0x20);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < g; ++b) {
    for (int i = 0; i < 4; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(pc + b * 256 + kPrefetchTile + 64 * i), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(ph + b * 128 + kPrefetchTile / 2), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(ph + b * 128 + 64 + kPrefetchTile / 2), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(sc.ahead(b, kPrefetchTile)), _MM_HINT_T0);
    __m512i w[8];
    for (int t = 0; t < 4; ++t) {
      const __m512i raw = load512(pc + b * 256 + t * 64);
      w[t] = _mm512_and_si512(raw, m4);
      w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
    }
    const __m512i h5 = load512(ph + b * 128), h6 = load512(ph + b * 128 + 64);
    // bit t of each byte to bit 4 (first plane) and bit 5 (second), as q6_block_codes
    w[0] = _mm512_or_si512(w[0], _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi16(h5, 4), m16),
                                                 _mm512_and_si512(_mm512_slli_epi16(h6, 5), m32)));
    w[1] = _mm512_or_si512(w[1], _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi16(h5, 3), m16),
                                                 _mm512_and_si512(_mm512_slli_epi16(h6, 4), m32)));
    w[2] = _mm512_or_si512(w[2], _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi16(h5, 2), m16),
                                                 _mm512_and_si512(_mm512_slli_epi16(h6, 3), m32)));
    w[3] = _mm512_or_si512(w[3], _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi16(h5, 1), m16),
                                                 _mm512_and_si512(_mm512_slli_epi16(h6, 2), m32)));
    w[4] = _mm512_or_si512(w[4], _mm512_or_si512(_mm512_and_si512(h5, m16),
                                                 _mm512_and_si512(_mm512_slli_epi16(h6, 1), m32)));
    w[5] = _mm512_or_si512(w[5], _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(h5, 1), m16),
                                                 _mm512_and_si512(h6, m32)));
    w[6] = _mm512_or_si512(w[6], _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(h5, 2), m16),
                                                 _mm512_and_si512(_mm512_srli_epi16(h6, 1), m32)));
    w[7] = _mm512_or_si512(w[7], _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(h5, 3), m16),
                                                 _mm512_and_si512(_mm512_srli_epi16(h6, 2), m32)));
    const int8_t* xr = x.codes(row, b);
    const int32_t* hs = x.hs.data() + 2 * (b * x.m + row);
    __m512i lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xr + r * kBlock;
      __m512i l = _mm512_dpbusd_epi32(_mm512_set1_epi32(-32 * hs[2 * r]), w[0], bcast4_512(xb));
      __m512i h = _mm512_dpbusd_epi32(_mm512_set1_epi32(-32 * hs[2 * r + 1]), w[4], bcast4_512(xb + 16));
      for (int j = 1; j < 4; ++j) {
        l = _mm512_dpbusd_epi32(l, w[j], bcast4_512(xb + 4 * j));
        h = _mm512_dpbusd_epi32(h, w[j + 4], bcast4_512(xb + 16 + 4 * j));
      }
      lo[r] = l;
      hi[r] = h;
    }
    q8_scale_tile<R>(lo, hi, sc, b, x, row, acc);
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

template <typename U>
inline void store_panel(const __m256& v, const float* bias, int64_t col, int64_t n, U* y) {
  alignas(32) float tmp[kPanel];
  _mm256_store_ps(tmp, v);
  const int64_t cols = std::min<int64_t>(kPanel, n - col);
  for (int64_t c = 0; c < cols; ++c) y[col + c] = static_cast<U>(tmp[c] + (bias ? bias[col + c] : 0.f));
}

template <typename U>
BLOCKDRAFT_VNNI inline void store_tile(const __m512& v, const float* bias, int64_t col, int64_t n, U* y) {
  alignas(64) float tmp[kTile * kPanel];
  _mm512_store_ps(tmp, v);
  const int64_t cols = std::min<int64_t>(kTile * kPanel, n - col);
  for (int64_t c = 0; c < cols; ++c) y[col + c] = static_cast<U>(tmp[c] + (bias ? bias[col + c] : 0.f));
}

// One tile x R rows on the VNNI kernels (Bits: 4, 5, 6 or 8; high: q5's fifth bits or q6's planes, else null)
template <int Bits, int R, typename Sc>
BLOCKDRAFT_VNNI inline void tile_vnni(const uint8_t* codes, const uint8_t* high, const Sc& sc, int64_t g,
                                      const QuantRows& x, int64_t row, __m512* out) {
  if constexpr (Bits == 8) q8_tile_vnni<R>(reinterpret_cast<const int8_t*>(codes), sc, g, x, row, out);
  else if constexpr (Bits == 6) q6_tile_vnni<R>(codes, high, sc, g, x, row, out);
  else q45_tile_vnni<R, Bits>(codes, high, sc, g, x, row, out);
}

// tiles [begin, end) of y = x W^T + bias on the VNNI kernels, rows in groups of up to kGroupRowsVnni; per tile and
// block: `unit` bytes of codes and `hunit` of high bits (q5, q6); scales_of(ti): tile ti's scales. Row r of y
// starts at y + r * ldy (a part of a stacked linear writes its columns of a wider row).
template <int Bits, typename ScalesOf, typename U>
BLOCKDRAFT_VNNI void tiles_vnni(const QuantRows& x, const uint8_t* codes, int64_t unit, const uint8_t* high,
                                int64_t hunit, const ScalesOf& scales_of, int64_t g, int64_t n, const float* bias, U* y,
                                int64_t ldy, int64_t begin, int64_t end) {
  __m512 out[kGroupRowsVnni];
  for (int64_t ti = begin; ti < end; ++ti) {
    const uint8_t* pc = codes + ti * g * unit;
    const uint8_t* ph = high != nullptr ? high + ti * g * hunit : nullptr;
    const auto sc = scales_of(ti);
    for (int64_t r = 0; r < x.m;) {
      const int64_t rows = std::min<int64_t>(kGroupRowsVnni, x.m - r);
      switch (rows) {
        case 8: tile_vnni<Bits, 8>(pc, ph, sc, g, x, r, out); break;
        case 7: tile_vnni<Bits, 7>(pc, ph, sc, g, x, r, out); break;
        case 6: tile_vnni<Bits, 6>(pc, ph, sc, g, x, r, out); break;
        case 5: tile_vnni<Bits, 5>(pc, ph, sc, g, x, r, out); break;
        case 4: tile_vnni<Bits, 4>(pc, ph, sc, g, x, r, out); break;
        case 3: tile_vnni<Bits, 3>(pc, ph, sc, g, x, r, out); break;
        case 2: tile_vnni<Bits, 2>(pc, ph, sc, g, x, r, out); break;
        default: tile_vnni<Bits, 1>(pc, ph, sc, g, x, r, out); break;
      }
      for (int64_t i = 0; i < rows; ++i) store_tile(out[i], bias, ti * kTile * kPanel, n, y + (r + i) * ldy);
      r += rows;
    }
  }
}

// --------------------------------------------------------------------------------------------- the products

// Rows per panel kernel call: each unpacked weight register serves this many rows (3 measured no faster: the
// accumulators the q4 kernel spills at 4 rows cost less than unpacking the weights more often).
constexpr int64_t kGroupRows = 4;

// rows in groups of up to kGroupRows through one panel kernel (Kernel: a callable template on the group size)
template <typename U, typename Kernel>
inline void panel_rows(int64_t m, int64_t pi, int64_t n, const float* bias, U* y, int64_t ldy, Kernel&& kernel) {
  __m256 out[kGroupRows];
  for (int64_t r = 0; r < m;) {
    const int64_t rows = std::min<int64_t>(kGroupRows, m - r);
    switch (rows) {
      case 4: kernel(std::integral_constant<int, 4>{}, r, out); break;
      case 3: kernel(std::integral_constant<int, 3>{}, r, out); break;
      case 2: kernel(std::integral_constant<int, 2>{}, r, out); break;
      default: kernel(std::integral_constant<int, 1>{}, r, out); break;
    }
    for (int64_t i = 0; i < rows; ++i) store_panel(out[i], bias, pi * kPanel, n, y + (r + i) * ldy);
    r += rows;
  }
}

// f(begin, end) over [0, n) in chunks the threads take as they finish the one before, each a quarter of what is left
// (at two threads) and at least `grain`: long runs keep the hardware prefetcher on one stream, the short last ones
// let the threads finish together. A static split in halves left one of two threads waiting 10-20% of a step (they
// stream the weights at unequal speeds). Which thread computes a column does not change its bits.
template <typename F>
inline void parallel_chunks(int64_t n, int64_t grain, const F& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  if (threads <= 1 || at::in_parallel_region()) {
    f(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t begin = next.load(std::memory_order_relaxed);
    while (begin < n) {
      const int64_t end = std::min(n, begin + std::max(grain, (n - begin) / (2 * threads)));
      if (next.compare_exchange_weak(begin, end, std::memory_order_relaxed)) {
        f(begin, end);
        begin = next.load(std::memory_order_relaxed);
      }
    }
  });
}

// Units (panels or tiles) in the smallest chunk of work: about 32 KB of weights.
inline int64_t chunk_units(int64_t unit_bytes) {
  return std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(unit_bytes, 1));
}

// y [M, N] (rows ldy apart) = x W^T + bias for one family of kernels (Bits 4, 5, 6 or 8) over `panels` panels:
// `unit` bytes of codes and `hunit` of high bits per tile and block; scales_of(pi, half): the scales of panel pi
// (half 0: of the whole tile pi / 2, for the VNNI kernels; kPanel: of the one panel, for AVX2).
template <int Bits, typename U, typename ScalesOf>
inline void products(const QuantRows& xr, int64_t panels, int64_t g, int64_t n, const uint8_t* codes, int64_t unit,
                     const uint8_t* high, int64_t hunit, const ScalesOf& scales_of, const float* bias, U* y,
                     int64_t ldy) {
  if (kernel_isa() == Isa::kVnni) {
    parallel_chunks(panels / kTile, chunk_units(g * (unit + hunit)), [&](int64_t begin, int64_t end) {
      tiles_vnni<Bits>(xr, codes, unit, high, hunit, [&](int64_t ti) { return scales_of(kTile * ti, 0); }, g, n,
                       bias, y, ldy, begin, end);
    });
    return;
  }
  parallel_chunks(panels, chunk_units(g * (unit + hunit) / kTile), [&](int64_t begin, int64_t end) {
    for (int64_t pi = begin; pi < end; ++pi) {
      const auto sc = scales_of(pi, kPanel);
      const uint8_t* pc = codes + panel_base(pi, g, unit, 32);
      const uint8_t* ph = high != nullptr ? high + panel_base(pi, g, hunit, 32) : nullptr;
      panel_rows(xr.m, pi, n, bias, y, ldy, [&](auto rows, int64_t r, __m256* out) {
        constexpr int R = decltype(rows)::value;
        if constexpr (Bits == 8) q8_panel<R>(reinterpret_cast<const int8_t*>(pc), sc, g, xr, r, out);
        else if constexpr (Bits == 6) q6_panel<R>(pc, ph, sc, g, xr, r, out);
        else if constexpr (Bits == 5) q5_panel<R>(pc, ph, sc, g, xr, r, out);
        else q4_panel<R>(pc, sc, g, xr, r, out);
      });
    }
  });
}

// the 4-bit (high null) or 5-bit (high: the fifth bits, uint8 [P/2, G, 64]) products over w's panels
template <typename U>
inline void q45_products(const QuantRows& xr, const Q4Packed& w, const uint8_t* high, const float* bias, U* y,
                         int64_t ldy) {
  auto run = [&](auto scales_of) {
    const uint8_t* codes = w.codes.data_ptr<uint8_t>();
    if (high != nullptr) products<5>(xr, w.panels, w.g, w.n, codes, 256, high, 64, scales_of, bias, y, ldy);
    else products<4>(xr, w.panels, w.g, w.n, codes, 256, nullptr, 0, scales_of, bias, y, ldy);
  };
  if (w.factored()) run([&](int64_t pi, int64_t half) { return q45_factored(w, pi, half); });
  else if (w.d.scalar_type() == at::kHalf)
    run([&](int64_t pi, int64_t half) { return q45_scales<at::Half>(w, pi, half); });
  else run([&](int64_t pi, int64_t half) { return q45_scales<float>(w, pi, half); });
}

// the 8-bit or 6-bit products over w's panels
template <typename U>
inline void q8_products(const QuantRows& xr, const Q8Packed& w, const float* bias, U* y, int64_t ldy) {
  auto run = [&](auto scales_of) {
    if (w.six())
      products<6>(xr, w.panels, w.g, w.n, w.low.data_ptr<uint8_t>(), 256, w.planes.data_ptr<uint8_t>(), 128,
                  scales_of, bias, y, ldy);
    else
      products<8>(xr, w.panels, w.g, w.n, reinterpret_cast<const uint8_t*>(w.codes.data_ptr<int8_t>()), 512,
                  nullptr, 0, scales_of, bias, y, ldy);
  };
  if (w.factored()) run([&](int64_t pi, int64_t half) { return q8_factored(w, pi, half); });
  else if (w.s.scalar_type() == at::kHalf)
    run([&](int64_t pi, int64_t half) { return q8_scales<at::Half>(w, pi, half); });
  else run([&](int64_t pi, int64_t half) { return q8_scales<float>(w, pi, half); });
}

}  // namespace blockdraft

namespace blockdraft {

// One quantized linear as the kernels hold it: packed weights and an optional float32 bias; or a stack of such
// linears over the same input (`parts`, their outputs side by side: a fused q/k/v whose parts come in different
// formats, GGUF's Q4_K q and k beside a Q6_K v), the activations quantized once for all of them. Each part computes
// its columns exactly as it would alone.
struct QLin {
  int bits = 0;
  int64_t n = 0, k = 0;
  Q4Packed q4;
  Q5Packed q5;
  Q8Packed q8;
  torch::Tensor bias;
  std::vector<QLin> parts;

  const float* bias_ptr() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }
  // bits per stored scale: 16 / 32 (floats), 8 (factored K-quant scales); a stack: its widest part's
  int scale_bits() const {
    if (!parts.empty()) {
      int b = 0;
      for (const QLin& p : parts) b = std::max(b, p.scale_bits());
      return b;
    }
    if (bits == 8 ? q8.factored() : (bits == 4 ? q4 : q5.low).factored()) return 8;
    return (bits == 4 ? q4.d : bits == 5 ? q5.low.d : q8.s).scalar_type() == at::kHalf ? 16 : 32;
  }
  // the kernel family: "q4", "q5", "q6" (6-bit codes in the q8 format) or "q8"; a stack: its parts', joined by "+"
  std::string layout() const {
    if (!parts.empty()) {
      std::string out;
      for (const QLin& p : parts) out += (out.empty() ? "" : "+") + p.layout();
      return out;
    }
    return bits == 8 ? (q8.six() ? "q6" : "q8") : bits == 4 ? "q4" : "q5";
  }
  // the bytes a product streams: codes, high bits and scales (the bias aside)
  int64_t weight_bytes() const {
    int64_t total = 0;
    for (const QLin& p : parts) total += p.weight_bytes();
    for (const torch::Tensor* t : {&q4.codes, &q4.d, &q4.o, &q4.sc, &q4.mn, &q4.sd, &q4.sm, &q5.low.codes, &q5.low.d,
                                   &q5.low.o, &q5.low.sc, &q5.low.mn, &q5.low.sd, &q5.low.sm, &q5.high, &q8.codes,
                                   &q8.s, &q8.low, &q8.planes, &q8.sub, &q8.sd})
      if (t->defined()) total += t->nbytes();
    return total;
  }

  // y [m, n] = x [m, k] W^T + b
  template <typename T, typename U>
  void apply(const T* x, int64_t m, U* y) const {
    const QuantRows xr(x, m, k);
    apply_rows(xr, y, n);
  }

  // the same from activations already quantized, row r of y at y + r * ldy
  template <typename U>
  void apply_rows(const QuantRows& xr, U* y, int64_t ldy) const {
    if (!parts.empty()) {
      int64_t col = 0;
      for (const QLin& p : parts) {
        p.apply_rows(xr, y + col, ldy);
        col += p.n;
      }
      return;
    }
    if (bits == 4) q45_products(xr, q4, nullptr, bias_ptr(), y, ldy);
    else if (bits == 5) q45_products(xr, q5.low, q5.high.data_ptr<uint8_t>(), bias_ptr(), y, ldy);
    else q8_products(xr, q8, bias_ptr(), y, ldy);
  }
};

// parts stacked along the output (see QLin): one input width, outputs side by side in order
inline QLin stack_qlin(const std::vector<QLin>& parts) {
  TORCH_CHECK(parts.size() >= 2, "a stack needs at least two parts");
  QLin q;
  q.k = parts[0].k;
  for (const QLin& p : parts) {
    TORCH_CHECK(p.k == q.k, "stacked parts must share the input width: ", p.k, " != ", q.k);
    q.n += p.n;
  }
  q.bits = parts[0].bits;
  q.parts = parts;
  return q;
}

// bits 4: codes uint8 [N, K/2], scale / offset float32 [N, K/32]; bits 5: the same plus high uint8 [N, K/8] (the
// fifth bits); bits 8: codes int8 [N, K], scale float32 [N, K/16]; bias float32-convertible [N] or none
// Factored scales (GGUF's K-quants, see Q4Packed and Q8Packed), optional: bits 4 / 5: sub and sub_min uint8
// [N, K/32], super_scale and super_min float32 [N, K/256] with scale = super_scale * sub and offset =
// -(super_min * sub_min) per block; bits 8: sub int8 [N, K/16] and super_scale [N, K/256] with scale = super_scale *
// sub. They must multiply out to scale (and offset) exactly in float32: that is what gives the float layout's bits.
inline QLin make_qlin(int64_t bits, torch::Tensor codes, torch::Tensor scale, c10::optional<torch::Tensor> offset,
                      c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> high,
                      c10::optional<torch::Tensor> sub, c10::optional<torch::Tensor> sub_min,
                      c10::optional<torch::Tensor> super_scale, c10::optional<torch::Tensor> super_min) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "bits must be 4, 5 or 8");
  TORCH_CHECK(codes.dim() == 2 && codes.device().is_cpu(), "codes must be a 2-d CPU tensor");
  QLin q;
  q.bits = static_cast<int>(bits);
  q.n = codes.size(0);
  q.k = bits == 8 ? codes.size(1) : codes.size(1) * 2;
  TORCH_CHECK(q.n > 0 && q.k > 0, "codes must not be empty, got ", codes.sizes());
  TORCH_CHECK(q.k % kBlock == 0, "K must be a multiple of 32, got ", q.k);
  // the exact shape, not just the element count: a transposed scale has the same count and gives wrong numbers
  const int64_t groups = bits == 8 ? q.k / 16 : q.k / kBlock;
  auto check_scales = [&](const torch::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
    TORCH_CHECK(t.is_floating_point(), name, " must be a float tensor, got ", t.scalar_type());
    TORCH_CHECK(t.dim() == 2 && t.size(0) == q.n && t.size(1) == groups, name, " must have shape [", q.n, ", ",
                groups, "], got ", t.sizes());
  };
  check_scales(scale, "scale");
  const torch::Tensor c = codes.contiguous(), s = scale.to(torch::kFloat).contiguous();
  if (bits == 4 || bits == 5) {
    TORCH_CHECK(c.scalar_type() == at::kByte, bits, "-bit codes must be uint8 [N, K/2]");
    TORCH_CHECK(offset.has_value() && offset->defined(), bits, "-bit weights need offsets");
    check_scales(*offset, "offset");
    const torch::Tensor o = offset->to(torch::kFloat).contiguous();
    if (bits == 4) {
      q.q4 = pack_q4(c, s, o);
    } else {
      TORCH_CHECK(high.has_value() && high->defined(), "5-bit weights need their fifth bits (high)");
      TORCH_CHECK(high->device().is_cpu(), "high must be a CPU tensor");
      const torch::Tensor h = high->contiguous();
      TORCH_CHECK(h.scalar_type() == at::kByte && h.dim() == 2 && h.size(0) == q.n && h.size(1) == q.k / 8,
                  "high must be uint8 [N, K/8] = [", q.n, ", ", q.k / 8, "]");
      q.q5 = pack_q5(c, h, s, o);
    }
  } else {
    TORCH_CHECK(c.scalar_type() == at::kChar, "8-bit codes must be int8 [N, K]");
    q.q8 = pack_q8(c, s);
  }
  const bool factored = sub.has_value() && sub->defined();
  TORCH_CHECK(factored == (super_scale.has_value() && super_scale->defined()),
              "factored scales need both sub and super_scale");
  if (factored) {
    TORCH_CHECK(q.k % 256 == 0, "factored scales need K to be a multiple of 256, got ", q.k);
    const int64_t per = bits == 8 ? 16 : 8;  // sub-scales per super-block of 256 inputs
    auto check = [&](const torch::Tensor& t, at::ScalarType dtype, int64_t cols, const char* name) {
      TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 2 && t.size(0) == q.n &&
                  t.size(1) == cols, name, " must be a ", dtype, " CPU tensor [", q.n, ", ", cols, "], got ",
                  t.scalar_type(), " ", t.sizes());
    };
    check(*sub, bits == 8 ? at::kChar : at::kByte, groups, "sub");
    check(*super_scale, at::kFloat, q.k / 256, "super_scale");
    const torch::Tensor sup = super_scale->contiguous(), sb = sub->contiguous();
    TORCH_CHECK(torch::equal(sup.repeat_interleave(per, 1) * sb.to(torch::kFloat), s),
                "the factored scales do not multiply out to scale exactly");
    if (bits == 8) {
      factor_q8(q.q8, sb, sup);
    } else {
      TORCH_CHECK(sub_min.has_value() && sub_min->defined() && super_min.has_value() && super_min->defined(),
                  bits, "-bit factored scales need sub_min and super_min");
      check(*sub_min, at::kByte, groups, "sub_min");
      check(*super_min, at::kFloat, q.k / 256, "super_min");
      const torch::Tensor smin = super_min->contiguous(), mn = sub_min->contiguous();
      TORCH_CHECK(torch::equal(-(smin.repeat_interleave(per, 1) * mn.to(torch::kFloat)), offset->to(torch::kFloat)),
                  "the factored offsets do not multiply out to offset exactly");
      factor_q4(bits == 4 ? q.q4 : q.q5.low, sb, mn, sup, smin);
    }
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->is_floating_point() && bias->dim() == 1 && bias->size(0) == q.n,
                "bias must be a float CPU tensor of shape [", q.n, "], got ", bias->sizes());
    q.bias = bias->to(torch::kFloat).contiguous();
  }
  return q;
}

}  // namespace blockdraft
