// The extension module: Python bindings of the quantized linears (qlinear.h), the machine's int8 ceiling, the
// rows' argmax, the chain selector's greedy chain (chain.h) and the native layer stacks (decoder.h).
#include "chain.h"
#include "decoder.h"
#include "qlinear.h"

#include <chrono>

using namespace blockdraft;

namespace {

// x [..., K] (float32 or bf16) -> y [..., N] in x's dtype
torch::Tensor qlin_call(const QLin& q, const torch::Tensor& xin) {
  TORCH_CHECK(xin.dim() >= 1 && xin.size(-1) == q.k, "x must be [..., ", q.k, "], got ", xin.sizes());
  TORCH_CHECK(xin.device().is_cpu(), "the quantized kernels run on CPU tensors");
  TORCH_CHECK(xin.scalar_type() == at::kFloat || xin.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  const torch::Tensor x = xin.reshape({-1, q.k}).contiguous();
  auto y = torch::empty({x.size(0), q.n}, x.options());
  if (x.scalar_type() == at::kFloat) q.apply(x.data_ptr<float>(), x.size(0), y.data_ptr<float>());
  else q.apply(x.data_ptr<at::BFloat16>(), x.size(0), y.data_ptr<at::BFloat16>());
  std::vector<int64_t> shape(xin.sizes().begin(), xin.sizes().end());
  shape.back() = q.n;
  return y.view(shape);
}

// One row's argmax with torch's semantics: the first index of the maximum, or of the first NaN when there is one.
// Two passes over a row that stays in cache: a vector max (NaNs noticed on the way), then the first lane equal to it.
// torch's own argmax over a 150k-entry float32 row ran at ~2 GB/s here (0.3 ms a row), ten times slower than this.
int64_t row_argmax(const float* x, int64_t n) {
  int64_t i = 0;
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  __m256 nan = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vmax = _mm256_max_ps(vmax, v);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  float m = lanes[0];
  for (int j = 1; j < 8; ++j) m = std::max(m, lanes[j]);
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (; i < n; ++i) {
    has_nan = has_nan || std::isnan(x[i]);
    m = std::max(m, x[i]);
  }
  if (has_nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  }
  const __m256 target = _mm256_set1_ps(m);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), target, _CMP_EQ_OQ));
    if (mask) return j + __builtin_ctz(static_cast<unsigned>(mask));
  }
  for (; j < n; ++j)
    if (x[j] == m) return j;
  return 0;  // not reached: m is one of the entries (an all -inf row returns 0 in the loop above)
}

// x [..., V] float32 -> int64 [...]: row_argmax of every row, rows spread over the threads
torch::Tensor argmax_rows(const torch::Tensor& xin) {
  TORCH_CHECK(xin.dim() >= 1 && xin.size(-1) > 0, "x must be [..., V] with V > 0, got ", xin.sizes());
  TORCH_CHECK(xin.device().is_cpu() && xin.scalar_type() == at::kFloat, "x must be a float32 CPU tensor");
  const int64_t v = xin.size(-1);
  const torch::Tensor x = xin.reshape({-1, v}).contiguous();
  const int64_t rows = x.size(0);
  auto out = torch::empty({rows}, x.options().dtype(at::kLong));
  const float* px = x.data_ptr<float>();
  int64_t* po = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) po[r] = row_argmax(px + r * v, v);
  });
  std::vector<int64_t> shape(xin.sizes().begin(), xin.sizes().end() - 1);
  return out.view(shape);
}

