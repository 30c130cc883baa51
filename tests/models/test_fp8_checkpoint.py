"""FP8 checkpoints as published (DeepSeek-V3 / Qwen -FP8 layout) load for dense models.

Each tiny HF checkpoint (conftest) is rewritten in the published layout here, from the
format's description: every Linear weight of the decoder layers becomes e4m3, with one
fp32 `weight_scale_inv` per [bn, bk] block (scale = amax / 448, w8 = w / scale), and
config.json gets the quantization_config. The reference is HF transformers on the
unquantized checkpoint with those Linear weights replaced by the dequantized ones
(w8.float() * scale per block), fp32: greedy tokens equal and logprobs within 1e-4.

Every variant not implemented (e5m2, an unknown activation scheme, a packed shard that
is not whole block rows) and a missing scale are refused with an error naming what.
Tensor parallelism: test_tensor_parallel_quantized.py. FP8 MoE experts: test_fp8_moe.py; per-tensor / per-channel scales
and static activation scales: test_fp8_scales.py.
"""
from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch

from conftest import (NUM_NEW, build_checkpoint, hf_greedy_batch, make_llm, make_prompts,
                      runner_of)
from logprob_check import K, check_completion
from tokenmill import SamplingParams
from tokenmill.config import ModelConfig
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.linear_methods import fp8 as fp8_method
from tokenmill.models.layers.linear_methods.fp8 import Fp8BlockLinearMethod
from tokenmill.models.loader import load_model
from tokenmill.platforms import create_platform

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint_refusals import load, read_tensors, write_variant  # noqa: E402

GREEDY_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True,
                                 logprobs=K)
FP8_MAX = 448.0  # the largest finite e4m3 value


def quantize_blocks(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], fp32 scale [ceil(N/bn), ceil(K/bk)]), block by block."""
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            s = tile.abs().max().clamp(min=1e-12) / FP8_MAX
            scale[i, j] = s
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (tile / s).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    out = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] *= scale[i, j]
    return out


def is_linear_weight(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith("_proj.weight") and ".layers." in name


def fp8_variant(src: str, dst: str, block, keep: tuple[str, ...] = (),
                qc_extra: dict | None = None) -> dict[str, torch.Tensor]:
    """`src` rewritten as an fp8 checkpoint with `block` [bn, bk] (the modules in `keep`
    left unquantized); returns the dequantized weights by checkpoint name."""
    bn, bk = block
    tensors, deq = {}, {}
    for name, t in read_tensors(src).items():
        if is_linear_weight(name, t) and not name.startswith(keep):
            q, s = quantize_blocks(t, bn, bk)
            tensors[name], tensors[name + "_scale_inv"] = q, s
            deq[name] = dequantize_blocks(q, s, bn, bk)
        else:
            tensors[name] = t
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), **(qc_extra or {})}
    write_variant(src, dst, tensors, cfg)
    return deq


def hf_dequantized(src: str, deq: dict[str, torch.Tensor]):
    """HF's model of the unquantized checkpoint with its Linear weights dequantized."""
    from transformers import AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    state = model.state_dict()
    with torch.no_grad():
        for name, w in deq.items():
            assert state[name].shape == w.shape, name
            state[name].copy_(w)
    return model


# (spec, arch, overrides, block): GQA with a q/k-normed Qwen3 (head_dim 32, untied);
# Llama GQA tied; a block whose bk does not divide K (64 = 48 + 16, 128 = 2*48 + 32);
# Qwen2's q/k/v biases beside the fp8 weights; Phi-3's checkpoint-fused projections.
CASES = {
    "qwen3_b16": ("qwen3", dict(head_dim=32, tie_word_embeddings=False), (16, 16)),
    "llama_gqa_tied_b16": ("llama", dict(tie_word_embeddings=True), (16, 16)),
    "qwen3_b32x48": ("qwen3", dict(head_dim=32, tie_word_embeddings=False), (32, 48)),
    "qwen2_bias_b16": ("qwen2", dict(tie_word_embeddings=False), (16, 16)),
    # Phi-3: q/k/v and gate/up stored fused in the checkpoint (one fp8 tensor each).
    "phi3_fused_b16": ("phi3", dict(partial_rotary_factor=0.75, sliding_window=2047,
                                    tie_word_embeddings=False), (16, 16)),
}


