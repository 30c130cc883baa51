// The Python bindings of tokenmill's native CPU kernels (one extension module).
#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv, torch::Tensor block_table,
                           torch::Tensor seq_lens, double scale);
torch::Tensor pack_bf16_weight(torch::Tensor w);
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor bias);
torch::Tensor qk_norm_rope(torch::Tensor qkv, torch::Tensor q_weight, torch::Tensor k_weight,
                           torch::Tensor cos, torch::Tensor sin, int64_t hq, int64_t hkv,
                           int64_t d, int64_t rd, double eps);
void kv_cache_write(torch::Tensor cache, torch::Tensor k, torch::Tensor v,
                    torch::Tensor slot_block, torch::Tensor slot_offset);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm_(torch::Tensor residual, torch::Tensor x, torch::Tensor weight,
                            double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache");
  m.def("pack_bf16_weight", &pack_bf16_weight, "bf16 [N, K] weights in linear_bf16's layout");
  m.def("linear_bf16", &linear_bf16, "x @ w^T + b with packed bf16 weights, fp32 math");
  m.def("qk_norm_rope", &qk_norm_rope, "per-head q/k RMSNorm + rotary; returns q, rotates k in place");
  m.def("kv_cache_write", &kv_cache_write, "write new K/V rows into the paged cache");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a packed gate_up");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, HF's rounding");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x in place, then RMSNorm(residual)");
}
