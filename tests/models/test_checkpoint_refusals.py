"""A checkpoint the loader cannot place is an error, never a model that generates noise.

Quantized formats other than block-scaled FP8, GPTQ, AWQ and compressed-tensors
pack-quantized (any unknown quant_method) are refused by name before a weight is read
(the implemented ones and their variants not implemented: tests/models/test_fp8_*.py,
test_gptq_checkpoint.py, test_awq_checkpoint.py, test_compressed_tensors_checkpoint.py,
test_int_quant_refusals.py); a tensor that matches no parameter, a parameter the
checkpoint does not fill and a weight of a non-floating dtype are each errors naming
the tensor, for every architecture the parity suites build. EAGLE-3 / DFlash drafters
are refused at start-up on targets that do not expose the hidden states they read.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import MODEL_SPECS, build_checkpoint, make_llm
from tokenmill.config import ModelConfig
from tokenmill.models import loader
from tokenmill.models.checkpoint_io import safetensors_files
from tokenmill.models.loader import load_model
from tokenmill.platforms import create_platform

sys.path.insert(0, os.path.dirname(__file__))
from test_hybrid_parity import HYBRID_SPECS, build_hybrid  # noqa: E402
from test_moe_parity import MOE_SPECS  # noqa: E402


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in safetensors_files(path):
        with safe_open(f, framework="pt") as st:
            out.update({n: st.get_tensor(n) for n in st.keys()})
    return out


def write_variant(src: str, dst: str, tensors: dict, config: dict | None = None) -> str:
    """`src` with its weights replaced by `tensors` (one file) and its config by `config`."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            shutil.copy(os.path.join(src, name), dst)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(dst, "model.safetensors"))
    if config is not None:
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config, f)
    return dst


def load(path: str):
    cfg = ModelConfig.from_pretrained(path, dtype="float32", device="cpu")
    return load_model(cfg.path, cfg.hf_config, cfg.dtype, cfg.device,
                      create_platform(cfg.device, cfg.dtype))


@pytest.fixture(scope="module")
def qwen3(tiny_model_factory):
    return tiny_model_factory("qwen3_headdim")


def _config(tm) -> dict:
    return json.load(open(os.path.join(tm.path, "config.json")))


def fp8_block(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / Qwen -FP8 layout: e4m3 weight, one fp32 scale_inv per block."""
    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    scale = torch.ones(rows, cols)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
    full = scale.repeat_interleave(block, 0)[:w.shape[0]].repeat_interleave(block, 1)
    return (w / full[:, :w.shape[1]]).to(torch.float8_e4m3fn), scale


def fp8_checkpoint(tm) -> tuple[dict, dict]:
    tensors = {}
    for name, t in read_tensors(tm.path).items():
        if t.dim() == 2 and "proj" in name:
            tensors[name], tensors[name + "_scale_inv"] = fp8_block(t)
        else:
            tensors[name] = t
    return tensors, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                     "weight_block_size": [32, 32]}


def gptq_checkpoint(tm) -> tuple[dict, dict]:
    """GPTQ's int4 layout: int32 words of 8 nibbles (qweight packed along the input,
    qzeros along the output), fp16 scales per group, g_idx."""
    tensors = {}
    for name, t in read_tensors(tm.path).items():
        if t.dim() == 2 and "proj" in name:
            out_f, in_f = t.shape
            base = name[:-len(".weight")]
            tensors[base + ".qweight"] = torch.zeros(in_f // 8, out_f, dtype=torch.int32)
            tensors[base + ".qzeros"] = torch.zeros(in_f // 32, out_f // 8, dtype=torch.int32)
            tensors[base + ".scales"] = torch.ones(in_f // 32, out_f, dtype=torch.float16)
            tensors[base + ".g_idx"] = torch.arange(in_f, dtype=torch.int32) // 32
        else:
            tensors[name] = t
    return tensors, {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                     "sym": True, "checkpoint_format": "gptq"}


@pytest.mark.parametrize("fmt", ["hqq", "fbgemm_fp8"])
def test_quantized_checkpoint_is_refused_by_method(qwen3, tmp_path, fmt, monkeypatch):
    """Refused naming the method, before any weight is read (the engine, the loader
    and the plain ModelConfig all say so): packed integer tensors under a method
    tokenmill does not implement (GPTQ's layout itself loads: below)."""
    tensors, qc = gptq_checkpoint(qwen3)
    qc = {**qc, "quant_method": fmt}
    path = write_variant(qwen3.path, str(tmp_path / fmt), tensors,
                         {**_config(qwen3), "quantization_config": qc})

    def no_reads(*a, **k):
        raise AssertionError("a weight was read before the format was checked")

    monkeypatch.setattr(loader, "iter_checkpoint", no_reads)
    with pytest.raises(ValueError, match=rf"quantization_config.quant_method '{fmt}' is not "
                                         r"implemented.*unquantized.*methods: awq, "
                                         r"compressed-tensors, fp8, gptq"):
        make_llm(path)
    with pytest.raises(ValueError, match=f"quant_method '{fmt}'"):
        load_model(path, {**_config(qwen3), "quantization_config": qc}, torch.float32,
                   torch.device("cpu"), create_platform("cpu", torch.float32))


@pytest.mark.parametrize("qc, named", [
    ({"quant_method": "my_new_format", "bits": 3}, "'my_new_format'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
      "version": "gemv"}, "awq version 'gemv' is not implemented"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"},
     "'compressed-tensors'"),
    ({"bits": 4}, "quantization_config has no quant_method"),
])
def test_any_quantization_config_is_refused(qwen3, tmp_path, qc, named):
    path = write_variant(qwen3.path, str(tmp_path / "q"), read_tensors(qwen3.path),
                         {**_config(qwen3), "quantization_config": qc})
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_pretrained(path)


