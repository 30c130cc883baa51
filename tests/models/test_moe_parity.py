"""Qwen3-MoE: greedy parity with Hugging Face transformers on tiny random checkpoints,
and loading both checkpoint layouts of the experts.

Like test_hf_parity.py (whose helpers this reuses) for the MoE configs below:
one prompt, a batch of 8 mixed lengths, forced chunked prefill (also chunks of
1-3 tokens), forced preemption, each with the top-5 logprobs of every generated
token against HF's dense forward (logprob_check.py). transformers 5 `save_pretrained` writes the
per-expert layout of the hub checkpoints ("mlp.experts.{e}.gate_proj.weight");
the fused layout ("mlp.experts.gate_up_proj" [E, 2I, H]) is written here by
hand from the same tensors.
"""
from __future__ import annotations

import dataclasses
import json
import os
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import NUM_NEW, TinyModel, build_checkpoint, hf_greedy, make_llm, scheduler_of
from test_hf_parity import (PREEMPT_CONFIGS, assert_same_tokens_and_logprobs,
                            check_preemption, record_schedules, run_greedy_logprobs)

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)

# name -> (architecture, config overrides on conftest.TINY); dense layers use intermediate_size.
MOE_SPECS: dict[str, tuple[str, dict]] = {
    # Top-2 of 8, renormalised; 3 layers: 0 dense (mlp_only_layers), 1 and 2 sparse; untied.
    "qwen3_moe_norm": ("qwen3_moe", dict(
        MOE, norm_topk_prob=True, num_hidden_layers=3, decoder_sparse_step=1,
        mlp_only_layers=[0], tie_word_embeddings=False)),
    # Top-2 of 8, raw softmax weights; decoder_sparse_step 2 + mlp_only_layers [0]:
    # layers 0 and 2 dense, 1 and 3 sparse; tied.
    "qwen3_moe_step2": ("qwen3_moe", dict(
        MOE, norm_topk_prob=False, num_hidden_layers=4, decoder_sparse_step=2,
        mlp_only_layers=[0], tie_word_embeddings=True)),
    # Top-1 of 16 (many experts get no tokens in a step), MQA, head_dim 32.
    "qwen3_moe_top1": ("qwen3_moe", dict(
        num_experts=16, num_experts_per_tok=1, moe_intermediate_size=32, norm_topk_prob=False,
        num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)),
}
MOE_MODELS = list(MOE_SPECS)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    cache: dict[str, TinyModel] = {}

    def get(name: str) -> TinyModel:
        if name not in cache:
            arch, overrides = MOE_SPECS[name]
            path = str(tmp_path_factory.mktemp(name))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hf = build_checkpoint(path, arch, overrides)
            cache[name] = TinyModel(name, path, arch, hf)
        return cache[name]

    return get


def _engine_model(llm):
    return llm.llm_engine.engine_core.runner.model


def _checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="pt") as st:
                out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def _copy_config(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for f in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(src, f)):
            with open(os.path.join(src, f)) as fi, open(os.path.join(dst, f), "w") as fo:
                fo.write(fi.read())


# ---- greedy parity -------------------------------------------------------------------

@pytest.mark.parametrize("name", MOE_MODELS)
def test_single_prompt(moe_model, name):
    tm = moe_model(name)
    prompt = tm.prompts[1]
    ref = hf_greedy(tm.hf, prompt, NUM_NEW)
    llm = make_llm(tm.path)
    assert_same_tokens_and_logprobs(tm, [prompt], run_greedy_logprobs(llm, [prompt]), [ref])
    assert tm.reference(prompt) == ref  # the left-padded batch references agree


@pytest.mark.parametrize("name", MOE_MODELS)
def test_layers_follow_the_config(moe_model, name):
    """Sparse and dense layers where HF has them; no expert weight left unloaded."""
    from tokenmill.models.layers.mlp import GatedMLP
    from tokenmill.models.layers.moe import SparseMoeBlock
    tm = moe_model(name)
    model = _engine_model(make_llm(tm.path))
    hf_layers = tm.hf.model.layers
    assert len(model.layers) == len(hf_layers)
    for ours, theirs in zip(model.layers, hf_layers):
        sparse = hasattr(theirs.mlp, "experts")
        assert isinstance(ours.mlp, SparseMoeBlock if sparse else GatedMLP)
        if sparse:
            assert ours.mlp.top_k == tm.hf.config.num_experts_per_tok
            assert ours.mlp.norm_topk_prob == tm.hf.config.norm_topk_prob
            assert torch.equal(ours.mlp.gate.dense_weight(), theirs.mlp.gate.weight)
            assert torch.equal(ours.mlp.experts.gate_up_proj, theirs.mlp.experts.gate_up_proj)
            assert torch.equal(ours.mlp.experts.down_proj, theirs.mlp.experts.down_proj)
    expected = {"qwen3_moe_norm": [False, True, True],
                "qwen3_moe_step2": [False, True, False, True],
                "qwen3_moe_top1": [True, True]}[name]
    assert [hasattr(layer.mlp, "experts") for layer in hf_layers] == expected


