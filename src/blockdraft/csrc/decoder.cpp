// The lean decoder's layers in one native call, for LLaMA / Qwen2 targets whose linears are all quantized.
//
// Why: with 4-bit weights a decode step's matmuls take a few milliseconds, and the ~40 small tensor ops per layer
// around them (norms, RoPE, cache writes, attention, residuals) cost more than that through the framework's
// per-op dispatch. Here one call runs the whole stack on preallocated buffers.
//
// It computes what lean.py's Python layers compute on the same quantized weights: RMSNorm, fused q/k/v (bias
// allowed), rotate-half RoPE from the caller's cos/sin, keys/values written into the caller's KVCache, causal
// attention over the cache (or a candidate tree's mask among the new tokens), o-projection, SiLU-gated MLP.
// The residual stream stays in float32 whatever the model's dtype (the cache keeps the model's dtype). Each new
// token's row is computed by the same operations whatever the number of new tokens, so a multi-token verify
// equals one-token steps bit for bit.
#include "qlinear.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <limits>

namespace {

using namespace blockdraft;

struct QLin {
  int bits = 0;
  int64_t n = 0, k = 0;
  torch::Tensor codes, scale, offset, bias;

  // y [m, n] = x [m, k] W^T + b, float32 in and out
  void apply(const float* x, int64_t m, float* y) const {
    const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
    if (bits == 4)
      q4_mm(x, m, k, codes.data_ptr<uint8_t>(), scale.data_ptr<float>(), offset.data_ptr<float>(), n, b, y);
    else
      q8_mm(x, m, k, codes.data_ptr<int8_t>(), scale.data_ptr<float>(), n, b, y);
  }
};

QLin make_qlin(int bits, torch::Tensor codes, torch::Tensor scale, c10::optional<torch::Tensor> offset,
               c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  QLin q;
  q.bits = bits;
  q.codes = codes.contiguous();
  q.scale = scale.contiguous();
  q.n = codes.size(0);
  q.k = bits == 4 ? codes.size(1) * 2 : codes.size(1);
  if (bits == 4) {
    TORCH_CHECK(offset.has_value() && offset->defined(), "4-bit weights need offsets");
    q.offset = offset->contiguous();
  }
  if (bias.has_value() && bias->defined()) q.bias = bias->to(torch::kFloat).contiguous();
  return q;
}

struct Layer {
  QLin qkv, o, gate_up, down;
  torch::Tensor ln_in, ln_post;  // float32 [H]
  float eps_in = 0.f, eps_post = 0.f;
};

// out [H] = w * (x * rsqrt(mean(x^2) + eps)): HF's LlamaRMSNorm order of operations, in float32
inline void rms_norm(const float* x, const float* w, int64_t h, float eps, float* out) {
  float ss = 0.f;
  for (int64_t i = 0; i < h; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) out[i] = w[i] * (x[i] * r);
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

// 8 cache values as floats
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // bf16 is the top half of a float32
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// q [D] . k [D] with D % 8 == 0, in a fixed order (two vector accumulators, then a fixed horizontal sum)
template <typename C>
inline float dot_d(const float* q, const C* k, int64_t d) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load8(k + i + 8), a1);
  }
  if (i < d) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), a0);
  const __m256 a = _mm256_add_ps(a0, a1);
  return hsum128(_mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)));
}

// o [D] += w * v [D], D % 8 == 0
template <typename C>
inline void axpy_d(float w, const C* v, float* o, int64_t d) {
  const __m256 wv = _mm256_set1_ps(w);
  for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(o + i, _mm256_fmadd_ps(wv, load8(v + i), _mm256_loadu_ps(o + i)));
}

class Decoder {
 public:
  Decoder(int64_t hidden, int64_t n_q, int64_t n_kv, int64_t head_dim, int64_t inter, torch::Tensor final_norm,
          double final_eps)
      : h_(hidden), nq_(n_q), nkv_(n_kv), d_(head_dim), inter_(inter),
        final_norm_(final_norm.to(torch::kFloat).contiguous()), final_eps_(static_cast<float>(final_eps)) {
    TORCH_CHECK(n_q % n_kv == 0 && head_dim % 8 == 0, "heads must group evenly and head_dim be a multiple of 8");
  }

