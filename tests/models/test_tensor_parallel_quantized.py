"""Tensor parallelism with quantized models: tensor_parallel_size=2 (gloo, two CPU
ranks) on a quantized checkpoint gives the output of tensor_parallel_size=1 on the
same checkpoint (greedy tokens equal, logprobs within 1e-4, fp32), and both are
within logprob_check's tolerance of HF transformers on the dequantized weights.

Formats: --quantization int8 / fp8 at load (a row-parallel layer's per-row scale is
taken over the whole row: the ranks' codes are the unsplit model's), fp8 checkpoints
with [16, 16] block scales (the scale grid cut with the weight; quant_method fp8 and
compressed-tensors' FP8_BLOCK) and with per-tensor static scales, GPTQ 4-bit group 32
symmetric and asymmetric, GPTQ desc_act: the writer's own act order, every group
scattered over the whole input (a row-parallel rank keeps every group's scales and
zero points and pads its groups: act_order_share.py), 4- and 8-bit, symmetric and
asymmetric, groups of 32, 64 and 48 (which does not divide a rank's 64 columns),
v1 and v2 zeros, and act order whose groups stay within a rank's columns (no
padding); GPTQ group 128 without act order (a group cut by the split: its g_idx
gives each rank's columns their group); compressed-tensors W4A16 actorder; GPTQ
8-bit with one group per row, GPTQ v2 with one KV head
(replicated) and a tied head, AWQ 4-bit group 32,
compressed-tensors W4A16 asymmetric (weight_shape rewritten per rank); MoE: a
Qwen3-MoE with GPTQ experts (and with act order: the experts' down_proj split by
its input), fp8 experts (block and per-channel scales) and int8 /
fp8 experts made at load, a DeepSeek-V3 with fp8 MLPs and experts (shared ones
too), and a hybrid Qwen3.5-MoE (Gated DeltaNet, shared expert) in GPTQ groups of 8.

Refused by name (before anything runs): an fp8 block, an AWQ word, or the group of a
layout without g_idx (AWQ, compressed-tensors without actorder) that a rank's share
would cut in two.
"""
from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch

from conftest import (MODEL_SPECS, NUM_NEW, build_checkpoint, hf_greedy_batch, make_llm,
                      make_prompts, runner_of)
from logprob_check import K, check_completion
from tokenmill import SamplingParams
from tokenmill.config import ModelConfig
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.linear_methods.fp8 import (Fp8BlockFusedMoEMethod,
                                                        Fp8BlockLinearMethod)
from tokenmill.models.layers.linear_methods.int8_at_load import Int8AtLoadFusedMoEMethod
from tokenmill.models.layers.linear_methods.quantized_linear import QuantizedLinearMethod
from tokenmill.models.layers.linear_methods.quantized_moe import QuantizedFusedMoEMethod
from tokenmill.models.layers.moe import FusedMoE
from tokenmill.models.loader import load_model
from tokenmill.models.quant_formats import (write_awq_checkpoint,
                                            write_compressed_tensors_checkpoint,
                                            write_gptq_checkpoint)
from tokenmill.models.quant_formats import writer as quant_writer
from tokenmill.platforms import create_platform

sys.path.insert(0, os.path.dirname(__file__))
from test_fp8_checkpoint import fp8_variant, hf_dequantized  # noqa: E402
from test_fp8_moe import hf_dequantized_moe, mlp_only_fp8_variant  # noqa: E402
from test_fp8_scales import PER_CHANNEL, PER_TENSOR, scales_variant  # noqa: E402
from test_hybrid_parity import HYBRID_SPECS, build_hybrid  # noqa: E402
from test_quantize_at_load import dequantized_checkpoint  # noqa: E402

GREEDY_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True,
                                 logprobs=K)
TOL = 1e-4
# Untied head; o_proj K = 4 heads x 32 = 128 and down_proj K = 128: 64 columns a rank.
QWEN3 = ("qwen3", dict(head_dim=32, tie_word_embeddings=False))
# Expert intermediate 64: 32 a rank, one group of 32.
QWEN3_MOE = ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                               norm_topk_prob=True, mlp_only_layers=[0],
                               tie_word_embeddings=False))
QUANTIZED_METHODS = (QuantizedLinearMethod, Fp8BlockLinearMethod, QuantizedFusedMoEMethod,
                     Fp8BlockFusedMoEMethod, Int8AtLoadFusedMoEMethod)
# Chunked prefill: the 33-token prompt takes three steps.
ENGINE = dict(max_num_batched_tokens=16)


def rank_local_perm(name: str, k: int, seed: int = 0) -> torch.Tensor:
    """act order for the desc_act case: the row-parallel layers' (o_proj, down_proj)
    columns shuffled within each half (each rank's groups its own), the other layers'
    across the whole input (column-parallel: every rank reads all of it)."""
    g = torch.Generator().manual_seed(k + seed)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        half = k // 2
        return torch.cat([torch.randperm(half, generator=g),
                          half + torch.randperm(half, generator=g)])
    return torch.randperm(k, generator=g)


