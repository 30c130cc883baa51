"""FP8 MoE experts as published (Qwen3-MoE-FP8 / DeepSeek-V3 per-expert layout) load.

A tiny Qwen3-MoE checkpoint (HF save_pretrained: per-expert tensors
"mlp.experts.{e}.{gate,up,down}_proj.weight") is rewritten by test_fp8_checkpoint's
`fp8_variant`: every decoder projection, the experts' included, e4m3 with one fp32
`weight_scale_inv` per [16, 16] block; the router and the embeddings stay plain. The
reference is HF transformers with the dequantized weights (its fused experts filled
from the per-expert ones), fp32: greedy tokens equal, logprobs within 1e-4. DeepSeek-V3
(the same per-expert names, plus shared experts) with its MLPs fp8.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings

import pytest
import torch

from conftest import MODEL_SPECS, NUM_NEW, build_checkpoint, make_llm
from logprob_check import K, check_completion
from tokenmill import SamplingParams
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.linear_methods.fp8 import (Fp8BlockFusedMoEMethod,
                                                        Fp8BlockLinearMethod)
from tokenmill.models.layers.moe import FusedMoE
from tokenmill.platforms import create_platform

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint_refusals import load, read_tensors, write_variant  # noqa: E402
from test_fp8_checkpoint import (GREEDY_LOGPROBS, Built, dequantize_blocks,  # noqa: E402
                                 fp8_variant, quantize_blocks)
from test_moe_parity import MOE_SPECS  # noqa: E402

BLOCK = (16, 16)


def hf_dequantized_moe(src: str, deq: dict[str, torch.Tensor]):
    """HF's model of `src` with the dequantized weights; per-expert names go into HF's
    stacked experts (gate rows, then up rows)."""
    from transformers import AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    state = model.state_dict()
    with torch.no_grad():
        for name, w in deq.items():
            if ".experts." not in name:
                state[name].copy_(w)
                continue
            prefix, e, proj, _ = name.rsplit(".", 3)  # ...experts, E, gate_proj, weight
            e = int(e)
            if proj == "down_proj":
                state[f"{prefix}.down_proj"][e].copy_(w)
            else:
                i = w.shape[0]
                rows = slice(0, i) if proj == "gate_proj" else slice(i, 2 * i)
                state[f"{prefix}.gate_up_proj"][e, rows].copy_(w)
    return model


def mlp_only_fp8_variant(src: str, dst: str) -> dict[str, torch.Tensor]:
    """`src` with only its MLP projections (routed experts, shared experts, dense MLPs)
    fp8: DeepSeek's MLA projections with interleaved rope rows are refused in fp8."""
    tensors, deq = {}, {}
    for name, t in read_tensors(src).items():
        if ".mlp." in name and t.dim() == 2 and name.endswith("_proj.weight"):
            q, sc = quantize_blocks(t, *BLOCK)
            tensors[name], tensors[name + "_scale_inv"] = q, sc
            deq[name] = dequantize_blocks(q, sc, *BLOCK)
        else:
            tensors[name] = t
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": list(BLOCK)}
    write_variant(src, dst, tensors, cfg)
    return deq


# name -> (architecture, config overrides, variant writer)
FP8_MOE_SPECS = {**{k: (*MOE_SPECS[k], fp8_variant) for k in MOE_SPECS},
                 "deepseek_v3": (*MODEL_SPECS["deepseek_v3"], mlp_only_fp8_variant)}


