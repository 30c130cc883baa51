"""FP8 checkpoints with per-tensor and per-channel weight scales (the "FP8" /
"FP8-Dynamic" layout: no weight_block_size, `weight_scale` fp32 as a scalar, [1], [N]
or [N, 1]), and the static activation scheme, whose `input_scale` tensors are not used
(the activations stay unquantized).

Each tiny HF checkpoint (conftest) is rewritten here in that layout, from the format's
description: every Linear weight of the decoder layers (and every expert matrix)
becomes e4m3 with w8 = w / s, s = amax / 448 over the tensor or over each output row,
W = w8.float() * s. q, k and v (gate and up) get their own per-tensor scales, which
differ, so the packed layers hold rows under different scales. The reference is HF
transformers with the weights replaced by W, fp32: greedy tokens equal and logprobs
within logprob_check's TOL.
"""
from __future__ import annotations

import json
import logging
import os
import sys

import pytest
import torch

from conftest import (NUM_NEW, build_checkpoint, hf_greedy_batch, make_llm, make_prompts,
                      runner_of)
from logprob_check import K, check_completion
from tokenmill import SamplingParams
from tokenmill.models.layers.linear_methods.fp8 import (Fp8BlockFusedMoEMethod,
                                                        Fp8BlockLinearMethod)
from tokenmill.platforms.cpu import DEFAULT_QUANTIZED_ROWS

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint_refusals import load, read_tensors, write_variant  # noqa: E402
from test_fp8_checkpoint import hf_dequantized, native_fp8_layers  # noqa: E402

GREEDY_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True,
                                 logprobs=K)
FP8_MAX = 448.0


def is_quantized_weight(name: str, t: torch.Tensor) -> bool:
    """A decoder layer's Linear or expert matrix (the MoE router `mlp.gate` is not)."""
    return t.dim() == 2 and ".layers." in name and name.endswith("_proj.weight")


def quantize(w: torch.Tensor, shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3, fp32 scale of `shape`): () / (1,) per tensor, (N,) / (N, 1)
    per output row."""
    wf = w.float()
    per_row = len(shape) > 0 and shape[0] == w.shape[0] and w.shape[0] > 1
    amax = wf.abs().amax(dim=1, keepdim=True) if per_row else wf.abs().max().reshape(1, 1)
    s = amax.clamp(min=1e-12) / FP8_MAX
    q = (wf / s).to(torch.float8_e4m3fn)
    return q, s.reshape(shape)


def compressed_tensors_fp8(static: bool, per_channel: bool) -> dict:
    """llm-compressor's quantization_config of an FP8 (static, per-tensor) or
    FP8-Dynamic (per-channel weights, per-token dynamic activations) release."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": "channel" if per_channel else "tensor"}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static,
            "strategy": "tensor" if static else "token"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts,
                                          "output_activations": None}}}


def scales_variant(src: str, dst: str, scale_shape, static: bool = False,
                   qc_extra: dict | None = None, qc: dict | None = None
                   ) -> dict[str, torch.Tensor]:
    """`src` rewritten with per-tensor / per-channel fp8 weights; `scale_shape(n)`: the
    shape of a weight_scale for n rows; `static`: activation_scheme static with an
    input_scale per layer. Returns the dequantized weights by checkpoint name."""
    tensors, deq = {}, {}
    for name, t in read_tensors(src).items():
        if is_quantized_weight(name, t):
            q, s = quantize(t, scale_shape(t.shape[0]))
            tensors[name], tensors[name + "_scale"] = q, s
            deq[name] = q.float() * s.reshape(-1, 1)
            if static:
                tensors[name[:-len("weight")] + "input_scale"] = torch.tensor(0.05)
        else:
            tensors[name] = t
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = qc or {"quant_method": "fp8",
                                        "activation_scheme": "static" if static else "dynamic",
                                        **(qc_extra or {})}
    write_variant(src, dst, tensors, cfg)
    return deq


