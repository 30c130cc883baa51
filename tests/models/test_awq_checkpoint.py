"""AWQ checkpoints as AutoAWQ publishes them (GEMM layout: 4-bit codes and zero points
packed along the output dim in AWQ's nibble order, fp16 scales) load, dense and MoE:
tiny random checkpoints quantized by write_awq_checkpoint, against HF transformers on
the dequantized fp32 twin: greedy tokens equal, logprobs within 1e-4; dense, MoE and a
vision-language hybrid MoE checkpoint. The nibble order
itself is checked against hand-packed words in test_int_quant_layouts.py."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from tokenmill.models.layers.linear_methods.awq import AwqLinearMethod
from tokenmill.models.quant_formats import write_awq_checkpoint

sys.path.insert(0, os.path.dirname(__file__))
from int_quant_check import LLAMA_TIED, QWEN3, build_quantized, check_parity  # noqa: E402
from test_checkpoint_refusals import load  # noqa: E402
from test_hybrid_parity import HYBRID_SPECS, build_hybrid  # noqa: E402
from test_moe_parity import MOE_SPECS  # noqa: E402

CASES = {
    "qwen3_g32": (QWEN3, dict(group_size=32)),
    "llama_tied_g128": (LLAMA_TIED, dict(group_size=128)),
    "qwen3_moe_top1_g32": (MOE_SPECS["qwen3_moe_top1"], dict(group_size=32)),
    # Qwen2's q / k / v biases beside the packed AWQ words.
    "qwen2_bias_g32": (("qwen2", dict(tie_word_embeddings=False)), dict(group_size=32)),
    # A Qwen3.5-MoE ForConditionalGeneration checkpoint (hybrid, MoE, its language
    # model's tensors under model.language_model.*, the vision tower plain), as the hub's
    # VL AWQ releases; the reference is HF's text model of the dequantized twin.
    "qwen3_5_moe_vl_g32": (HYBRID_SPECS["qwen3_5_moe_vl"], dict(group_size=32,
                                                               build=build_hybrid)),
}


@pytest.fixture(scope="module")
def awq_model(tmp_path_factory):
    cache = {}

    def get(case: str):
        if case not in cache:
            spec, kw = CASES[case]
            cache[case] = build_quantized(tmp_path_factory, case, spec,
                                          write_awq_checkpoint, **kw)
        return cache[case]
    return get


@pytest.mark.parametrize("case", list(CASES))
def test_awq_greedy_tokens_and_logprobs_match_hf_dequantized(awq_model, case):
    check_parity(awq_model(case), case)


def test_awq_layers_dequantize_to_the_checkpoint(awq_model):
    m = awq_model("qwen3_g32")
    model = load(m.path)
    gate_up = model.layers[1].mlp.gate_up_proj
    assert isinstance(gate_up.method, AwqLinearMethod)
    want = torch.cat([m.deq[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(gate_up.dense_weight(), want)
    assert gate_up.method.weight_form.perm is None and gate_up.method.weight_form.bits == 4
