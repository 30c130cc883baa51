// Every decoder layer of a dense Gemma 4 text model for a decode-only step, in one call.
//
// The same operations, in the same order, as the Python layers make with the native
// kernels (tokenmill/models/gemma4.py: Gemma4DecoderLayer, Gemma4Attention,
// Gemma4RMSNorm, GeluTanhMLP, PagedAttention), so the residual stream is
// bit-identical to theirs: packed linears, kv_cache_write, paged_decode and
// gelu_tanh_mul where they call them, the same ATen ops elsewhere (Gemma 4's norm
// x * (mean(x^2) + eps)^-0.5 [* w] in fp32, the rope, the per-layer input gate).
// Against Gemma 3's loop (cpu_gemma_decode_layers.cpp) each layer has its own shape
// (global layers: their head_dim and KV heads), V is normalised without a weight,
// k = v layers take V from the K rows, KV-shared layers compute queries only and read
// their source's cache (bound as theirs) without writing, an optional per-layer input
// branch follows the MLP, and the layer's output is scaled by its layer_scalar.
// MoE layers are not here: such models keep their Python layers.
#include "ops.h"
#include "parallel.h"

namespace {

enum Slot {
  INPUT_NORM, QKV, QKV_BIAS, Q_NORM, K_NORM, KV_CACHE, O_PROJ, O_BIAS,
  POST_ATTN_NORM, PRE_FF_NORM, GATE_UP, DOWN, POST_FF_NORM,
  PLE_GATE, PLE_PROJ, PLE_NORM, LAYER_SCALAR, NUM_SLOTS
};

// Per layer in layer_info: table group (index into `tables` / 4), rope kind (index into
// `ropes` / 2), sliding window (0: full), KV heads, head_dim, MLP intermediate size,
// k = v (0/1), KV-shared (0/1: no K/V rows, no cache write), per-layer input (0/1).
enum Info { GROUP, KIND, WINDOW, KV_HEADS, HEAD_DIM, INTER, K_EQ_V, SHARED, PLE, NUM_INFO };

}  // namespace

// x [T, hidden] bf16 or fp32 (packed linears of the same kind): the residual stream,
// updated in place and returned. per_layer: [T, num_layers, P] per-layer inputs, or
// empty. ropes: (cos, sin) [T, 1, head_dim] per rope kind; tables: (slot_block,
// slot_offset, block_table, seq_lens) per KV cache group.
torch::Tensor gemma4_decode_layers(torch::Tensor x, std::vector<torch::Tensor> weights,
                                   std::vector<int64_t> layer_info, int64_t num_heads,
                                   double eps, torch::Tensor per_layer,
                                   std::vector<torch::Tensor> ropes,
                                   std::vector<torch::Tensor> tables) {
  TORCH_CHECK(weights.size() % NUM_SLOTS == 0, "gemma4_decode_layers: ", NUM_SLOTS,
              " tensors per layer");
  const size_t num_layers = weights.size() / NUM_SLOTS;
  TORCH_CHECK(layer_info.size() == NUM_INFO * num_layers, "gemma4_decode_layers: ",
              static_cast<int>(NUM_INFO), " ints per layer");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "gemma4_decode_layers: x must be [T, hidden]");
  TORCH_CHECK(ropes.size() % 2 == 0 && tables.size() % 4 == 0,
              "gemma4_decode_layers: (cos, sin) per rope kind, 4 tensors per table group");
  const int64_t t = x.size(0), hidden = x.size(1), hq = num_heads;
  const bool f32 = x.scalar_type() == at::kFloat;
  // Gemma4RMSNorm.forward: fp32 math, the weight (if any) in fp32, rounded once.
  auto norm = [&](const torch::Tensor& v, const torch::Tensor& w) {
    torch::Tensor vf = v.to(at::kFloat);
    vf = vf * at::pow(vf.pow(2).mean(-1, true) + eps, -0.5);
    if (w.defined() && w.numel()) vf = vf * w.to(at::kFloat);
    return vf.to(v.scalar_type());
  };
  // RotaryEmbedding.apply over the whole head.
  auto rope = [](const torch::Tensor& v, const torch::Tensor& cos, const torch::Tensor& sin) {
    auto halves = v.chunk(2, -1);
    return v * cos + at::cat({-halves[1], halves[0]}, -1) * sin;
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
      const int64_t* info = layer_info.data() + l * NUM_INFO;
      const int64_t hkv = info[KV_HEADS], d = info[HEAD_DIM], inter = info[INTER];
      const bool k_eq_v = info[K_EQ_V] != 0, shared = info[SHARED] != 0;
      TORCH_CHECK(4 * info[GROUP] + 3 < static_cast<int64_t>(tables.size()) &&
                      2 * info[KIND] + 1 < static_cast<int64_t>(ropes.size()),
                  "gemma4_decode_layers: layer ", l, " names a missing table or rope");
      TORCH_CHECK(!info[PLE] || (per_layer.dim() == 3 && per_layer.size(1) ==
                                 static_cast<int64_t>(num_layers)),
                  "gemma4_decode_layers: per_layer must be [T, num_layers, P]");
      const torch::Tensor& cos = ropes[2 * info[KIND]];
      const torch::Tensor& sin = ropes[2 * info[KIND] + 1];
      const torch::Tensor* tab = tables.data() + 4 * info[GROUP];
      const int64_t q_size = hq * d, k_size = shared ? 0 : hkv * d;
      const int64_t v_size = k_eq_v ? 0 : k_size;
      // Gemma4Attention.forward
      torch::Tensor h = norm(x, w[INPUT_NORM]);
      torch::Tensor qkv = linear(h, w[QKV], q_size + k_size + v_size, w[QKV_BIAS]);
      torch::Tensor q = rope(norm(qkv.narrow(1, 0, q_size).reshape({t, hq, d}), w[Q_NORM]),
                             cos, sin);
      if (!shared) {  // (a shared layer's source wrote this step's K/V already)
        torch::Tensor k = qkv.narrow(1, q_size, k_size);
        torch::Tensor v = k_eq_v ? k : qkv.narrow(1, q_size + k_size, v_size);
        v = norm(v.reshape({t, hkv, d}), none);
        k = rope(norm(k.reshape({t, hkv, d}), w[K_NORM]), cos, sin);
        kv_cache_write(w[KV_CACHE], k, v, tab[0], tab[1]);
      }
      torch::Tensor attn =
          paged_decode(q.contiguous(), w[KV_CACHE], tab[2], tab[3], 1.0, info[WINDOW], 0.0)
              .view({t, -1});
      torch::Tensor o = linear(attn, w[O_PROJ], hidden, w[O_BIAS]);
      // Gemma4DecoderLayer.forward: the dense MLP between its norms, the per-layer input
      // branch, the layer scalar.
      x.add_(norm(o, w[POST_ATTN_NORM]));
      h = norm(x, w[PRE_FF_NORM]);
      torch::Tensor act = gelu_tanh_mul(linear(h, w[GATE_UP], 2 * inter, none));
      x.add_(norm(linear(act, w[DOWN], hidden, none), w[POST_FF_NORM]));
      if (info[PLE]) {
        const int64_t p = per_layer.size(2);
        torch::Tensor g = at::gelu(linear(x, w[PLE_GATE], p, none), "tanh") *
                          per_layer.select(1, static_cast<int64_t>(l));
        x.add_(norm(linear(g, w[PLE_PROJ], hidden, none), w[PLE_NORM]));
      }
      x.mul_(w[LAYER_SCALAR]);
    }
  });
  return x;
}
