// Weight-only quantized linears for CPU decoding: y [M, N] = x [M, K] W^T, W stored in blocks of 32 along K.
//
// Three weight formats, chosen so that GGUF's own blocks map onto them without requantization (quant/):
//   q4: unsigned 4-bit codes c in 0..15 with a scale d and an offset o per block: w = d * c + o
//       (GGUF Q4_0: o = -8d; Q4_1: o = m; Q4_K: d = d*sc, o = -dmin*m per sub-block of 32).
//   q5: the same with a fifth bit, c in 0..31 (GGUF Q5_0: o = -16d; Q5_1: o = m; Q5_K as Q4_K).
//   q8: signed 8-bit codes with a scale per 16 elements: w = s * c (GGUF Q8_0: one scale repeated for both
//       halves of a block; Q6_K: codes - 32 with its per-16 scales). Codes that fit 6 bits (Q6_K's) are held in 6
//       ("q6": the q8 kernels' integers from unsigned codes, see Q8Packed).
// GGUF's K-quants keep their scales factored, an integer per block times a float per 256 inputs (Q4Packed,
// Q8Packed): the kernels multiply them out exactly and stream about the bits per weight the file holds. A fused
// linear whose parts need different formats is a stack of linears over one quantized input (QLin::parts).
//
// Layout: the kernels read weights repacked once into panels of 8 output columns (`pack_q4`, `pack_q8`). Within a
// panel and block, one 32-bit lane of a vector register holds 4 consecutive inputs of one column, so a vector of
// 8 lanes is 8 columns. Panels are stored in pairs ("tiles" of 16 columns), interleaved every 32 bytes, so that a
// 512-bit register loads the same 4 inputs of 16 columns from one address and the weights stream from one place.
// The activations' 4 matching inputs are broadcast to every lane, and the integer
// multiply-adds leave each column's dot product in its own lane: no horizontal sums, the block's scales apply to 8
// columns in one instruction, and with several rows each unpacked weight register serves every row. That is what
// makes a multi-token verify cost little more than one token where the weights, not the arithmetic, are the bound.
//
// Activations are quantized per row and block of 32 to int8 (scale = max|x| / 127), as llama.cpp does for its
// integer dot products; the q4 offset term uses the exact float sum of each block of x.
//
// Why the result does not depend on M: the integer parts are exact, and every output y[m, n] gets the same
// sequence of float operations whatever the number of rows and however rows are grouped, so a multi-token verify
// step and a one-token step produce the same numbers for the same row. Greedy speculative decoding on these
// kernels is therefore token-exact against plain decoding on them, in bf16 as in fp32.
#pragma once
#include "vnni.h"

namespace blockdraft {

// --------------------------------------------------------------------------------------------- the products

// Rows per panel kernel call: each unpacked weight register serves this many rows (3 measured no faster: the
// accumulators the q4 kernel spills at 4 rows cost less than unpacking the weights more often).
constexpr int64_t kGroupRows = 4;

// rows in groups of up to kGroupRows through one panel kernel (Kernel: a callable template on the group size)
template <typename U, typename Kernel>
inline void panel_rows(int64_t m, int64_t pi, int64_t n, const float* bias, U* y, int64_t ldy, Kernel&& kernel) {
  __m256 out[kGroupRows];
  for (int64_t r = 0; r < m;) {
    const int64_t rows = std::min<int64_t>(kGroupRows, m - r);
    switch (rows) {
      case 4: kernel(std::integral_constant<int, 4>{}, r, out); break;
      case 3: kernel(std::integral_constant<int, 3>{}, r, out); break;
      case 2: kernel(std::integral_constant<int, 2>{}, r, out); break;
      default: kernel(std::integral_constant<int, 1>{}, r, out); break;
    }
    for (int64_t i = 0; i < rows; ++i) store_panel(out[i], bias, pi * kPanel, n, y + (r + i) * ldy);
    r += rows;
  }
}

// f(begin, end) over [0, n) in chunks the threads take as they finish the one before, each a quarter of what is left
// (at two threads) and at least `grain`: long runs keep the hardware prefetcher on one stream, the short last ones
// let the threads finish together. A static split in halves left one of two threads waiting 10-20% of a step (they
// stream the weights at unequal speeds). Which thread computes a column does not change its bits.
template <typename F>
inline void parallel_chunks(int64_t n, int64_t grain, const F& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  if (threads <= 1 || at::in_parallel_region()) {
    f(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t begin = next.load(std::memory_order_relaxed);
    while (begin < n) {
      const int64_t end = std::min(n, begin + std::max(grain, (n - begin) / (2 * threads)));
      if (next.compare_exchange_weak(begin, end, std::memory_order_relaxed)) {
        f(begin, end);
        begin = next.load(std::memory_order_relaxed);
      }
    }
  });
}

// Units (panels or tiles) in the smallest chunk of work: about 32 KB of weights.
inline int64_t chunk_units(int64_t unit_bytes) {
  return std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(unit_bytes, 1));
}

