// The per-token work around the linears of the native layer stacks (decoder.cpp): RMSNorm, the exponential of the
// softmax, RoPE, the caches' checks and writes, and attention over the caches of a batch of rows (chains, causal
// prompts and candidate trees alike). Included by decoder.cpp only.
#pragma once
#include "qlinear.h"

#include <algorithm>
#include <limits>

namespace {

using namespace blockdraft;

// out [H] = w * (x * rsqrt(mean(x^2) + eps)): HF's LlamaRMSNorm order of operations, in float32 (H % 8 == 0;
// the sum of squares in 8 lanes, then a fixed horizontal sum)
inline void rms_norm(const float* x, const float* w, int64_t h, float eps, float* out) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < h; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i), acc);
  const __m256 r = _mm256_set1_ps(1.f / std::sqrt(hsum256(acc) / static_cast<float>(h) + eps));
  for (int64_t i = 0; i < h; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), r)));
}

// e^x for 8 floats: x = n ln2 + f, |f| <= ln2 / 2, e^f by its degree-6 Taylor polynomial (relative error ~2e-7,
// about 2 float ulps), times 2^n through the exponent bits. Inputs below -87 give 0 (the softmax's masked
// entries and far tails), above 88 are clamped. The scalar exp of the C library took most of a multi-token step.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts: n * hi is exact
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// act [I] = silu(g) * u, silu(g) = g / (1 + e^-g)
inline void silu_mul(const float* g, const float* u, int64_t n, float* act) {
  const __m256 one = _mm256_set1_ps(1.f), neg = _mm256_set1_ps(-0.f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 a = _mm256_loadu_ps(g + i);
    const __m256 s = _mm256_div_ps(a, _mm256_add_ps(one, exp8(_mm256_xor_ps(a, neg))));
    _mm256_storeu_ps(act + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
  }
}

// x [N] += y [N]
inline void add_into(float* x, const float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) x[i] += y[i];
}

// out [t, H] = RMSNorm of each row of x [t, H]; x [t, H] += y [t, H]. Rows run across the threads from
// kParallelRows on (for_rows): each row's operations are the same either way.
inline void rms_norm_rows(const float* x, const float* w, int64_t t, int64_t h, float eps, float* out) {
  for_rows(t, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_norm(x + r * h, w, h, eps, out + r * h);
  });
}

inline void add_rows(float* x, const float* y, int64_t t, int64_t h) {
  for_rows(t, [&](int64_t r0, int64_t r1) { add_into(x + r0 * h, y + r0 * h, (r1 - r0) * h); });
}

// v [D] rotated in place: v * cos + rotate_half(v) * sin, rotate_half(v) = (-v[D/2:], v[:D/2])
inline void rope(float* v, const float* cs, const float* sn, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cs[i] + (-b) * sn[i];
    v[i + half] = b * cs[i + half] + a * sn[i + half];
  }
}

// o [D] += w * v [D], D % 8 == 0
template <typename C>
inline void axpy_d(float w, const C* v, float* o, int64_t d) {
  const __m256 wv = _mm256_set1_ps(w);
  for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(o + i, _mm256_fmadd_ps(wv, load8(v + i), _mm256_loadu_ps(o + i)));
}

// q [D] . k [D] for four keys, D % 8 == 0: per key a fixed order (two vector accumulators, then a fixed horizontal
// sum), so a key's score does not depend on which keys share the call; q's chunks are loaded once for all four and
// the eight chains of multiply-adds run side by side
template <typename C>
inline void dot4_d(const float* q, const C* const* k, int64_t d, float* out) {
  __m256 a[4][2];
  for (int j = 0; j < 4; ++j) a[j][0] = a[j][1] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const __m256 q0 = _mm256_loadu_ps(q + i), q1 = _mm256_loadu_ps(q + i + 8);
    for (int j = 0; j < 4; ++j) {
      a[j][0] = _mm256_fmadd_ps(q0, load8(k[j] + i), a[j][0]);
      a[j][1] = _mm256_fmadd_ps(q1, load8(k[j] + i + 8), a[j][1]);
    }
  }
  if (i < d) {
    const __m256 q0 = _mm256_loadu_ps(q + i);
    for (int j = 0; j < 4; ++j) a[j][0] = _mm256_fmadd_ps(q0, load8(k[j] + i), a[j][0]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m256 v = _mm256_add_ps(a[j][0], a[j][1]);
    out[j] = hsum128(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
  }
}

// o [D] = sum over keys s (in slot order, zero weights skipped) of w[s] v_s [D], D % 8 == 0: per element the same
// sequence of multiply-adds as repeated axpy_d from zero, with the accumulators held in registers (64 elements at
// a time) instead of a load and a store of o per key
template <typename C>
inline void weighted_values(const float* w, float inv, const C* vh, int64_t n, int64_t d, float* o) {
  int64_t c = 0;
  for (; c + 64 <= d; c += 64) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t s = 0; s < n; ++s) {
      if (w[s] == 0.f) continue;
      const __m256 wv = _mm256_set1_ps(w[s] * inv);
      const C* v = vh + s * d + c;
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(wv, load8(v + 8 * j), acc[j]);
    }
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(o + c + 8 * j, acc[j]);
  }
  if (c < d) {
    std::fill(o + c, o + d, 0.f);
    for (int64_t s = 0; s < n; ++s)
      if (w[s] != 0.f) axpy_d(w[s] * inv, vh + s * d + c, o + c, d - c);
  }
}

