// Every decoder layer of a Llama-family model for a decode-only step, in one call.
//
// Why: at batch 1 a layer runs a dozen native kernels, each reached from Python
// through nn.Module calls, and that interpreter and dispatcher work costs about
// as much as the kernels themselves on this CPU. This loop makes the same kernel
// calls with the same arguments in the same order as the Python layers
// (tokenmill/models/llama.py: DecoderLayer, Attention, PagedAttention,
// GatedMLP), so its output is bit-identical to theirs. The model definition
// stays in Python, which also decides when this path applies
// (tokenmill/models/layers/decode_layers.py).
#include "ops.h"

namespace {

// The tensors of one layer in `weights`, in this order (empty tensor = none).
enum Slot {
  INPUT_NORM, QKV, QKV_BIAS, Q_NORM, K_NORM, KV_CACHE, O_PROJ, O_BIAS,
  POST_NORM, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS, NUM_SLOTS
};

}  // namespace

// x [T, hidden] bf16 (packed bf16 linears) or fp32 (packed fp32 linears): the residual
// stream, updated in place and returned.
// dims: (num_heads, num_kv_heads, head_dim, rotary_dim, hidden, intermediate[, window]),
// window > 0: every layer attends over a sliding window of that many positions;
// cos / sin [T, 1, rotary_dim]; slot_block / slot_offset [T]: where each token's
// K/V go; block_table [T, max_nb] int32 and seq_lens [T] int32 of the decode rows.
torch::Tensor decode_layers(torch::Tensor x, std::vector<torch::Tensor> weights,
                            std::vector<int64_t> dims, double eps, double scale,
                            torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_block,
                            torch::Tensor slot_offset, torch::Tensor block_table,
                            torch::Tensor seq_lens) {
  TORCH_CHECK(weights.size() % NUM_SLOTS == 0, "decode_layers: ", NUM_SLOTS,
              " tensors per layer");
  TORCH_CHECK(dims.size() == 6 || dims.size() == 7, "decode_layers: 6 or 7 dims");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode_layers: x must be [T, hidden]");
  const int64_t hq = dims[0], hkv = dims[1], d = dims[2], rd = dims[3], hidden = dims[4],
                inter = dims[5], window = dims.size() == 7 ? dims[6] : 0;
  const int64_t t = x.size(0), q_size = hq * d, kv_size = hkv * d;
  const size_t num_layers = weights.size() / NUM_SLOTS;
  // fp32 models (packed fp32 linears): the Python layers' fp32 norms are PyTorch's
  // rms_norm (HF's formula), so the loop calls the same ATen op there.
  const bool f32 = x.scalar_type() == at::kFloat;
  auto norm = [&](const torch::Tensor& v, const torch::Tensor& weight) {
    return f32 ? at::rms_norm(v, {hidden}, weight, eps) : rms_norm(v, weight, eps);
  };
  auto linear = [&](const torch::Tensor& v, const torch::Tensor& packed, int64_t n,
                    const torch::Tensor& bias) {
    return f32 ? linear_f32(v, packed, n, bias) : linear_bf16(v, packed, n, bias);
  };
  for (size_t l = 0; l < num_layers; ++l) {
    const torch::Tensor* w = weights.data() + l * NUM_SLOTS;
    // Attention block: DecoderLayer.input_layernorm, Attention.forward.
    torch::Tensor h = norm(x, w[INPUT_NORM]);
    torch::Tensor qkv = linear(h, w[QKV], q_size + 2 * kv_size, w[QKV_BIAS]);
    torch::Tensor q = qk_norm_rope(qkv, w[Q_NORM], w[K_NORM], cos, sin, hq, hkv, d, rd,
                                   w[Q_NORM].numel() > 0 ? eps : 0.0);
    torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({t, hkv, d});
    torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, hkv, d});
    // PagedAttention.forward, decode-only.
    kv_cache_write(w[KV_CACHE], k, v, slot_block, slot_offset);
    torch::Tensor attn =
        paged_decode(q.contiguous(), w[KV_CACHE], block_table, seq_lens, scale, window, 0.0)
            .view({t, -1});
    torch::Tensor o = linear(attn, w[O_PROJ], hidden, w[O_BIAS]);
    // MLP block: post_attention_layernorm.add_forward, GatedMLP.forward, the residual add.
    h = f32 ? norm(x.add_(o), w[POST_NORM]) : add_rms_norm_(x, o, w[POST_NORM], eps);
    torch::Tensor act = silu_mul(linear(h, w[GATE_UP], 2 * inter, w[GATE_UP_BIAS]));
    x.add_(linear(act, w[DOWN], hidden, w[DOWN_BIAS]));
  }
  return x;
}