def test_quantization_in_text_config_and_compression_config(qwen3, tmp_path):
    """A vision-language config keeps it in text_config; older compressed-tensors
    checkpoints write `compression_config`."""
    cfg = _config(qwen3)
    tensors = read_tensors(qwen3.path)
    nested = write_variant(qwen3.path, str(tmp_path / "nested"), tensors, {
        "architectures": cfg["architectures"], "model_type": "qwen3_vl",
        "text_config": {**cfg, "quantization_config": {"quant_method": "fp8",
                                                       "fmt": "e5m2"}}})
    # (fp8 itself loads; its e5m2 variant is refused: found in text_config)
    with pytest.raises(ValueError, match="fp8 fmt 'e5m2' is not implemented"):
        ModelConfig.from_pretrained(nested)
    old = write_variant(qwen3.path, str(tmp_path / "old"), tensors,
                        {**cfg, "compression_config": {"config_groups": {}}})
    with pytest.raises(ValueError, match="compression_config.quant_method "
                                         "'compressed-tensors'"):
        ModelConfig.from_pretrained(old)


def test_real_layout_fp8_checkpoint_loads(qwen3, tmp_path):
    """The real-layout block-scaled FP8 checkpoint that used to be refused now loads
    (its parity with HF: tests/models/test_fp8_checkpoint.py)."""
    from tokenmill.models.layers.linear_methods.fp8 import Fp8BlockLinearMethod
    tensors, qc = fp8_checkpoint(qwen3)
    path = write_variant(qwen3.path, str(tmp_path / "fp8"), tensors,
                         {**_config(qwen3), "quantization_config": qc})
    model = load(path)
    assert isinstance(model.layers[0].self_attn.qkv_proj.method, Fp8BlockLinearMethod)


def test_real_layout_gptq_checkpoint_loads(qwen3, tmp_path):
    """The GPTQ layout that used to be refused by method now loads (its parity with
    HF: tests/models/test_gptq_checkpoint.py)."""
    from tokenmill.models.layers.linear_methods.gptq import GptqLinearMethod
    tensors, qc = gptq_checkpoint(qwen3)
    path = write_variant(qwen3.path, str(tmp_path / "gptq"), tensors,
                         {**_config(qwen3), "quantization_config": qc})
    model = load(path)
    assert isinstance(model.layers[0].self_attn.qkv_proj.method, GptqLinearMethod)


