// Python bindings of the quantized linears (qlinear.h) and of the native decoder stack (decoder.cpp).
#include "qlinear.h"

using namespace blockdraft;

void register_decoder(pybind11::module& m);

namespace {

// x [..., K] -> a contiguous [M, K] view or copy
torch::Tensor rows_of(const torch::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "x must be [..., ", k, "], got ", x.sizes());
  TORCH_CHECK(x.device().is_cpu(), "the quantized kernels run on CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32");
  return x.reshape({-1, k}).contiguous();
}

std::vector<int64_t> out_shape(const torch::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return shape;
}

const float* bias_ptr(const c10::optional<torch::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
              "bias must be a contiguous float32 [", n, "] tensor");
  return bias->data_ptr<float>();
}

}  // namespace

// x [..., K], qw uint8 [N, K/2], d / o float32 [N, K/32], bias float32 [N] or None -> y [..., N] in x's dtype
torch::Tensor q4_linear(torch::Tensor xin, torch::Tensor qw, torch::Tensor d, torch::Tensor o,
                        c10::optional<torch::Tensor> bias) {
  const int64_t k = qw.size(1) * 2, n = qw.size(0);
  const torch::Tensor x = rows_of(xin, k);
  TORCH_CHECK(qw.scalar_type() == at::kByte && qw.is_contiguous(), "qw must be contiguous uint8 [N, K/2]");
  TORCH_CHECK(d.scalar_type() == at::kFloat && o.scalar_type() == at::kFloat && d.is_contiguous() &&
                  o.is_contiguous() && d.numel() == n * (k / kBlock) && o.numel() == d.numel(),
              "d and o must be contiguous float32 [N, K/32]");
  auto y = torch::empty({x.size(0), n}, x.options());
  const float* b = bias_ptr(bias, n);
  if (x.scalar_type() == at::kFloat)
    q4_mm(x.data_ptr<float>(), x.size(0), k, qw.data_ptr<uint8_t>(), d.data_ptr<float>(), o.data_ptr<float>(), n, b,
          y.data_ptr<float>());
  else
    q4_mm(x.data_ptr<at::BFloat16>(), x.size(0), k, qw.data_ptr<uint8_t>(), d.data_ptr<float>(),
          o.data_ptr<float>(), n, b, y.data_ptr<at::BFloat16>());
  return y.view(out_shape(xin, n));
}

// x [..., K], qw int8 [N, K], s float32 [N, K/16], bias float32 [N] or None -> y [..., N] in x's dtype
torch::Tensor q8_linear(torch::Tensor xin, torch::Tensor qw, torch::Tensor s, c10::optional<torch::Tensor> bias) {
  const int64_t k = qw.size(1), n = qw.size(0);
  const torch::Tensor x = rows_of(xin, k);
  TORCH_CHECK(qw.scalar_type() == at::kChar && qw.is_contiguous(), "qw must be contiguous int8 [N, K]");
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.numel() == n * (k / 16),
              "s must be contiguous float32 [N, K/16]");
  auto y = torch::empty({x.size(0), n}, x.options());
  const float* b = bias_ptr(bias, n);
  if (x.scalar_type() == at::kFloat)
    q8_mm(x.data_ptr<float>(), x.size(0), k, qw.data_ptr<int8_t>(), s.data_ptr<float>(), n, b, y.data_ptr<float>());
  else
    q8_mm(x.data_ptr<at::BFloat16>(), x.size(0), k, qw.data_ptr<int8_t>(), s.data_ptr<float>(), n, b,
          y.data_ptr<at::BFloat16>());
  return y.view(out_shape(xin, n));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_linear", &q4_linear, "x [..., K] @ (d * c + o)^T, 4-bit codes in blocks of 32");
  m.def("q8_linear", &q8_linear, "x [..., K] @ (s * c)^T, 8-bit codes with a scale per 16");
  register_decoder(m);
}