def _write_int(writer, rank_local=False, **kw):
    """`rank_local`: the row-parallel layers' act order within each rank's columns
    (rank_local_perm), else the writer's own (every group over all of K)."""
    def write(src, dst, ref):
        with pytest.MonkeyPatch.context() as mp:
            if rank_local:
                mp.setattr(quant_writer, "act_order_perm_for", rank_local_perm)
            writer(src, dst, reference_dir=ref, **kw)
        return ref
    return write


def _write_fp8_block(src, dst, ref):
    deq = fp8_variant(src, dst, (16, 16))
    return (hf_dequantized_moe if ".experts." in " ".join(deq) else hf_dequantized)(src, deq)


def _write_fp8_mlp_only(src, dst, ref):
    return hf_dequantized_moe(src, mlp_only_fp8_variant(src, dst))


def _write_fp8_scales(scale_shape, static=False):
    def write(src, dst, ref):
        deq = scales_variant(src, dst, scale_shape, static)
        return (hf_dequantized_moe if ".experts." in " ".join(deq) else hf_dequantized)(
            src, deq)
    return write


def _at_load(method):
    def write(src, dst, ref):
        dequantized_checkpoint(src, ref, method)
        return ref
    return write


# name -> (model spec, writer (src, dst, ref dir) -> HF reference dir or model,
#          --quantization)
CASES = {
    "int8_at_load": (QWEN3, _at_load("int8"), "int8"),
    "fp8_at_load": (QWEN3, _at_load("fp8"), "fp8"),
    "fp8_block16": (QWEN3, _write_fp8_block, None),
    "fp8_per_tensor_static": (QWEN3, _write_fp8_scales(PER_TENSOR, static=True), None),
    # compressed-tensors' FP8_BLOCK: the block scales under the name weight_scale.
    "ct_fp8_block16": (QWEN3, _write_int(quant_writer.write_compressed_tensors_fp8_block_checkpoint,
                                         block=(16, 16)), None),
    "gptq_4bit_g32_sym": (QWEN3, _write_int(write_gptq_checkpoint, bits=4, group_size=32,
                                            sym=True), None),
    "gptq_4bit_g32_asym": (QWEN3, _write_int(write_gptq_checkpoint, bits=4, group_size=32,
                                             sym=False), None),
    "gptq_4bit_g32_desc_act_rank_local": (QWEN3, _write_int(write_gptq_checkpoint,
                                                            rank_local=True, bits=4,
                                                            group_size=32, sym=False,
                                                            desc_act=True), None),
    # Act order as published: each group's columns scattered over both ranks.
    "gptq_4bit_g32_desc_act_asym": (QWEN3, _write_int(write_gptq_checkpoint, bits=4,
                                                      group_size=32, sym=False,
                                                      desc_act=True), None),
    "gptq_4bit_g64_desc_act_sym": (QWEN3, _write_int(write_gptq_checkpoint, bits=4,
                                                     group_size=64, sym=True,
                                                     desc_act=True), None),
    "gptq_8bit_g32_desc_act_sym_v2": (QWEN3, _write_int(write_gptq_checkpoint, bits=8,
                                                        group_size=32, sym=True,
                                                        desc_act=True,
                                                        checkpoint_format="gptq_v2"), None),
    "gptq_8bit_g64_desc_act_asym": (QWEN3, _write_int(write_gptq_checkpoint, bits=8,
                                                      group_size=64, sym=False,
                                                      desc_act=True), None),
    # 48 does not divide a rank's 64 columns (K 128: groups of 48, 48 and 32).
    "gptq_4bit_g48_desc_act_asym": (QWEN3, _write_int(write_gptq_checkpoint, bits=4,
                                                      group_size=48, sym=False,
                                                      desc_act=True), None),
    # No act order, one group of 128 over both ranks' 64 columns: cut by g_idx.
    "gptq_4bit_g128": (QWEN3, _write_int(write_gptq_checkpoint, bits=4, group_size=128,
                                         sym=True), None),
    "ct_w4a16_g32_actorder": (QWEN3, _write_int(write_compressed_tensors_checkpoint,
                                                bits=4, group_size=32, symmetric=False,
                                                actorder=True), None),
    # One KV head for two ranks (k / v rows replicated), head tied to the embedding.
    "gptq_4bit_g32_mqa_tied": (("qwen3", dict(head_dim=32, num_key_value_heads=1,
                                              tie_word_embeddings=True)),
                               _write_int(write_gptq_checkpoint, bits=4, group_size=32,
                                          sym=False, checkpoint_format="gptq_v2"), None),
    # 8-bit, one group per row: the scales and zero points stay whole on a row split.
    "gptq_8bit_gall": (QWEN3, _write_int(write_gptq_checkpoint, bits=8, group_size=-1,
                                         sym=True), None),
    "awq_g32": (QWEN3, _write_int(write_awq_checkpoint, group_size=32), None),
    "ct_w4a16_g32_asym": (QWEN3, _write_int(write_compressed_tensors_checkpoint, bits=4,
                                            group_size=32, symmetric=False), None),
    "qwen3_moe_gptq_4bit_g32": (QWEN3_MOE, _write_int(write_gptq_checkpoint, bits=4,
                                                      group_size=32, sym=True), None),
"qwen3_moe_gptq_4bit_g16_desc_act": (QWEN3_MOE, _write_int(write_gptq_checkpoint, bits=4,
                                                               group_size=16, sym=False,
                                                               desc_act=True), None),
    "qwen3_moe_int8_at_load": (QWEN3_MOE, _at_load("int8"), "int8"),
    "qwen3_moe_fp8_at_load": (QWEN3_MOE, _at_load("fp8"), "fp8"),
    "qwen3_moe_fp8_block16": (QWEN3_MOE, _write_fp8_block, None),
    "qwen3_moe_fp8_per_channel": (QWEN3_MOE, _write_fp8_scales(PER_CHANNEL), None),
    # DeepSeek-V3 (MLA attention plain: its interleaved rope rows refuse fp8): dense
    # MLP, routed and shared experts in [16, 16] fp8 blocks.
    "deepseek_v3_mlp_fp8_block16": (MODEL_SPECS["deepseek_v3"], _write_fp8_mlp_only, None),
    # Hybrid (Gated DeltaNet split by key heads, gated attention, MoE with a shared
    # expert): groups of 8, as the experts' 16 columns a rank (I = 32) allow.
    "qwen3_5_moe_gptq_4bit_g8": ((*HYBRID_SPECS["qwen3_5_moe"], build_hybrid),
                                 _write_int(write_gptq_checkpoint, bits=4, group_size=8,
                                            sym=False), None),
}