// Which cached keys a new query sees: all of them (a DFlash draft's block), the causal prefix through its own
// slot, or the cache plus the new tokens its row of a tree mask allows.
enum class Seen { kAll, kCausal, kTree };

// Attention of new queries over one layer's cache, for one or more sequences ("rows") at once. A row's queries sit
// at q + r * q_stride (n_q heads of D); its keys / values [Hkv, cap, D] at kb / vb hold start + t positions (the new
// ones included).
// The exponentials run 8 keys at a time over the keys rounded up to 8 (padding and unseen keys score -inf and weigh
// exactly 0); every sum over keys runs in slot order. So a query's numbers do not depend on the new tokens beside
// it, on the other rows, nor, for a tree, on where its ancestors sit in the cache: a k-token verify, chain or tree,
// alone or in a batch, gives the bits of one-token steps along each path.
template <typename C>
struct AttnRow {
  const float* q;     // [t, q_stride]: the row's first query head
  const C* kb;        // [Hkv, cap, D]
  const C* vb;
  int64_t cap, start, t;
  Seen seen;
  const bool* tm;     // [t, t] when seen == kTree
  float* att;         // [t, n_q * D]
};

template <typename C>
void attention_rows(const std::vector<AttnRow<C>>& rows, int64_t q_stride, int64_t n_q, int64_t n_kv, int64_t d) {
  const int64_t group = n_q / n_kv;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const float ninf = -std::numeric_limits<float>::infinity();
  // one job per (row, new query, head), numbered row by row
  std::vector<int64_t> first(rows.size() + 1, 0);
  int64_t longest = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    first[i + 1] = first[i] + rows[i].t * n_q;
    longest = std::max(longest, rows[i].start + rows[i].t);
  }
  // Jobs are dealt round-robin to the threads: a causal query's cost grows with its position, so contiguous
  // ranges of a prefill's jobs would leave one thread with three quarters of the work.
  const int64_t jobs = first.back();
  const int64_t stride = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), jobs));
  at::parallel_for(0, stride, 1, [&](int64_t lane_begin, int64_t lane_end) {
    std::vector<float> p((longest + 7) / 8 * 8);
    for (int64_t lane = lane_begin; lane < lane_end; ++lane) {
      size_t ri = 0;
      for (int64_t job = lane; job < jobs; job += stride) {
        while (job >= first[ri + 1]) ++ri;
        const AttnRow<C>& R = rows[ri];
        const int64_t local = job - first[ri], hh = local % n_q, r = local / n_q, g = hh / group;
        const int64_t start = R.start, seen_end = R.seen == Seen::kCausal ? start + r + 1 : start + R.t;
        // A causal query stops at its own slot: the keys after it would score -inf, weigh exactly 0 and add
        // exact zeros to the sums, so skipping them computes what a one-token step at this position computes,
        // bit for bit (and halves a prefill's scoring). A tree's or a block's query runs over the whole row.
        const int64_t total = R.seen == Seen::kCausal ? seen_end : start + R.t, padded = (total + 7) / 8 * 8;
        const float* qv = R.q + r * q_stride + hh * d;
        const C* kh = R.kb + g * R.cap * d;
        const C* vh = R.vb + g * R.cap * d;
        // scores four keys at a time (the last group repeats the last key); unseen keys score -inf
        float four[4];
        const C* ks[4];
        for (int64_t s = 0; s < total; s += 4) {
          for (int j = 0; j < 4; ++j) ks[j] = kh + std::min<int64_t>(s + j, total - 1) * d;
          dot4_d(qv, ks, d, four);
          for (int64_t j = 0; j < 4 && s + j < total; ++j) {
            const int64_t k = s + j;
            const bool ok = k < start || (k < seen_end && (R.seen != Seen::kTree || R.tm[r * R.t + (k - start)]));
            p[k] = ok ? four[j] * scale : ninf;
          }
        }
        for (int64_t s = total; s < padded; ++s) p[s] = ninf;
        __m256 mx8 = _mm256_set1_ps(ninf);
        for (int64_t s = 0; s < padded; s += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(p.data() + s));
        const float mx = hmax256(mx8);
        const __m256 mv = _mm256_set1_ps(mx);
        for (int64_t s = 0; s < padded; s += 8)
          _mm256_storeu_ps(p.data() + s, exp8(_mm256_sub_ps(_mm256_loadu_ps(p.data() + s), mv)));
        // summed in slot order: unseen keys add exact zeros, so a tree node (whose ancestors sit at other slots than
        // in a chain, in the same order) gets the sum of its chain, bit for bit
        float sum = 0.f;
        for (int64_t s = 0; s < total; ++s) sum += p[s];
        const float inv = 1.f / sum;
        weighted_values(p.data(), inv, vh, total, d, R.att + r * n_q * d + hh * d);
      }
    }
  });
}

