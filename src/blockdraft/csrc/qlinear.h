// Weight-only quantized linears for CPU decoding: y [M, N] = x [M, K] W^T, W stored in blocks of 32 along K.
//
// Two weight formats, chosen so that GGUF's own blocks map onto them without requantization:
//   q4: unsigned 4-bit codes c in 0..15 with a scale d and an offset o per block: w = d * c + o
//       (GGUF Q4_0: o = -8d; Q4_1: o = m; Q4_K: d = d*sc, o = -dmin*m per sub-block of 32).
//       Bytes: 16 per block; byte j holds element j in its low nibble and element j + 16 in its high nibble
//       (GGUF's Q4_0 / Q4_1 layout, so those blocks are copied as they are).
//   q8: signed 8-bit codes with a scale per 16 elements: w = s * c (GGUF Q8_0: one scale repeated for both
//       halves of a block; Q6_K: codes - 32 with its per-16 scales).
//
// Activations are quantized per row and block of 32 to int8 (scale = max|x| / 127), as llama.cpp does for its
// integer dot products; the q4 offset term uses the exact float sum of each block of x. The integer dot products
// run through AVX2's u8 x s8 multiply-add.
//
// Why the result does not depend on M: every output y[m, n] is computed by the same sequence of operations
// whatever the number of rows and however rows are grouped, so a multi-token verify step and a one-token step
// produce the same numbers for the same row. Greedy speculative decoding on these kernels is therefore token-exact
// against plain decoding on them, in bf16 as in fp32.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <vector>

namespace blockdraft {

constexpr int64_t kBlock = 32;

// x [M, K] (float or bf16) -> int8 codes [M, K], per-block scales dx [M, K/32], exact per-block sums xs [M, K/32]
// and dx times the sum of each block's codes, dxs [M, K/32]
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int8_t* xq, float* dx, float* xs, float* dxs) {
  const int64_t g = k / kBlock;
  float buf[kBlock];
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < g; ++b) {
      const T* src = x + r * k + b * kBlock;
      float amax = 0.f, sum = 0.f;
      for (int j = 0; j < kBlock; ++j) {
        buf[j] = static_cast<float>(src[j]);
        amax = std::fmax(amax, std::fabs(buf[j]));
        sum += buf[j];
      }
      const float d = amax / 127.f;
      const float id = d > 0.f ? 1.f / d : 0.f;
      int8_t* dst = xq + r * k + b * kBlock;
      int csum = 0;
      for (int j = 0; j < kBlock; ++j) {
        dst[j] = static_cast<int8_t>(std::nearbyint(buf[j] * id));
        csum += dst[j];
      }
      dx[r * g + b] = d;
      xs[r * g + b] = sum;
      dxs[r * g + b] = d * static_cast<float>(csum);
    }
  }
}

inline float hsum128(__m128 s) {
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// integer dot of 32 unsigned codes with 32 signed activations, as 8 partial sums (lanes 0..3 cover inputs 0..15,
// lanes 4..7 inputs 16..31)
inline __m256i dot32(__m256i wu, __m256i xs8) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xs8), _mm256_set1_epi16(1));
}

// four blocks' partial sums -> [b0 lo, b1 lo, b2 lo, b3 lo | b0 hi, b1 hi, b2 hi, b3 hi] (lo / hi: inputs 0..15 /
// 16..31 of the block)
// (unpack/add instead of hadd: single-uop instructions, where hadd is several)
inline __m256i halves4(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
  const __m256i a = _mm256_add_epi32(_mm256_unpacklo_epi32(v0, v1), _mm256_unpackhi_epi32(v0, v1));
  const __m256i b = _mm256_add_epi32(_mm256_unpacklo_epi32(v2, v3), _mm256_unpackhi_epi32(v2, v3));
  return _mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
}

// unpack one row of q4 codes (K/2 bytes) into K bytes in input order
inline void unpack_q4(const uint8_t* qw, int64_t g, uint8_t* out) {
  const __m128i m4 = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < g; ++b) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qw + b * 16));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + b * kBlock), _mm_and_si128(raw, m4));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + b * kBlock + 16), _mm_and_si128(_mm_srli_epi16(raw, 4), m4));
  }
}

