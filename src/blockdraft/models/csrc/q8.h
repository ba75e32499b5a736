// The 8-bit weight format (q8) and its 6-bit form (q6, GGUF's Q6_K codes): packing, scales and the AVX2 panel
// kernels.
#pragma once
#include "q45.h"

namespace blockdraft {

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
  const auto range = qw.aminmax();
  const bool six = std::get<0>(range).item<int8_t>() >= -32 && std::get<1>(range).item<int8_t>() <= 31;
  if (six) {
    // u = c + 32 (0..63), row by row across the threads: its low nibbles in GGUF's q4 byte layout (byte j of a
    // block holds input j low and j + 16 high) and its fifth and sixth bits as planes (bit j of byte q: input
    // 8q + j). Done with tensor operations these took ~4.6 s of a 150k-row LM head's packing.
    const torch::Tensor nib = torch::empty({p.n, p.k / 2}, torch::kByte);
    const torch::Tensor bit4 = torch::empty({p.n, p.k / 8}, torch::kByte), bit5 = torch::empty_like(bit4);
    const int8_t* src = qw.data_ptr<int8_t>();
    uint8_t *pn = nib.data_ptr<uint8_t>(), *p4 = bit4.data_ptr<uint8_t>(), *p5 = bit5.data_ptr<uint8_t>();
    const int64_t k = p.k;
    at::parallel_for(0, p.n, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int8_t* row = src + r * k;
        auto u = [&](int64_t i) { return static_cast<uint8_t>(row[i] + 32); };
        for (int64_t b = 0; b < k / kBlock; ++b)
          for (int j = 0; j < 16; ++j)
            pn[r * (k / 2) + b * 16 + j] = static_cast<uint8_t>((u(b * kBlock + j) & 15) |
                                                                 ((u(b * kBlock + 16 + j) & 15) << 4));
        for (int64_t q = 0; q < k / 8; ++q) {
          uint8_t x4 = 0, x5 = 0;
          for (int j = 0; j < 8; ++j) {
            x4 = static_cast<uint8_t>(x4 | (((u(8 * q + j) >> 4) & 1) << j));
            x5 = static_cast<uint8_t>(x5 | (((u(8 * q + j) >> 5) & 1) << j));
          }
          p4[r * (k / 8) + q] = x4;
          p5[r * (k / 8) + q] = x5;
        }
      }
    });
    const torch::Tensor zero = torch::zeros({p.n, p.g}, torch::kFloat);
    Q4Packed geometry = pack_q4(nib, zero, zero);
    p.low = geometry.codes;
    p.planes = torch::cat({pack_plane(bit4, geometry), pack_plane(bit5, geometry)}, 2).contiguous();
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

// acc[r] += row r's integer dot with the half of a block's codes pb (512 bytes, 8 words of 64) that starts at word
// J0 (0: the low half, 4: the high one). Each half is its own unrolled loop: a test on j inside one loop of 8 kept
// it rolled and spilled accumulators.
template <int R, int J0>
__attribute__((always_inline)) inline void q8_half(const int8_t* pb, const int8_t* xr, __m256i* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 4
  for (int j = J0; j < J0 + 4; ++j) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + j * 64));
    const __m256i aw = _mm256_sign_epi8(w, w);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(
          _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast4(xr + r * kBlock + 4 * j), w)), ones));
  }
}

// R rows x one panel, q8: per block and half, s dx dot(c, xq). AVX2 multiplies unsigned by signed bytes, so the
// codes enter as |c| and their signs move onto x; each pair sum <= 2 * 128 * 127 fits int16 before widening.
template <int R, typename Sc>
inline void q8_panel(const int8_t* pc, const Sc& sc, int64_t g, const QuantRows& x, int64_t row, __m256* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < g; ++b) {
    __m256i lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
    q8_prefetch(pc, sc, b);
    const int8_t* xr = x.codes(row, b);
    q8_half<R, 0>(pc + b * 512, xr, lo);
    q8_half<R, 4>(pc + b * 512, xr, hi);
    q8_scale_block<R>(lo, hi, sc, b, x, row, acc);
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// Block b of a q6 panel unpacked into 8 registers of codes u in 0..63: q4's registers, the fifth bits of the first
// plane and the sixth bits of the second.
template <typename Sc>
inline void q6_block_codes(const uint8_t* pc, const uint8_t* ph, const Sc& sc, int64_t b, __m256i* w) {
  q4_block_codes(pc, sc, b, w);
  _mm_prefetch(reinterpret_cast<const char*>(ph + b * 128 + kPrefetch / 2), _MM_HINT_T0);
  add_plane<4>(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ph + b * 128)), kRegs{});
  add_plane<5>(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ph + b * 128 + 64)), kRegs{});
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

}  // namespace blockdraft
