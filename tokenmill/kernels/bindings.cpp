// The Python bindings of tokenmill's native CPU kernels: one extension module per
// capability level (tokenmill/kernels/__init__.py builds the same sources with
// that level's flags and names it in TOKENMILL_CPU_LEVEL).
#include <torch/python.h>  // pybind11 and its Tensor casters, without the C++ frontend

#include "ops.h"
#include "parallel.h"
#include "vec.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode,
        "decode attention over a paged KV cache (window > 0: the last `window` positions)",
        pybind11::arg("q"), pybind11::arg("kv"), pybind11::arg("block_table"),
        pybind11::arg("seq_lens"), pybind11::arg("scale"), pybind11::arg("window") = 0,
        pybind11::arg("softcap") = 0.0, pybind11::arg("k_scale") = 1.0,
        pybind11::arg("v_scale") = 1.0);
  m.def("paged_prefill", &paged_prefill,
        "flash-style prefill attention of every prompt chunk over its paged K/V (causal, "
        "window > 0: the last `window` positions, softcap > 0: capped scores)",
        pybind11::arg("q"), pybind11::arg("kv"), pybind11::arg("block_table"),
        pybind11::arg("query_start_loc"), pybind11::arg("seq_lens"), pybind11::arg("scale"),
        pybind11::arg("window") = 0, pybind11::arg("softcap") = 0.0);
  m.def("widen_e4m3", &widen_e4m3,
        "float8_e4m3fn codes (uint8) -> fp32 through the decode kernel's vector widening",
        pybind11::arg("codes"));
  m.def("mla_decode", &mla_decode,
        "MLA decode attention in the latent space: all heads over each latent row at once",
        pybind11::arg("q"), pybind11::arg("cache"), pybind11::arg("block_table"),
        pybind11::arg("seq_lens"), pybind11::arg("scale"), pybind11::arg("kv_lora_rank"),
        pybind11::arg("span_tokens") = 0);
  m.def("pack_bf16_weight", &pack_bf16_weight, "bf16 [N, K] weights in linear_bf16's layout");
  m.def("linear_bf16", &linear_bf16, "x @ w^T + b with packed bf16 weights, fp32 math");
  m.def("linear_bf16_dot_tuning", &linear_bf16_dot_tuning,
        "the many-row bf16 path's cache blocking (benchmark sweeps): set / get",
        pybind11::arg("values") = std::vector<int64_t>{});
  m.def("pack_f32_weight", &pack_f32_weight, "fp32 [N, K] weights in linear_f32's layout");
  m.def("linear_f32", &linear_f32, "x @ w^T + b with packed fp32 weights");
  m.def("pack_quant_weight", &pack_quant_weight,
        "4- / 8-bit codes, group scales and zero points in linear_quant's layout",
        pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("zeros"),
        pybind11::arg("bits"), pybind11::arg("group_size"), pybind11::arg("quad") = false);
  m.def("linear_quant", &linear_quant,
        "x @ W^T + b with packed 4- / 8-bit weights widened in registers, fp32 math",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"),
        pybind11::arg("zeros"), pybind11::arg("N"), pybind11::arg("bits"),
        pybind11::arg("group_size"), pybind11::arg("bias"));
  m.def("linear_quant_dot", &linear_quant_dot,
        "x @ W^T + b for many bf16 rows: packed quantized weights dequantized to bf16 "
        "pairs for vdpbf16ps (avx512_bf16)",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"),
        pybind11::arg("zeros"), pybind11::arg("N"), pybind11::arg("bits"),
        pybind11::arg("group_size"), pybind11::arg("bias"), pybind11::arg("fp32_out") = false);
  // linear_quant_dot is built (avx512_bf16): the quantized layers' many-row path
  m.attr("has_quant_dot") = has_quant_dot();
  m.def("dequantize_quant", &dequantize_quant,
        "rows r0:r1 of the packed 4- / 8-bit / e4m3 weights dequantized to fp32 (or "
        "rounded to bf16), as [K, r1 - r0]",
        pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("zeros"),
        pybind11::arg("N"), pybind11::arg("bits"), pybind11::arg("group_size"),
        pybind11::arg("r0"), pybind11::arg("r1"), pybind11::arg("bf16") = false);
  m.attr("QUANT_E4M3") = kQuantE4m3;  // the `bits` of e4m3 weights in the three above
  // pack_quant_weight(quad=True): integer dot products on 15-bit activations
  m.attr("has_quant_quad") = has_quant_quad();
  m.def("row_argmax", &row_argmax,
        "each row's argmax (torch.argmax's order) and whether it holds a NaN",
        pybind11::arg("logits"));
  m.def("top_k_top_p_mask_", &top_k_top_p_mask_,
        "each row's smallest value that its min-p, then top-k, then top-p keep (-inf: "
        "all); the values below it set to -inf in place",
        pybind11::arg("logits"), pybind11::arg("top_k"), pybind11::arg("top_p"),
        pybind11::arg("min_p"));
  m.def("row_logprobs", &row_logprobs,
        "each row's chosen value, its k largest and the chosen one's rank, in one pass",
        pybind11::arg("logprobs"), pybind11::arg("chosen"), pybind11::arg("k"));
  m.def("grammar_bitmask_", &grammar_bitmask_,
        "logits rows `rows` set to -inf where their packed grammar bitmask forbids a token",
        pybind11::arg("logits"), pybind11::arg("rows"), pybind11::arg("bitmask"));
  m.def("draw_rows", &draw_rows,
        "each row's token by the inverse of its cumulative distribution, from its logits",
        pybind11::arg("logits"), pybind11::arg("u"));
  m.def("greedy_lm_head", &greedy_lm_head,
        "argmax of x @ w^T from an int8 screen plus exact candidate blocks");
  m.def("qk_norm_rope", &qk_norm_rope, "per-head q/k RMSNorm + rotary; returns q, rotates k in place");
  m.def("kv_cache_write", &kv_cache_write,
        "write new K/V rows into the paged cache (an fp8 cache: K / k_scale, V / v_scale)",
        pybind11::arg("cache"), pybind11::arg("k"), pybind11::arg("v"),
        pybind11::arg("slot_block"), pybind11::arg("slot_offset"),
        pybind11::arg("k_scale") = 1.0, pybind11::arg("v_scale") = 1.0);
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a packed gate_up");
  m.def("rms_norm_zero_centered", &rms_norm_zero_centered,
        "x / rms(x) * (1 + weight) in fp32, rounded once (Qwen3.5 / Qwen3-Next)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("gated_rms_norm", &gated_rms_norm,
        "each head row of x normalised, times weight, times silu(z) (Gated DeltaNet's output norm)",
        pybind11::arg("x"), pybind11::arg("z"), pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("add_rms_norm_zero_centered_", &add_rms_norm_zero_centered_,
        "residual += x in place (rounded to the dtype), then rms_norm_zero_centered(residual)",
        pybind11::arg("residual"), pybind11::arg("x"), pybind11::arg("weight"),
        pybind11::arg("eps"));
  m.def("causal_conv1d_silu", &causal_conv1d_silu,
        "silu(depthwise causal conv1d) of each sequence, continuing from its conv state slot",
        pybind11::arg("x"), pybind11::arg("conv_state"), pybind11::arg("weight"),
        pybind11::arg("cu_seqlens"), pybind11::arg("read_slots"), pybind11::arg("write_slots"));
  m.def("gated_delta_rule", &gated_delta_rule,
        "Gated DeltaNet's delta rule token by token: sequence n (tokens cu_seqlens[n] .. "
        "cu_seqlens[n + 1]) from state[read_slots[n]] into state[write_slots[n]]",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("g"),
        pybind11::arg("beta"), pybind11::arg("state"), pybind11::arg("cu_seqlens"),
        pybind11::arg("read_slots"), pybind11::arg("write_slots"));
  m.def("gated_delta_rule_qkv", &gated_delta_rule_qkv,
        "gated_delta_rule from a Gated DeltaNet layer's conv output q | k | v and gate inputs "
        "a, b: q and k L2-normalised (q times q_scale), g = -exp(A_log) softplus(a + dt_bias), "
        "beta = sigmoid(b)",
        pybind11::arg("mixed_qkv"), pybind11::arg("a"), pybind11::arg("b"),
        pybind11::arg("A_log"), pybind11::arg("dt_bias"), pybind11::arg("state"),
        pybind11::arg("cu_seqlens"), pybind11::arg("read_slots"), pybind11::arg("write_slots"),
        pybind11::arg("num_k_heads"), pybind11::arg("q_scale"));
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu_tanh(gate) * up of a packed gate_up");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, HF's rounding");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x in place, then RMSNorm(residual)");
  m.def("decode_layers", &decode_layers,
        "all decoder layers of a Llama-family model for a decode-only step, in one call",
        pybind11::arg("x"), pybind11::arg("weights"), pybind11::arg("dims"),
        pybind11::arg("quant"), pybind11::arg("eps"), pybind11::arg("scale"),
        pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("slot_block"),
        pybind11::arg("slot_offset"), pybind11::arg("block_table"), pybind11::arg("seq_lens"),
        pybind11::arg("kv_scales") = std::vector<double>{},
        pybind11::arg("taps") = pybind11::none(),
        pybind11::arg("tap_layers") = std::vector<int64_t>{});
  m.def("set_teams", &tmpar::set_teams,
        "one parallel region per decode_layers call (True, the default) or a region per "
        "loop (False); returns the previous setting", pybind11::arg("on"));
  m.def("team_loops", &tmpar::team_loops, "parallel loops handed to a team so far (tests)");
  m.def("gemma_decode_layers", &gemma_decode_layers,
        "all decoder layers of a Gemma 3 model for a decode-only step, in one call");
  m.def("gemma4_decode_layers", &gemma4_decode_layers,
        "all decoder layers of a dense Gemma 4 model for a decode-only step, in one call");
  m.def("hybrid_decode_layers", &hybrid_decode_layers,
        "all decoder layers of a Qwen3.5 / Qwen3-Next model (dense MLPs) for a decode-only "
        "step, in one call");
  // The capability level this module was built for, and what it can do well.
  m.attr("capability") = TOKENMILL_CPU_LEVEL_NAME;
  m.attr("vector_lanes") = tmvec::Vec::W;  // fp32 lanes of the kernels' vectors