class Built:
    def __init__(self, src: str, path: str, hf, vocab: int):
        self.src, self.path, self.hf = src, path, hf
        self.prompts = make_prompts([5, 17, 33, 8], vocab)
        self._ref = None

    def reference(self) -> list[list[int]]:
        if self._ref is None:
            self._ref = hf_greedy_batch(self.hf, self.prompts, NUM_NEW)
        return self._ref


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    cache: dict[str, Built] = {}

    def get(case: str) -> Built:
        if case not in cache:
            arch, overrides, block = CASES[case]
            src = str(tmp_path_factory.mktemp(case + "_src"))
            build_checkpoint(src, arch, overrides)
            path = str(tmp_path_factory.mktemp(case))
            deq = fp8_variant(src, path, block)
            cfg = json.load(open(os.path.join(src, "config.json")))
            cache[case] = Built(src, path, hf_dequantized(src, deq), cfg["vocab_size"])
        return cache[case]
    return get


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_greedy_tokens_and_logprobs_match_hf_dequantized(fp8_model, case):
    m = fp8_model(case)
    llm = make_llm(m.path)  # fp32, the default capability level
    native_fp8_layers(runner_of(llm).model)  # the native kernel where the CPU has one
    outs = llm.generate([{"prompt_token_ids": p} for p in m.prompts], GREEDY_LOGPROBS,
                        use_tqdm=False)
    for i, (p, o, ref) in enumerate(zip(m.prompts, outs, m.reference())):
        comp = o.outputs[0]
        assert comp.token_ids == ref, (case, i, comp.token_ids, ref)
        check_completion(m, p, comp, K, f"{case}: prompt {i}", greedy=True)


def test_fp8_bf16_runs_close_to_hf(fp8_model):
    m = fp8_model("qwen3_b16")
    llm = make_llm(m.path, dtype="bfloat16")
    outs = llm.generate([{"prompt_token_ids": p} for p in m.prompts],
                        SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True),
                        use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert all(len(g) == NUM_NEW for g in got)
    # bf16 rounding may flip a near-tie later on; the first tokens agree with fp32 HF.
    first = sum(g[:4] == r[:4] for g, r in zip(got, m.reference()))
    assert first >= len(got) - 1, (got, m.reference())


def native_fp8_layers(model, native: bool | None = None) -> int:
    """Checks that every fp8 Linear of `model` runs the native kernel where its platform
    has one (`native`; None: the default CPU platform's answer), its packed copy the only
    one kept; -> how many do (0: no native kernels)."""
    if native is None:
        native = create_platform("cpu", torch.float32).quantized_max_rows > 0
    count = 0
    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and isinstance(mod.method, Fp8BlockLinearMethod):
            assert (mod.method.packed is not None) == native, name
            assert ("native up to" in mod.method.describe()) == native, name
            if native:  # no e4m3 [N, K] copy beside the packed one
                assert mod.weight.is_meta and mod.weight_scale_inv.is_meta, name
            count += native
    return count


