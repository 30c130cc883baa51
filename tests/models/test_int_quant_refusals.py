"""Every variant of the integer formats tokenmill does not load, and every checkpoint
that does not fit its config, is refused with an error naming the field or tensor:
config fields (ModelConfig, before a weight is read) and checkpoint tensors (the
loader, from the safetensors headers before loading or while converting)."""
from __future__ import annotations

import json
import logging
import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from conftest import MODEL_SPECS, build_checkpoint  # noqa: E402
from test_checkpoint_refusals import load, read_tensors, write_variant  # noqa: E402
from test_moe_parity import MOE_SPECS  # noqa: E402

from tokenmill.config import ModelConfig  # noqa: E402
from tokenmill.models.layers.linear import Linear  # noqa: E402
from tokenmill.models.quant_formats import (write_compressed_tensors_checkpoint,  # noqa: E402
                                            write_gptq_checkpoint)

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
        "sym": True, "checkpoint_format": "gptq"}
CT_W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
         "group_size": 32}


def ct(weights=None, **top) -> dict:
    group = {"targets": ["Linear"], "weights": {**CT_W4, **(weights or {})},
             "input_activations": None, "output_activations": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": group}, **top}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_src"))
    build_checkpoint(path, "qwen3", dict(head_dim=32, tie_word_embeddings=False))
    return path


@pytest.fixture(scope="module")
def gptq(src, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_gptq"))
    write_gptq_checkpoint(src, path, bits=4, group_size=32)
    return path


def _config(path: str) -> dict:
    return json.load(open(os.path.join(path, "config.json")))


@pytest.mark.parametrize("qc, message", [
    ({**GPTQ, "bits": 3}, r"gptq bits 3 is not implemented"),
    ({**GPTQ, "bits": 2}, r"gptq bits 2 is not implemented"),
    ({**GPTQ, "checkpoint_format": "marlin"}, r"gptq checkpoint_format 'marlin' is not "
                                              r"implemented"),
    ({**GPTQ, "group_size": 0}, r"gptq group_size must be positive or -1"),
    ({**GPTQ, "dynamic": {"-:.*down": {}}}, r"gptq dynamic .* is not implemented"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": False},
     r"awq zero_point false is not implemented"),
    ({"quant_method": "awq", "bits": 8, "group_size": 32}, r"awq bits 8 is not implemented"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "exllama"},
     r"awq version 'exllama' is not implemented"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "backend": "llm-awq"},
     r"awq backend 'llm-awq' is not implemented"),
    # float-quantized FP8 loads as the fp8 method (test_fp8_scales.py, block strategy:
    # test_ct_fp8_block.py); its variants that do not map onto per-tensor / per-channel
    # / block e4m3 weights are refused by name.
    (ct({"type": "float", "num_bits": 8, "strategy": "group", "group_size": 128},
        format="float-quantized"),
     r"FP8 weights strategy 'group' is not implemented"),
    (ct({"type": "float", "num_bits": 8, "strategy": "block"}, format="float-quantized"),
     r"strategy 'block' needs block_structure \[bn, bk\] \(two positive ints\), got None"),
    (ct({"type": "float", "num_bits": 8, "strategy": "block", "block_structure": [128, 0]},
        format="float-quantized"),
     r"strategy 'block' needs block_structure .*got \[128, 0\]"),
    (ct({"type": "float", "num_bits": 4, "strategy": "tensor"}, format="float-quantized"),
     r"float-quantized weights of type 'float' / num_bits 4 are not implemented"),
    ({**ct(format="float-quantized"), "config_groups": {"g": {
        "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
        "input_activations": {"type": "int", "num_bits": 8, "dynamic": True}}}},
     r"input_activations of type 'int' / num_bits 8 are not implemented"),
    (ct(format="marlin-24"), r"format 'marlin-24' is not implemented"),
    ({**ct(), "config_groups": {"g": {"weights": {**CT_W4, "num_bits": 8}, "input_activations":
                                      {"num_bits": 8, "type": "int"}}}},
     r"input_activations \(activation quantization: W8A8, W4A8"),
    (ct({"num_bits": 2}), r"weights num_bits 2 is not implemented"),
    (ct({"type": "float", "num_bits": 8}), r"weights type 'float' \(FP8 / FP4 weights\)"),
    (ct({"strategy": "tensor"}), r"weights strategy 'tensor' is not implemented"),
    (ct({"strategy": "group", "group_size": None}), r"strategy 'group' needs a positive"),
    (ct(sparsity_config={"format": "sparse-24-bitmask"}), r"sparsity_config format "
                                                          r"'sparse-24-bitmask'"),
    (ct(kv_cache_scheme={"num_bits": 8, "type": "int"}), r"kv_cache_scheme type 'int' is "
                                                         r"not implemented"),
    (ct(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "channel"}),
     r"kv_cache_scheme strategy 'channel' is not implemented"),
    (ct(kv_cache_scheme={"num_bits": 8, "type": "float", "dynamic": True}),
     r"kv_cache_scheme dynamic is not implemented"),
    (ct(quantization_status="frozen"), r"quantization_status 'frozen' is not implemented"),
    ({**ct(), "config_groups": {"a": {"weights": CT_W4},
                                "b": {"weights": {**CT_W4, "num_bits": 8}}}},
     r"config groups with different weight schemes"),
])
def test_format_variants_not_implemented_are_refused_by_name(src, tmp_path, qc, message):
    path = write_variant(src, str(tmp_path / "q"), read_tensors(src),
                         {**_config(src), "quantization_config": qc})
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(path)


