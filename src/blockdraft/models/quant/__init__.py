"""Weight-only quantized linears for the fast decode path, and the exact mapping of GGUF's quant blocks onto them.

Why: a decode step of a small target is bound by the bytes of weights it reads. A Q4_1 GGUF holds ~4.5 bits per
weight; dequantized to bf16 the same model reads 16. Three formats cover what GGUF files hold (`csrc/qlinear.h`):
- `Q4Weight`: 4-bit codes c with a scale d and an offset o per block of 32 along the input: w = d * c + o. GGUF's
  Q4_0 (o = -8d), Q4_1 (o = m) and Q4_K (per sub-block d * sc and -dmin * m) map onto it exactly.
- `Q5Weight`: the same with a fifth bit per code (c in 0..31; 6 bits per weight as the kernels hold it, scale and
  offset in float16): GGUF's Q5_0 (o = -16d), Q5_1 (o = m) and Q5_K (per sub-block, as Q4_K) map onto it exactly.
- `Q8Weight`: signed 8-bit codes with a scale per 16 inputs: w = s * c. GGUF's Q8_0 (one scale per 32) and Q6_K
  (codes - 32, one scale per 16) map onto it exactly.
GGUF's K-quants (Q4_K, Q5_K, Q6_K) keep their two-level scales (`Factored`: an integer per block times a float per
256 inputs), and Q6_K's codes, which fit 6 bits, are held in 6: the kernels stream ~4.6 bits per Q4_K weight and
~6.6 per Q6_K weight, about what the file holds, for the same bits of output as the float scales.
A fused linear whose parts differ in kind (a Q5_0 q/k beside a Q8_0 v) takes the narrowest format that holds every
part exactly, or, where none does (a Q4_K q/k beside a Q6_K v), stays a `Stacked` of its parts (`fuse`).
A bf16 / fp32 model can be quantized into 4 or 8 bits (`quantize_q4`, `quantize_q8`: groups of 32, min/max and
absmax; the `int4` / `int8` weights modes), opt-in, at some cost in quality; `quantize_q5` does the same in 5 bits.

The kernels quantize activations per row and block of 32 to int8 (as llama.cpp does) and compute integer dot
products with AVX2. Each output element is computed the same way whatever the number of rows, so a multi-token
verify and a one-token step agree exactly on the same row (what keeps greedy speculative decoding token-exact on
these weights). The extension is compiled once per machine on first use (torch's C++ extension loader, cached under
$TORCH_EXTENSIONS_DIR); without a compiler or AVX2 the same weights run dequantized through `F.linear` instead
(`kernel_status` says which).

Modules: formats.py (the formats, packing, quantizing, fusing), kernels.py (`QuantLinear` and the kernels' loading),
gguf.py (GGUF blocks and names), plan.py (`WeightPlan`: which weights a target's fast path holds quantized).
"""

from .formats import (BLOCK, WEIGHT_MODES, Factored, Q4Weight, Q5Weight, Q8Weight, QWeight, Stacked, as_kind, bits_of,
                      concat, fuse, pack_q4, pack_q5, quantize, quantize_q4, quantize_q5, quantize_q8, qweight_tensors,
                      tensor_bytes)
from .gguf import GGUFBlocks, gguf_block_weight, gguf_name, llama_rope_rows, match_rows, read_gguf_weights
from .kernels import QuantLinear, kernel_isa, kernel_status, loaded_kernels, quant_kernels
from .plan import WeightPlan, drop_float_weight, gguf_plan, plan_weights

__all__ = ["BLOCK", "GGUFBlocks", "WEIGHT_MODES", "Factored", "Q4Weight", "Q5Weight", "Q8Weight", "QWeight",
           "QuantLinear", "Stacked", "WeightPlan", "as_kind", "bits_of", "concat", "drop_float_weight", "fuse",
           "gguf_block_weight", "gguf_name", "gguf_plan", "kernel_isa", "kernel_status", "llama_rope_rows",
           "loaded_kernels", "match_rows", "pack_q4", "pack_q5", "plan_weights", "quant_kernels", "quantize",
           "quantize_q4", "quantize_q5", "quantize_q8", "qweight_tensors", "read_gguf_weights", "tensor_bytes"]