#if defined(TM_VEC_AVX512) && defined(__AVX512BF16__)
  // paged_prefill and paged_decode over a bf16 cache: both products on vdpbf16ps
  // (cpu_paged_prefill.cpp, cpu_paged_attention.cpp)
  m.attr("has_bf16_dot") = true;
#else
  m.attr("has_bf16_dot") = false;
#endif
  // linear_bf16 takes bf16 inputs of this many rows and more on vdpbf16ps
  // (cpu_linear_dot.cpp; avx512_bf16): fast enough at every row count that the
  // platform keeps the packed copy only (tokenmill/platforms/cpu.py).
  m.attr("has_bf16_dot_gemm") = linear_bf16_dot_rows() > 0;
  m.attr("bf16_dot_gemm_min_rows") = linear_bf16_dot_rows();
#if defined(__AMX_BF16__)
  // ... and on AMX tiles (cpu_linear_amx.cpp; the amx level)
  m.attr("has_amx_gemm") = true;
#else
  m.attr("has_amx_gemm") = false;
#endif
#if defined(TM_VEC_GENERIC)
  // Plain arrays: slower than the library GEMM; greedy_lm_head is exact there too,
  // but its int8 screen is plain C++ (on x86-64 the default level is SSE2, not this).
  m.attr("has_fast_linear_bf16") = false;
  m.attr("has_greedy_lm_head") = false;
#else
  m.attr("has_fast_linear_bf16") = true;
  m.attr("has_greedy_lm_head") = true;  // the int8 screen is vectorised at every ISA of vec.h
#endif
}
