// The entry points of tokenmill's native CPU kernels, shared by the Python
// bindings (bindings.cpp) and the kernels that call each other.
//
// The kernels include ATen, not <torch/extension.h>: that header (pybind11 and the
// whole C++ frontend) costs ~25 s of compile per file, and every capability level
// compiles them all. Only bindings.cpp includes pybind11 (<torch/python.h>).
// torch:: names resolve to ATen's, as <torch/types.h> makes them.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

namespace torch {
using namespace at;  // NOLINT: as torch/types.h
}  // namespace torch

// The capability level this build is for (-DTOKENMILL_CPU_LEVEL=avx2 ...), as a string.
#ifndef TOKENMILL_CPU_LEVEL
#define TOKENMILL_CPU_LEVEL unknown
#endif
#define TOKENMILL_STR2(x) #x
#define TOKENMILL_STR(x) TOKENMILL_STR2(x)
#define TOKENMILL_CPU_LEVEL_NAME TOKENMILL_STR(TOKENMILL_CPU_LEVEL)

// k_scale / v_scale: an fp8 cache's per-layer scales (the cache holds K / k_scale and
// V / v_scale): the scores and the output are multiplied back by them; 1.0 otherwise.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv, torch::Tensor block_table,
                           torch::Tensor seq_lens, double scale, int64_t window,
                           double softcap, double k_scale = 1.0, double v_scale = 1.0);
// Flash-style prefill over the paged cache (cpu_paged_prefill.cpp): every prompt chunk
// of a step after its cached prefix; q [Tq, Hq, D], query_start_loc [P + 1] int64,
// seq_lens [P] int32 (prefix + chunk), block_table [P, max_nb] int32 -> [Tq, Hq, D].
torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor kv, torch::Tensor block_table,
                            torch::Tensor query_start_loc, torch::Tensor seq_lens,
                            double scale, int64_t window, double softcap);
// float8_e4m3fn codes [n] (uint8) widened to fp32 [n] by this level's vec_fp8.h.
torch::Tensor widen_e4m3(torch::Tensor codes);
// MLA's latent-space decode (cpu_mla_decode.cpp): q [nd, H, R + rope] against cache
// [num_blocks, bs, R + rope] -> [nd, H, R]; span_tokens > 0 forces the split-K span.
torch::Tensor mla_decode(torch::Tensor q, torch::Tensor cache, torch::Tensor block_table,
                         torch::Tensor seq_lens, double scale, int64_t kv_lora_rank,
                         int64_t span_tokens);
torch::Tensor pack_bf16_weight(torch::Tensor w);
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor bias);
// The same for fp32 weights: packed [ceil(N/32), K, 32] fp32, x fp32.
torch::Tensor pack_f32_weight(torch::Tensor w);
torch::Tensor linear_f32(torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor bias);
// src [n] bf16 -> dst [n] fp32 (cpu_linear.cpp), by every thread when n is large (a
// linear's prefill-sized input), inline otherwise.
void widen_bf16(const c10::BFloat16* src, float* dst, int64_t n);
// One packed 32-column block for `rows` rows, exactly as linear_bf16 computes it (no bias);
// `x_bf16`: x holds bf16 values (linear_bf16 was given bf16 x: its many-row path differs).
void linear_bf16_block(const float* x, int64_t K, const uint16_t* wblock, float* y, int64_t ldy,
                       int64_t rows, int64_t ncols, bool x_bf16 = false);
// linear_bf16's many-row path for bf16 x on vdpbf16ps (cpu_linear_dot.cpp): the row
// count from which linear_bf16 takes it (0: not built at this level); x [M, K] bf16,
// packed weights, bias [N] fp32 or null -> y [M, N] into yf (fp32) or yb (bf16).
int64_t linear_bf16_dot_rows();
void linear_bf16_dot(const c10::BFloat16* x, int64_t M, int64_t K, const uint16_t* packed,
                     int64_t N, const float* bias, float* yf, c10::BFloat16* yb);
// The driver of linear_bf16_dot over any source of 32-column weight blocks: `pairs`
// writes pairs [p0, p0 + np) of block b as pair words [np, 32] (pair word p of column c:
// bf16 (w[2p][c], w[2p + 1][c]), a K past the end 0; cpu_linear_dot.cpp), into a
// per-thread scratch it then multiplies on vdpbf16ps. `bf16_blocks`: linear_bf16's
// packed blocks (few rows then read them in registers, no scratch), or null.
struct DotPairSource {
  virtual void pairs(int64_t b, int64_t p0, int64_t np, uint32_t* dst) const = 0;
  virtual const uint16_t* bf16_blocks() const { return nullptr; }

 protected:
  ~DotPairSource() = default;
};
void linear_dot_gemm(const c10::BFloat16* x, int64_t M, int64_t K, int64_t N,
                     const DotPairSource& w, const float* bias, float* yf, c10::BFloat16* yb);
