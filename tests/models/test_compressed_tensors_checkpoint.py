"""compressed-tensors "pack-quantized" checkpoints (llm-compressor W4A16 / W8A16) load,
dense and MoE: tiny random checkpoints quantized by
write_compressed_tensors_checkpoint (weight_packed / weight_scale in bf16 /
weight_zero_point / weight_shape / weight_g_idx), against HF transformers on the
dequantized fp32 twin: greedy tokens equal, logprobs within 1e-4.

Variants: 4 and 8 bits, strategy group and channel, symmetric and asymmetric,
actorder (weight_g_idx), an `ignore`d layer left unquantized, MoE experts, Phi-3's
checkpoint-fused projections."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from tokenmill.models.layers.linear_methods.compressed_tensors import (
    CompressedTensorsLinearMethod)
from tokenmill.models.quant_formats import write_compressed_tensors_checkpoint

sys.path.insert(0, os.path.dirname(__file__))
from int_quant_check import LLAMA_TIED, QWEN3, build_quantized, check_parity  # noqa: E402
from test_checkpoint_refusals import load  # noqa: E402
from test_moe_parity import MOE_SPECS  # noqa: E402

KEEP = "model.layers.1.mlp.down_proj"
CASES = {
    "qwen3_w4_g32_sym": (QWEN3, dict(bits=4, group_size=32, symmetric=True)),
    "llama_w8_channel_asym": (LLAMA_TIED, dict(bits=8, group_size=None, symmetric=False)),
    "qwen3_w4_g32_asym_actorder_ignore": (QWEN3, dict(bits=4, group_size=32,
                                                      symmetric=False, actorder=True,
                                                      keep=(KEEP,))),
    "qwen3_moe_w4_g32_sym": (MOE_SPECS["qwen3_moe_norm"], dict(bits=4, group_size=32,
                                                               symmetric=True)),
    # Phi-3: q / k / v and gate / up stored fused in the checkpoint (one matrix each).
    "phi3_fused_w8_g32_asym": (("phi3", dict(partial_rotary_factor=0.75, sliding_window=2047,
                                             tie_word_embeddings=False)),
                               dict(bits=8, group_size=32, symmetric=False)),
}


@pytest.fixture(scope="module")
def ct_model(tmp_path_factory):
    cache = {}

    def get(case: str):
        if case not in cache:
            spec, kw = CASES[case]
            cache[case] = build_quantized(tmp_path_factory, case, spec,
                                          write_compressed_tensors_checkpoint, **kw)
        return cache[case]
    return get


@pytest.mark.parametrize("case", list(CASES))
def test_compressed_tensors_tokens_and_logprobs_match_hf_dequantized(ct_model, case):
    check_parity(ct_model(case), case)


def test_compressed_tensors_ignored_layer_stays_plain(ct_model):
    m = ct_model("qwen3_w4_g32_asym_actorder_ignore")
    model = load(m.path)
    assert not isinstance(model.layers[1].mlp.down_proj.method, CompressedTensorsLinearMethod)
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.method, CompressedTensorsLinearMethod)
    assert qkv.method.weight_form.perm is not None
    want = torch.cat([m.deq[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv.dense_weight(), want)
