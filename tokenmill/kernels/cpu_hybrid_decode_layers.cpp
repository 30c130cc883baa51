// Every decoder layer of a Qwen3.5 / Qwen3-Next model (dense MLPs) for a decode-only
// step, in one call.
//
// Why: a one-row hybrid step ran ~110 ATen and native calls from nn.Module code, and
// at batch 1 the interpreter between them was ~18% of the step (bench-qwen3.5-512,
// bf16: 1.6 of 8.7 ms). This loop makes the calls the Python layers make with the
// native kernels (tokenmill/models/qwen3_next.py: HybridDecoderLayer through
// PreNormBlock.forward_deferred, GatedAttention, ZeroCenteredRMSNorm; layers/
// gated_deltanet.py: GatedDeltaNet.forward when every row is one sequence, GatedRMSNorm;
// GatedMLP), in the same order with the same arguments, so the residual stream is
// bit-identical to theirs. Where the Python layers use PyTorch ops (the attention's
// partial rotary and output gate) this loop calls the same ATen ops. Which steps take it is decided in Python (models/layers/hybrid_decode_layers.py).
#include "decode_linear.h"
#include "ops.h"
#include "parallel.h"

namespace {

using tmdecode::LINEAR_SLOTS;

// The tensors of one layer in `weights`, in this order; each linear is LINEAR_SLOTS long.
// The token mixer's slots are shared by its two kinds: a Gated DeltaNet layer's in_proj,
// conv weight [C, K], A_log, dt_bias, gated norm weight, conv state [S, K-1, C] and ssm
// state [S, Hv, Dv, Dk] (fp32), out_proj; an attention layer's qkv_proj (q and its gate
// interleaved per head), q / k norm weights, KV cache, o_proj (two slots empty).
enum Slot {
  INPUT_NORM,
  MIX_IN,
  CONV_W = MIX_IN + LINEAR_SLOTS, A_LOG, DT_BIAS, GATED_NORM, CONV_STATE, SSM_STATE,
  MIX_OUT,
  POST_NORM = MIX_OUT + LINEAR_SLOTS,
  GATE_UP,
  DOWN = GATE_UP + LINEAR_SLOTS,
  NUM_SLOTS = DOWN + LINEAR_SLOTS,
  Q_NORM = CONV_W, K_NORM = A_LOG, KV_CACHE = DT_BIAS
};

// A layer's linears in `quant` (linear_quant's bits and group size each; bits 0: packed).
enum QuantSlot { Q_MIX_IN, Q_MIX_OUT, Q_GATE_UP, Q_DOWN, NUM_LINEARS };

}  // namespace