def _moe_fp8(tmp_path_factory, spec: str) -> Built:
    arch, overrides, variant = FP8_MOE_SPECS[spec]
    src = str(tmp_path_factory.mktemp(spec + "_src"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_checkpoint(src, arch, overrides)
    path = str(tmp_path_factory.mktemp(spec + "_fp8"))
    deq = variant(src, path) if variant is mlp_only_fp8_variant else variant(src, path, BLOCK)
    assert any(".experts.0.up_proj" in n for n in deq)
    vocab = json.load(open(os.path.join(src, "config.json")))["vocab_size"]
    return Built(src, path, hf_dequantized_moe(src, deq), vocab)


@pytest.fixture(scope="module")
def moe_fp8(tmp_path_factory):
    cache: dict[str, Built] = {}

    def get(spec: str) -> Built:
        if spec not in cache:
            cache[spec] = _moe_fp8(tmp_path_factory, spec)
        return cache[spec]
    return get


@pytest.mark.parametrize("spec", ["qwen3_moe_norm", "qwen3_moe_top1", "deepseek_v3"])
def test_fp8_moe_greedy_tokens_and_logprobs_match_hf_dequantized(moe_fp8, spec):
    m = moe_fp8(spec)
    llm = make_llm(m.path, dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in m.prompts], GREEDY_LOGPROBS,
                        use_tqdm=False)
    for i, (p, o, ref) in enumerate(zip(m.prompts, outs, m.reference())):
        comp = o.outputs[0]
        assert comp.token_ids == ref, (spec, i, comp.token_ids, ref)
        check_completion(m, p, comp, K, f"{spec}: prompt {i}", greedy=True)


def test_fp8_moe_bf16_runs(moe_fp8):
    m = moe_fp8("qwen3_moe_norm")
    llm = make_llm(m.path, dtype="bfloat16")
    outs = llm.generate([{"prompt_token_ids": p} for p in m.prompts],
                        SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True),
                        use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert all(len(g) == NUM_NEW for g in got)
    first = sum(g[:2] == r[:2] for g, r in zip(got, m.reference()))
    assert first >= len(got) - 1, (got, m.reference())


def test_fp8_moe_experts_stay_e4m3(moe_fp8):
    """Experts resident as e4m3 + fp32 scales only, stacked exactly as the per-expert
    checkpoint tensors, or (the CPU's native kernels) packed once per expert with no
    stacked copy beside them, dequantizing to the same matrices; the router stays
    unquantized."""
    m = moe_fp8("qwen3_moe_norm")
    model = load(m.path)
    src = read_tensors(m.path)
    moes = [(n, mod) for n, mod in model.named_modules() if isinstance(mod, FusedMoE)]
    assert len(moes) == 2
    for name, mod in moes:
        assert isinstance(mod.method, Fp8BlockFusedMoEMethod), name
        assert mod.gate_up_proj.dtype == torch.float8_e4m3fn
        assert mod.down_proj.dtype == torch.float8_e4m3fn
        held = {k: v.dtype for k, v in mod.state_dict().items()}
        ck = f"model.{name}.3"
        gate, up = (src[f"{ck}.{p}_proj.weight"] for p in ("gate", "up"))
        s13 = torch.cat([src[f"{ck}.gate_proj.weight_scale_inv"],
                         src[f"{ck}.up_proj.weight_scale_inv"]])
        packed = mod.method.packed
        if packed is not None:
            assert held == {"gate_up_proj": torch.float8_e4m3fn,
                            "down_proj": torch.float8_e4m3fn}, name
            assert mod.gate_up_proj.is_meta and mod.down_proj.is_meta
            assert len(packed.w13) == len(packed.w2) == mod.num_experts
            assert "native up to" in mod.method.describe()
            assert torch.equal(packed.w13[3].dequantize(),
                               dequantize_blocks(torch.cat([gate, up]), s13, *BLOCK))
            assert torch.equal(packed.w2[3].dequantize(),
                               dequantize_blocks(src[f"{ck}.down_proj.weight"],
                                                 src[f"{ck}.down_proj.weight_scale_inv"],
                                                 *BLOCK))
            continue
        assert held == {"gate_up_proj": torch.float8_e4m3fn,
                        "gate_up_proj_scale_inv": torch.float32,
                        "down_proj": torch.float8_e4m3fn,
                        "down_proj_scale_inv": torch.float32}, name
        assert not any(isinstance(v, torch.Tensor) for v in vars(mod.method).values())
        assert torch.equal(mod.gate_up_proj[3].view(torch.uint8),
                           torch.cat([gate, up]).view(torch.uint8))
        assert torch.equal(mod.gate_up_proj_scale_inv[3], s13)
        assert torch.equal(mod.down_proj_scale_inv[3], src[f"{ck}.down_proj.weight_scale_inv"])
    router = model.layers[1].mlp.gate
    assert isinstance(router, Linear) and not isinstance(router.method, Fp8BlockLinearMethod)
    assert router.weight.dtype == torch.float32
    assert isinstance(model.layers[0].mlp.gate_up_proj.method, Fp8BlockLinearMethod)


def _method_layer(e=4, h=40, i=32, dtype=torch.float32):
    torch.manual_seed(0)
    layer = FusedMoE(e, h, i, dtype=dtype)
    layer.use_method(Fp8BlockFusedMoEMethod(BLOCK), dtype)
    w13 = [quantize_blocks(torch.randn(2 * i, h), *BLOCK) for _ in range(e)]
    w2 = [quantize_blocks(torch.randn(h, i), *BLOCK) for _ in range(e)]
    with torch.no_grad():
        for k, ((q13, s13), (q2, s2)) in enumerate(zip(w13, w2)):
            layer.gate_up_proj[k].copy_(q13)
            layer.gate_up_proj_scale_inv[k].copy_(s13)
            layer.down_proj[k].copy_(q2)
            layer.down_proj_scale_inv[k].copy_(s2)
    dense13 = torch.stack([dequantize_blocks(q, s, *BLOCK) for q, s in w13])
    dense2 = torch.stack([dequantize_blocks(q, s, *BLOCK) for q, s in w2])
    return layer, dense13, dense2


def test_fp8_moe_method_matches_dequantized_experts_and_widens():
    """The method's output is the unquantized experts' on the dequantized weights (H not
    a multiple of bk: partial last blocks); a widening platform widens it."""
    from tokenmill.models.layers.linear_methods.fused_moe import fused_experts
    layer, d13, d2 = _method_layer()
    x = torch.randn(6, 40)
    ids = torch.tensor([[0, 2], [2, 0], [2, 3], [0, 2], [3, 0], [2, 3]])  # expert 1 idle
    wts = torch.rand(6, 2)
    assert torch.allclose(layer(x, wts, ids), fused_experts(x, d13, d2, wts, ids), atol=1e-5)
    platform = dataclasses.replace(create_platform("cpu", torch.bfloat16), gemm_dtype="float32")
    method = platform.moe_method(layer)
    assert isinstance(method, Fp8BlockFusedMoEMethod) and method.compute_dtype == torch.float32
    layer.set_method(method)
    xb = x.to(torch.bfloat16)
    want = fused_experts(xb, d13, d2, wts.to(torch.bfloat16), ids, torch.float32)
    assert torch.equal(layer(xb, wts.to(torch.bfloat16), ids), want)
    plain = dataclasses.replace(platform, gemm_dtype="bfloat16")
    assert plain.moe_method(layer) is layer.method


def _quantized_moe_checkpoint(tmp_path, spec="qwen3_moe_norm", **overrides):
    arch, base = MOE_SPECS[spec]
    src = str(tmp_path / "src")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_checkpoint(src, arch, {**base, **overrides})
    path = str(tmp_path / "fp8")
    fp8_variant(src, path, BLOCK)
    return path


def test_fp8_moe_refuses_intermediate_not_whole_block_rows(tmp_path):
    path = _quantized_moe_checkpoint(tmp_path, moe_intermediate_size=24)
    with pytest.raises(ValueError, match=r"MoE layer layers\.1\.mlp\.experts: expert "
                                         r"intermediate size 24 is not a multiple of the "
                                         r"fp8 block's 16 rows"):
        load(path)


def test_fp8_moe_refuses_a_missing_expert_scale(tmp_path):
    path = _quantized_moe_checkpoint(tmp_path)
    tensors = read_tensors(path)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight_scale_inv"]
    write_variant(path, str(tmp_path / "noscale"), tensors)
    with pytest.raises(ValueError, match=r"fp8 tensor model\.layers\.2\.mlp\.experts\.5\."
                                         r"up_proj\.weight has no block scales"):
        load(str(tmp_path / "noscale"))


def test_fp8_moe_refuses_a_plain_expert_among_fp8_ones(tmp_path):
    path = _quantized_moe_checkpoint(tmp_path)
    tensors = read_tensors(path)
    name = "model.layers.1.mlp.experts.6.down_proj.weight"
    tensors[name] = dequantize_blocks(tensors[name], tensors.pop(name + "_scale_inv"), *BLOCK)
    write_variant(path, str(tmp_path / "mixed"), tensors)
    with pytest.raises(ValueError, match=r"MoE layer layers\.1\.mlp\.experts: .* is fp8 but "
                                         r"model\.layers\.1\.mlp\.experts\.6\.down_proj\."
                                         r"weight \(F32\) is not"):
        load(str(tmp_path / "mixed"))


def test_fp8_moe_refuses_experts_stored_stacked(tmp_path):
    """A checkpoint shipping the experts already stacked in fp8 is refused by name."""
    path = _quantized_moe_checkpoint(tmp_path)
    tensors = read_tensors(path)
    pre = "model.layers.1.mlp.experts"
    tensors[f"{pre}.gate_up_proj"] = torch.stack(
        [torch.cat([tensors.pop(f"{pre}.{e}.{p}_proj.weight") for p in ("gate", "up")])
         for e in range(8)])
    write_variant(path, str(tmp_path / "stacked"), tensors)
    with pytest.raises(ValueError, match=r"tensor model\.layers\.1\.mlp\.experts\.gate_up_proj "
                                         r"is fp8 experts stored stacked"):
        load(str(tmp_path / "stacked"))