// linear_dot_gemm on AMX tiles (cpu_linear_amx.cpp; the amx level only): y's row
// stride ldy. amx_dot_ready(): this process may use the tiles (the OS grants them on
// request); false where the level has no AMX.
void amx_dot_gemm(const c10::BFloat16* x, int64_t M, int64_t K, int64_t N,
                  const DotPairSource& w, const float* bias, float* yf, c10::BFloat16* yb,
                  int64_t ldy);
bool amx_dot_ready();
// Its cache blocking, [x_chunk_bytes, w_group_bytes, kc2, direct_rows] (empty: keep) ->
// the values before (empty where the level has no such path): the benchmark's sweeps.
std::vector<int64_t> linear_bf16_dot_tuning(std::vector<int64_t> values);
// One packed block for `rows` bf16 rows, as linear_bf16_dot computes it (no bias).
void linear_bf16_dot_block(const c10::BFloat16* x, int64_t rows, int64_t K,
                           const uint16_t* wblock, float* y, int64_t ldy, int64_t ncols);
void linear_f32_block(const float* x, int64_t K, const float* wblock, float* y, int64_t ldy,
                      int64_t rows, int64_t ncols);
// Integer-quantized weights (cpu_quant_linear.cpp): codes uint8 [N, K], scales fp32 [N, G],
// zeros uint8 [N, G] -> (codes [N/32, K, 32 or 16] uint8, scales [N/32, G, 32] fp32 or
// fp16, zeros [N/32, G, 32] uint8), the layout linear_quant / dequantize_quant read;
// `quad` (4 / 8 bits, where has_quant_quad(): the avx2, avx512, avx512_vnni and avx512_bf16 levels):
// codes [N/32, K/4 or K/8, 128], the layout of the integer dot products on 15-bit
// activations (cpu_quant_linear.cpp).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> pack_quant_weight(
    torch::Tensor codes, torch::Tensor scales, torch::Tensor zeros, int64_t bits,
    int64_t group_size, bool quad);
bool has_quant_quad();
torch::Tensor linear_quant(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                           torch::Tensor zeros, int64_t N, int64_t bits, int64_t group_size,
                           torch::Tensor bias);
// Many bf16 rows on vdpbf16ps (avx512_bf16 only: has_quant_dot()): each block's codes
// (plain or quad layout) dequantized to bf16(W') straight into linear_dot_gemm's pair
// scratch; x [M, K] bf16 -> y [M, N] bf16 (fp32 with `fp32_out`).
bool has_quant_dot();
torch::Tensor linear_quant_dot(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                               torch::Tensor zeros, int64_t N, int64_t bits, int64_t group_size,
                               torch::Tensor bias, bool fp32_out);
// Rows r0:r1 (r0 a multiple of 32) of the dequantized [N, K] weights (kernel column
// order), transposed: [K, r1 - r0], the right operand of x @ W^T; fp32, or (bf16) those
// values rounded to bf16 as .to(torch.bfloat16) rounds them.
torch::Tensor dequantize_quant(torch::Tensor codes, torch::Tensor scales, torch::Tensor zeros,
                               int64_t N, int64_t bits, int64_t group_size, int64_t r0,
                               int64_t r1, bool bf16);
// The `bits` of float8_e4m3fn weights in the three above (FP8 checkpoints, fp8 made at
// load): codes e4m3 [N, K] (or their uint8 bits), packed a byte a code as 8-bit ones,
// scales fp32 [N, G] (fp8.py's block scales, one per column and group), zeros empty.
constexpr int64_t kQuantE4m3 = 0xe4;
// logits [M, V] fp32 / bf16 / fp16 -> (argmax ids [M] int64, rows holding a NaN [M]
// bool), torch.argmax's order (cpu_argmax.cpp).
std::tuple<torch::Tensor, torch::Tensor> row_argmax(torch::Tensor logits);
// logits [M, V] fp32 (a random row's tempered, cut logits), u [M] uniforms in [0, 1) ->
// [M] int64: each row's token by the inverse of its cumulative distribution (the first
// whose running sum of exp(x - max) passes u times the row's total), without a
// probabilities tensor (cpu_draw.cpp).
torch::Tensor draw_rows(torch::Tensor logits, torch::Tensor u);
// In place: logits [N, V] fp32 rows rows[i] get -inf where bitmask row i (int32 [R, W],
// xgrammar's packed layout: bit t % 32 of word t / 32 set = token t allowed) forbids a
// token (cpu_bitmask.cpp).
void grammar_bitmask_(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask);
// logprobs [M, V] fp32, chosen [M] (int), k in [0, 64] -> (ids [M, 1 + k] int64, values
// [M, 1 + k] fp32, ranks [M] int64): column 0 the chosen token, then the row's k largest
// (largest first; of equal values the earlier index), the chosen one's rank = 1 + the
// values strictly above it: torch's gather / topk / (x > chosen).sum() in one pass
// (cpu_logprobs.cpp).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> row_logprobs(torch::Tensor logprobs,
                                                                     torch::Tensor chosen,
                                                                     int64_t k);