// one new position's key and value of every kv head into a layer's cache buffers [Hkv, cap, D] at slot
template <typename C>
inline void store_kv(const float* k, const float* v, int64_t n_kv, int64_t d, C* kb, C* vb, int64_t cap,
                     int64_t slot) {
  for (int64_t g = 0; g < n_kv; ++g)
    for (int64_t i = 0; i < d; ++i) {
      kb[(g * cap + slot) * d + i] = static_cast<C>(k[g * d + i]);
      vb[(g * cap + slot) * d + i] = static_cast<C>(v[g * d + i]);
    }
}

// The checks both stacks make on a caller's KVCache buffers [L, 1, Hkv, capacity, D] before writing t new
// positions at start.
inline void check_cache(const torch::Tensor& kc, const torch::Tensor& vc, int64_t layers, int64_t n_kv, int64_t d,
                        int64_t start, int64_t t) {
  TORCH_CHECK(kc.dim() == 5 && kc.size(0) == layers && kc.size(1) == 1 && kc.size(2) == n_kv && kc.size(4) == d &&
                  kc.is_contiguous() && vc.sizes() == kc.sizes() && vc.is_contiguous() &&
                  vc.scalar_type() == kc.scalar_type(),
              "caches must be contiguous [L, 1, Hkv, capacity, D]");
  TORCH_CHECK(kc.scalar_type() == at::kFloat || kc.scalar_type() == at::kBFloat16, "cache must be fp32 or bf16");
  TORCH_CHECK(start >= 0 && t >= 1 && start + t <= kc.size(3), "the cache has no room for ", t, " tokens after ",
              start);
}

// RoPE rows [S, D] float32 for S new tokens
inline void check_rope(const torch::Tensor& cos, const torch::Tensor& sin, int64_t s, int64_t d) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == s * d && sin.numel() == s * d,
              "cos / sin must be contiguous float32 [S, D]");
}

// A batch of rows: row i has counts[i] new tokens (consecutive in the stacked inputs) written into its own cache
// (kcs[i], vcs[i]) from slot starts[i] on. Every cache has one dtype.
struct Rows {
  std::vector<int64_t> offset;  // [rows + 1]: row i's tokens are offset[i] .. offset[i + 1] - 1
  bool fp32 = false;

  Rows(const std::vector<torch::Tensor>& kcs, const std::vector<torch::Tensor>& vcs,
       const std::vector<int64_t>& starts, const std::vector<int64_t>& counts, int64_t layers, int64_t n_kv,
       int64_t d, int64_t total) {
    const size_t n = kcs.size();
    TORCH_CHECK(n >= 1 && vcs.size() == n && starts.size() == n && counts.size() == n,
                "one key cache, value cache, start and count per row");
    offset.assign(n + 1, 0);
    for (size_t i = 0; i < n; ++i) {
      check_cache(kcs[i], vcs[i], layers, n_kv, d, starts[i], counts[i]);
      TORCH_CHECK(kcs[i].scalar_type() == kcs[0].scalar_type(), "every row's cache must have one dtype");
      offset[i + 1] = offset[i] + counts[i];
    }
    TORCH_CHECK(offset[n] == total, "the rows' counts must add up to the stacked tokens (", total, ")");
    fp32 = kcs[0].scalar_type() == at::kFloat;
  }
  size_t size() const { return offset.size() - 1; }
};

