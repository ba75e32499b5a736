// The 4- and 5-bit weight formats (q4, q5): packing into panels, their scales (as floats or factored as GGUF's
// K-quants hold them) and the AVX2 panel kernels.
#pragma once
#include "common.h"

namespace blockdraft {

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
  // each column writes its own bytes: columns split across the threads
  at::parallel_for(0, p.n, 256, [&](int64_t c0, int64_t c1) {
    for (int64_t col = c0; col < c1; ++col) {
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
  });
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
  at::parallel_for(0, q.n, 256, [&](int64_t c0, int64_t c1) {  // each column ors into its own bytes
    for (int64_t col = c0; col < c1; ++col) {
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
  });
  return plane;
}

inline Q5Packed pack_q5(const torch::Tensor& qw, const torch::Tensor& hb, const torch::Tensor& d,
                        const torch::Tensor& o) {
  Q5Packed p;
  p.low = pack_q4(qw, d, o);
  p.high = pack_plane(hb, p.low);
  return p;
}

// Bit t of each byte of a bit plane hb moved to bit D (mask: 1 << D in every byte). The 16-bit shifts carry bits
// across bytes only into positions other than D: a left shift by s <= D takes bit D of either byte from its own
// bit D - s, a right shift by s <= 7 - D from its own bit D + s.
template <int D, int T>
inline __m256i plane_bit(__m256i hb, __m256i mask) {
  if constexpr (T < D) return _mm256_and_si256(_mm256_slli_epi16(hb, D - T), mask);
  else if constexpr (T == D) return _mm256_and_si256(hb, mask);
  else return _mm256_and_si256(_mm256_srli_epi16(hb, T - D), mask);
}

// the 8 registers of an unpacked block, as a pack to expand over
using kRegs = std::make_integer_sequence<int, 8>;

// w[t] |= bit t of each byte of the plane hb, as bit D: a fifth (D = 4) or sixth (D = 5) bit of every code
template <int D, int... T>
inline void add_plane(__m256i* w, __m256i hb, std::integer_sequence<int, T...>) {
  const __m256i mask = _mm256_set1_epi8(1 << D);
  ((w[T] = _mm256_or_si256(w[T], plane_bit<D, T>(hb, mask))), ...);
}

// Block b of a q5 panel unpacked into 8 registers of codes 0..31 (q4's registers with the fifth bits added), the
// same for every instruction set.
template <typename Sc>
inline void q5_block_codes(const uint8_t* pc, const uint8_t* ph, const Sc& sc, int64_t b, __m256i* w) {
  q4_block_codes(pc, sc, b, w);
  _mm_prefetch(reinterpret_cast<const char*>(ph + b * 64 + kPrefetch / 4), _MM_HINT_T0);
  add_plane<4>(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ph + b * 64)), kRegs{});
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

}  // namespace blockdraft
