"""DeepSeek-V2 / V3 (multi-head latent attention, DeepSeek MoE) against transformers.

The single-prompt, mixed-batch, chunked-prefill and preemption parity runs come
from test_hf_parity.py (both configs are in conftest.MODEL_SPECS). Here: the
layers follow the config, the KV cache holds exactly the latent bytes, the
PyTorch decode path (no native kernels) matches too, prefix caching (hits on a
shared prefix, with chunked prefill and under preemption), n > 1, and logprobs
and prompt logprobs close to HF's. Every greedy run here also checks the top-5
logprobs of its tokens against HF's dense forward (logprob_check.py).
"""
from __future__ import annotations

import pytest
import torch

from conftest import make_llm, runner_of, scheduler_of
from logprob_check import K, check_completion, check_prompt_logprobs
from test_hf_parity import assert_same_tokens_and_logprobs, run_greedy_logprobs
from test_logprobs import generate
from test_prefix_caching import assert_idle, shared_prefix_prompts, stats
from tokenmill import SamplingParams

MODELS = ["deepseek_v2", "deepseek_v3"]


@pytest.mark.parametrize("name", MODELS)
def test_layers_follow_the_config(tiny_model_factory, name):
    from tokenmill.models.deepseek_v2 import DeepseekMoE
    from tokenmill.models.layers.mlp import GatedMLP
    tm = tiny_model_factory(name)
    model = runner_of(make_llm(tm.path)).model
    hf_layers = tm.hf.model.layers
    assert [hasattr(layer.mlp, "experts") for layer in hf_layers] == [False, True, True]
    for ours, theirs in zip(model.layers, hf_layers):
        sparse = hasattr(theirs.mlp, "experts")
        assert isinstance(ours.mlp, DeepseekMoE if sparse else GatedMLP)
        attn = ours.self_attn
        assert hasattr(attn, "q_proj") == (tm.hf_config["q_lora_rank"] is None)
        assert torch.equal(attn.kv_b_proj.dense_weight(), theirs.self_attn.kv_b_proj.weight)
        if sparse:
            assert torch.equal(ours.mlp.gate.weight, theirs.mlp.gate.weight)
            assert torch.equal(ours.mlp.experts.gate_up_proj, theirs.mlp.experts.gate_up_proj)
            if name == "deepseek_v3":
                bias = theirs.mlp.gate.e_score_correction_bias
                assert bias.abs().sum() > 0  # randomised, so loading it is tested
                assert torch.equal(ours.mlp.gate.e_score_correction_bias, bias)
            else:
                assert ours.mlp.gate.e_score_correction_bias is None


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("name", MODELS)
def test_kv_cache_holds_the_latent_bytes_only(tiny_model_factory, name, block_size):
    """One latent row (kv_lora_rank + qk_rope_head_dim) per token and layer, no V."""
    from tokenmill.core.kv_cache_spec import MLAAttentionSpec
    tm = tiny_model_factory(name)
    llm = make_llm(tm.path, block_size=block_size)
    runner = runner_of(llm)
    cfg = runner.kv_cache_config
    c = tm.hf_config
    width = c["kv_lora_rank"] + c["qk_rope_head_dim"]
    layers = c["num_hidden_layers"]
    assert len(cfg.groups) == 1
    spec = cfg.groups[0].spec
    assert isinstance(spec, MLAAttentionSpec) and spec.head_size == width
    per_layer = block_size * width * 4  # fp32
    assert cfg.buffer_page_sizes() == [per_layer] * layers
    assert cfg.bytes_per_block() == layers * per_layer
    for i in range(layers):
        cache = runner.kv_caches[f"layers.{i}.attn"]
        assert cache.shape == (cfg.num_blocks, block_size, width)
        assert cache.untyped_storage().nbytes() == cfg.num_blocks * per_layer