// One layer's attention for a batch of rows: each row's new keys / values (rotated first when cs / sn are given)
// go into its own cache at layer li, then every row's queries attend over their row's cache. qkv [S, (n_q + 2 n_kv)
// D] holds the stacked rows' projections; trees (when given) [i] defined: row i is a candidate tree, else `plain`
// (kCausal for the target's new tokens, kAll for a draft's block). att [S, n_q D].
template <typename C>
void attend_rows(int64_t li, const Rows& rows, const std::vector<torch::Tensor>& kcs,
                 const std::vector<torch::Tensor>& vcs, const std::vector<int64_t>& starts, float* qkv, int64_t n_q,
                 int64_t n_kv, int64_t d, const float* cs, const float* sn, const std::vector<torch::Tensor>* trees,
                 Seen plain, float* att) {
  const int64_t row = (n_q + 2 * n_kv) * d;
  std::vector<AttnRow<C>> jobs;
  jobs.reserve(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t cap = kcs[i].size(3), o = rows.offset[i], t = rows.offset[i + 1] - o;
    C* kb = kcs[i].data_ptr<C>() + li * n_kv * cap * d;
    C* vb = vcs[i].data_ptr<C>() + li * n_kv * cap * d;
    for_rows(t, [&](int64_t r0, int64_t r1) {
      for (int64_t r = o + r0; r < o + r1; ++r) {
        float* q = qkv + r * row;
        if (cs != nullptr)
          for (int64_t hh = 0; hh < n_q + n_kv; ++hh) rope(q + hh * d, cs + r * d, sn + r * d, d);
        store_kv(q + n_q * d, q + (n_q + n_kv) * d, n_kv, d, kb, vb, cap, starts[i] + (r - o));
      }
    });
    const bool tree = trees != nullptr && (*trees)[i].defined();
    jobs.push_back(AttnRow<C>{qkv + o * row, kb, vb, cap, starts[i], t, tree ? Seen::kTree : plain,
                              tree ? (*trees)[i].data_ptr<bool>() : nullptr, att + o * n_q * d});
  }
  attention_rows(jobs, row, n_q, n_kv, d);
}

// The SiLU-gated MLP of t rows added into the residual stream x [t, H]: x += down(silu(gate(h)) * up(h)),
// h = RMSNorm(x) with ln. hbuf [t, H], gu [t, 2I], act [t, I], tmp [t, H]: scratch.
inline void mlp_residual(float* x, int64_t t, int64_t h, int64_t inter, const float* ln, float eps,
                         const QLin& gate_up, const QLin& down, float* hbuf, float* gu, float* act, float* tmp) {
  rms_norm_rows(x, ln, t, h, eps, hbuf);
  gate_up.apply(hbuf, t, gu);
  for_rows(t, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_mul(gu + r * 2 * inter, gu + r * 2 * inter + inter, inter, act + r * inter);
  });
  down.apply(act, t, tmp);
  add_rows(x, tmp, t, h);
}

// A 1-d float vector of exactly n entries on the CPU (a norm's weights): anything else is refused here, where a
// short one would otherwise be read past its end.
inline torch::Tensor checked_vector(const torch::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.defined() && t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_floating_point(), name, " must be a float tensor, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, name, " must have shape [", n, "], got ", t.sizes());
  return t.to(torch::kFloat).contiguous();
}

inline void check_heads(int64_t hidden, int64_t n_q, int64_t n_kv, int64_t head_dim, int64_t inter) {
  TORCH_CHECK(hidden > 0 && n_q > 0 && n_kv > 0 && head_dim > 0 && inter > 0,
              "hidden, head counts, head_dim and intermediate size must be > 0, got ", hidden, ", ", n_q, ", ", n_kv,
              ", ", head_dim, ", ", inter);
  TORCH_CHECK(n_q % n_kv == 0 && head_dim % 8 == 0, "heads must group evenly and head_dim be a multiple of 8");
  TORCH_CHECK(hidden % kBlock == 0 && inter % kBlock == 0, "hidden and intermediate sizes must be multiples of 32");
}

}  // namespace
