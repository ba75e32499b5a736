// The chain selector's greedy chain in one call (models/selector.py holds the formula and the torch reference,
// `choose_chain`). Per block row k: z = W_out silu(W_h rms(h_k) + b + W_e rms(e_prev)), the row's K candidates
// scored again as s + z . W_head[id], the first maximum chosen, its id fed to row k + 1. The arithmetic is a few
// matrix-vector products of a few hundred numbers; in torch each of the ~25 operations a block needs cost 10-30 us
// on 2 threads whatever its size, so a block's chain cost ~1 ms beside a ~4 ms draft step. Here it is one call on
// torch's threads, float32 throughout, sums in another order than torch's: the same values to rounding, and the
// same choices wherever two candidates' scores are not within rounding.
#pragma once
#include "common.h"

namespace blockdraft {

// sum_i a[i] b[i], 32 products a round in four chains (a: float32 or bf16, b: float32)
template <typename A>
inline float dot_chain(const A* a, const float* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm256_fmadd_ps(load8(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(load8(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    s2 = _mm256_fmadd_ps(load8(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
    s3 = _mm256_fmadd_ps(load8(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(load8(a + i), _mm256_loadu_ps(b + i), s0);
  float s = hsum256(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  for (; i < n; ++i) s += static_cast<float>(a[i]) * b[i];
  return s;
}

// out = x / sqrt(mean(x^2) + eps), float32 (selector.py `_rms`)
template <typename A>
inline void rms_chain(const A* x, int64_t n, float* out) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<float>(x[i]);
    ss += out[i] * out[i];
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + 1e-6f);
  for (int64_t i = 0; i < n; ++i) out[i] *= r;
}

// y[r, o] = sum_i w[o, i] x[r, i] (+ b[o]) for r < m, o < rows: w [rows, n] float32 row-major, x [m, n], y [m, rows].
// Each weight row is read once for all m inputs, and the rows are split over torch's threads: the selector's
// matrices (1.5 MB each on a 1.5B target) are cold after a verify step has streamed the target's weights.
inline void mm_chain(const float* w, const float* x, int64_t m, const float* b, int64_t rows, int64_t n, float* y) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t r = 0; r < m; ++r)
        y[r * rows + o] = dot_chain(w + o * n, x + r * n, n) + (b != nullptr ? b[o] : 0.f);
  });
}

// The first index of the maximum of s[0..k) (torch's argmax: a NaN counts as the maximum)
inline int64_t argmax_chain(const float* s, int64_t k) {
  int64_t best = 0;
  for (int64_t j = 0; j < k; ++j) {
    if (std::isnan(s[j])) return j;
    if (s[j] > s[best]) best = j;
  }
  return best;
}

struct ChainWeights {
  const float *w_h, *w_e, *b, *w_out;  // [R, H], [R, H], [R], [H, R]
  int64_t rank, hidden;
};

// The greedy chain of one block. top_s [g, K] the rows' K best draft scores, top_ids [g, K] their target ids, hidden
// [g, H] the rows' draft states (float32 or bf16, as T), anchor the committed token before row 1, embed / head [V, H]
// the target's input embedding and LM head (float32 or bf16, as E), table [V, R] the token parts W_e rms(e_id) kept
// where have[id] (computed here on first use). -> chosen [g] (indices into K), cand [g, K] the candidates' scores.
template <typename T, typename E>
void chain_greedy(const float* top_s, const int64_t* top_ids, const T* hidden, int64_t g, int64_t k, int64_t anchor,
                  const ChainWeights& cw, const E* embed, const E* head, float* table, uint8_t* have,
                  int64_t* chosen, float* cand) {
  const int64_t h = cw.hidden, r = cw.rank;
  std::vector<float> x(g * h), hp(g * r), a(r), z(h);
  for (int64_t row = 0; row < g; ++row) rms_chain(hidden + row * h, h, x.data() + row * h);
  mm_chain(cw.w_h, x.data(), g, cw.b, r, h, hp.data());  // the hidden half of every row at once
  int64_t prev = anchor;
  for (int64_t row = 0; row < g; ++row) {
    float* tp = table + prev * r;
    if (!have[prev]) {
      rms_chain(embed + prev * h, h, x.data());
      mm_chain(cw.w_e, x.data(), 1, nullptr, r, h, tp);
      have[prev] = 1;
    }
    for (int64_t i = 0; i < r; ++i) {
      const float v = hp[row * r + i] + tp[i];
      a[i] = v / (1.f + std::exp(-v));  // silu
    }
    mm_chain(cw.w_out, a.data(), 1, nullptr, h, r, z.data());
    float* s = cand + row * k;
    for (int64_t j = 0; j < k; ++j) s[j] = top_s[row * k + j] + dot_chain(head + top_ids[row * k + j] * h, z.data(), h);
    chosen[row] = argmax_chain(s, k);
    prev = top_ids[row * k + chosen[row]];
  }
}

}  // namespace blockdraft