@pytest.mark.parametrize("name", MODELS)
def test_pytorch_decode_path_matches_hf(tiny_model_factory, name):
    """cpu_kernels=torch: the absorbed decode as batched matmuls over gathered blocks."""
    tm = tiny_model_factory(name)
    llm = make_llm(tm.path, cpu_kernels="torch", block_size=4)
    assert {b.name for b in runner_of(llm).attn_backends.values()} == {"mla_torch"}
    assert_same_tokens_and_logprobs(tm, tm.prompts, run_greedy_logprobs(llm, tm.prompts))


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("name", MODELS)
def test_native_mla_decode_kernel_matches_hf(tiny_model_factory, name, block_size, monkeypatch):
    """Decode rows through the native latent-space kernel (the default with native
    kernels), forced to split every row across spans of 3 tokens (split-K and its
    merge on every step) and at the automatic split: HF's tokens either way."""
    tm = tiny_model_factory(name)
    llm = make_llm(tm.path, block_size=block_size)
    backends = list(runner_of(llm).attn_backends.values())
    if backends[0].name != "mla_cpu_native":
        pytest.skip("no native CPU kernels")
    ops = backends[0].ops
    for span in (3, 0):
        calls = []
        orig = ops.mla_decode
        monkeypatch.setattr(ops, "mla_decode",
                            lambda *a, _span=span, _orig=orig: calls.append(1)
                            or _orig(*a, span_tokens=_span))
        assert_same_tokens_and_logprobs(tm, tm.prompts, run_greedy_logprobs(llm, tm.prompts))
        assert calls
        monkeypatch.setattr(ops, "mla_decode", orig)


@pytest.mark.parametrize("name", MODELS)
def test_naive_decode_matches_hf(tiny_model_factory, name, monkeypatch):
    """Decode rows in the naive form (K/V expanded per head every step, the comparison
    path of `bench window`) give HF's tokens like the absorbed form."""
    from tokenmill.models.layers.mla import PagedMLAAttention
    tm = tiny_model_factory(name)
    monkeypatch.setattr(PagedMLAAttention, "absorb_decode", False)
    calls = []
    orig = PagedMLAAttention._decode_naive
    monkeypatch.setattr(PagedMLAAttention, "_decode_naive",
                        lambda self, *a: calls.append(1) or orig(self, *a))
    llm = make_llm(tm.path, block_size=4)
    assert_same_tokens_and_logprobs(tm, tm.prompts, run_greedy_logprobs(llm, tm.prompts))
    assert calls


# ---- prefix caching ---------------------------------------------------------------------

PC_BS = 8


def _greedy(llm, prompts, n):
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _greedy_checked(tm, llm, prompts, n, where):
    """Greedy tokens (returned), each completion's top-K logprobs checked against HF."""
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=K)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        check_completion(tm, p, o.outputs[0], K, f"{where} prompt {i}", greedy=True)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", MODELS)
def test_prefix_caching_hits_and_matches_hf(tiny_model_factory, name):
    tm = tiny_model_factory(name)
    prompts = shared_prefix_prompts(tm.vocab_size, prefix_len=60, n=4, suffix=(1, 20))
    llm = make_llm(tm.path, block_size=PC_BS, max_model_len=128, max_num_batched_tokens=24)
    assert scheduler_of(llm).kv_cache_manager.enable_caching
    first = _greedy_checked(tm, llm, prompts, 12, name)
    assert stats(llm)["prefix_cache_hits"] > 0
    # Now every prompt starts cached.
    again = _greedy_checked(tm, llm, prompts[::-1], 12, f"{name} cached")[::-1]
    for p, a, b in zip(prompts, first, again):
        assert a == b == tm.reference(p, 12)
    assert_idle(llm)


