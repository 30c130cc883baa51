// Every decoder layer of a Gemma 3 model for a decode-only step, in one call.
//
// The same kernel calls, in the same order, as the Python layers make when they
// have the native kernels (tokenmill/models/gemma3.py: Gemma3DecoderLayer,
// Gemma3Attention, GeluTanhMLP, PagedAttention), so the residual stream is
// bit-identical to theirs. What differs from the Llama loop (cpu_decode_layers.cpp):
// each layer reads its own KV cache group's slot mapping and block table and its
// kind's rope table (local layers slide and rotate with their own base); Gemma's
// RMSNorm x / rms(x) * (1 + w) is PyTorch's fp32 rms_norm over the weights with the
// +1 folded in at load (`w1`, fp32), rounded once; four norms per layer (after
// attention, around the MLP); gelu-tanh MLP; optional attention soft-capping.
#include "ops.h"
#include "parallel.h"

namespace {

enum Slot {
  INPUT_NORM, QKV, QKV_BIAS, Q_NORM, K_NORM, KV_CACHE, O_PROJ, O_BIAS,
  POST_ATTN_NORM, PRE_FF_NORM, GATE_UP, DOWN, POST_FF_NORM, NUM_SLOTS
};

// Per layer in layer_info: its table group (index into `tables` / 4), its rope kind
// (index into `ropes` / 2) and its sliding window (0: full attention).
constexpr int kInfo = 3;

}  // namespace

// x [T, hidden] bf16 or fp32 (packed linears of the same kind): the residual stream,
// updated in place and returned. dims: (num_heads, num_kv_heads, head_dim, hidden,
// intermediate). ropes: (cos, sin) [T, head_dim] per rope kind; tables: (slot_block,
// slot_offset, block_table, seq_lens) per KV cache group.
torch::Tensor gemma_decode_layers(torch::Tensor x, std::vector<torch::Tensor> weights,
                                  std::vector<int64_t> layer_info, std::vector<int64_t> dims,
                                  double eps, double scale, double softcap,
                                  std::vector<torch::Tensor> ropes,
                                  std::vector<torch::Tensor> tables) {
  TORCH_CHECK(weights.size() % NUM_SLOTS == 0, "gemma_decode_layers: ", NUM_SLOTS,
              " tensors per layer");
  const size_t num_layers = weights.size() / NUM_SLOTS;
  TORCH_CHECK(layer_info.size() == kInfo * num_layers, "gemma_decode_layers: ", kInfo,
              " ints per layer");
  TORCH_CHECK(dims.size() == 5, "gemma_decode_layers: 5 dims");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "gemma_decode_layers: x must be [T, hidden]");
  TORCH_CHECK(ropes.size() % 2 == 0 && tables.size() % 4 == 0,
              "gemma_decode_layers: (cos, sin) per rope kind, 4 tensors per table group");
  const int64_t hq = dims[0], hkv = dims[1], d = dims[2], hidden = dims[3], inter = dims[4];
  const int64_t t = x.size(0), q_size = hq * d, kv_size = hkv * d;
  const bool f32 = x.scalar_type() == at::kFloat;
  // GemmaRMSNorm: fp32 math over the folded fp32 weights, rounded once to x's dtype.
  auto norm = [&](const torch::Tensor& v, const torch::Tensor& w1) {
    const int64_t n = v.size(-1);
    return f32 ? at::rms_norm(v, {n}, w1, eps)
               : at::rms_norm(v.to(at::kFloat), {n}, w1, eps).to(v.scalar_type());
  };
  auto linear = [&](const torch::Tensor& v, const torch::Tensor& packed, int64_t n,
                    const torch::Tensor& bias) {
    return f32 ? linear_f32(v, packed, n, bias) : linear_bf16(v, packed, n, bias);
  };
  const torch::Tensor none;
  // One parallel region for every layer of a small step (parallel.h), as decode_layers.
  tmpar::with_team_for_rows(t, [&] {
    for (size_t l = 0; l < num_layers; ++l) {
      const torch::Tensor* w = weights.data() + l * NUM_SLOTS;
      const int64_t group = layer_info[kInfo * l], kind = layer_info[kInfo * l + 1],
                    window = layer_info[kInfo * l + 2];
      TORCH_CHECK(4 * group + 3 < static_cast<int64_t>(tables.size()) &&
                      2 * kind + 1 < static_cast<int64_t>(ropes.size()),
                  "gemma_decode_layers: layer ", l, " names a missing table or rope");
      const torch::Tensor& cos = ropes[2 * kind];
      const torch::Tensor& sin = ropes[2 * kind + 1];
      const torch::Tensor* tab = tables.data() + 4 * group;
      // Gemma3Attention.forward: q/k Gemma norms per head, written back, then rope.
      torch::Tensor h = norm(x, w[INPUT_NORM]);
      torch::Tensor qkv = linear(h, w[QKV], q_size + 2 * kv_size, w[QKV_BIAS]);
      torch::Tensor qv = qkv.narrow(1, 0, q_size);
      torch::Tensor kv = qkv.narrow(1, q_size, kv_size);
      qv.copy_(norm(qv.reshape({t, hq, d}), w[Q_NORM]).view({t, q_size}));
      kv.copy_(norm(kv.reshape({t, hkv, d}), w[K_NORM]).view({t, kv_size}));
      torch::Tensor q = qk_norm_rope(qkv, none, none, cos, sin, hq, hkv, d, d, 0.0);
      torch::Tensor k = kv.view({t, hkv, d});
      torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, hkv, d});
      // PagedAttention.forward, decode-only, on the layer's group.
      kv_cache_write(w[KV_CACHE], k, v, tab[0], tab[1]);
      torch::Tensor attn =
          paged_decode(q.contiguous(), w[KV_CACHE], tab[2], tab[3], scale, window, softcap)
              .view({t, -1});
      torch::Tensor o = linear(attn, w[O_PROJ], hidden, w[O_BIAS]);
      // Gemma3DecoderLayer.forward: x + post_attn(o), then the MLP between its norms.
      x.add_(norm(o, w[POST_ATTN_NORM]));
      h = norm(x, w[PRE_FF_NORM]);
      torch::Tensor act = gelu_tanh_mul(linear(h, w[GATE_UP], 2 * inter, none));
      x.add_(norm(linear(act, w[DOWN], hidden, none), w[POST_FF_NORM]));
    }
  });
  return x;
}
