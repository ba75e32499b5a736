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
#include "decoder.h"
#include "qlinear.h"
#include "stack_ops.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <limits>

namespace {

using namespace blockdraft;

struct Layer {
  QLin qkv, o, gate_up, down;
  torch::Tensor ln_in, ln_post;  // float32 [H]
  float eps_in = 0.f, eps_post = 0.f;
};

class Decoder {
 public:
  Decoder(int64_t hidden, int64_t n_q, int64_t n_kv, int64_t head_dim, int64_t inter, torch::Tensor final_norm,
          double final_eps)
      : h_(hidden), nq_(n_q), nkv_(n_kv), d_(head_dim), inter_(inter), final_eps_(static_cast<float>(final_eps)) {
    check_heads(hidden, n_q, n_kv, head_dim, inter);
    final_norm_ = checked_vector(final_norm, hidden, "final_norm");
  }

  void add_layer(QLin qkv, QLin o, QLin gate_up, QLin down, torch::Tensor ln_in, double eps_in,
                 torch::Tensor ln_post, double eps_post) {
    const int64_t qkv_n = (nq_ + 2 * nkv_) * d_;
    TORCH_CHECK(qkv.n == qkv_n && qkv.k == h_ && o.n == h_ && o.k == nq_ * d_ && gate_up.n == 2 * inter_ &&
                    gate_up.k == h_ && down.n == h_ && down.k == inter_,
                "layer shapes do not fit the decoder");
    Layer l{qkv, o, gate_up, down, checked_vector(ln_in, h_, "ln_in"), checked_vector(ln_post, h_, "ln_post"),
            static_cast<float>(eps_in), static_cast<float>(eps_post)};
    layers_.push_back(std::move(l));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [S, H]: the new tokens' embeddings of every row, stacked row by row -> (final-normed hidden [S, H],
  // features [S, len(tap) * H]) in x's dtype. Row i: counts[i] new tokens, written into its KVCache buffers
  // kcs[i] / vcs[i] [L, 1, Hkv, capacity, D] at slots starts[i] .. starts[i] + counts[i] - 1. cos / sin [S, D]
  // float32 for the new tokens' positions. trees[i]: [counts[i], counts[i]] bool (true = new token r sees new
  // token j), or an empty tensor for causal order; every new token sees its row's whole cache. The matmuls run over
  // all rows at once (each weight read once per step); each row attends over its own cache.
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, std::vector<torch::Tensor> kcs,
                                                   std::vector<torch::Tensor> vcs, std::vector<int64_t> starts,
                                                   std::vector<int64_t> counts, torch::Tensor cos, torch::Tensor sin,
                                                   std::vector<torch::Tensor> trees, std::vector<int64_t> tap) {
    const int64_t t = x.size(0);
    TORCH_CHECK(x.dim() == 2 && x.size(1) == h_, "x must be [S, ", h_, "]");
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be fp32 or bf16");
    const Rows rows(kcs, vcs, starts, counts, num_layers(), nkv_, d_, t);
    check_rope(cos, sin, t, d_);
    TORCH_CHECK(trees.size() == rows.size(), "one tree mask (or an empty tensor) per row");
    std::vector<torch::Tensor> tree_c(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      if (trees[i].numel() == 0) continue;
      tree_c[i] = trees[i].to(torch::kBool).contiguous();
      TORCH_CHECK(tree_c[i].dim() == 2 && tree_c[i].size(0) == counts[i] && tree_c[i].size(1) == counts[i],
                  "row ", i, ": its tree must be [T, T]");
    }
    for (int64_t i : tap) TORCH_CHECK(i >= 0 && i < num_layers(), "tap layer ", i, " out of range");

    torch::Tensor res = x.to(torch::kFloat, false, true).contiguous();  // the residual stream [S, H], a copy
    torch::Tensor feats = torch::empty({t, static_cast<int64_t>(tap.size()) * h_}, torch::kFloat);
    std::vector<float> hbuf(t * h_), qkv(t * (nq_ + 2 * nkv_) * d_), att(t * nq_ * d_), tmp(t * h_),
        gu(t * 2 * inter_), act(t * inter_);
    float* xr = res.data_ptr<float>();
    for (int64_t li = 0; li < num_layers(); ++li) {
      const Layer& L = layers_[li];
      rms_norm_rows(xr, L.ln_in.data_ptr<float>(), t, h_, L.eps_in, hbuf.data());
      L.qkv.apply(hbuf.data(), t, qkv.data());
      const float *cs = cos.data_ptr<float>(), *sn = sin.data_ptr<float>();
      if (rows.fp32)
        attend_rows<float>(li, rows, kcs, vcs, starts, qkv.data(), nq_, nkv_, d_, cs, sn, &tree_c, Seen::kCausal,
                           att.data());
      else
        attend_rows<at::BFloat16>(li, rows, kcs, vcs, starts, qkv.data(), nq_, nkv_, d_, cs, sn, &tree_c,
                                  Seen::kCausal, att.data());
      L.o.apply(att.data(), t, tmp.data());
      add_rows(xr, tmp.data(), t, h_);
      mlp_residual(xr, t, h_, inter_, L.ln_post.data_ptr<float>(), L.eps_post, L.gate_up, L.down, hbuf.data(),
                   gu.data(), act.data(), tmp.data());
      for (size_t j = 0; j < tap.size(); ++j)
        if (tap[j] == li)
          for (int64_t r = 0; r < t; ++r)
            std::copy(xr + r * h_, xr + (r + 1) * h_, feats.data_ptr<float>() + r * tap.size() * h_ + j * h_);
    }
    torch::Tensor out = torch::empty({t, h_}, torch::kFloat);
    rms_norm_rows(xr, final_norm_.data_ptr<float>(), t, h_, final_eps_, out.data_ptr<float>());
    return {out.to(x.scalar_type()), feats.to(x.scalar_type())};
  }