// logits [M, V] fp32; top_k [M] (int; <= 0 or >= V: none), top_p [M] (>= 1: none),
// min_p [M] (<= 0: none), each or empty -> [M] fp32: each row's smallest value that
// min-p, then top-k, then top-p keep (-inf: every value), by radix select, no sort;
// the values below it set to -inf in place (cpu_top_k_top_p.cpp).
torch::Tensor top_k_top_p_mask_(torch::Tensor logits, torch::Tensor top_k, torch::Tensor top_p,
                                torch::Tensor min_p);
std::tuple<torch::Tensor, int64_t> greedy_lm_head(torch::Tensor x, torch::Tensor packed,
                                                  torch::Tensor q, torch::Tensor scale,
                                                  torch::Tensor coef, torch::Tensor l1w,
                                                  int64_t N);
torch::Tensor qk_norm_rope(torch::Tensor qkv, torch::Tensor q_weight, torch::Tensor k_weight,
                           torch::Tensor cos, torch::Tensor sin, int64_t hq, int64_t hkv,
                           int64_t d, int64_t rd, double eps);
// An fp8 cache stores K / k_scale and V / v_scale (scales 1.0: K and V as they are; any
// other scale only into a float8_e4m3fn cache).
void kv_cache_write(torch::Tensor cache, torch::Tensor k, torch::Tensor v,
                    torch::Tensor slot_block, torch::Tensor slot_offset, double k_scale = 1.0,
                    double v_scale = 1.0);
torch::Tensor silu_mul(torch::Tensor gate_up);
// Qwen3.5 / Qwen3-Next (cpu_norm.cpp): x / rms(x) * (1 + weight) in fp32, rounded once;
// and the gated norm of the delta rule's output, times silu(z).
torch::Tensor rms_norm_zero_centered(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor gated_rms_norm(torch::Tensor x, torch::Tensor z, torch::Tensor weight, double eps);
// residual += x (in place, rounded to the dtype), then the zero-centered norm of it.
torch::Tensor add_rms_norm_zero_centered_(torch::Tensor residual, torch::Tensor x,
                                          torch::Tensor weight, double eps);
// The depthwise causal conv1d + SiLU before the delta rule (cpu_causal_conv.cpp).
torch::Tensor causal_conv1d_silu(torch::Tensor x, torch::Tensor conv_state, torch::Tensor weight,
                                 torch::Tensor cu_seqlens, torch::Tensor read_slots,
                                 torch::Tensor write_slots);
// Gated DeltaNet's delta rule, token by token, each sequence from its state slot
// (cpu_gated_delta.cpp).
torch::Tensor gated_delta_rule(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               torch::Tensor g, torch::Tensor beta, torch::Tensor state,
                               torch::Tensor cu_seqlens, torch::Tensor read_slots,
                               torch::Tensor write_slots);
// The same from the layer's conv output q | k | v and gate inputs a, b: the q / k L2
// norms, g and beta computed in the kernel.
torch::Tensor gated_delta_rule_qkv(torch::Tensor mixed_qkv, torch::Tensor a, torch::Tensor b,
                                   torch::Tensor A_log, torch::Tensor dt_bias,
                                   torch::Tensor state, torch::Tensor cu_seqlens,
                                   torch::Tensor read_slots, torch::Tensor write_slots,
                                   int64_t num_k_heads, double q_scale);
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm_(torch::Tensor residual, torch::Tensor x, torch::Tensor weight,
                            double eps);
torch::Tensor decode_layers(torch::Tensor x, std::vector<torch::Tensor> weights,
                            std::vector<int64_t> dims, std::vector<int64_t> quant,
                            double eps, double scale,
                            torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_block,
                            torch::Tensor slot_offset, torch::Tensor block_table,
                            torch::Tensor seq_lens, std::vector<double> kv_scales = {},
                            std::optional<torch::Tensor> taps = std::nullopt,
                            std::vector<int64_t> tap_layers = {});
torch::Tensor hybrid_decode_layers(torch::Tensor x, std::vector<torch::Tensor> weights,
                                   std::vector<int64_t> linear_layers,
                                   std::vector<int64_t> dims, std::vector<int64_t> quant,
                                   double eps, double scale, double q_scale, torch::Tensor cos,
                                   torch::Tensor sin, torch::Tensor slot_block,
                                   torch::Tensor slot_offset, torch::Tensor block_table,
                                   torch::Tensor seq_lens, torch::Tensor query_start_loc,
                                   torch::Tensor state_indices, std::vector<double> kv_scales,
                                   std::vector<torch::Tensor> decode_steps);
torch::Tensor gemma_decode_layers(torch::Tensor x, std::vector<torch::Tensor> weights,
                                  std::vector<int64_t> layer_info, std::vector<int64_t> dims,
                                  double eps, double scale, double softcap,
                                  std::vector<torch::Tensor> ropes,
                                  std::vector<torch::Tensor> tables);
torch::Tensor gemma4_decode_layers(torch::Tensor x, std::vector<torch::Tensor> weights,
                                   std::vector<int64_t> layer_info, int64_t num_heads,
                                   double eps, torch::Tensor per_layer,
                                   std::vector<torch::Tensor> ropes,
                                   std::vector<torch::Tensor> tables);