  void add_layer(QLin qkv, QLin o, QLin gate_up, QLin down, torch::Tensor ln_in, double eps_in,
                 torch::Tensor ln_post, double eps_post) {
    const int64_t qkv_n = (nq_ + 2 * nkv_) * d_;
    TORCH_CHECK(qkv.n == qkv_n && qkv.k == h_ && o.n == h_ && o.k == nq_ * d_ && gate_up.n == 2 * inter_ &&
                    gate_up.k == h_ && down.n == h_ && down.k == inter_,
                "layer shapes do not fit the decoder");
    Layer l{qkv, o, gate_up, down, ln_in.to(torch::kFloat).contiguous(), ln_post.to(torch::kFloat).contiguous(),
            static_cast<float>(eps_in), static_cast<float>(eps_post)};
    layers_.push_back(std::move(l));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [T, H] (the new tokens' embeddings) -> (final-normed hidden [T, H], features [T, len(tap) * H]) in x's
  // dtype. kc / vc: the KVCache buffers [L, 1, Hkv, capacity, D], capacity >= start + T; the new keys and values
  // are written at start .. start + T - 1. cos / sin [T, D] float32 for the new tokens' positions. tree [T, T] bool
  // (true = new token i sees new token j) or None for causal order; every new token sees the whole cache.
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, torch::Tensor kc, torch::Tensor vc,
                                                   int64_t start, torch::Tensor cos, torch::Tensor sin,
                                                   c10::optional<torch::Tensor> tree, std::vector<int64_t> tap) {
    const int64_t t = x.size(0);
    TORCH_CHECK(x.dim() == 2 && x.size(1) == h_, "x must be [T, ", h_, "]");
    TORCH_CHECK(kc.dim() == 5 && kc.size(0) == num_layers() && kc.size(1) == 1 && kc.size(2) == nkv_ &&
                    kc.size(4) == d_ && kc.is_contiguous() && vc.sizes() == kc.sizes() && vc.is_contiguous() &&
                    vc.scalar_type() == kc.scalar_type(),
                "caches must be contiguous [L, 1, Hkv, capacity, D]");
    TORCH_CHECK(start >= 0 && start + t <= kc.size(3), "the cache has no room for ", t, " tokens after ", start);
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.numel() == t * d_ && sin.numel() == t * d_,
                "cos / sin must be contiguous float32 [T, D]");
    const bool* tm = nullptr;
    torch::Tensor tree_c;
    if (tree.has_value() && tree->defined()) {
      tree_c = tree->to(torch::kBool).contiguous();
      TORCH_CHECK(tree_c.dim() == 2 && tree_c.size(0) == t && tree_c.size(1) == t, "tree must be [T, T]");
      tm = tree_c.data_ptr<bool>();
    }
    for (int64_t i : tap) TORCH_CHECK(i >= 0 && i < num_layers(), "tap layer ", i, " out of range");
    TORCH_CHECK(kc.scalar_type() == at::kFloat || kc.scalar_type() == at::kBFloat16, "cache must be fp32 or bf16");
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be fp32 or bf16");

    torch::Tensor res = x.to(torch::kFloat, false, true).contiguous();  // the residual stream [T, H], a copy
    torch::Tensor feats = torch::empty({t, static_cast<int64_t>(tap.size()) * h_}, torch::kFloat);
    std::vector<float> hbuf(t * h_), qkv(t * (nq_ + 2 * nkv_) * d_), att(t * nq_ * d_), tmp(t * h_),
        gu(t * 2 * inter_), act(t * inter_);
    float* xr = res.data_ptr<float>();
    for (int64_t li = 0; li < num_layers(); ++li) {
      const Layer& L = layers_[li];
      for (int64_t r = 0; r < t; ++r)
        rms_norm(xr + r * h_, L.ln_in.data_ptr<float>(), h_, L.eps_in, hbuf.data() + r * h_);
      L.qkv.apply(hbuf.data(), t, qkv.data());
      if (kc.scalar_type() == at::kFloat)
        attend<float>(li, t, start, qkv.data(), kc.data_ptr<float>(), vc.data_ptr<float>(), kc.size(3),
                      cos.data_ptr<float>(), sin.data_ptr<float>(), tm, att.data());
      else
        attend<at::BFloat16>(li, t, start, qkv.data(), kc.data_ptr<at::BFloat16>(), vc.data_ptr<at::BFloat16>(),
                             kc.size(3), cos.data_ptr<float>(), sin.data_ptr<float>(), tm, att.data());
      L.o.apply(att.data(), t, tmp.data());
      for (int64_t i = 0; i < t * h_; ++i) xr[i] += tmp[i];
      for (int64_t r = 0; r < t; ++r)
        rms_norm(xr + r * h_, L.ln_post.data_ptr<float>(), h_, L.eps_post, hbuf.data() + r * h_);
      L.gate_up.apply(hbuf.data(), t, gu.data());
      for (int64_t r = 0; r < t; ++r) {
        const float* g = gu.data() + r * 2 * inter_;
        for (int64_t i = 0; i < inter_; ++i) {
          const float a = g[i];
          act[r * inter_ + i] = (a / (1.f + std::exp(-a))) * g[inter_ + i];
        }
      }
      L.down.apply(act.data(), t, tmp.data());
      for (int64_t i = 0; i < t * h_; ++i) xr[i] += tmp[i];
      for (size_t j = 0; j < tap.size(); ++j)
        if (tap[j] == li)
          for (int64_t r = 0; r < t; ++r)
            std::copy(xr + r * h_, xr + (r + 1) * h_, feats.data_ptr<float>() + r * tap.size() * h_ + j * h_);
    }
    torch::Tensor out = torch::empty({t, h_}, torch::kFloat);
    for (int64_t r = 0; r < t; ++r)
      rms_norm(xr + r * h_, final_norm_.data_ptr<float>(), h_, final_eps_, out.data_ptr<float>() + r * h_);
    return {out.to(x.scalar_type()), feats.to(x.scalar_type())};
  }