// x [T, hidden] bf16 (packed bf16 linears) or fp32 (packed fp32 linears): the residual
// stream, updated in place through
// every layer (each MLP output added) and returned; the final norm is the caller's.
// linear_layers: per layer 1 for Gated DeltaNet, 0 for gated attention.
// dims: (num_heads, num_kv_heads, head_dim, rotary_dim, hidden, intermediate,
//        linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
//        linear_value_head_dim).
// quant: per layer and linear (NUM_LINEARS each), linear_quant's (bits, group size).
// scale: the attention layers' softmax scale; q_scale: the DeltaNet layers' query scale.
// cos / sin [T, 1, rotary_dim]; slot_block / slot_offset [T], block_table [T, max_nb]
// int32 and seq_lens [T] int32: the attention layers' KV cache group;
// query_start_loc [T + 1] int64 (one token a row) and state_indices [T] int64: the
// DeltaNet layers' rows and their state slots (read and written in place);
// kv_scales: per layer (k_scale, v_scale) of an fp8 cache, or empty (all 1.0);
// decode_steps: empty, or a speculative step's (rows [m], read slots [m], write slots [m])
// for token j = 0, 1, ... of every row that has one (StateMetadata.decode_steps; then
// query_start_loc / state_indices are not read).
torch::Tensor hybrid_decode_layers(torch::Tensor x, std::vector<torch::Tensor> weights,
                                   std::vector<int64_t> linear_layers,
                                   std::vector<int64_t> dims, std::vector<int64_t> quant,
                                   double eps, double scale, double q_scale, torch::Tensor cos,
                                   torch::Tensor sin, torch::Tensor slot_block,
                                   torch::Tensor slot_offset, torch::Tensor block_table,
                                   torch::Tensor seq_lens, torch::Tensor query_start_loc,
                                   torch::Tensor state_indices, std::vector<double> kv_scales,
                                   std::vector<torch::Tensor> decode_steps) {
  TORCH_CHECK(weights.size() % NUM_SLOTS == 0, "hybrid_decode_layers: ", NUM_SLOTS,
              " tensors per layer");
  const size_t num_layers = weights.size() / NUM_SLOTS;
  TORCH_CHECK(linear_layers.size() == num_layers, "hybrid_decode_layers: one kind per layer");
  TORCH_CHECK(quant.size() == num_layers * NUM_LINEARS * 2, "hybrid_decode_layers: ",
              NUM_LINEARS * 2, " quant entries per layer");
  TORCH_CHECK(kv_scales.empty() || kv_scales.size() == num_layers * 2,
              "hybrid_decode_layers: kv_scales must be empty or (k_scale, v_scale) per layer");
  TORCH_CHECK(dims.size() == 10, "hybrid_decode_layers: 10 dims");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "hybrid_decode_layers: x must be [T, hidden]");
  const int64_t hq = dims[0], hkv = dims[1], d = dims[2], rd = dims[3], hidden = dims[4],
                inter = dims[5], nk = dims[6], nv = dims[7], dk = dims[8], dv = dims[9];
  const int64_t t = x.size(0), q_size = hq * d, kv_size = hkv * d;
  const int64_t key_dim = nk * dk, value_dim = nv * dv, conv_dim = 2 * key_dim + value_dim;
  TORCH_CHECK(decode_steps.size() % 3 == 0,
              "hybrid_decode_layers: decode_steps must be (rows, read slots, write slots) triples");
  const size_t num_steps = decode_steps.size() / 3;
  TORCH_CHECK(num_steps > 0 || (query_start_loc.numel() == t + 1 && state_indices.numel() == t),
              "hybrid_decode_layers: one token and one state slot a row");
  const bool f32 = x.scalar_type() == at::kFloat;

  // ZeroCenteredRMSNorm.forward / add_forward and GatedRMSNorm.forward: their native
  // kernels, which they take in every dtype (`native_fp32_norm`).
  auto norm = [&](const torch::Tensor& v, const torch::Tensor& w) {
    return rms_norm_zero_centered(v, w, eps);
  };
  auto add_norm = [&](torch::Tensor& residual, const torch::Tensor& v, const torch::Tensor& w) {
    return add_rms_norm_zero_centered_(residual, v, w, eps);
  };
  // RotaryEmbedding.apply: neox rotary on the first rd features, the rest passed through.
  auto rope = [&](const torch::Tensor& v) {
    if (rd == d) {
      auto half = v.chunk(2, -1);
      return v * cos + at::cat({-half[1], half[0]}, -1) * sin;
    }
    torch::Tensor vr = v.narrow(-1, 0, rd), vp = v.narrow(-1, rd, d - rd);
    auto half = vr.chunk(2, -1);
    return at::cat({vr * cos + at::cat({-half[1], half[0]}, -1) * sin, vp}, -1);
  };
  auto linear = [&](const torch::Tensor& v, const torch::Tensor* lin, int64_t n,
                    const int64_t* bits_group) {
    return tmdecode::linear(v, lin, n, bits_group, f32);
  };

  // One parallel region for every layer of a small step (parallel.h), as decode_layers.
  tmpar::with_team_for_rows(t, [&] {
    torch::Tensor pending;  // the layer before's MLP output, added by this layer's norm
    for (size_t l = 0; l < num_layers; ++l) {
      const torch::Tensor* w = weights.data() + l * NUM_SLOTS;
      const int64_t* lq = quant.data() + l * NUM_LINEARS * 2;
      torch::Tensor h = pending.defined() ? add_norm(x, pending, w[INPUT_NORM])
                                          : norm(x, w[INPUT_NORM]);
      torch::Tensor mixed_out;
      if (linear_layers[l]) {
        // GatedDeltaNet.forward, every row one sequence: in_proj, the conv and the rule
        // over the whole step in place on the rows' slots, the gated norm, out_proj.
        torch::Tensor proj = linear(h, w + MIX_IN, conv_dim + value_dim + 2 * nv,
                                    lq + 2 * Q_MIX_IN);
        torch::Tensor mixed = proj.narrow(1, 0, conv_dim);
        torch::Tensor z = proj.narrow(1, conv_dim, value_dim);
        torch::Tensor b = proj.narrow(1, conv_dim + value_dim, nv);
        torch::Tensor a = proj.narrow(1, conv_dim + value_dim + nv, nv);
        torch::Tensor conv_out, core;
        if (num_steps == 0) {
          conv_out = causal_conv1d_silu(mixed, w[CONV_STATE], w[CONV_W], query_start_loc,
                                        state_indices, state_indices);
          core = gated_delta_rule_qkv(conv_out, a, b, w[A_LOG], w[DT_BIAS], w[SSM_STATE],
                                      query_start_loc, state_indices, state_indices, nk, q_scale);
        } else {
          // Speculation (GatedDeltaNet._by_pieces): token j of every row that has one, in
          // order j = 0, 1, ..., each a one-token sequence from its read slot to its write
          // slot; the conv's steps, then the rule's.
          conv_out = at::empty_like(mixed);
          for (size_t s = 0; s < num_steps; ++s) {
            const torch::Tensor& rows = decode_steps[3 * s];
            const torch::Tensor cu = at::arange(rows.numel() + 1, rows.options());
            conv_out.index_put_({rows}, causal_conv1d_silu(mixed.index({rows}), w[CONV_STATE],
                                                           w[CONV_W], cu, decode_steps[3 * s + 1],
                                                           decode_steps[3 * s + 2]));
          }
          core = at::empty({t, nv, dv}, x.options().dtype(at::kFloat));
          for (size_t s = 0; s < num_steps; ++s) {
            const torch::Tensor& rows = decode_steps[3 * s];
            const torch::Tensor cu = at::arange(rows.numel() + 1, rows.options());
            core.index_put_({rows}, gated_delta_rule_qkv(
                                        conv_out.index({rows}), a.index({rows}), b.index({rows}),
                                        w[A_LOG], w[DT_BIAS], w[SSM_STATE], cu,
                                        decode_steps[3 * s + 1], decode_steps[3 * s + 2], nk,
                                        q_scale));
          }
        }
        core = gated_rms_norm(core, z.reshape({t, nv, dv}), w[GATED_NORM], eps);
        mixed_out = linear(core.reshape({t, value_dim}), w + MIX_OUT, hidden, lq + 2 * Q_MIX_OUT);
      } else {
        // GatedAttention.forward: q and its gate per head, the q / k norms, rotary, the
        // paged KV cache (CpuNativeAttentionImpl's decode calls), the gate, o_proj.
        torch::Tensor qkv = linear(h, w + MIX_IN, 2 * q_size + 2 * kv_size, lq + 2 * Q_MIX_IN);
        auto qg = qkv.narrow(1, 0, 2 * q_size).view({t, hq, 2 * d}).chunk(2, -1);
        torch::Tensor q = norm(qg[0], w[Q_NORM]);
        torch::Tensor k = norm(qkv.narrow(1, 2 * q_size, kv_size).view({t, hkv, d}), w[K_NORM]);
        torch::Tensor v = qkv.narrow(1, 2 * q_size + kv_size, kv_size).view({t, hkv, d});
        q = rope(q);
        k = rope(k);
        const double ks = kv_scales.empty() ? 1.0 : kv_scales[2 * l],
                     vs = kv_scales.empty() ? 1.0 : kv_scales[2 * l + 1];
        kv_cache_write(w[KV_CACHE], k, v, slot_block, slot_offset, ks, vs);
        torch::Tensor attn = paged_decode(q.contiguous(), w[KV_CACHE], block_table, seq_lens,
                                          scale, 0, 0.0, ks, vs)
                                 .view({t, hq, d}) *
                             at::sigmoid(qg[1]);
        mixed_out = linear(attn.view({t, q_size}), w + MIX_OUT, hidden, lq + 2 * Q_MIX_OUT);
      }
      // The MLP block: post_attention_layernorm.add_forward, GatedMLP.forward; its output
      // is added by the next layer's input norm (PreNormBlock.forward_deferred).
      h = add_norm(x, mixed_out, w[POST_NORM]);
      torch::Tensor act = silu_mul(linear(h, w + GATE_UP, 2 * inter, lq + 2 * Q_GATE_UP));
      pending = linear(act, w + DOWN, hidden, lq + 2 * Q_DOWN);
    }
    if (pending.defined()) x.add_(pending);
  });
  return x;
}
