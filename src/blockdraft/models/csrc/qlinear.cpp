// Python bindings of the quantized linears (qlinear.h) and of the native decoder stack (decoder.cpp).
#include "qlinear.h"

using namespace blockdraft;

void register_decoder(pybind11::module& m);

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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<QLin>(m, "QLin")
      .def("__call__", &qlin_call, "x [..., K] (float32 / bf16) -> x W^T + b [..., N] in x's dtype",
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_readonly("bits", &QLin::bits)
      .def_readonly("out_features", &QLin::n)
      .def_readonly("in_features", &QLin::k)
      .def_property_readonly("scale_bits", &QLin::scale_bits, "16 when the scales are held as float16, else 32");
  m.def("make_qlin", &make_qlin,
        "a quantized linear, packed for the kernels: (bits 4: codes uint8 [N, K/2], scale and offset [N, K/32] | "
        "bits 5: the same, and high uint8 [N, K/8] | bits 8: codes int8 [N, K], scale [N, K/16], offset None), "
        "bias [N] or None",
        pybind11::arg("bits"), pybind11::arg("codes"), pybind11::arg("scale"), pybind11::arg("offset"),
        pybind11::arg("bias"), pybind11::arg("high") = pybind11::none());
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
  register_decoder(m);
}