def test_fp8_tensors_without_their_config_are_refused(qwen3, tmp_path):
    """The same FP8 files with the quantization_config stripped are refused; the scale
    tensors match no parameter (named), and e4m3 weights alone are not values (named)."""
    tensors, _ = fp8_checkpoint(qwen3)
    path = write_variant(qwen3.path, str(tmp_path / "noconfig"), tensors, _config(qwen3))
    with pytest.raises(ValueError, match=r"float8_e4m3fn is not a plain|weight_scale_inv "
                                         r"matches no parameter"):
        load(path)
    plain = read_tensors(qwen3.path)
    scales = {k: v for k, v in tensors.items() if k.endswith("_scale_inv")}
    path = write_variant(qwen3.path, str(tmp_path / "scales"), {**plain, **scales})
    with pytest.raises(ValueError, match=r"tensor model\.layers\.\d+\.\S+_proj\."
                                         r"weight_scale_inv matches no parameter"):
        load(path)
    weights_only = {k: v for k, v in tensors.items() if not k.endswith("_scale_inv")}
    path = write_variant(qwen3.path, str(tmp_path / "noscale"), weights_only, _config(qwen3))
    with pytest.raises(ValueError, match=r"_proj\.weight: checkpoint dtype "
                                         r"torch.float8_e4m3fn is not a plain"):
        load(path)


def test_integer_weight_is_refused(qwen3, tmp_path):
    tensors = read_tensors(qwen3.path)
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(torch.int8)
    path = write_variant(qwen3.path, str(tmp_path / "int8"), tensors)
    with pytest.raises(ValueError, match=rf"{name}: checkpoint dtype torch.int8"):
        load(path)


