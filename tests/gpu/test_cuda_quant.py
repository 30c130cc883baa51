"""Quantized weights and the FP8 KV cache on CUDA against the CPU: the Triton W4A16 /
W8A16 / FP8-block GEMMs compiled for the GPU (bf16 included, which the interpreter
tests of tests/unit/test_triton_quant_linear.py cannot check) against the PyTorch
reference of each format, and whole models (GPTQ 4 / 8 bits with act-order, AWQ,
block FP8, MoE experts in GPTQ and fp8 (DeepSeek-V3 style, and made at load),
--quantization int8 / fp8, an fp8 KV cache) whose CUDA greedy tokens and logprobs
(fp32) equal the CPU's PyTorch path on the same checkpoint. Skipped without CUDA (scripts/gpu_check.sh runs them on a GPU)."""
from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from conftest import (MODEL_SPECS, TINY, build_checkpoint, make_llm, make_prompts,
                      random_quantized_weight, runner_of)
from tokenmill import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "models"))
from test_fp8_checkpoint import fp8_variant  # noqa: E402
from test_fp8_moe import mlp_only_fp8_variant  # noqa: E402
from test_moe_parity import MOE_SPECS  # noqa: E402

NUM_NEW = 10
LOGPROB_TOL = 1e-3  # fp32 both sides, IEEE dots; only the reduction order differs
# An fp8 KV cache: the order can move a K/V value across an e4m3 rounding boundary, one
# e4m3 step (1/16 of the value) on these large-weight checkpoints (CPU native against
# CPU PyTorch differ by 1.2e-3 on fp8_kv_cache_swa).
FP8_KV_LOGPROB_TOL = 1e-2
PARAMS = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module", autouse=True)
def ieee_fp32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _qw(n, k, bits, group, perm, seed):
    return random_quantized_weight(n, k, bits, group, perm, seed)


# (bits, N, K, group, act-order): N off the 64-wide tile, K off the group and odd (a
# half-filled last byte), a layer of a real model's size (split over K at few rows).
INT_SHAPES = [(4, 70, 100, 32, False), (4, 64, 131, 48, True), (8, 200, 256, 64, True),
              (4, 1024, 3072, 128, False)]


@pytest.mark.parametrize("bits,n,k,group,perm", INT_SHAPES)
def test_int_weight_gemm_compiled_equals_the_reference(bits, n, k, group, perm):
    from tokenmill.models.layers.linear_methods.quantized_weight import reference_linear
    from tokenmill.ops.triton_quant_linear import IntWeightTriton
    qw = _qw(n, k, bits, group, perm, seed=n + k)
    gpu = IntWeightTriton(qw, "cuda")
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(n, generator=g)
    # bf16 dequantized weights (the prefill path) round each weight as a bf16 model's
    wt = torch.empty(k, n, dtype=torch.bfloat16, device="cuda")
    gpu._dequantize_into(wt)
    ref_w = qw.dequantize()
    ref_w = ref_w if qw.perm is None else ref_w[:, qw.perm]  # the codes' column order
    assert torch.equal(wt.cpu(), ref_w.to(torch.bfloat16).t())
    for rows in (1, 16, 17, 64, 130):  # decode tiles (split), 64-row tiles, dequantized
        x = torch.randn(rows, k, generator=g)
        want = reference_linear(qw, x, bias)
        got = gpu.linear(x.cuda(), bias.cuda())
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4 * k ** 0.5)
        # bf16: the weights rounded to bf16 as a bf16 model's would be, fp32 accumulation
        xb = x.to(torch.bfloat16)
        want_b = F.linear(xb.float(), qw.dequantize(torch.bfloat16).float(), bias)
        got_b = gpu.linear(xb.cuda(), bias.cuda())
        assert got_b.dtype == torch.bfloat16
        torch.testing.assert_close(got_b.float().cpu(), want_b, rtol=2e-2,
                                   atol=1e-2 * want_b.abs().max().item())


@pytest.mark.parametrize("n,k,block", [(70, 100, (32, 32)), (512, 384, (128, 128)),
                                       (96, 200, (16, 48)), (300, 1024, (1, 1024))])
def test_fp8_block_gemm_compiled_equals_the_dequantized_weights(n, k, block):
    from tokenmill.models.layers.linear_methods.fp8 import dequantize_block_fp8
    from tokenmill.ops.triton_quant_linear import Fp8WeightTriton
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(n, k, generator=g) * 50).to(torch.float8_e4m3fn)
    s = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 0.01 + 1e-3
    bias = torch.randn(n, generator=g)
    gpu = Fp8WeightTriton(w.cuda(), s.cuda(), block)
    ref_w = dequantize_block_fp8(w, s, block)
    wt = torch.empty(k, n, dtype=torch.bfloat16, device="cuda")
    gpu._dequantize_into(wt)
    assert torch.equal(wt.cpu(), ref_w.to(torch.bfloat16).t())
    for rows in (1, 5, 16, 40, 131):
        x = torch.randn(rows, k, generator=g)
        got = gpu.linear(x.cuda(), bias.cuda())
        torch.testing.assert_close(got.cpu(), F.linear(x, ref_w, bias), rtol=1e-4,
                                   atol=1e-4 * k ** 0.5)
        xb = x.to(torch.bfloat16)
        got_b = gpu.linear(xb.cuda(), bias.cuda())
        want_b = F.linear(xb.float(), ref_w.to(torch.bfloat16).float(), bias)
        torch.testing.assert_close(got_b.float().cpu(), want_b, rtol=2e-2,
                                   atol=1e-2 * want_b.abs().max().item())