PER_TENSOR, PER_TENSOR_1 = (lambda n: ()), (lambda n: (1,))
PER_CHANNEL, PER_CHANNEL_FLAT = (lambda n: (n, 1)), (lambda n: (n,))
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           tie_word_embeddings=False)
# (arch, overrides, scale shape, static)
CASES = {
    "qwen3_per_tensor": ("qwen3", dict(head_dim=32, tie_word_embeddings=False),
                         PER_TENSOR, False),
    "llama_tied_per_tensor_1": ("llama", dict(tie_word_embeddings=True), PER_TENSOR_1, False),
    "qwen3_per_channel": ("qwen3", dict(head_dim=32, tie_word_embeddings=False),
                          PER_CHANNEL, False),
    "qwen2_bias_per_channel_flat": ("qwen2", dict(tie_word_embeddings=False),
                                    PER_CHANNEL_FLAT, False),
    # Phi-3's checkpoint-fused qkv_proj / gate_up_proj: one per-tensor scale each.
    "phi3_fused_per_tensor": ("phi3", dict(partial_rotary_factor=0.75, sliding_window=2047,
                                           tie_word_embeddings=False), PER_TENSOR, False),
    "qwen3_static_per_tensor": ("qwen3", dict(head_dim=32, tie_word_embeddings=False),
                                PER_TENSOR, True),
    "qwen3_moe_per_tensor": ("qwen3_moe", MOE, PER_TENSOR, False),
    "qwen3_moe_per_channel": ("qwen3_moe", MOE, PER_CHANNEL, True),
    # compressed-tensors' float-quantized FP8 (llm-compressor's FP8-Dynamic and FP8)
    "ct_fp8_dynamic_per_channel": ("qwen3", dict(head_dim=32, tie_word_embeddings=False),
                                   PER_CHANNEL, False),
    "ct_fp8_static_per_tensor": ("llama", dict(tie_word_embeddings=False), PER_TENSOR_1,
                                 True),
}


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    cache = {}

    def get(case: str):
        if case not in cache:
            arch, overrides, shape, static = CASES[case]
            src = str(tmp_path_factory.mktemp(case + "_src"))
            build_checkpoint(src, arch, overrides)
            path = str(tmp_path_factory.mktemp(case))
            qc = (compressed_tensors_fp8(static, shape is PER_CHANNEL)
                  if case.startswith("ct_") else None)
            deq = scales_variant(src, path, shape, static, qc=qc)
            cache[case] = (src, path, deq)
        return cache[case]
    return get


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_scales_match_hf_dequantized(variant, case, caplog):
    src, path, deq = variant(case)
    hf = hf_dequantized(src, deq) if "moe" not in case else None
    if hf is None:  # HF's MoE keeps its experts fused: load the dequantized checkpoint
        ref = path + "_dequantized"
        write_variant(src, ref, {**read_tensors(src), **deq})
        hf = hf_dequantized(ref, {})
    vocab = json.load(open(os.path.join(src, "config.json")))["vocab_size"]
    prompts = make_prompts([5, 17, 33, 8], vocab)
    want = hf_greedy_batch(hf, prompts, NUM_NEW)
    with caplog.at_level(logging.INFO, logger="tokenmill.models.quantized_layers"):
        llm = make_llm(path)
    static = CASES[case][3]
    assert ("input_scale tensors are not used" in caplog.text) == static
    native_fp8_layers(runner_of(llm).model)  # the native kernel where the CPU has one
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_LOGPROBS,
                        use_tqdm=False)
    holder = type("Ref", (), {"hf": hf})()
    for i, (p, o, w) in enumerate(zip(prompts, outs, want)):
        comp = o.outputs[0]
        assert comp.token_ids == w, (case, i, comp.token_ids, w)
        check_completion(holder, p, comp, K, f"{case}: prompt {i}", greedy=True)
    llm.shutdown()