// One q4 output: sum_b d_b dx_b dot(c_b - 8, xq_b) + (o_b + 8 d_b) xs_b, four blocks reduced at a time. The codes
// enter centred, w = d (c - 8) + (o + 8d): the integer part then spans at most half the block's range, which halves
// the error that quantizing x adds (with d c + o it would span all of it). dot(c - 8, xq) = dot(c, xq) - 8 sum(xq),
// and dxs holds dx sum(xq). wc: the column's codes unpacked [K]; xq [K], dx / xs / dxs [K/32]:
// the row's quantized activations.
// codes of block b as 32 bytes in input order: from the packed nibbles (Packed) or an unpacked copy
template <bool Packed>
inline __m256i codes32(const uint8_t* w, int64_t b) {
  if constexpr (Packed) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * 16));
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kBlock));
  }
}

// four blocks from b on, into a main and two offset accumulators (kept apart so that no chain of dependent
// multiply-adds limits the loop)
template <bool Packed>
inline void q4_group(const uint8_t* wc, const float* d, const float* o, int64_t b, const int8_t* xq,
                     const float* dx, const float* xs, const float* dxs, __m128& acc, __m128& offp, __m128& offn) {
  __m256i v[4];
  for (int j = 0; j < 4; ++j)
    v[j] = dot32(codes32<Packed>(wc, b + j),
                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (b + j) * kBlock)));
  const __m256i h = halves4(v[0], v[1], v[2], v[3]);
  const __m128 dots = _mm_cvtepi32_ps(_mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
  const __m128 dv = _mm_loadu_ps(d + b), eight = _mm_set1_ps(8.f);
  acc = _mm_fmadd_ps(dots, _mm_mul_ps(dv, _mm_loadu_ps(dx + b)), acc);
  offp = _mm_fmadd_ps(_mm_fmadd_ps(eight, dv, _mm_loadu_ps(o + b)), _mm_loadu_ps(xs + b), offp);
  offn = _mm_fmadd_ps(_mm_mul_ps(eight, dv), _mm_loadu_ps(dxs + b), offn);
}

template <bool Packed>
inline float q4_dot(const uint8_t* wc, const float* d, const float* o, int64_t g, const int8_t* xq,
                    const float* dx, const float* xs, const float* dxs) {
  __m128 a0 = _mm_setzero_ps(), a1 = a0, p0 = a0, p1 = a0, n0 = a0, n1 = a0;
  int64_t b = 0;
  for (; b + 8 <= g; b += 8) {
    q4_group<Packed>(wc, d, o, b, xq, dx, xs, dxs, a0, p0, n0);
    q4_group<Packed>(wc, d, o, b + 4, xq, dx, xs, dxs, a1, p1, n1);
  }
  if (b + 4 <= g) {
    q4_group<Packed>(wc, d, o, b, xq, dx, xs, dxs, a0, p0, n0);
    b += 4;
  }
  float tail = 0.f;
  for (; b < g; ++b) {
    const int dot = hsum_epi32(dot32(codes32<Packed>(wc, b),
                                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock))));
    tail += static_cast<float>(dot) * (d[b] * dx[b]) + std::fma(8.f, d[b], o[b]) * xs[b] - (8.f * d[b]) * dxs[b];
  }
  const __m128 sum = _mm_add_ps(_mm_add_ps(a0, a1), _mm_sub_ps(_mm_add_ps(p0, p1), _mm_add_ps(n0, n1)));
  return hsum128(sum) + tail;
}