# name -> (arch, overrides, how the checkpoint is made, engine arguments)
QWEN3 = ("qwen3", dict(head_dim=32, tie_word_embeddings=False))
LLAMA_TIED = ("llama", dict(tie_word_embeddings=True))
MODELS = {
    "gptq4_g32_actorder": (*QWEN3, ("gptq", dict(bits=4, group_size=32, sym=False,
                                                 desc_act=True)), {}),
    "gptq8_gall": (*LLAMA_TIED, ("gptq", dict(bits=8, group_size=-1, sym=True)), {}),
    "awq4_g32": (*QWEN3, ("awq", dict(group_size=32)), {}),
    "fp8_block16": (*QWEN3, ("fp8", (16, 16)), {}),
    "gptq4_moe": (*MOE_SPECS["qwen3_moe_norm"], ("gptq", dict(bits=4, group_size=32,
                                                             sym=True)), {}),
    # MoE experts fp8 as DeepSeek-V3 publishes them (only the MLPs: MLA's projections
    # stay plain), through the Triton grouped GEMMs; and fp8 made at load (per-channel)
    "fp8_moe_deepseek": (*MODEL_SPECS["deepseek_v3"], ("fp8_mlp", None), {}),
    "fp8_moe_at_load": (*MOE_SPECS["qwen3_moe_norm"], None, dict(quantization="fp8")),
    "int8_at_load": (*QWEN3, None, dict(quantization="int8")),
    "fp8_at_load": (*LLAMA_TIED, None, dict(quantization="fp8")),
    "fp8_kv_cache": (*QWEN3, None, dict(kv_cache_dtype="fp8")),
    "fp8_kv_cache_swa": ("mistral", dict(head_dim=32, sliding_window=12,
                                         tie_word_embeddings=False), None,
                         dict(kv_cache_dtype="fp8")),
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    built = {}

    def get(name):
        if name not in built:
            arch, overrides, fmt, _ = MODELS[name]
            src = str(tmp_path_factory.mktemp(name + "_src"))
            with warnings.catch_warnings(), torch.device("cpu"):
                warnings.simplefilter("ignore")
                build_checkpoint(src, arch, overrides)
            path = src
            if fmt is not None:
                from tokenmill.models.quant_formats import (write_awq_checkpoint,
                                                            write_gptq_checkpoint)
                path = str(tmp_path_factory.mktemp(name))
                kind, kw = fmt
                if kind == "fp8":
                    fp8_variant(src, path, kw)
                elif kind == "fp8_mlp":  # (its own block, [16, 16])
                    mlp_only_fp8_variant(src, path)
                else:
                    write = write_gptq_checkpoint if kind == "gptq" else write_awq_checkpoint
                    write(src, path, return_dequantized=False, **kw)
            built[name] = path
        return built[name]

    return get


def _run(path, device, prompts, **kw):
    llm = make_llm(path, device=device, max_num_seqs=8, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [o.outputs[0] for o in outs], llm


@pytest.mark.parametrize("name", list(MODELS))
def test_quantized_model_on_cuda_equals_cpu(model_path, name):
    """Greedy tokens equal and each step's sampled logprob within LOGPROB_TOL of the CPU's
    PyTorch path (fp32); decode steps replayed from CUDA graphs, prompts in 16-token
    chunks (a cached prefix under every later chunk)."""
    path = model_path(name)
    kw = MODELS[name][3]
    prompts = make_prompts([5, 33, 1, 70, 17, 2], TINY["vocab_size"], seed=4)
    want, _ = _run(path, "cpu", prompts, cpu_kernels="torch", **kw)
    got, llm = _run(path, "cuda", prompts, max_num_batched_tokens=16, **kw)
    runner = runner_of(llm)
    assert runner.cuda_graphs is not None
    if "quantization" in kw or MODELS[name][2] is not None:
        described = " ".join(m.method.describe() for m in runner.model.modules()
                             if hasattr(getattr(m, "method", None), "describe"))
        assert "Triton" in described, described[:500]
    if "moe" in name:  # the experts too: the sync-free grouped GEMMs, not dequantized
        from tokenmill.models.layers.moe import FusedMoE
        experts = [m.method.describe() for m in runner.model.modules()
                   if isinstance(m, FusedMoE)]
        assert experts and all("Triton grouped GEMMs" in d for d in experts), experts
    if kw.get("kv_cache_dtype") == "fp8":
        assert all(c.dtype == torch.float8_e4m3fn for c in runner.kv_caches.values())
    tol = FP8_KV_LOGPROB_TOL if kw.get("kv_cache_dtype") == "fp8" else LOGPROB_TOL
    for i, (g, w) in enumerate(zip(got, want)):
        assert list(g.token_ids) == list(w.token_ids), (name, i)
        for step, (lg, lw, tok) in enumerate(zip(g.logprobs, w.logprobs, g.token_ids)):
            assert abs(lg[tok].logprob - lw[tok].logprob) <= tol, (name, i, step)