// y [M, N] (rows ldy apart) = x W^T + bias for one family of kernels (Bits 4, 5, 6 or 8) over `panels` panels:
// `unit` bytes of codes and `hunit` of high bits per tile and block; scales_of(pi, half): the scales of panel pi
// (half 0: of the whole tile pi / 2, for the VNNI kernels; kPanel: of the one panel, for AVX2).
template <int Bits, typename U, typename ScalesOf>
inline void products(const QuantRows& xr, int64_t panels, int64_t g, int64_t n, const uint8_t* codes, int64_t unit,
                     const uint8_t* high, int64_t hunit, const ScalesOf& scales_of, const float* bias, U* y,
                     int64_t ldy) {
  if (kernel_isa() == Isa::kVnni) {
    parallel_chunks(panels / kTile, chunk_units(g * (unit + hunit)), [&](int64_t begin, int64_t end) {
      tiles_vnni<Bits>(xr, codes, unit, high, hunit, [&](int64_t ti) { return scales_of(kTile * ti, 0); }, g, n,
                       bias, y, ldy, begin, end);
    });
    return;
  }
  parallel_chunks(panels, chunk_units(g * (unit + hunit) / kTile), [&](int64_t begin, int64_t end) {
    for (int64_t pi = begin; pi < end; ++pi) {
      const auto sc = scales_of(pi, kPanel);
      const uint8_t* pc = codes + panel_base(pi, g, unit, 32);
      const uint8_t* ph = high != nullptr ? high + panel_base(pi, g, hunit, 32) : nullptr;
      panel_rows(xr.m, pi, n, bias, y, ldy, [&](auto rows, int64_t r, __m256* out) {
        constexpr int R = decltype(rows)::value;
        if constexpr (Bits == 8) q8_panel<R>(reinterpret_cast<const int8_t*>(pc), sc, g, xr, r, out);
        else if constexpr (Bits == 6) q6_panel<R>(pc, ph, sc, g, xr, r, out);
        else if constexpr (Bits == 5) q5_panel<R>(pc, ph, sc, g, xr, r, out);
        else q4_panel<R>(pc, sc, g, xr, r, out);
      });
    }
  });
}

// the 4-bit (high null) or 5-bit (high: the fifth bits, uint8 [P/2, G, 64]) products over w's panels
template <typename U>
inline void q45_products(const QuantRows& xr, const Q4Packed& w, const uint8_t* high, const float* bias, U* y,
                         int64_t ldy) {
  auto run = [&](auto scales_of) {
    const uint8_t* codes = w.codes.data_ptr<uint8_t>();
    if (high != nullptr) products<5>(xr, w.panels, w.g, w.n, codes, 256, high, 64, scales_of, bias, y, ldy);
    else products<4>(xr, w.panels, w.g, w.n, codes, 256, nullptr, 0, scales_of, bias, y, ldy);
  };
  if (w.factored()) run([&](int64_t pi, int64_t half) { return q45_factored(w, pi, half); });
  else if (w.d.scalar_type() == at::kHalf)
    run([&](int64_t pi, int64_t half) { return q45_scales<at::Half>(w, pi, half); });
  else run([&](int64_t pi, int64_t half) { return q45_scales<float>(w, pi, half); });
}

// the 8-bit or 6-bit products over w's panels
template <typename U>
inline void q8_products(const QuantRows& xr, const Q8Packed& w, const float* bias, U* y, int64_t ldy) {
  auto run = [&](auto scales_of) {
    if (w.six())
      products<6>(xr, w.panels, w.g, w.n, w.low.data_ptr<uint8_t>(), 256, w.planes.data_ptr<uint8_t>(), 128,
                  scales_of, bias, y, ldy);
    else
      products<8>(xr, w.panels, w.g, w.n, reinterpret_cast<const uint8_t*>(w.codes.data_ptr<int8_t>()), 512,
                  nullptr, 0, scales_of, bias, y, ldy);
  };
  if (w.factored()) run([&](int64_t pi, int64_t half) { return q8_factored(w, pi, half); });
  else if (w.s.scalar_type() == at::kHalf)
    run([&](int64_t pi, int64_t half) { return q8_scales<at::Half>(w, pi, half); });
  else run([&](int64_t pi, int64_t half) { return q8_scales<float>(w, pi, half); });
}

}  // namespace blockdraft