def _mutated(gptq: str, dst: str, change) -> str:
    tensors = read_tensors(gptq)
    change(tensors)
    return write_variant(gptq, dst, tensors)


def test_quantized_lm_head_loads_and_embedding_is_refused(src, gptq, tmp_path):
    """A GPTQ lm_head (untied) takes the GPTQ method (test_gptq_checkpoint.py checks
    its parity); a quantized embedding has no layer to place it."""
    from tokenmill.models.layers.linear_methods.int_packing import pack_int32

    def head(t):
        w = t.pop("lm_head.weight")
        t["lm_head.qweight"] = pack_int32(torch.zeros(w.shape[1], w.shape[0], dtype=torch.long),
                                          4, 0)
        t["lm_head.qzeros"] = torch.zeros(2, w.shape[0] // 8, dtype=torch.int32)
        t["lm_head.scales"] = torch.ones(2, w.shape[0], dtype=torch.float16)
    from tokenmill.models.layers.linear_methods.gptq import GptqLinearMethod
    model = load(_mutated(gptq, str(tmp_path / "head"), head))
    assert isinstance(model.lm_head.method, GptqLinearMethod)

    def embed(t):
        t["model.embed_tokens.qweight"] = torch.zeros(8, 384, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"gptq tensor model\.embed_tokens\.qweight is not "
                                         r"one Qwen3ForCausalLM can place"):
        load(_mutated(gptq, str(tmp_path / "embed"), embed))


def test_half_quantized_packed_layer_is_refused(src, gptq, tmp_path):
    plain = read_tensors(src)

    def k_plain(t):
        for kind in ("qweight", "qzeros", "scales", "g_idx"):
            del t[f"model.layers.0.self_attn.k_proj.{kind}"]
        name = "model.layers.0.self_attn.k_proj.weight"
        t[name] = plain[name]
    with pytest.raises(ValueError, match=r"layer layers\.0\.self_attn\.qkv_proj packs .*"
                                         r"q_proj\.qweight is quantized but "
                                         r"layers\.0\.self_attn\.k_proj is not"):
        load(_mutated(gptq, str(tmp_path / "half"), k_plain))


@pytest.mark.parametrize("name, bad, message", [
    ("model.layers.0.mlp.down_proj.scales", torch.ones(3, 64, dtype=torch.float16),
     r"down_proj\.scales has shape \(3, 64\); a \[64, 128\] matrix in gptq 4-bit, group 32 "
     r"needs \(4, 64\)"),
    ("model.layers.1.self_attn.o_proj.qzeros", torch.zeros(2, 8, dtype=torch.float32),
     r"o_proj\.qzeros is F32; gptq stores it as I32"),
    ("model.layers.1.mlp.up_proj.qzeros", None, r"gptq tensor model\.layers\.1\.mlp\.up_proj"
                                               r"\.qzeros is missing"),
    ("model.layers.0.mlp.extra_proj.qweight", torch.zeros(8, 64, dtype=torch.int32),
     r"gptq tensor model\.layers\.0\.mlp\.extra_proj\.qweight is not one"),
])
def test_misfit_tensors_are_named(gptq, tmp_path, name, bad, message):
    def change(t):
        if bad is None:
            del t[name]
        else:
            t[name] = bad
    with pytest.raises(ValueError, match=message):
        load(_mutated(gptq, str(tmp_path / "bad"), change))


def test_bad_g_idx_is_named(gptq, tmp_path):
    def invalid(t):
        g = t["model.layers.0.mlp.down_proj.g_idx"]
        t["model.layers.0.mlp.down_proj.g_idx"] = torch.zeros_like(g)
    with pytest.raises(ValueError, match=r"g_idx gives group 0 128 columns .*not a valid "
                                         r"group assignment"):
        load(_mutated(gptq, str(tmp_path / "invalid"), invalid))

    def differs(t):
        name = "model.layers.0.self_attn.v_proj.g_idx"
        t[name] = t[name].flip(0).contiguous()
    with pytest.raises(ValueError, match=r"shards of the packed layer have different g_idx"):
        load(_mutated(gptq, str(tmp_path / "differs"), differs))


def test_ignored_layer_stored_quantized_is_a_contradiction(src, tmp_path):
    path = str(tmp_path / "ct")
    write_compressed_tensors_checkpoint(src, path, bits=4, group_size=32)
    cfg = _config(path)
    cfg["quantization_config"]["ignore"] = ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj$"]
    bad = write_variant(path, str(tmp_path / "ct_bad"), read_tensors(path), cfg)
    with pytest.raises(ValueError, match=r"down_proj\.weight_packed is quantized but the "
                                         r"quantization_config lists .* as not converted"):
        load(bad)

    def shape(t):
        t["model.layers.0.mlp.down_proj.weight_shape"] = torch.tensor([64, 64])
    with pytest.raises(ValueError, match=r"weight_shape says \[\[64, 64\]\], the layer's "
                                         r"matrices are \[\[64, 128\]\]"):
        load(_mutated(path, str(tmp_path / "ct_shape"), shape))


def test_moe_with_one_expert_unquantized_is_refused(tmp_path):
    arch, overrides = MOE_SPECS["qwen3_moe_norm"]
    src = str(tmp_path / "moe_src")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_checkpoint(src, arch, overrides)
    path = str(tmp_path / "moe")
    write_gptq_checkpoint(src, path, bits=4, group_size=32,
                          keep=("model.layers.1.mlp.experts.5.up_proj",))
    with pytest.raises(ValueError, match=r"MoE layer layers\.1\.mlp\.experts: .* is quantized "
                                         r"but layers\.1\.mlp\.experts\.5\.up_proj is not"):
        load(path)


def test_quantized_mla_projections_with_interleaved_rope_are_refused(tmp_path):
    """DeepSeek reorders the rope rows of q_b_proj / kv_a_proj_with_mqa as it loads
    them; rows packed into GPTQ words (and their scales) cannot be: refused, named."""
    arch, overrides = MODEL_SPECS["deepseek_v3"]
    src = str(tmp_path / "ds_src")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_checkpoint(src, arch, overrides)
    path = str(tmp_path / "ds")
    write_gptq_checkpoint(src, path, bits=4, group_size=16)
    with pytest.raises(ValueError, match=r"self_attn\.(q_b_proj|kv_a_proj_with_mqa)\.\w+: "
                                         r"integer-quantized MLA projections with "
                                         r"interleaved rope rows are not implemented"):
        load(path)


def test_int_config_over_plain_weights_loads_them_plain(src, tmp_path, caplog):
    path = write_variant(src, str(tmp_path / "plain"), read_tensors(src),
                         {**_config(src), "quantization_config": GPTQ})
    with caplog.at_level(logging.WARNING, logger="tokenmill.models.loader"):
        model = load(path)
    assert "quantization_config says gptq but no layer's weights" in caplog.text
    assert all(type(m.method).__name__ != "GptqLinearMethod" for m in model.modules()
               if isinstance(m, Linear))


def test_quantized_tensors_without_their_config_are_refused(src, gptq, tmp_path):
    path = write_variant(gptq, str(tmp_path / "noconfig"), read_tensors(gptq), _config(src))
    with pytest.raises(ValueError, match=r"_proj\.(qweight|qzeros|scales|g_idx) matches no "
                                         r"parameter"):
        load(path)


def test_packed_shard_ending_inside_a_word_is_refused(tmp_path):
    """q_proj of 36 rows in 4 bits ends mid-word in qzeros (packed along N): its words
    cannot be concatenated with k_proj's; refused naming the layer. 8 bits fit."""
    src = str(tmp_path / "src")
    build_checkpoint(src, "llama", dict(hidden_size=36, num_attention_heads=3,
                                        num_key_value_heads=1, intermediate_size=72,
                                        tie_word_embeddings=False))
    path = str(tmp_path / "q4")
    write_gptq_checkpoint(src, path, bits=4, group_size=12)
    with pytest.raises(ValueError, match=r"layer layers\.0\.self_attn\.qkv_proj packs .*; "
                                         r"model\.layers\.0\.self_attn\.q_proj has 36 rows, "
                                         r"which end inside a packed int32 word"):
        load(path)
    write_gptq_checkpoint(src, str(tmp_path / "q8"), bits=8, group_size=12)
    load(str(tmp_path / "q8"))


def test_published_config_spellings_are_accepted():
    """What the hub's configs write besides the writer's spelling: AutoAWQ's own keys
    (w_bit, q_group_size, "GEMM"), GPTQModel's "format", compressed-tensors' older
    compression_config with the scheme nested, channel strategy, ignore patterns."""
    from tokenmill.models.quantization import (AwqConfig, CompressedTensorsConfig,
                                               GptqConfig, ignores_module, int_quant_config)
    awq = int_quant_config({"quantization_config": {
        "quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True,
        "version": "GEMM", "modules_to_not_convert": ["visual"]}})
    assert awq == AwqConfig(64, ("visual",))
    gptq = int_quant_config({"quantization_config": {
        "quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": True, "sym": False,
        "format": "gptq_v2", "dynamic": None, "meta": {"quantizer": ["gptqmodel"]}}})
    assert gptq == GptqConfig(8, -1, True, False, "gptq_v2") and not gptq.v1_zeros
    old = int_quant_config({"compression_config": {"quantization_config": {
        "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel",
            "group_size": None, "actorder": None}}},
        "ignore": ["lm_head", "re:.*mlp.gate$"]}, "sparsity_config": {"format": "dense"}}})
    assert old == CompressedTensorsConfig(8, None, False, ("lm_head", "re:.*mlp.gate$"))
    assert ignores_module(old.ignored, "model.layers.3.mlp.gate")
    assert not ignores_module(old.ignored, "model.layers.3.mlp.gate_proj")
    assert ignores_module(("layers.0",), "model.layers.0.mlp.down_proj")
    assert not ignores_module(("layers.1",), "model.layers.10.mlp.down_proj")