 private:
  // RoPE on the new q / k rows, the new k / v into the cache, then attention of every new query over the cache
  template <typename C>
  void attend(int64_t li, int64_t t, int64_t start, float* qkv, C* kc, C* vc, int64_t cap, const float* cs,
              const float* sn, const bool* tm, float* att) const {
    const int64_t row = (nq_ + 2 * nkv_) * d_;
    for (int64_t r = 0; r < t; ++r) {
      float* q = qkv + r * row;
      for (int64_t hh = 0; hh < nq_ + nkv_; ++hh) rope(q + hh * d_, cs + r * d_, sn + r * d_, d_);
      for (int64_t g = 0; g < nkv_; ++g) {
        const float* k = q + (nq_ + g) * d_;
        const float* v = q + (nq_ + nkv_ + g) * d_;
        C* kd = kc + ((li * nkv_ + g) * cap + start + r) * d_;
        C* vd = vc + ((li * nkv_ + g) * cap + start + r) * d_;
        for (int64_t i = 0; i < d_; ++i) {
          kd[i] = static_cast<C>(k[i]);
          vd[i] = static_cast<C>(v[i]);
        }
      }
    }
    const int64_t total = start + t, group = nq_ / nkv_;
    const float scale = 1.f / std::sqrt(static_cast<float>(d_));
    at::parallel_for(0, nq_ * t, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> p(total), kf(d_);
      for (int64_t job = begin; job < end; ++job) {
        const int64_t hh = job % nq_, r = job / nq_, g = hh / group;
        const float* q = qkv + r * row + hh * d_;
        const C* kb = kc + (li * nkv_ + g) * cap * d_;
        const C* vb = vc + (li * nkv_ + g) * cap * d_;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < total; ++s) {
          const bool seen = s < start || (tm ? tm[r * t + (s - start)] : s <= start + r);
          if (!seen) {
            p[s] = -std::numeric_limits<float>::infinity();
            continue;
          }
          p[s] = dot_d(q, kb + s * d_, d_) * scale;
          mx = std::max(mx, p[s]);
        }
        float sum = 0.f;
        for (int64_t s = 0; s < total; ++s) {
          p[s] = p[s] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(p[s] - mx);
          sum += p[s];
        }
        float* o = att + r * nq_ * d_ + hh * d_;
        std::fill(o, o + d_, 0.f);
        for (int64_t s = 0; s < total; ++s) {
          if (p[s] == 0.f) continue;
          axpy_d(p[s] / sum, vb + s * d_, o, d_);
        }
      }
    });
  }

  int64_t h_, nq_, nkv_, d_, inter_;
  torch::Tensor final_norm_;
  float final_eps_;
  std::vector<Layer> layers_;
};

}  // namespace

void register_decoder(pybind11::module& m) {
  pybind11::class_<QLin>(m, "QLin");
  m.def("make_qlin", &make_qlin, "a quantized linear for the native decoder (bits, codes, scale, offset, bias)");
  pybind11::class_<Decoder>(m, "Decoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, torch::Tensor, double>())
      .def("add_layer", &Decoder::add_layer)
      .def("num_layers", &Decoder::num_layers)
      .def("forward", &Decoder::forward);
}