@pytest.mark.parametrize("cpu_kernels", ["auto", "torch"])
def test_fp8_layers_keep_the_e4m3_weights_only(fp8_model, cpu_kernels):
    """The resident weight is one byte a weight (no dequantized copy kept): the native
    kernels' packed e4m3 (the layer's e4m3 tensor and scales dropped), or, without
    them, the e4m3 tensor itself; the lm_head and embeddings stay unquantized, and
    dense_weight() is the dequantized W."""
    m = fp8_model("qwen3_b16")
    cfg = ModelConfig.from_pretrained(m.path, dtype="float32", device="cpu")
    platform = create_platform(cfg.device, cfg.dtype, cpu_kernels=cpu_kernels)
    model = load_model(cfg.path, cfg.hf_config, cfg.dtype, cfg.device, platform)
    native = platform.quantized_max_rows > 0
    assert native == (cpu_kernels == "auto" and platform.ops is not None)
    assert native_fp8_layers(model, native) == (2 * 4 if native else 0)
    fp8_layers = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, Linear):
            continue
        if name == "lm_head":
            assert not isinstance(mod.method, Fp8BlockLinearMethod)
            continue
        assert isinstance(mod.method, Fp8BlockLinearMethod), name
        fp8_layers += 1
        assert mod.weight.dtype == torch.float8_e4m3fn and mod.weight.element_size() == 1
        n, k = mod.weight.shape
        scales = mod.weight_scale_inv.numel() * 4
        held = sum(t.numel() * t.element_size() for t in mod.state_dict().values()
                   if not t.is_meta)
        if native:
            # Packed: a byte a weight and an fp32 scale per column and bk = 16 columns
            # (N padded to the 32-column pack). Here 1.25x the checkpoint's bytes, of
            # tiny 16-column blocks; a [128, 128] block checkpoint's: 1.03x, per-channel
            # 1.00x (tests/unit/test_cpu_fp8_linear.py, test_quantize_at_load.py).
            assert held == 0, name
            padded = -(-n // 32) * 32
            assert mod.method.packed.nbytes() == padded * k + padded * -(-k // 16) * 4, name
        else:
            assert held == n * k + scales, name
            # Nothing the method keeps is a tensor (no dequantized copy).
            assert not any(isinstance(v, torch.Tensor) for v in vars(mod.method).values())
    assert fp8_layers == 2 * 4  # qkv, o, gate_up, down per layer
    assert model.embed_tokens.weight.dtype == torch.float32
    src = read_tensors(m.path)
    down = model.layers[1].mlp.down_proj
    want = dequantize_blocks(src["model.layers.1.mlp.down_proj.weight"],
                             src["model.layers.1.mlp.down_proj.weight_scale_inv"], 16, 16)
    assert torch.equal(down.dense_weight(), want)
    # The packed q | k | v: its scales concatenated in block rows as its weights are.
    qkv = model.layers[0].self_attn.qkv_proj
    want = torch.cat([dequantize_blocks(src[f"model.layers.0.self_attn.{p}_proj.weight"],
                                        src[f"model.layers.0.self_attn.{p}_proj.weight_scale_inv"],
                                        16, 16) for p in "qkv"])
    assert torch.equal(qkv.dense_weight(), want)


def test_fp8_method_in_row_tiles_matches_one_tile(monkeypatch):
    """The per-call dequantization in row tiles (a large layer) gives the whole-matrix
    result; partial last blocks in both dims."""
    torch.manual_seed(0)
    layer = Linear(40, 72, bias=True, method=Fp8BlockLinearMethod((16, 16)),
                   dtype=torch.float32)
    w = torch.randn(72, 40)
    q, s = quantize_blocks(w, 16, 16)
    with torch.no_grad():
        layer.weight.copy_(q)
        layer.weight_scale_inv.copy_(s)
        layer.bias.normal_()
    x = torch.randn(5, 40)
    want = x @ dequantize_blocks(q, s, 16, 16).T + layer.bias
    assert torch.allclose(layer(x), want, atol=1e-5)
    monkeypatch.setattr(fp8_method, "ROW_TILE_ELEMENTS", 40 * 16)  # one block row a tile
    assert layer.method._tile_rows(40) == 16
    assert torch.allclose(layer(x), want, atol=1e-5)
    assert torch.equal(layer.dense_weight(), dequantize_blocks(q, s, 16, 16))
    xb = x.to(torch.bfloat16)
    assert layer(xb).dtype == torch.bfloat16


def test_platform_widens_the_fp8_gemms():
    """Where the platform widens bf16 GEMMs (CPUs without native bf16), the fp8 layers'
    dequantized GEMMs are widened too: fp32 GEMM, the result rounded to bf16 (the
    dequantized path: no native kernel here; with it, tests/unit/test_cpu_fp8_linear.py)."""
    import dataclasses
    platform = dataclasses.replace(create_platform("cpu", torch.bfloat16), gemm_dtype="float32",
                                   quantized_max_rows=0)
    layer = Linear(32, 48, bias=False, method=Fp8BlockLinearMethod((16, 16)),
                   dtype=torch.bfloat16)
    q, s = quantize_blocks(torch.randn(48, 32), 16, 16)
    with torch.no_grad():
        layer.weight.copy_(q)
        layer.weight_scale_inv.copy_(s)
    method = platform.linear_method(layer)
    assert isinstance(method, Fp8BlockLinearMethod) and method.compute_dtype == torch.float32
    layer.set_method(method)
    x = torch.randn(3, 32).to(torch.bfloat16)
    want = (x.float() @ dequantize_blocks(q, s, 16, 16).T).to(torch.bfloat16)
    assert torch.equal(layer(x), want)
    assert layer.dense_weight().dtype == torch.bfloat16
    # No widening: the fp8 method is kept as it is.
    plain = dataclasses.replace(platform, gemm_dtype="bfloat16")
    assert plain.linear_method(layer) is layer.method


def test_modules_to_not_convert_stay_unquantized(tmp_path):
    """A layer the config leaves unquantized (its weight stored plain) loads plain, the
    rest fp8; still HF's tokens. Listing a layer whose weight is fp8 is refused."""
    src = str(tmp_path / "src")
    build_checkpoint(src, "llama", dict(tie_word_embeddings=False))
    path = str(tmp_path / "fp8")
    keep = "model.layers.1.mlp.down_proj"
    deq = fp8_variant(src, path, (16, 16), keep=(keep,),
                      qc_extra={"modules_to_not_convert": ["lm_head", keep]})
    model = load(path)
    assert not isinstance(model.layers[1].mlp.down_proj.method, Fp8BlockLinearMethod)
    assert isinstance(model.layers[0].mlp.down_proj.method, Fp8BlockLinearMethod)
    hf = hf_dequantized(src, deq)
    prompts = make_prompts([7, 20], 384)
    outs = make_llm(path).generate([{"prompt_token_ids": p} for p in prompts],
                                   GREEDY_LOGPROBS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy_batch(hf, prompts, NUM_NEW)
    bad = str(tmp_path / "contradiction")
    fp8_variant(src, bad, (16, 16),
                qc_extra={"ignored_layers": ["model.layers.0.mlp.down_proj"]})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight is fp8 "
                                         r"but quantization_config lists"):
        load(bad)


# ---- refusals ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_src(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("qwen3_fp8_src"))
    build_checkpoint(src, "qwen3", dict(head_dim=32, tie_word_embeddings=False))
    return src


def _with_config(src: str, dst: str, **qc) -> str:
    """An fp8 [16, 16] copy of `src` whose quantization_config has `qc` on top."""
    fp8_variant(src, dst, (16, 16), qc_extra=qc)
    return dst


@pytest.mark.parametrize("qc, message", [
    (dict(fmt="e5m2"), r"fp8 fmt 'e5m2' is not implemented"),
    # (static schemes and per-tensor / per-channel scales load: test_fp8_scales.py)
    (dict(activation_scheme="per_token"), r"fp8 activation_scheme 'per_token' is not "
                                          r"implemented"),
    (dict(weight_block_size=[128]), r"weight_block_size must be two positive ints"),
])
def test_fp8_variants_not_implemented_are_refused_by_name(qwen3_src, tmp_path, qc, message):
    path = _with_config(qwen3_src, str(tmp_path / "q"), **qc)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(path)
    with pytest.raises(ValueError, match=message):
        make_llm(path)


def test_fp8_tensors_of_variants_not_implemented_are_named(qwen3_src, tmp_path):
    """e5m2 weights or static input scales under an e4m3 / dynamic config: named."""
    path = _with_config(qwen3_src, str(tmp_path / "e5m2"))
    tensors = read_tensors(path)
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].float().to(torch.float8_e5m2)
    write_variant(path, str(tmp_path / "e5m2b"), tensors)
    with pytest.raises(ValueError, match=rf"{name} is float8_e5m2"):
        load(str(tmp_path / "e5m2b"))
    tensors = read_tensors(path)
    tensors["model.layers.0.mlp.up_proj.input_scale"] = torch.ones(1)
    write_variant(path, str(tmp_path / "static"), tensors)
    with pytest.raises(ValueError, match=r"up_proj\.input_scale is a per-tensor weight "
                                         r"scale or a static activation scale"):
        load(str(tmp_path / "static"))


def test_fp8_missing_scale_is_named(qwen3_src, tmp_path):
    path = _with_config(qwen3_src, str(tmp_path / "fp8"))
    for drop in ("model.layers.0.mlp.down_proj.weight_scale_inv",
                 "model.layers.1.self_attn.k_proj.weight_scale_inv"):
        tensors = {k: v for k, v in read_tensors(path).items() if k != drop}
        variant = write_variant(path, str(tmp_path / drop), tensors)
        with pytest.raises(ValueError, match=rf"{drop.replace('.', '[.]')} is missing"):
            load(variant)


def test_fp8_scale_of_the_wrong_block_size_is_named(qwen3_src, tmp_path):
    path = _with_config(qwen3_src, str(tmp_path / "fp8"))
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["quantization_config"]["weight_block_size"] = [32, 32]
    write_variant(path, str(tmp_path / "b32"), read_tensors(path), cfg)
    with pytest.raises(ValueError, match=r"weight_scale_inv has shape .* needs"):
        load(str(tmp_path / "b32"))


def test_fp8_packed_shard_not_whole_block_rows_is_refused(qwen3_src, tmp_path):
    """q_proj has 128 rows: with bn = 48 its scales end mid-block, so q | k | v's
    scales cannot be concatenated; refused naming the layer."""
    path = str(tmp_path / "b48")
    fp8_variant(qwen3_src, path, (48, 16))
    with pytest.raises(ValueError, match=r"layer layers\.0\.self_attn\.qkv_proj packs .*"
                                         r"q_proj\.weight has 128 rows, not a multiple"):
        load(path)


def test_fp8_packed_layer_half_quantized_is_refused(qwen3_src, tmp_path):
    path = _with_config(qwen3_src, str(tmp_path / "fp8"))
    tensors = read_tensors(path)
    plain = read_tensors(qwen3_src)
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = plain[name]
    del tensors[name + "_scale_inv"]
    write_variant(path, str(tmp_path / "half"), tensors)
    with pytest.raises(ValueError, match=r"gate_up_proj packs .*up_proj\.weight \(F32\) not"):
        load(str(tmp_path / "half"))


def test_drafters_refuse_fp8():
    """EAGLE-3 / DFlash drafters place no quantized layers: their loaders refuse fp8."""
    from tokenmill.models.quantization import check_quantization
    cfg = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert check_quantization(cfg, "model m") == "fp8"
    with pytest.raises(ValueError, match=r"EAGLE-3 draft d: quantization_config.quant_method "
                                         r"'fp8' is not implemented"):
        check_quantization(cfg, "EAGLE-3 draft d", implemented=())


def test_fp8_config_over_plain_weights_loads_them_plain(qwen3_src, tmp_path, caplog):
    import logging
    cfg = json.load(open(os.path.join(qwen3_src, "config.json")))
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}
    path = write_variant(qwen3_src, str(tmp_path / "plain"), read_tensors(qwen3_src), cfg)
    with caplog.at_level(logging.WARNING, logger="tokenmill.models.loader"):
        model = load(path)
    assert "no layer's weights are e4m3" in caplog.text
    assert not any(isinstance(m.method, Fp8BlockLinearMethod) for m in model.modules()
                   if isinstance(m, Linear))
