// What every quantized kernel shares (qlinear.h has the overview): the block and panel geometry, vector
// helpers, the split of per-row work across threads, and the activations quantized per row and block (QuantRows).
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
#include <utility>
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

}  // namespace blockdraft