 private:
  int64_t h_, nq_, nkv_, d_, inter_;
  torch::Tensor final_norm_;
  float final_eps_;
  std::vector<Layer> layers_;
};

// The DFlash draft's decode-time forward (draft_lean.py's LeanDraft) in native calls, for a draft whose linears
// are all quantized. The draft runs a handful of rows per step (the block and the newly committed context), so
// through the framework its cost was per-op dispatch, several times its matmuls. It computes what LeanDraft
// computes on the same weights: context features fused (fc, RMSNorm) and projected into every layer's keys /
// values (k-normed, rotated) in the draft's KVCache; the block through the layers (RMSNorm, q/k/v with per-head
// q/k RMSNorm and RoPE, attention of every block query over the whole context and the whole block, o, SiLU MLP).
struct DraftLayer {
  QLin qkv, o, gate_up, down;
  torch::Tensor ln1, ln2, q_norm, k_norm;  // float32 [H], [H], [D], [D]
  float eps = 0.f;
};

class DraftStack {
 public:
  DraftStack(int64_t hidden, int64_t n_q, int64_t n_kv, int64_t head_dim, int64_t inter, QLin fc,
             torch::Tensor hidden_norm, double hidden_eps, QLin ctx_kv, torch::Tensor final_norm, double final_eps)
      : h_(hidden), nq_(n_q), nkv_(n_kv), d_(head_dim), inter_(inter), fc_(std::move(fc)),
        hidden_eps_(static_cast<float>(hidden_eps)), ctx_kv_(std::move(ctx_kv)),
        final_eps_(static_cast<float>(final_eps)) {
    check_heads(hidden, n_q, n_kv, head_dim, inter);
    hidden_norm_ = checked_vector(hidden_norm, hidden, "hidden_norm");
    final_norm_ = checked_vector(final_norm, hidden, "final_norm");
    TORCH_CHECK(fc_.n == h_, "fc must project the features to the hidden size");
  }