namespace blockdraft {

// One quantized linear as the kernels hold it: packed weights and an optional float32 bias; or a stack of such
// linears over the same input (`parts`, their outputs side by side: a fused q/k/v whose parts come in different
// formats, GGUF's Q4_K q and k beside a Q6_K v), the activations quantized once for all of them. Each part computes
// its columns exactly as it would alone.
struct QLin {
  int bits = 0;
  int64_t n = 0, k = 0;
  Q4Packed q4;
  Q5Packed q5;
  Q8Packed q8;
  torch::Tensor bias;
  std::vector<QLin> parts;

  const float* bias_ptr() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }
  // bits per stored scale: 16 / 32 (floats), 8 (factored K-quant scales); a stack: its widest part's
  int scale_bits() const {
    if (!parts.empty()) {
      int b = 0;
      for (const QLin& p : parts) b = std::max(b, p.scale_bits());
      return b;
    }
    if (bits == 8 ? q8.factored() : (bits == 4 ? q4 : q5.low).factored()) return 8;
    return (bits == 4 ? q4.d : bits == 5 ? q5.low.d : q8.s).scalar_type() == at::kHalf ? 16 : 32;
  }
  // the kernel family: "q4", "q5", "q6" (6-bit codes in the q8 format) or "q8"; a stack: its parts', joined by "+"
  std::string layout() const {
    if (!parts.empty()) {
      std::string out;
      for (const QLin& p : parts) out += (out.empty() ? "" : "+") + p.layout();
      return out;
    }
    return bits == 8 ? (q8.six() ? "q6" : "q8") : bits == 4 ? "q4" : "q5";
  }
  // the bytes a product streams: codes, high bits and scales (the bias aside)
  int64_t weight_bytes() const {
    int64_t total = 0;
    for (const QLin& p : parts) total += p.weight_bytes();
    for (const torch::Tensor* t : {&q4.codes, &q4.d, &q4.o, &q4.sc, &q4.mn, &q4.sd, &q4.sm, &q5.low.codes, &q5.low.d,
                                   &q5.low.o, &q5.low.sc, &q5.low.mn, &q5.low.sd, &q5.low.sm, &q5.high, &q8.codes,
                                   &q8.s, &q8.low, &q8.planes, &q8.sub, &q8.sd})
      if (t->defined()) total += t->nbytes();
    return total;
  }

  // y [m, n] = x [m, k] W^T + b
  template <typename T, typename U>
  void apply(const T* x, int64_t m, U* y) const {
    const QuantRows xr(x, m, k);
    apply_rows(xr, y, n);
  }

  // the same from activations already quantized, row r of y at y + r * ldy
  template <typename U>
  void apply_rows(const QuantRows& xr, U* y, int64_t ldy) const {
    if (!parts.empty()) {
      int64_t col = 0;
      for (const QLin& p : parts) {
        p.apply_rows(xr, y + col, ldy);
        col += p.n;
      }
      return;
    }
    if (bits == 4) q45_products(xr, q4, nullptr, bias_ptr(), y, ldy);
    else if (bits == 5) q45_products(xr, q5.low, q5.high.data_ptr<uint8_t>(), bias_ptr(), y, ldy);
    else q8_products(xr, q8, bias_ptr(), y, ldy);
  }
};

// parts stacked along the output (see QLin): one input width, outputs side by side in order
inline QLin stack_qlin(const std::vector<QLin>& parts) {
  TORCH_CHECK(parts.size() >= 2, "a stack needs at least two parts");
  QLin q;
  q.k = parts[0].k;
  for (const QLin& p : parts) {
    TORCH_CHECK(p.k == q.k, "stacked parts must share the input width: ", p.k, " != ", q.k);
    q.n += p.n;
  }
  q.bits = parts[0].bits;
  q.parts = parts;
  return q;
}