@pytest.mark.parametrize("name", MODELS)
def test_preemption_with_prefix_caching_matches_hf(tiny_model_factory, name):
    tm = tiny_model_factory(name)
    prompts = shared_prefix_prompts(tm.vocab_size, prefix_len=40, n=6, seed=3, suffix=(1, 20))
    llm = make_llm(tm.path, max_model_len=96, block_size=PC_BS, num_kv_blocks=25)
    got = _greedy_checked(tm, llm, prompts, 20, f"{name} preempted")
    assert scheduler_of(llm).num_preemptions > 0, "the pool was meant to force preemption"
    assert stats(llm)["prefix_cache_hits"] > 0
    for p, g in zip(prompts, got):
        assert g == tm.reference(p, 20)
    assert_idle(llm)


# ---- n > 1 and logprobs -------------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_n_completions(tiny_model_factory, name):
    """Seeded sampled siblings (sharing one prompt) equal lone requests of their seeds
    (sibling i draws with seed + i), and each one's logprobs are HF's for its tokens."""
    tm = tiny_model_factory(name)
    llm = make_llm(tm.path, block_size=PC_BS)
    prompt = tm.prompts[2]
    sp = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=15, ignore_eos=True,
                        logprobs=1)
    trio = generate(llm, [prompt], sp)[0].outputs
    assert len(trio) == 3 and len({tuple(c.token_ids) for c in trio}) > 1
    lone = generate(llm, [prompt], sp.clone(n=1, seed=13))[0].outputs[0]
    assert lone.token_ids == trio[2].token_ids
    for i, comp in enumerate(trio):
        check_completion(tm, prompt, comp, 1, f"{name} sibling {i}")
    assert_idle(llm)


@pytest.mark.parametrize("name", MODELS)
def test_logprobs_match_hf(tiny_model_factory, name):
    tm = tiny_model_factory(name)
    llm = make_llm(tm.path, block_size=4, max_num_batched_tokens=16)  # chunked prompts
    prompts = tm.prompts[:4]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3,
                        prompt_logprobs=2)
    for p, out in zip(prompts, generate(llm, prompts, sp)):
        comp = out.outputs[0]
        assert comp.token_ids == tm.reference(p)[:12]
        check_completion(tm, p, comp, 3, name)
        check_prompt_logprobs(tm, p, out.prompt_logprobs, 2, name)


# ---- the external KV tier ---------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_kv_connector_moves_latent_blocks(tiny_model_factory, name):
    """The CPU store keeps MLA blocks (latent rows, no V): outputs identical with
    external hits, and a connector of the K/V layout is refused."""
    from tokenmill.kv_connector.config import KVConnectorConfig, KVGeometry
    from tokenmill.kv_connector.connector import KVConnector
    from tokenmill.kv_connector.worker import KVConnectorWorker
    tm = tiny_model_factory(name)
    prompts = shared_prefix_prompts(tm.vocab_size, prefix_len=60, n=3, suffix=(1, 20))
    llm = make_llm(tm.path, block_size=PC_BS, kv_connector=["cpu"])
    core = llm.llm_engine.engine_core
    geo = core.kv_connector.geometry
    c = tm.hf_config
    width = c["kv_lora_rank"] + c["qk_rope_head_dim"]
    assert geo.latent and geo.tag.endswith("-MLA")
    assert geo.payload_bytes == c["num_hidden_layers"] * PC_BS * width * 4
    first = _greedy(llm, prompts, 12)
    scheduler_of(llm).kv_cache_manager.reset_prefix_cache()  # served by the store now
    again = _greedy_checked(tm, llm, prompts, 12, f"{name} external hits")
    ext = core.kv_cache_stats()["external"]
    assert ext["hit_blocks"] > 0 and ext["load_failures"] == 0
    for p, a, b in zip(prompts, first, again):
        assert a == b == tm.reference(p, 12)
    assert_idle(llm)
    kv_layout = KVGeometry(geo.num_layers, geo.num_kv_heads, geo.head_size, geo.dtype,
                           geo.block_size)
    conn = KVConnector(KVConnectorConfig(["cpu"]), "m", kv_layout)
    with pytest.raises(ValueError, match="refusing"):
        KVConnectorWorker(conn, core.runner.kv_caches,
                          core.kv_cache_config.groups[0].layer_names)