// The chain selector's greedy chain of one block (chain.h): (top_s [g, K] float32, top_ids [g, K] int64, hidden
// [g, H] float32 / bf16, anchor, w_h [R, H], w_e [R, H], b [R], w_out [H, R] float32, embed [V, H], head [V, H]
// (one dtype, float32 / bf16), table [V, R] float32, have [V] uint8) -> (chosen [g] int64, cand [g, K] float32).
// table and have are the caller's store of token parts, filled here.
std::tuple<torch::Tensor, torch::Tensor> selector_chain(const torch::Tensor& top_s, const torch::Tensor& top_ids,
                                                        const torch::Tensor& hidden, int64_t anchor,
                                                        const torch::Tensor& w_h, const torch::Tensor& w_e,
                                                        const torch::Tensor& b, const torch::Tensor& w_out,
                                                        const torch::Tensor& embed, const torch::Tensor& head,
                                                        const torch::Tensor& table, const torch::Tensor& have) {
  for (const auto* t : {&top_s, &top_ids, &hidden, &w_h, &w_e, &b, &w_out, &embed, &head, &table, &have})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "the selector's chain takes contiguous CPU tensors");
  TORCH_CHECK(top_s.dim() == 2 && top_s.scalar_type() == at::kFloat, "top_s must be float32 [g, K]");
  TORCH_CHECK(top_ids.sizes() == top_s.sizes() && top_ids.scalar_type() == at::kLong, "top_ids must be int64 [g, K]");
  const int64_t g = top_s.size(0), k = top_s.size(1), r = w_h.size(0), h = w_h.size(1), v = embed.size(0);
  TORCH_CHECK(k >= 1, "at least one candidate a row");
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == g && hidden.size(1) == h, "hidden must be [g, H]");
  TORCH_CHECK(hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16, "hidden: float32 or bf16");
  for (const auto* t : {&w_h, &w_e, &b, &w_out, &table})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "the selector's weights and token parts are float32");
  TORCH_CHECK(w_e.sizes() == w_h.sizes() && b.dim() == 1 && b.size(0) == r, "w_e [R, H] and b [R]");
  TORCH_CHECK(w_out.dim() == 2 && w_out.size(0) == h && w_out.size(1) == r, "w_out must be [H, R]");
  TORCH_CHECK(embed.dim() == 2 && embed.size(1) == h && head.dim() == 2 && head.size(1) == h,
              "embed and head must be [V, H]");
  TORCH_CHECK(embed.scalar_type() == head.scalar_type() &&
              (embed.scalar_type() == at::kFloat || embed.scalar_type() == at::kBFloat16),
              "embed and head: one dtype, float32 or bf16");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == v && table.size(1) == r, "table must be [V, R]");
  TORCH_CHECK(have.dim() == 1 && have.size(0) == v && have.scalar_type() == at::kByte, "have must be uint8 [V]");
  const int64_t* ids = top_ids.data_ptr<int64_t>();
  TORCH_CHECK(anchor >= 0 && anchor < v, "anchor out of the vocabulary");
  for (int64_t i = 0; i < g * k; ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < head.size(0) && ids[i] < v, "id out of range");
  auto chosen = torch::empty({g}, top_ids.options());
  auto cand = torch::empty({g, k}, top_s.options());
  const ChainWeights cw{w_h.data_ptr<float>(), w_e.data_ptr<float>(), b.data_ptr<float>(), w_out.data_ptr<float>(),
                        r, h};
  {
    pybind11::gil_scoped_release free;
    auto run = [&](auto* hid, auto* emb, auto* hd) {
      chain_greedy(top_s.data_ptr<float>(), ids, hid, g, k, anchor, cw, emb, hd, table.data_ptr<float>(),
                   have.data_ptr<uint8_t>(), chosen.data_ptr<int64_t>(), cand.data_ptr<float>());
    };
    const bool hf = hidden.scalar_type() == at::kFloat, ef = embed.scalar_type() == at::kFloat;
    if (hf && ef) run(hidden.data_ptr<float>(), embed.data_ptr<float>(), head.data_ptr<float>());
    else if (hf) run(hidden.data_ptr<float>(), embed.data_ptr<at::BFloat16>(), head.data_ptr<at::BFloat16>());
    else if (ef) run(hidden.data_ptr<at::BFloat16>(), embed.data_ptr<float>(), head.data_ptr<float>());
    else run(hidden.data_ptr<at::BFloat16>(), embed.data_ptr<at::BFloat16>(), head.data_ptr<at::BFloat16>());
  }
  return {chosen, cand};
}

// The machine's int8 multiply-add ceiling: every thread runs `iters` rounds of 12 independent multiply-add chains on
// registers (no memory traffic), VNNI: vpdpbusd (64 multiply-adds), AVX2: vpmaddubsw + vpaddw (32 multiply-adds,
// what the AVX2 kernels' inner loop issues per weight register and row). -> multiply-adds per second over all
// threads. The kernels' figures are read as a share of it: what they lose to unpacking, scales, loads and stores.
// It is a lower bound of the peak, not the peak: on an AMD Zen 4 the q4 kernels on 64 rows came out a few percent
// above it (the register loop and the kernels see the same clock only when sampled in one rotation).
constexpr int kPeakChains = 12;

BLOCKDRAFT_VNNI int64_t peak_vnni(int64_t iters, int32_t seed) {
  __m512i acc[kPeakChains];
  for (int i = 0; i < kPeakChains; ++i) acc[i] = _mm512_set1_epi32(seed + i);
  const __m512i a = _mm512_set1_epi32(seed * 3 + 1), b = _mm512_set1_epi32(seed * 5 + 2);
  for (int64_t it = 0; it < iters; ++it) {
    for (int i = 0; i < kPeakChains; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    asm volatile("" : "+v"(acc[0]), "+v"(acc[5]), "+v"(acc[11]));  // keeps the loop from being folded
  }
  __m512i s = acc[0];
  for (int i = 1; i < kPeakChains; ++i) s = _mm512_add_epi32(s, acc[i]);
  return _mm512_reduce_add_epi32(s);
}

int64_t peak_avx2(int64_t iters, int32_t seed) {
  __m256i acc[kPeakChains];
  for (int i = 0; i < kPeakChains; ++i) acc[i] = _mm256_set1_epi16(static_cast<int16_t>(seed + i));
  const __m256i a = _mm256_set1_epi8(static_cast<char>(seed | 1)), b = _mm256_set1_epi8(static_cast<char>(seed + 2));
  for (int64_t it = 0; it < iters; ++it) {
    for (int i = 0; i < kPeakChains; ++i) acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(a, b));
    asm volatile("" : "+x"(acc[0]), "+x"(acc[5]), "+x"(acc[11]));
  }
  __m256i s = acc[0];
  for (int i = 1; i < kPeakChains; ++i) s = _mm256_add_epi16(s, acc[i]);
  return hsum_epi32(_mm256_madd_epi16(s, _mm256_set1_epi16(1)));
}