// One q8 output: sum over halves h of s_h dx dot(c_h, xq_h). s: the column's scales [K/16] in input order.
inline float q8_dot(const int8_t* wc, const float* s, int64_t g, const int8_t* xq, const float* dx) {
  __m256 accs[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t b = 0;
  // scales come as [b0 lo, b0 hi, b1 lo, ...]; halves4 gives [b0 lo, b1 lo, b2 lo, b3 lo | b0 hi, ...]
  const __m256i perm = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  for (; b + 4 <= g; b += 4) {
    __m256& acc = accs[(b / 4) & 1];
    __m256i v[4];
    for (int j = 0; j < 4; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + (b + j) * kBlock));
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (b + j) * kBlock));
      v[j] = dot32(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));  // |w| times x with w's sign
    }
    const __m256 dots = _mm256_cvtepi32_ps(halves4(v[0], v[1], v[2], v[3]));
    const __m256 sv = _mm256_permutevar8x32_ps(_mm256_loadu_ps(s + 2 * b), perm);
    const __m128 dx4 = _mm_loadu_ps(dx + b);
    acc = _mm256_fmadd_ps(dots, _mm256_mul_ps(sv, _mm256_set_m128(dx4, dx4)), acc);
  }
  float tail = 0.f;
  for (; b < g; ++b) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + b * kBlock));
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
    const __m256i v = dot32(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    const int lo = hsum_epi32(_mm256_blend_epi32(v, _mm256_setzero_si256(), 0xF0));
    const int hi = hsum_epi32(_mm256_blend_epi32(v, _mm256_setzero_si256(), 0x0F));
    tail += (static_cast<float>(lo) * s[2 * b] + static_cast<float>(hi) * s[2 * b + 1]) * dx[b];
  }
  const __m256 acc = _mm256_add_ps(accs[0], accs[1]);
  return hsum128(_mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1))) + tail;
}

template <typename T>
inline void store(T* y, float v) { y[0] = static_cast<T>(v); }

// Grain: enough columns per task that the parallel overhead stays small against the work.
inline int64_t grain(int64_t k) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)); }

// y [M, N] (U) = x [M, K] (T) W^T + bias for q4 weights
template <typename T, typename U>
inline void q4_mm(const T* x, int64_t m, int64_t k, const uint8_t* qp, const float* dp, const float* op, int64_t n,
           const float* bias, U* yp) {
  const int64_t g = k / kBlock;
  std::vector<int8_t> xq(m * k);
  std::vector<float> dx(m * g), xs(m * g), dxs(m * g);
  quantize_rows(x, m, k, xq.data(), dx.data(), xs.data(), dxs.data());
  at::parallel_for(0, n, grain(k), [&](int64_t begin, int64_t end) {
    // one row reads the packed codes directly; several unpack each column once and reread it from L1
    std::vector<uint8_t> wc(m > 1 ? k : 0);
    for (int64_t c = begin; c < end; ++c) {
      const float bc = bias ? bias[c] : 0.f;
      if (m == 1) {
        store(yp + c, q4_dot<true>(qp + c * (k / 2), dp + c * g, op + c * g, g, xq.data(), dx.data(), xs.data(),
                                   dxs.data()) + bc);
        continue;
      }
      unpack_q4(qp + c * (k / 2), g, wc.data());
      for (int64_t r = 0; r < m; ++r)
        store(yp + r * n + c, q4_dot<false>(wc.data(), dp + c * g, op + c * g, g, xq.data() + r * k,
                                            dx.data() + r * g, xs.data() + r * g, dxs.data() + r * g) + bc);
    }
  });
}

// y [M, N] (U) = x [M, K] (T) W^T + bias for q8 weights
template <typename T, typename U>
inline void q8_mm(const T* x, int64_t m, int64_t k, const int8_t* qp, const float* sp, int64_t n, const float* bias,
           U* yp) {
  const int64_t g = k / kBlock;
  std::vector<int8_t> xq(m * k);
  std::vector<float> dx(m * g), xs(m * g), dxs(m * g);
  quantize_rows(x, m, k, xq.data(), dx.data(), xs.data(), dxs.data());
  at::parallel_for(0, n, grain(k), [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const float bc = bias ? bias[c] : 0.f;
      for (int64_t r = 0; r < m; ++r)
        store(yp + r * n + c, q8_dot(qp + c * k, sp + c * 2 * g, g, xq.data() + r * k, dx.data() + r * g) + bc);
    }
  });
}

}  // namespace blockdraft