// bits 4: codes uint8 [N, K/2], scale / offset float32 [N, K/32]; bits 5: the same plus high uint8 [N, K/8] (the
// fifth bits); bits 8: codes int8 [N, K], scale float32 [N, K/16]; bias float32-convertible [N] or none
// Factored scales (GGUF's K-quants, see Q4Packed and Q8Packed), optional: bits 4 / 5: sub and sub_min uint8
// [N, K/32], super_scale and super_min float32 [N, K/256] with scale = super_scale * sub and offset =
// -(super_min * sub_min) per block; bits 8: sub int8 [N, K/16] and super_scale [N, K/256] with scale = super_scale *
// sub. They must multiply out to scale (and offset) exactly in float32: that is what gives the float layout's bits.
inline QLin make_qlin(int64_t bits, torch::Tensor codes, torch::Tensor scale, c10::optional<torch::Tensor> offset,
                      c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> high,
                      c10::optional<torch::Tensor> sub, c10::optional<torch::Tensor> sub_min,
                      c10::optional<torch::Tensor> super_scale, c10::optional<torch::Tensor> super_min) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "bits must be 4, 5 or 8");
  TORCH_CHECK(codes.dim() == 2 && codes.device().is_cpu(), "codes must be a 2-d CPU tensor");
  QLin q;
  q.bits = static_cast<int>(bits);
  q.n = codes.size(0);
  q.k = bits == 8 ? codes.size(1) : codes.size(1) * 2;
  TORCH_CHECK(q.n > 0 && q.k > 0, "codes must not be empty, got ", codes.sizes());
  TORCH_CHECK(q.k % kBlock == 0, "K must be a multiple of 32, got ", q.k);
  // the exact shape, not just the element count: a transposed scale has the same count and gives wrong numbers
  const int64_t groups = bits == 8 ? q.k / 16 : q.k / kBlock;
  auto check_scales = [&](const torch::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
    TORCH_CHECK(t.is_floating_point(), name, " must be a float tensor, got ", t.scalar_type());
    TORCH_CHECK(t.dim() == 2 && t.size(0) == q.n && t.size(1) == groups, name, " must have shape [", q.n, ", ",
                groups, "], got ", t.sizes());
  };
  check_scales(scale, "scale");
  const torch::Tensor c = codes.contiguous(), s = scale.to(torch::kFloat).contiguous();
  if (bits == 4 || bits == 5) {
    TORCH_CHECK(c.scalar_type() == at::kByte, bits, "-bit codes must be uint8 [N, K/2]");
    TORCH_CHECK(offset.has_value() && offset->defined(), bits, "-bit weights need offsets");
    check_scales(*offset, "offset");
    const torch::Tensor o = offset->to(torch::kFloat).contiguous();
    if (bits == 4) {
      q.q4 = pack_q4(c, s, o);
    } else {
      TORCH_CHECK(high.has_value() && high->defined(), "5-bit weights need their fifth bits (high)");
      TORCH_CHECK(high->device().is_cpu(), "high must be a CPU tensor");
      const torch::Tensor h = high->contiguous();
      TORCH_CHECK(h.scalar_type() == at::kByte && h.dim() == 2 && h.size(0) == q.n && h.size(1) == q.k / 8,
                  "high must be uint8 [N, K/8] = [", q.n, ", ", q.k / 8, "]");
      q.q5 = pack_q5(c, h, s, o);
    }
  } else {
    TORCH_CHECK(c.scalar_type() == at::kChar, "8-bit codes must be int8 [N, K]");
    q.q8 = pack_q8(c, s);
  }
  const bool factored = sub.has_value() && sub->defined();
  TORCH_CHECK(factored == (super_scale.has_value() && super_scale->defined()),
              "factored scales need both sub and super_scale");
  if (factored) {
    TORCH_CHECK(q.k % 256 == 0, "factored scales need K to be a multiple of 256, got ", q.k);
    const int64_t per = bits == 8 ? 16 : 8;  // sub-scales per super-block of 256 inputs
    auto check = [&](const torch::Tensor& t, at::ScalarType dtype, int64_t cols, const char* name) {
      TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 2 && t.size(0) == q.n &&
                  t.size(1) == cols, name, " must be a ", dtype, " CPU tensor [", q.n, ", ", cols, "], got ",
                  t.scalar_type(), " ", t.sizes());
    };
    check(*sub, bits == 8 ? at::kChar : at::kByte, groups, "sub");
    check(*super_scale, at::kFloat, q.k / 256, "super_scale");
    const torch::Tensor sup = super_scale->contiguous(), sb = sub->contiguous();
    TORCH_CHECK(torch::equal(sup.repeat_interleave(per, 1) * sb.to(torch::kFloat), s),
                "the factored scales do not multiply out to scale exactly");
    if (bits == 8) {
      factor_q8(q.q8, sb, sup);
    } else {
      TORCH_CHECK(sub_min.has_value() && sub_min->defined() && super_min.has_value() && super_min->defined(),
                  bits, "-bit factored scales need sub_min and super_min");
      check(*sub_min, at::kByte, groups, "sub_min");
      check(*super_min, at::kFloat, q.k / 256, "super_min");
      const torch::Tensor smin = super_min->contiguous(), mn = sub_min->contiguous();
      TORCH_CHECK(torch::equal(-(smin.repeat_interleave(per, 1) * mn.to(torch::kFloat)), offset->to(torch::kFloat)),
                  "the factored offsets do not multiply out to offset exactly");
      factor_q4(bits == 4 ? q.q4 : q.q5.low, sb, mn, sup, smin);
    }
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->is_floating_point() && bias->dim() == 1 && bias->size(0) == q.n,
                "bias must be a float CPU tensor of shape [", q.n, "], got ", bias->sizes());
    q.bias = bias->to(torch::kFloat).contiguous();
  }
  return q;
}

}  // namespace blockdraft