def test_fused_shards_with_different_per_tensor_scales(variant):
    """q, k and v have their own per-tensor scales: the packed qkv_proj holds each
    shard's rows under its own scale, exactly the dequantized shards concatenated."""
    _, path, deq = variant("qwen3_per_tensor")
    tensors = read_tensors(path)
    p = "model.layers.0.self_attn.{}_proj.weight_scale"
    scales = [float(tensors[p.format(x)]) for x in "qkv"]
    assert len(set(scales)) == 3, scales
    model = load(path)
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.method, Fp8BlockLinearMethod)
    native = native_fp8_layers(model) > 0
    rows = f", native up to {DEFAULT_QUANTIZED_ROWS} rows" if native else ""
    assert qkv.method.describe() == f"Fp8BlockLinearMethod(per-channel{rows})"
    assert qkv.weight_scale_inv.shape == (qkv.out_features, 1)
    want = torch.cat([deq[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(qkv.dense_weight(), want)
    gate_up = model.layers[1].mlp.gate_up_proj
    want = torch.cat([deq[f"model.layers.1.mlp.{x}_proj.weight"] for x in ("gate", "up")])
    assert torch.equal(gate_up.dense_weight(), want)
    assert model.lm_head.weight.dtype == torch.float32  # the head stays unquantized


def test_fp8_moe_per_tensor_experts_take_the_block_method(variant):
    _, path, _ = variant("qwen3_moe_per_tensor")
    experts = load(path).layers[0].mlp.experts
    assert isinstance(experts.method, Fp8BlockFusedMoEMethod)
    packed = experts.method.packed
    if packed is None:
        assert experts.gate_up_proj_scale_inv.shape == (4, 64, 1)
        assert experts.down_proj_scale_inv.shape == (4, 64, 1)
    else:  # packed for the native kernel: one scale per row, one group the whole row
        bn, bk = experts.method.block_size
        assert bn == 1 and bk >= max(experts.hidden_size, experts.intermediate_size)
        assert len(packed.w13) == len(packed.w2) == 4
        assert not hasattr(experts, "gate_up_proj_scale_inv")


# ---- refusals ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_src(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("qwen3_scales_src"))
    build_checkpoint(src, "qwen3", dict(head_dim=32, tie_word_embeddings=False))
    return src


def test_wrong_scale_shape_is_named(qwen3_src, tmp_path):
    path = str(tmp_path / "fp8")
    scales_variant(qwen3_src, path, PER_TENSOR)
    tensors = read_tensors(path)
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[name] = torch.ones(2, 3)
    write_variant(path, str(tmp_path / "bad"), tensors)
    with pytest.raises(ValueError, match=rf"{name} has shape \(2, 3\); .* takes one scale "
                                         rf"per tensor"):
        load(str(tmp_path / "bad"))


def test_missing_scale_is_named(qwen3_src, tmp_path):
    path = str(tmp_path / "fp8")
    scales_variant(qwen3_src, path, PER_CHANNEL)
    drop = "model.layers.0.self_attn.k_proj.weight_scale"
    tensors = {k: v for k, v in read_tensors(path).items() if k != drop}
    write_variant(path, str(tmp_path / "missing"), tensors)
    with pytest.raises(ValueError, match=rf"per-channel scales: {drop.replace('.', '[.]')} "
                                         rf"is missing"):
        load(str(tmp_path / "missing"))


def test_block_scales_without_weight_block_size_are_named(qwen3_src, tmp_path):
    """A block-scaled checkpoint whose config lost weight_block_size: its
    weight_scale_inv tensors are named, not loaded as per-row scales."""
    from test_fp8_checkpoint import fp8_variant
    path = str(tmp_path / "block")
    fp8_variant(qwen3_src, path, (16, 16))
    cfg = json.load(open(os.path.join(path, "config.json")))
    del cfg["quantization_config"]["weight_block_size"]
    write_variant(path, str(tmp_path / "noblock"), read_tensors(path), cfg)
    with pytest.raises(ValueError, match=r"weight_scale_inv is a per-tensor weight scale or "
                                         r"a static activation scale, which this "
                                         r"quantization_config does not use"):
        load(str(tmp_path / "noblock"))


def test_input_scale_under_a_dynamic_scheme_is_named(qwen3_src, tmp_path):
    path = str(tmp_path / "fp8")
    scales_variant(qwen3_src, path, PER_TENSOR)
    tensors = read_tensors(path)
    tensors["model.layers.0.mlp.up_proj.input_scale"] = torch.tensor(0.1)
    write_variant(path, str(tmp_path / "stray"), tensors)
    with pytest.raises(ValueError, match=r"up_proj\.input_scale is a per-tensor weight scale "
                                         r"or a static activation scale.*activation_scheme "
                                         r"dynamic"):
        load(str(tmp_path / "stray"))


def test_e5m2_per_tensor_stays_refused(qwen3_src, tmp_path):
    path = str(tmp_path / "fp8")
    scales_variant(qwen3_src, path, PER_TENSOR, qc_extra={"fmt": "e5m2"})
    with pytest.raises(ValueError, match=r"fp8 fmt 'e5m2' is not implemented"):
        load(path)
