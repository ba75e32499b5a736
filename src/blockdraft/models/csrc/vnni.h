// The AVX512-VNNI tile kernels of every format: the same packed weights and the same bits as the AVX2 ones.
#pragma once
#include "q8.h"

namespace blockdraft {

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

// w[t] |= bit t of each byte of the plane hb, as bit D (add_plane on 512-bit registers)
template <int D, int T>
BLOCKDRAFT_VNNI inline __m512i plane_bit512(__m512i hb, __m512i mask) {
  if constexpr (T < D) return _mm512_and_si512(_mm512_slli_epi16(hb, D - T), mask);
  else if constexpr (T == D) return _mm512_and_si512(hb, mask);
  else return _mm512_and_si512(_mm512_srli_epi16(hb, T - D), mask);
}
template <int D, int... T>
BLOCKDRAFT_VNNI inline void add_plane512(__m512i* w, __m512i hb, std::integer_sequence<int, T...>) {
  const __m512i mask = _mm512_set1_epi8(1 << D);
  ((w[T] = _mm512_or_si512(w[T], plane_bit512<D, T>(hb, mask))), ...);
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

// Block b of a tile's 4-bit codes (q4, and the low bits of q5 / q6): ask for the weights and the scales
// kPrefetchTile bytes ahead, and unpack the nibbles into 8 registers (chunk t's low nibbles in w[t], high in w[t + 4])
template <typename Sc>
BLOCKDRAFT_VNNI inline void q4_tile_codes(const uint8_t* pc, const Sc& sc, int64_t b, __m512i* w) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int i = 0; i < 4; ++i)
    _mm_prefetch(reinterpret_cast<const char*>(pc + b * 256 + kPrefetchTile + 64 * i), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(sc.ahead(b, kPrefetchTile)), _MM_HINT_T0);
  for (int t = 0; t < 4; ++t) {
    const __m512i raw = load512(pc + b * 256 + t * 64);
    w[t] = _mm512_and_si512(raw, m4);
    w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
  }
}

// R rows x one tile, q4 (ph null) or q5 (ph: its fifth bits): the codes are unsigned, so vpdpbusd takes them as they
// are; the offsets pass centres them (at 8 or 16) as on AVX2. out[r]: the tile's 16 columns of row + r.
template <int R, int Bits, typename Sc>
BLOCKDRAFT_VNNI inline void q45_tile_vnni(const uint8_t* pc, const uint8_t* ph, const Sc& sc, int64_t g,
                                          const QuantRows& x, int64_t row, __m512* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < g; ++b) {
    __m512i w[8];
    q4_tile_codes(pc, sc, b, w);
    if constexpr (Bits == 5) {
      _mm_prefetch(reinterpret_cast<const char*>(ph + b * 64 + kPrefetchTile / 4), _MM_HINT_T0);
      add_plane512<4>(w, load512(ph + b * 64), kRegs{});
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

// acc[r] += row r's integer dot with the half of a block's codes pb that starts at word J0, as q8_half does on
// AVX2 (one unrolled loop per half).
template <int R, int J0>
BLOCKDRAFT_VNNI __attribute__((always_inline)) inline void q8_half_vnni(const int8_t* pb, const int8_t* xr,
                                                                        __m512i* acc) {
#pragma GCC unroll 4
  for (int j = J0; j < J0 + 4; ++j) {
    const __m512i w = load512(pb + j * 64);
    const __m512i aw = _mm512_abs_epi8(w);
    const __mmask64 neg = _mm512_movepi8_mask(w);
    for (int r = 0; r < R; ++r) {
      const __m512i xv = bcast4_512(xr + r * kBlock + 4 * j);
      acc[r] = _mm512_dpbusd_epi32(acc[r], aw, _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv));
    }
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
    q8_half_vnni<R, 0>(pc + b * 512, xr, lo);
    q8_half_vnni<R, 4>(pc + b * 512, xr, hi);
    q8_scale_tile<R>(lo, hi, sc, b, x, row, acc);
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// R rows x one tile, q6: unsigned codes u straight into vpdpbusd, per half block, less 32 sum(xq): q8's integers,
// then its float operations (q8_scale_tile)
template <int R, typename Sc>
BLOCKDRAFT_VNNI inline void q6_tile_vnni(const uint8_t* pc, const uint8_t* ph, const Sc& sc, int64_t g,
                                         const QuantRows& x, int64_t row, __m512* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < g; ++b) {
    _mm_prefetch(reinterpret_cast<const char*>(ph + b * 128 + kPrefetchTile / 2), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(ph + b * 128 + 64 + kPrefetchTile / 2), _MM_HINT_T0);
    __m512i w[8];
    q4_tile_codes(pc, sc, b, w);
    add_plane512<4>(w, load512(ph + b * 128), kRegs{});
    add_plane512<5>(w, load512(ph + b * 128 + 64), kRegs{});
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

}  // namespace blockdraft
