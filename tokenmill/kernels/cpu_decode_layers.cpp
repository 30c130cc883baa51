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
#include <cstring>

#include "decode_linear.h"
#include "ops.h"
#include "parallel.h"

namespace {

using tmdecode::LINEAR_SLOTS;

// The tensors of one layer in `weights`, in this order; each linear is LINEAR_SLOTS long.
enum Slot {
  INPUT_NORM,
  QKV,
  Q_NORM = QKV + LINEAR_SLOTS, K_NORM, KV_CACHE,
  O_PROJ,
  POST_NORM = O_PROJ + LINEAR_SLOTS,
  GATE_UP,
  DOWN = GATE_UP + LINEAR_SLOTS,
  NUM_SLOTS = DOWN + LINEAR_SLOTS
};

// A layer's linears in `quant` (linear_quant's bits and group size each; bits 0: packed
// bf16 / fp32).
enum QuantSlot { Q_QKV, Q_O, Q_GATE_UP, Q_DOWN, NUM_LINEARS };

// Column block j of taps [T, n * hidden] = x [T, hidden], as row copies: an ATen narrow
// and copy_ cost microseconds of dispatch each, every step of a drafting engine.
void copy_tap(const torch::Tensor& x, torch::Tensor& taps, int64_t j, int64_t n) {
  const int64_t t = x.size(0), row = x.size(1) * x.element_size();
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(taps.data_ptr()) + j * row;
  for (int64_t r = 0; r < t; ++r) std::memcpy(dst + r * n * row, src + r * row, row);
}

}  // namespace

// x [T, hidden] bf16 (packed bf16 linears) or fp32 (packed fp32 linears): the residual
// stream, updated in place and returned.
// dims: (num_heads, num_kv_heads, head_dim, rotary_dim, hidden, intermediate[, window]),
// window > 0: every layer attends over a sliding window of that many positions;
// quant: per layer and linear (NUM_LINEARS each), linear_quant's bits (4, 8 or
// kQuantE4m3) and group size, bits 0 for a packed float linear;
// cos / sin [T, 1, rotary_dim]; slot_block / slot_offset [T]: where each token's
// K/V go; block_table [T, max_nb] int32 and seq_lens [T] int32 of the decode rows;
// kv_scales: per layer its fp8 cache's (k_scale, v_scale), or empty (all 1.0).
// taps [T, n * hidden] with tap_layers [n]: a drafter's hidden-state taps
// (models/layers/taps.py); column block j gets a copy of x as it enters layer
// tap_layers[j] of this call (entries outside [0, layers) are left alone). Taken here,
// one call serves a step whose taps would otherwise split the loop into several.
torch::Tensor decode_layers(torch::Tensor x, std::vector<torch::Tensor> weights,
                            std::vector<int64_t> dims, std::vector<int64_t> quant,
                            double eps, double scale, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_block,
                            torch::Tensor slot_offset, torch::Tensor block_table,
                            torch::Tensor seq_lens, std::vector<double> kv_scales,
                            std::optional<torch::Tensor> taps,
                            std::vector<int64_t> tap_layers) {
  TORCH_CHECK(weights.size() % NUM_SLOTS == 0, "decode_layers: ", NUM_SLOTS,
              " tensors per layer");
  TORCH_CHECK(dims.size() == 6 || dims.size() == 7, "decode_layers: 6 or 7 dims");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode_layers: x must be [T, hidden]");
  const int64_t hq = dims[0], hkv = dims[1], d = dims[2], rd = dims[3], hidden = dims[4],
                inter = dims[5], window = dims.size() == 7 ? dims[6] : 0;
  const int64_t t = x.size(0), q_size = hq * d, kv_size = hkv * d;
  const size_t num_layers = weights.size() / NUM_SLOTS;
  const int64_t num_taps = static_cast<int64_t>(tap_layers.size());
  if (num_taps > 0) {
    TORCH_CHECK(taps.has_value() && taps->dim() == 2 && taps->size(0) == t &&
                    taps->size(1) == num_taps * hidden &&
                    taps->scalar_type() == x.scalar_type() && taps->is_contiguous(),
                "decode_layers: taps must be contiguous [T, len(tap_layers) * hidden] in x's dtype");
  }
  TORCH_CHECK(quant.size() == num_layers * NUM_LINEARS * 2, "decode_layers: ",
              NUM_LINEARS * 2, " quant entries per layer");
  TORCH_CHECK(kv_scales.empty() || kv_scales.size() == num_layers * 2,
              "decode_layers: kv_scales must be empty or (k_scale, v_scale) per layer");
  // fp32 models (packed fp32 linears): the Python layers' fp32 norms are PyTorch's
  // rms_norm (HF's formula), so the loop calls the same ATen op there.
  const bool f32 = x.scalar_type() == at::kFloat;
  auto norm = [&](const torch::Tensor& v, const torch::Tensor& weight) {
    return f32 ? at::rms_norm(v, {hidden}, weight, eps) : rms_norm(v, weight, eps);
  };
  // As Linear.forward through the layer's method (decode_linear.h).
  auto linear = [&](const torch::Tensor& v, const torch::Tensor* lin, int64_t n,
                    const int64_t* bits_group) {
    return tmdecode::linear(v, lin, n, bits_group, f32);
  };
  // One parallel region for every layer of a small step: the linears' and attention's
  // loops are handed to its waiting threads (parallel.h) instead of each forking its own.
  tmpar::with_team_for_rows(t, [&] {
    for (size_t l = 0; l < num_layers; ++l) {
      const torch::Tensor* w = weights.data() + l * NUM_SLOTS;
      const int64_t* lq = quant.data() + l * NUM_LINEARS * 2;
      for (int64_t j = 0; j < num_taps; ++j)
        if (tap_layers[j] == static_cast<int64_t>(l)) copy_tap(x, *taps, j, num_taps);
      // Attention block: DecoderLayer.input_layernorm, Attention.forward.
      torch::Tensor h = norm(x, w[INPUT_NORM]);
      torch::Tensor qkv = linear(h, w + QKV, q_size + 2 * kv_size, lq + 2 * Q_QKV);
      torch::Tensor q = qk_norm_rope(qkv, w[Q_NORM], w[K_NORM], cos, sin, hq, hkv, d, rd,
                                     w[Q_NORM].numel() > 0 ? eps : 0.0);
      torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({t, hkv, d});
      torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, hkv, d});
      // PagedAttention.forward, decode-only (CpuNativeAttentionImpl's calls).
      const double ks = kv_scales.empty() ? 1.0 : kv_scales[2 * l],
                   vs = kv_scales.empty() ? 1.0 : kv_scales[2 * l + 1];
      kv_cache_write(w[KV_CACHE], k, v, slot_block, slot_offset, ks, vs);
      torch::Tensor attn = paged_decode(q.contiguous(), w[KV_CACHE], block_table, seq_lens,
                                        scale, window, 0.0, ks, vs)
                               .view({t, -1});
      torch::Tensor o = linear(attn, w + O_PROJ, hidden, lq + 2 * Q_O);
      // MLP block: post_attention_layernorm.add_forward, GatedMLP.forward, the residual add.
      h = f32 ? norm(x.add_(o), w[POST_NORM]) : add_rms_norm_(x, o, w[POST_NORM], eps);
      torch::Tensor act = silu_mul(linear(h, w + GATE_UP, 2 * inter, lq + 2 * Q_GATE_UP));
      x.add_(linear(act, w + DOWN, hidden, lq + 2 * Q_DOWN));
    }
  });
  return x;
}