def test_unknown_tensor_is_named_and_known_unused_ones_load(qwen3, tmp_path):
    tensors = read_tensors(qwen3.path)
    extra = dict(tensors, **{"model.layers.1.mlp.gate_proj.bias": torch.zeros(128)})
    path = write_variant(qwen3.path, str(tmp_path / "extra"), extra)
    with pytest.raises(ValueError, match=r"tensor model\.layers\.1\.mlp\.gate_proj\.bias "
                                         r"matches no parameter of Qwen3ForCausalLM"):
        load(path)
    # Listed as unused on purpose (old checkpoints save the rotary frequencies).
    assert any(s == "rotary_emb.inv_freq" for s in loader.UNUSED_TENSOR_SUFFIXES)
    unused = dict(tensors, **{"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16)})
    path = write_variant(qwen3.path, str(tmp_path / "unused"), unused)
    from tokenmill import SamplingParams
    prompt = qwen3.prompts[1]
    out = make_llm(path).generate({"prompt_token_ids": prompt},
                                  SamplingParams(temperature=0.0, max_tokens=20))
    assert out[0].outputs[0].token_ids == qwen3.reference(prompt)  # HF's greedy tokens


# Every architecture the parity suites build: (spec table, name).
SWEEP = ([("text", n) for n in MODEL_SPECS] + [("moe", n) for n in MOE_SPECS]
         + [("hybrid", n) for n in HYBRID_SPECS] + [("vl", "qwen2_5_vl"), ("vl", "qwen3_vl")])


@pytest.fixture(scope="module")
def sweep_checkpoints(tmp_path_factory):
    built = {}

    def get(table: str, name: str) -> str:
        if (table, name) not in built:
            path = str(tmp_path_factory.mktemp(f"sweep_{name}"))
            if table == "hybrid":
                arch, overrides = HYBRID_SPECS[name]
                build_hybrid(path, arch, overrides)
            elif table == "vl":
                import vl_checkpoint
                build = {"qwen2_5_vl": vl_checkpoint.build_vl_checkpoint,
                         "qwen3_vl": vl_checkpoint.build_qwen3_vl_checkpoint}[name]
                build(path)
            else:
                arch, overrides = (MODEL_SPECS if table == "text" else MOE_SPECS)[name]
                build_checkpoint(path, arch, overrides)
            built[(table, name)] = path
        return built[(table, name)]
    return get


def _layer_zero_tensors(tensors: dict) -> list[str]:
    """The checkpoint tensors of one decoder layer (what a truncated download or a
    renamed module loses)."""
    names = sorted(n for n in tensors if ".layers.0." in n and "visual" not in n)
    assert names
    return names


@pytest.mark.parametrize("table, name", SWEEP, ids=[n for _, n in SWEEP])
def test_every_architecture_names_what_it_lacks_or_cannot_place(sweep_checkpoints, tmp_path,
                                                                 table, name):
    """For every architecture: the complete checkpoint loads; each of layer 0's tensors
    left out is an error naming what is missing (a few that a KV-shared Gemma 4 layer
    does not use aside), and an extra tensor is an error naming it."""
    path = sweep_checkpoints(table, name)
    tensors = read_tensors(path)
    load(path)
    names = _layer_zero_tensors(tensors)
    # Spread over the layer's tensors (attention, norms, MLP or experts, state params).
    picks = names[::max(1, len(names) // 4)]
    for drop in picks:
        variant = write_variant(path, str(tmp_path / drop), {k: v for k, v in tensors.items()
                                                             if k != drop})
        with pytest.raises(ValueError, match="lacks") as err:
            load(variant)
        # The message names the parameter (or the packed shard / expert) left unfilled.
        leaf = drop.split(".layers.0.")[1].rsplit(".", 1)[0].split(".")[-1]
        assert "layers.0." in str(err.value), (drop, str(err.value))
        assert leaf in str(err.value) or "experts" in str(err.value) \
            or "_proj" in str(err.value), (drop, str(err.value))
    bogus = dict(tensors, **{"model.layers.0.not_a_module.weight": torch.zeros(2)})
    variant = write_variant(path, str(tmp_path / "bogus"), bogus)
    with pytest.raises(ValueError, match=r"not_a_module\.weight matches no parameter"):
        load(variant)


def test_deepseek_v3_mtp_layers_are_unused_on_purpose(tiny_model_factory, tmp_path):
    """V3 checkpoints carry their next-token (MTP) layer as model.layers.{N} past
    num_hidden_layers: dropped by DeepseekV2ForCausalLM.map_checkpoint, so the load
    succeeds and the tokens stay HF's; any other extra tensor still fails."""
    from tokenmill import SamplingParams
    tm = tiny_model_factory("deepseek_v3")
    tensors = read_tensors(tm.path)
    n = tm.hf_config["num_hidden_layers"]
    mtp = {k.replace(f".layers.{n - 1}.", f".layers.{n}."): v.clone() for k, v in tensors.items()
           if f".layers.{n - 1}." in k}
    mtp[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(8, 8)  # MTP-only modules
    path = write_variant(tm.path, str(tmp_path / "v3mtp"), {**tensors, **mtp})
    prompt = tm.prompts[0]
    out = make_llm(path).generate({"prompt_token_ids": prompt},
                                  SamplingParams(temperature=0.0, max_tokens=20))
    assert out[0].outputs[0].token_ids == tm.reference(prompt)


def test_hybrid_model_without_prefix_caching_turns_the_external_kv_tier_off(tmp_path,
                                                                           caplog):
    """A hybrid's tier hit resumes from a state snapshot, which only prefix caching
    takes: without it the tier is off, with the reason."""
    import logging

    from conftest import runner_of
    arch, overrides = HYBRID_SPECS["qwen3_5"]
    path = str(tmp_path / "hybrid")
    build_hybrid(path, arch, overrides)
    with caplog.at_level(logging.WARNING, logger="tokenmill.kv_connector"):
        llm = make_llm(path, kv_connector=["cpu"], enable_prefix_caching=False)
    assert llm.llm_engine.engine_core.kv_connector is None
    assert runner_of(llm).kv_connector is None
    assert "turned off" in caplog.text and "Gated DeltaNet" in caplog.text