@pytest.mark.parametrize("name", MOE_MODELS)
def test_batch_of_mixed_lengths(moe_model, name):
    tm = moe_model(name)
    prompts = tm.prompts
    assert len(prompts) == 8 and len({len(p) for p in prompts}) == 8
    llm = make_llm(tm.path)
    assert_same_tokens_and_logprobs(tm, prompts, run_greedy_logprobs(llm, prompts))
    assert scheduler_of(llm).kv_cache_manager.num_used_blocks == 0


@pytest.mark.parametrize("budget,block_size", [(16, 4), (3, 16)])
@pytest.mark.parametrize("name", MOE_MODELS)
def test_chunked_prefill(moe_model, name, budget, block_size):
    tm = moe_model(name)
    prompts = tm.prompts
    llm = make_llm(tm.path, max_num_batched_tokens=budget, block_size=block_size)
    seen = record_schedules(llm)
    assert_same_tokens_and_logprobs(tm, prompts, run_greedy_logprobs(llm, prompts))
    assert max(so.total_num_scheduled_tokens for so in seen) <= budget
    # Every prompt chunk, by request: the budget really split the prompts.
    prompt_len = {nr.req_id: len(nr.prompt_token_ids)
                  for so in seen for nr in so.scheduled_new_reqs}
    done = dict.fromkeys(prompt_len, 0)
    chunks = []
    for so in seen:
        for req_id, n in so.num_scheduled_tokens.items():
            if done[req_id] < prompt_len[req_id]:
                chunks.append(n)
                done[req_id] += n
    assert len(chunks) > len(prompts)
    if budget == 3:
        assert {1, 2, 3} <= set(chunks)


@pytest.mark.parametrize("config", list(PREEMPT_CONFIGS))
@pytest.mark.parametrize("name", MOE_MODELS)
def test_preemption(moe_model, name, config):
    check_preemption(moe_model(name), config)


def test_some_experts_get_no_tokens(moe_model):
    """The top-1 config really leaves experts idle in a step (and the engine still matches HF)."""
    import tokenmill.models.layers.linear_methods.fused_moe as moe_mod
    tm = moe_model("qwen3_moe_top1")
    llm = make_llm(tm.path)
    counts = []
    orig = moe_mod.fused_experts

    def spy(x, w13, w2, weights, ids, *rest):
        counts.append((x.shape[0], len(ids.unique()), w13.shape[0]))
        return orig(x, w13, w2, weights, ids, *rest)

    moe_mod.fused_experts = spy
    try:
        prompts = tm.prompts[:4]
        assert_same_tokens_and_logprobs(tm, prompts, run_greedy_logprobs(llm, prompts))
    finally:
        moe_mod.fused_experts = orig
    assert any(hit < experts for _, hit, experts in counts)
    assert any(tokens > experts for tokens, _, experts in counts)  # prefill steps too


# ---- loading the two checkpoint layouts ----------------------------------------------

def test_transformers_writes_per_expert_tensors(moe_model):
    tm = moe_model("qwen3_moe_norm")
    names = set(_checkpoint_tensors(tm.path))
    assert "model.layers.1.mlp.gate.weight" in names
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in names
    assert "model.layers.1.mlp.experts.gate_up_proj" not in names
    assert "model.layers.0.mlp.gate_proj.weight" in names  # the dense layer