class Case:
    def __init__(self, path: str, hf, quantization: str | None):
        self.path, self.hf, self.quantization = path, hf, quantization
        vocab = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
        self.prompts = make_prompts([5, 17, 33, 8], vocab)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    cache: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in cache:
            (arch, overrides, *build), write, method = CASES[name]
            src = str(tmp_path_factory.mktemp(name + "_src"))
            (build[0] if build else build_checkpoint)(src, arch, overrides)
            ref = str(tmp_path_factory.mktemp(name + "_ref"))
            dst = src if method is not None else str(tmp_path_factory.mktemp(name))
            hf = write(src, dst, ref)
            if isinstance(hf, str):
                hf = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
            cache[name] = Case(dst, hf, method)
        return cache[name]
    return get


def _quantized_layers(model) -> int:
    """How many of rank 0's Linears and expert blocks run a quantized method."""
    return sum(isinstance(getattr(m, "method", None), QUANTIZED_METHODS)
               for m in model.modules() if isinstance(m, (Linear, FusedMoE)))


def _run(case: Case, tp: int):
    llm = make_llm(case.path, tensor_parallel_size=tp, quantization=case.quantization,
                   **ENGINE)
    try:
        model = runner_of(llm).runner.model if tp > 1 else runner_of(llm).model
        assert _quantized_layers(model) > 0
        columns = next(m for n, m in model.named_modules()
                       if n.endswith("o_proj")).in_features  # (a rank's share)
        outs = llm.generate([{"prompt_token_ids": p} for p in case.prompts], GREEDY_LOGPROBS,
                            use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return [o.outputs[0] for o in outs], columns


@pytest.mark.parametrize("name", list(CASES))
def test_tp2_equals_tp1_and_hf_dequantized(quantized, name):
    case = quantized(name)
    (one, columns_1), (two, columns_2) = _run(case, 1), _run(case, 2)
    assert columns_2 * 2 == columns_1  # o_proj split
    want = hf_greedy_batch(case.hf, case.prompts, NUM_NEW)
    for i, (p, a, b, w) in enumerate(zip(case.prompts, one, two, want)):
        where = f"{name}: prompt {i}"
        assert b.token_ids == a.token_ids == w, (where, b.token_ids, a.token_ids, w)
        for j, (da, db) in enumerate(zip(a.logprobs, b.logprobs)):
            assert da.keys() == db.keys(), (where, j)
            for tok in da:
                assert db[tok].logprob == pytest.approx(da[tok].logprob, abs=TOL), (
                    where, j, tok, db[tok].logprob, da[tok].logprob)
        check_completion(case, p, b, K, f"{where} (tp 2)", greedy=True)


# ---- refusals, by name, before any weight is used ----------------------------------
def _load_rank0(path: str):
    """Rank 0 of two, loaded alone (no collective runs before the weights are placed)."""
    cfg = ModelConfig.from_pretrained(path, dtype="float32", device="cpu")
    return load_model(cfg.path, cfg.hf_config, cfg.dtype, cfg.device,
                      create_platform(cfg.device, cfg.dtype, tensor_parallel_size=2),
                      tp_group=types.SimpleNamespace(size=2, rank=0))


@pytest.fixture(scope="module")
def qwen3_src(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("qwen3_tpq_src"))
    build_checkpoint(src, *QWEN3)
    return src


def test_fp8_block_cut_by_the_split_is_refused(qwen3_src, tmp_path):
    # o_proj / down_proj: K 128 in one block of 128 columns; a rank holds 64.
    fp8_variant(qwen3_src, str(tmp_path), (16, 128))
    with pytest.raises(ValueError, match=r"layer layers\.0\.self_attn\.o_proj: "
                                         r"tensor_parallel_size: fp8 weight_block_size "
                                         r"\[16, 128\]: input columns in blocks of 128: a "
                                         r"rank's 64 of 128 is not a multiple of 128"):
        _load_rank0(str(tmp_path))


def test_group_cut_by_the_split_without_g_idx_is_refused(qwen3_src, tmp_path):
    # compressed-tensors without actorder stores no g_idx: a rank's 64 of o_proj's 128
    # columns would cut its one group of 128 (GPTQ, which stores g_idx, loads it).
    write_compressed_tensors_checkpoint(qwen3_src, str(tmp_path), bits=4, group_size=128,
                                        symmetric=False)
    with pytest.raises(ValueError, match=r"layer layers\.0\.self_attn\.o_proj: "
                                         r"tensor_parallel_size: compressed-tensors W4A16, "
                                         r"group 128, asymmetric (weight_scale|"
                                         r"weight_zero_point) \(input columns\): groups of "
                                         r"128 columns: a rank's 64 of 128 is not a multiple "
                                         r"of 128"):
        _load_rank0(str(tmp_path))
    awq = tmp_path / "awq"
    write_awq_checkpoint(qwen3_src, str(awq), group_size=128)
    with pytest.raises(ValueError, match=r"layer layers\.0\.self_attn\.o_proj: "
                                         r"tensor_parallel_size: awq 4-bit, group 128 "
                                         r"(qzeros|scales) \(input columns\): groups of 128 "
                                         r"columns: a rank's 64 of 128 is not a multiple of "
                                         r"128"):
        _load_rank0(str(awq))


def test_act_order_across_ranks_loads_padded(qwen3_src, tmp_path):
    """The writer's own act order (o_proj's groups over all of K): rank 0 keeps every
    group's scales and its 64 columns, padded; its weight is the checkpoint's
    dequantized columns 0..63 exactly."""
    ref = tmp_path / "ref"
    deq = write_gptq_checkpoint(qwen3_src, str(tmp_path / "q"), bits=4, group_size=32,
                                desc_act=True, sym=False, reference_dir=str(ref))
    model = _load_rank0(str(tmp_path / "q"))
    o_proj = model.layers[0].self_attn.o_proj
    form = o_proj.method.weight_form
    assert form.perm is not None and form.perm.numel() > 64  # (padding columns)
    want = deq["model.layers.0.self_attn.o_proj.weight"][:, :64]
    assert torch.equal(o_proj.dense_weight().float(), want)


def test_awq_word_cut_by_the_split_is_refused():
    """A column split whose rows per rank end inside AWQ's 8-column words."""
    from tokenmill.models.layers.linear_methods.awq import AwqLayout
    from tokenmill.models.layers.linear_methods.int_layout import int_tp_rules
    from tokenmill.models.tensor_parallel import RankSlices
    rules = RankSlices(0, 2, 2).column(20)  # 40 rows, 20 a rank
    with pytest.raises(ValueError, match=r"awq 4-bit, group 32 qweight \(output rows\): 8 per "
                                         r"word: a rank's 20 of 40 is not a multiple of 8"):
        int_tp_rules(AwqLayout(32), rules, {"weight": ("qweight", "qzeros", "scales")})
    # 16 a rank: whole words, and the scales' columns cut as the rows are.
    rules = int_tp_rules(AwqLayout(32), RankSlices(1, 2, 2).column(16),
                         {"weight": ("qweight", "qzeros", "scales")})
    qweight = torch.arange(64 * 4, dtype=torch.int32).reshape(64, 4)
    assert torch.equal(rules[("qweight", None)].take(qweight), qweight[:, 2:])
    scales = torch.randn(2, 32)
    assert torch.equal(rules[("scales", None)].take(scales), scales[:, 16:])
