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
  register_decoder(m);
}