def _fuse_experts(tensors: dict, num_experts: int) -> dict:
    """Per-expert HF tensors -> HF's fused layout ("experts.gate_up_proj" [E, 2I, H])."""
    out = {}
    prefixes = sorted({k.split(".experts.")[0] for k in tensors if ".experts." in k})
    for pre in prefixes:
        e = range(num_experts)
        gate = [tensors.pop(f"{pre}.experts.{i}.gate_proj.weight") for i in e]
        up = [tensors.pop(f"{pre}.experts.{i}.up_proj.weight") for i in e]
        down = [tensors.pop(f"{pre}.experts.{i}.down_proj.weight") for i in e]
        out[f"{pre}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(gate, up)]).contiguous()
        out[f"{pre}.experts.down_proj"] = torch.stack(down).contiguous()
    out.update(tensors)
    return out


def test_fused_expert_checkpoint(moe_model, tmp_path):
    tm = moe_model("qwen3_moe_step2")
    fused = _fuse_experts(_checkpoint_tensors(tm.path), 8)
    assert "model.layers.3.mlp.experts.gate_up_proj" in fused
    assert not any(".experts.0." in k for k in fused)
    _copy_config(tm.path, str(tmp_path))
    save_file(fused, str(tmp_path / "model.safetensors"))
    llm = make_llm(str(tmp_path))
    model = _engine_model(llm)
    for layer in (1, 3):
        assert torch.equal(model.layers[layer].mlp.experts.gate_up_proj,
                           tm.hf.model.layers[layer].mlp.experts.gate_up_proj)
    prompts = tm.prompts[:3]
    assert_same_tokens_and_logprobs(tm, prompts, run_greedy_logprobs(llm, prompts))


def test_sharded_per_expert_checkpoint(tmp_path):
    """Experts of one layer split across shards are stacked as they arrive."""
    arch, overrides = MOE_SPECS["qwen3_moe_norm"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = build_checkpoint(str(tmp_path), arch, overrides, seed=5, max_shard_size="40KB")
    weight_map = json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"]
    files = {weight_map[f"model.layers.1.mlp.experts.{e}.{m}.weight"]
             for e in range(8) for m in ("gate_proj", "up_proj", "down_proj")}
    assert len(files) > 1
    tm = TinyModel("qwen3_moe_sharded", str(tmp_path), arch, hf)
    prompts = tm.prompts[:3]
    assert_same_tokens_and_logprobs(tm, prompts,
                                    run_greedy_logprobs(make_llm(str(tmp_path)), prompts))


@pytest.mark.parametrize("drop", ["model.layers.2.mlp.experts.5.up_proj.weight",
                                  "model.layers.1.mlp.experts.0.down_proj.weight"])
def test_missing_expert_is_named(moe_model, tmp_path, drop):
    tm = moe_model("qwen3_moe_norm")
    tensors = _checkpoint_tensors(tm.path)
    del tensors[drop]
    _copy_config(tm.path, str(tmp_path))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    layer, expert, proj = drop.split(".")[2], drop.split(".")[5], drop.split(".")[6]
    with pytest.raises(ValueError, match=rf"layers\.{layer}\.mlp\.experts\..*: {expert}\.{proj}"):
        make_llm(str(tmp_path))


def test_expert_index_out_of_range(moe_model, tmp_path):
    tm = moe_model("qwen3_moe_norm")
    tensors = _checkpoint_tensors(tm.path)
    tensors["model.layers.1.mlp.experts.8.up_proj.weight"] = tensors[
        "model.layers.1.mlp.experts.7.up_proj.weight"].clone()
    _copy_config(tm.path, str(tmp_path))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="expert 8 out of range"):
        make_llm(str(tmp_path))


def test_bf16_model_widens_expert_gemms(moe_model, monkeypatch):
    """A bf16 MoE model with fp32 GEMMs (the policy on CPUs without native bf16)."""
    from tokenmill.platforms import cpu as cpu_platform
    from tokenmill.models.loader import load_model
    tm = moe_model("qwen3_moe_norm")
    monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: False)
    widened = cpu_platform.CpuPlatform.create("cpu", torch.bfloat16, cpu_kernels="torch")
    assert widened.gemm_dtype == "float32"
    model = load_model(tm.path, tm.hf_config, torch.bfloat16, torch.device("cpu"), widened)
    moe = model.layers[1].mlp
    assert moe.gate.weight.dtype == torch.float32
    assert moe.experts.gate_up_proj.dtype == moe.experts.down_proj.dtype == torch.float32
    assert moe.experts.method.compute_dtype == torch.float32
    # Exact upcast of the bf16-rounded checkpoint weights.
    ref = tm.hf.model.layers[1].mlp.experts.gate_up_proj.to(torch.bfloat16).float()
    assert torch.equal(moe.experts.gate_up_proj, ref)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    x = torch.randn(7, tm.hf_config["hidden_size"]).to(torch.bfloat16)
    # As on a CPU with native bf16 GEMMs.
    native = load_model(tm.path, tm.hf_config, torch.bfloat16, torch.device("cpu"),
                        dataclasses.replace(widened, gemm_dtype="bfloat16"))
    assert native.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    with torch.no_grad():
        wide, narrow = moe(x), native.layers[1].mlp(x)
    assert wide.dtype == torch.bfloat16
    torch.testing.assert_close(wide.float(), narrow.float(), atol=5e-2, rtol=5e-2)