// isa "avx512-vnni" or "avx2"; threads: torch's pool (each thread one equal share) -> multiply-adds per second
double int8_peak(const std::string& isa, int64_t iters) {
  TORCH_CHECK(isa == "avx2" || isa == "avx512-vnni", "isa must be 'avx2' or 'avx512-vnni'");
  TORCH_CHECK(isa == "avx2" || cpu_has_vnni(), "this CPU has no AVX512-VNNI");
  TORCH_CHECK(iters > 0, "iters must be > 0");
  const bool vnni = isa == "avx512-vnni";
  const int64_t threads = at::get_num_threads();
  std::atomic<int64_t> sink{0};
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) sink += vnni ? peak_vnni(iters, static_cast<int32_t>(i)) : peak_avx2(iters, i);
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double per_round = kPeakChains * (vnni ? 64.0 : 32.0);
  static volatile int64_t kept;  // the chains' results are used: the loops cannot be dropped
  kept = sink.load();
  return static_cast<double>(threads) * iters * per_round / s;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<QLin>(m, "QLin")
      .def("__call__", &qlin_call, "x [..., K] (float32 / bf16) -> x W^T + b [..., N] in x's dtype",
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_readonly("bits", &QLin::bits)
      .def_readonly("out_features", &QLin::n)
      .def_readonly("in_features", &QLin::k)
      .def_property_readonly("scale_bits", &QLin::scale_bits,
                             "bits per stored scale: 16 / 32 (float16 / float32), 8 (factored K-quant scales)")
      .def_property_readonly("layout", &QLin::layout, "the kernel family: q4, q5, q6 or q8 (a stack: joined by +)")
      .def_property_readonly("weight_bytes", &QLin::weight_bytes, "the bytes one product streams (codes, scales)");
  m.def("make_qlin", &make_qlin,
        "a quantized linear, packed for the kernels: (bits 4: codes uint8 [N, K/2], scale and offset [N, K/32] | "
        "bits 5: the same, and high uint8 [N, K/8] | bits 8: codes int8 [N, K], scale [N, K/16], offset None), "
        "bias [N] or None; optionally the scales factored as GGUF's K-quants hold them (sub, sub_min, super_scale, "
        "super_min; see qlinear.h)",
        pybind11::arg("bits"), pybind11::arg("codes"), pybind11::arg("scale"), pybind11::arg("offset"),
        pybind11::arg("bias"), pybind11::arg("high") = pybind11::none(), pybind11::arg("sub") = pybind11::none(),
        pybind11::arg("sub_min") = pybind11::none(), pybind11::arg("super_scale") = pybind11::none(),
        pybind11::arg("super_min") = pybind11::none());
  m.def("stack_qlin", &stack_qlin, "linears over one input stacked along the output (their outputs side by side)",
        pybind11::arg("parts"));
  m.def("kernel_isa", [] { return kernel_isa() == Isa::kVnni ? "avx512-vnni" : "avx2"; },
        "the instruction set the quantized products use now");
  m.def("cpu_has_vnni", &cpu_has_vnni, "whether this CPU runs the AVX512-VNNI kernels");
  m.def("set_kernel_isa", [](const std::string& name) {
          TORCH_CHECK(name == "avx2" || name == "avx512-vnni", "kernel ISA must be 'avx2' or 'avx512-vnni'");
          TORCH_CHECK(name == "avx2" || cpu_has_vnni(), "this CPU has no AVX512-VNNI");
          isa_slot().store(static_cast<int>(name == "avx2" ? Isa::kAvx2 : Isa::kVnni));
        }, "use these kernels from now on (both give the same bits; for tests and measurements)");
  m.def("argmax_rows", &argmax_rows, "x [..., V] float32 -> int64 [...]: torch.argmax(x, -1), the same indices",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("selector_chain", &selector_chain, "the chain selector's greedy chain of one block (chain.h)");
  m.def("int8_peak", &int8_peak, "the int8 multiply-add ceiling of this CPU on torch's threads: (isa, rounds per "
        "thread) -> multiply-adds per second", pybind11::arg("isa"), pybind11::arg("iters"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  register_decoder(m);
}
