"""compressed-tensors float-quantized FP8 with the block strategy (llm-compressor's
FP8_BLOCK scheme: weights {"type": "float", "num_bits": 8, "strategy": "block",
"block_structure": [bn, bk]}, activations dynamic per group) load as the fp8 block
method.

Each tiny HF checkpoint (conftest) is rewritten by quant_formats' writer
(`write_compressed_tensors_fp8_block_checkpoint`, from the format's description): every
decoder projection, experts included, an e4m3 `weight` and an fp32 `weight_scale`
[ceil(N / bn), ceil(K / bk)] that is the dequantization factor (W = weight * scale; not
the inverse, despite quant_method fp8's `weight_scale_inv` name for the same factor).
The reference is HF transformers with the weights replaced by W, fp32: greedy tokens
equal and logprobs within logprob_check's TOL (1e-4), dense and MoE, blocks of
[128, 128] (a model wide enough for them), [32, 32] and [16, 48] (K not a multiple of
bk).
"""
from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch

from conftest import build_checkpoint, make_llm, runner_of
from logprob_check import K, check_completion
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.linear_methods.fp8 import (Fp8BlockFusedMoEMethod,
                                                        Fp8BlockLinearMethod)
from tokenmill.models.quant_formats.writer import \
    write_compressed_tensors_fp8_block_checkpoint

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint_refusals import load, read_tensors, write_variant  # noqa: E402
from test_fp8_checkpoint import (GREEDY_LOGPROBS, Built, hf_dequantized,  # noqa: E402
                                 native_fp8_layers)
from test_fp8_moe import hf_dequantized_moe  # noqa: E402

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           tie_word_embeddings=False)
# A Llama whose every projection is whole [128, 128] blocks but down_proj's K (384 =
# 3 x 128): the published block size on packed q | k | v and gate | up.
WIDE = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
# case -> (arch, overrides, block)
CASES = {
    "llama_wide_b128": ("llama", WIDE, (128, 128)),
    "qwen3_b32": ("qwen3", dict(head_dim=32, tie_word_embeddings=False), (32, 32)),
    "llama_tied_b16x48": ("llama", dict(tie_word_embeddings=True), (16, 48)),
    "qwen3_moe_b16": ("qwen3_moe", MOE, (16, 16)),
    "qwen3_moe_b32": ("qwen3_moe", MOE, (32, 32)),
}


@pytest.fixture(scope="module")
def ct_block(tmp_path_factory):
    cache: dict[str, tuple[Built, dict]] = {}

    def get(case: str) -> tuple[Built, dict]:
        if case not in cache:
            arch, overrides, block = CASES[case]
            src = str(tmp_path_factory.mktemp(case + "_src"))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                build_checkpoint(src, arch, overrides)
            path = str(tmp_path_factory.mktemp(case))
            deq = write_compressed_tensors_fp8_block_checkpoint(src, path, block)
            hf = hf_dequantized_moe(src, deq) if "moe" in arch else hf_dequantized(src, deq)
            vocab = json.load(open(os.path.join(src, "config.json")))["vocab_size"]
            cache[case] = (Built(src, path, hf, vocab), deq)
        return cache[case]
    return get


@pytest.mark.parametrize("case", list(CASES))
def test_ct_fp8_block_matches_hf_dequantized(ct_block, case):
    m, _ = ct_block(case)
    llm = make_llm(m.path)
    model = runner_of(llm).model
    native_fp8_layers(model)  # the native kernel where the CPU has one
    # every projection fp8 (the lm_head and an MoE router stay unquantized)
    methods = {type(mod.method) for name, mod in model.named_modules()
               if isinstance(mod, Linear) and name.endswith("_proj")}
    assert methods == {Fp8BlockLinearMethod}
    if "moe" in case:
        assert isinstance(model.layers[0].mlp.experts.method, Fp8BlockFusedMoEMethod)
    outs = llm.generate([{"prompt_token_ids": p} for p in m.prompts], GREEDY_LOGPROBS,
                        use_tqdm=False)
    for i, (p, o, ref) in enumerate(zip(m.prompts, outs, m.reference())):
        comp = o.outputs[0]
        assert comp.token_ids == ref, (case, i, comp.token_ids, ref)
        check_completion(m, p, comp, K, f"{case}: prompt {i}", greedy=True)


def test_checkpoint_layout_and_scales_loaded_as_stored(ct_block):
    """The writer's layout (weight e4m3, weight_scale fp32 per block, no _inv tensor) and
    the loaded layers' weights: exactly the dequantized shards, the stored scale used
    as the multiplier."""
    m, deq = ct_block("llama_wide_b128")
    tensors = read_tensors(m.path)
    w = "model.layers.0.mlp.down_proj"
    assert tensors[w + ".weight"].dtype == torch.float8_e4m3fn
    assert tensors[w + ".weight_scale"].dtype == torch.float32
    assert tuple(tensors[w + ".weight_scale"].shape) == (2, 3)  # [256 / 128, 384 / 128]
    assert not any(n.endswith("_scale_inv") for n in tensors)
    qc = json.load(open(os.path.join(m.path, "config.json")))["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["block_structure"] == [128, 128]
    model = load(m.path)
    qkv = model.layers[0].self_attn.qkv_proj
    want = torch.cat([deq[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"])
    assert isinstance(qkv.method, Fp8BlockLinearMethod) and qkv.method.block_size == (128, 128)
    assert torch.equal(qkv.dense_weight(), want)
    assert torch.equal(model.layers[0].mlp.down_proj.dense_weight(), deq[w + ".weight"])


def test_moe_experts_take_the_block_method(ct_block):
    m, _ = ct_block("qwen3_moe_b16")
    experts = load(m.path).layers[0].mlp.experts
    assert isinstance(experts.method, Fp8BlockFusedMoEMethod)
    assert experts.method.block_size == (16, 16)
    packed = experts.method.packed
    if packed is None:
        # [E, 2 I / bn, ceil(H / bk)]: gate and up rows stacked, 64 / 16 = 4 column blocks
        assert tuple(experts.gate_up_proj_scale_inv.shape) == (4, 4, 4)
    else:  # packed for the native kernel: the block columns are its groups
        assert len(packed.w13) == 4 and packed.w13[0].group_size == 16


def test_block_structure_contradicting_the_scales_is_refused_by_name(ct_block, tmp_path):
    m, _ = ct_block("qwen3_b32")
    cfg = json.load(open(os.path.join(m.path, "config.json")))
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["block_structure"] = \
        [16, 16]
    path = write_variant(m.path, str(tmp_path / "bad"), read_tensors(m.path), cfg)
    with pytest.raises(ValueError, match=r"weight_scale has shape \(\d+, \d+\); .* in "
                                         r"\[16, 16\] blocks needs"):
        load(path)


def test_packed_shard_not_whole_block_rows_is_refused_by_name(tmp_path):
    """[128, 128] blocks on the tiny Llama: q_proj's 64 rows cannot be followed by
    k_proj's block rows in one packed qkv_proj."""
    src = str(tmp_path / "src")
    build_checkpoint(src, "llama", dict(tie_word_embeddings=False))
    path = str(tmp_path / "q")
    write_compressed_tensors_fp8_block_checkpoint(src, path, (128, 128),
                                                  return_dequantized=False)
    with pytest.raises(ValueError, match=r"q_proj.weight has 64 rows, not a multiple of "
                                         r"the fp8 block's 128"):
        load(path)