  void add_layer(QLin qkv, QLin o, QLin gate_up, QLin down, torch::Tensor ln1, torch::Tensor ln2,
                 torch::Tensor q_norm, torch::Tensor k_norm, double eps) {
    TORCH_CHECK(qkv.n == (nq_ + 2 * nkv_) * d_ && qkv.k == h_ && o.n == h_ && o.k == nq_ * d_ &&
                    gate_up.n == 2 * inter_ && gate_up.k == h_ && down.n == h_ && down.k == inter_,
                "layer shapes do not fit the draft");
    layers_.push_back(DraftLayer{qkv, o, gate_up, down, checked_vector(ln1, h_, "ln1"),
                                 checked_vector(ln2, h_, "ln2"), checked_vector(q_norm, d_, "q_norm"),
                                 checked_vector(k_norm, d_, "k_norm"), static_cast<float>(eps)});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // features [C, F] of C context positions -> their keys / values in every layer's cache slots start .. start+C-1
  // (kc / vc: the draft's KVCache buffers [L, 1, Hkv, capacity, D]); cos / sin [C, D] float32 of their positions
  void context(torch::Tensor feats, torch::Tensor kc, torch::Tensor vc, int64_t start, torch::Tensor cos,
               torch::Tensor sin) {
    const int64_t c = feats.size(0);
    check_cache(kc, vc, num_layers(), nkv_, d_, start, c);
    check_rope(cos, sin, c, d_);
    TORCH_CHECK(feats.dim() == 2 && feats.size(1) == fc_.k, "features must be [C, ", fc_.k, "]");
    TORCH_CHECK(ctx_kv_.n == 2 * num_layers() * nkv_ * d_ && ctx_kv_.k == h_, "context k/v shapes do not fit");
    const torch::Tensor f = feats.to(torch::kFloat).contiguous();
    std::vector<float> x(c * h_), kv(c * ctx_kv_.n);
    fc_.apply(f.data_ptr<float>(), c, x.data());
    for (int64_t r = 0; r < c; ++r) rms_norm(x.data() + r * h_, hidden_norm_.data_ptr<float>(), h_, hidden_eps_,
                                             x.data() + r * h_);
    ctx_kv_.apply(x.data(), c, kv.data());
    const int64_t per = nkv_ * d_, cap = kc.size(3);
    for (int64_t li = 0; li < num_layers(); ++li) {
      const DraftLayer& L = layers_[li];
      for (int64_t r = 0; r < c; ++r) {
        float* k = kv.data() + r * ctx_kv_.n + li * per;
        const float* v = kv.data() + r * ctx_kv_.n + (num_layers() + li) * per;
        for (int64_t g = 0; g < nkv_; ++g) {
          rms_norm(k + g * d_, L.k_norm.data_ptr<float>(), d_, L.eps, k + g * d_);
          rope(k + g * d_, cos.data_ptr<float>() + r * d_, sin.data_ptr<float>() + r * d_, d_);
        }
        if (kc.scalar_type() == at::kFloat)
          store_kv(k, v, nkv_, d_, kc.data_ptr<float>() + li * nkv_ * cap * d_,
                   vc.data_ptr<float>() + li * nkv_ * cap * d_, cap, start + r);
        else
          store_kv(k, v, nkv_, d_, kc.data_ptr<at::BFloat16>() + li * nkv_ * cap * d_,
                   vc.data_ptr<at::BFloat16>() + li * nkv_ * cap * d_, cap, start + r);
      }
    }
  }

  // x [S, H]: the blocks' embeddings of every row, stacked -> final-normed hidden [S, H] in x's dtype. Row i's block
  // (counts[i] tokens) puts its keys / values into slots starts[i] .. after its context (starts[i] = the context's
  // length) in its own cache (kcs[i], vcs[i]); each of its queries sees its whole context and its whole block.
  torch::Tensor forward(torch::Tensor x, std::vector<torch::Tensor> kcs, std::vector<torch::Tensor> vcs,
                        std::vector<int64_t> starts, std::vector<int64_t> counts, torch::Tensor cos,
                        torch::Tensor sin) {
    const int64_t t = x.size(0);
    TORCH_CHECK(x.dim() == 2 && x.size(1) == h_, "x must be [S, ", h_, "]");
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be fp32 or bf16");
    const Rows rows(kcs, vcs, starts, counts, num_layers(), nkv_, d_, t);
    check_rope(cos, sin, t, d_);
    torch::Tensor res = x.to(torch::kFloat, false, true).contiguous();
    const int64_t row = (nq_ + 2 * nkv_) * d_;
    std::vector<float> hbuf(t * h_), qkv(t * row), att(t * nq_ * d_), tmp(t * h_), gu(t * 2 * inter_),
        act(t * inter_);
    float* xr = res.data_ptr<float>();
    for (int64_t li = 0; li < num_layers(); ++li) {
      const DraftLayer& L = layers_[li];
      for (int64_t r = 0; r < t; ++r) rms_norm(xr + r * h_, L.ln1.data_ptr<float>(), h_, L.eps, hbuf.data() + r * h_);
      L.qkv.apply(hbuf.data(), t, qkv.data());
      for (int64_t r = 0; r < t; ++r) {
        float* q = qkv.data() + r * row;
        for (int64_t hh = 0; hh < nq_ + nkv_; ++hh) {
          const float* w = (hh < nq_ ? L.q_norm : L.k_norm).data_ptr<float>();
          rms_norm(q + hh * d_, w, d_, L.eps, q + hh * d_);
          rope(q + hh * d_, cos.data_ptr<float>() + r * d_, sin.data_ptr<float>() + r * d_, d_);
        }
      }
      // q and k were normed and rotated above; every block query sees its whole context and block
      if (rows.fp32)
        attend_rows<float>(li, rows, kcs, vcs, starts, qkv.data(), nq_, nkv_, d_, nullptr, nullptr, nullptr,
                           Seen::kAll, att.data());
      else
        attend_rows<at::BFloat16>(li, rows, kcs, vcs, starts, qkv.data(), nq_, nkv_, d_, nullptr, nullptr, nullptr,
                                  Seen::kAll, att.data());
      L.o.apply(att.data(), t, tmp.data());
      add_into(xr, tmp.data(), t * h_);
      mlp_residual(xr, t, h_, inter_, L.ln2.data_ptr<float>(), L.eps, L.gate_up, L.down, hbuf.data(), gu.data(),
                   act.data(), tmp.data());
    }
    torch::Tensor out = torch::empty({t, h_}, torch::kFloat);
    for (int64_t r = 0; r < t; ++r)
      rms_norm(xr + r * h_, final_norm_.data_ptr<float>(), h_, final_eps_, out.data_ptr<float>() + r * h_);
    return out.to(x.scalar_type());
  }

 private:
  int64_t h_, nq_, nkv_, d_, inter_;
  QLin fc_;
  torch::Tensor hidden_norm_;
  float hidden_eps_;
  QLin ctx_kv_;
  torch::Tensor final_norm_;
  float final_eps_;
  std::vector<DraftLayer> layers_;
};

}  // namespace

void register_decoder(pybind11::module& m) {
  pybind11::class_<Decoder>(m, "Decoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, torch::Tensor, double>())
      .def("add_layer", &Decoder::add_layer)
      .def("num_layers", &Decoder::num_layers)
      .def("forward", &Decoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<DraftStack>(m, "DraftStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, QLin, torch::Tensor, double, QLin,
                          torch::Tensor, double>())
      .def("add_layer", &DraftStack::add_layer)
      .def("num_layers", &DraftStack::num_layers)
      .def("context", &DraftStack::context, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward", &DraftStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
