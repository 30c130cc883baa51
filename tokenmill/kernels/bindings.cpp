// The Python bindings of tokenmill's native CPU kernels (one extension module).
#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv, torch::Tensor block_table,
                           torch::Tensor seq_lens, double scale);
torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, torch::Tensor bias);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache");
  m.def("gemv_bf16", &gemv_bf16, "x @ w^T for a few rows x and bf16 weights w");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, HF's rounding");
}
