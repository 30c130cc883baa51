// A linear as the native decode loops call it (cpu_decode_layers.cpp,
// cpu_hybrid_decode_layers.cpp): the packed float kernel, or linear_quant over the
// integer / fp8 codes, the same call Linear.forward makes through the layer's method.
#pragma once

#include "ops.h"

namespace tmdecode {

// A linear's tensors in a loop's `weights`: the packed weight (bf16 / fp32 packed, or the
// integer codes of pack_quant_weight), the integer kind's scales and zero points and its
// act-order permutation of the inputs, and the bias (empty tensor = none).
enum LinearSlot { W, SCALES, ZEROS, PERM, BIAS, LINEAR_SLOTS };

// v [T, K] -> [T, n]. bits_group: linear_quant's (bits, group size), bits 0 for a packed
// float linear (linear_f32 for fp32 inputs, else linear_bf16). QuantizedLinearMethod
// (quantized_cpu.py) permutes the inputs for act-order first; so does this.
inline torch::Tensor linear(const torch::Tensor& v, const torch::Tensor* lin, int64_t n,
                            const int64_t* bits_group, bool f32) {
  const int64_t bits = bits_group[0];
  if (bits == 0)
    return f32 ? linear_f32(v, lin[W], n, lin[BIAS]) : linear_bf16(v, lin[W], n, lin[BIAS]);
  const torch::Tensor in = lin[PERM].numel() > 0 ? v.index_select(1, lin[PERM]) : v;
  return linear_quant(in, lin[W], lin[SCALES], lin[ZEROS], n, bits, bits_group[1], lin[BIAS]);
}

}  // namespace tmdecode
