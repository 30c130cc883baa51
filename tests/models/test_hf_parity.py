"""Greedy parity with Hugging Face transformers on tiny random checkpoints.

Every config in conftest.MODEL_SPECS (Llama / Qwen2 / Qwen3; GQA and MQA; a
Qwen3 head_dim that is not hidden / heads; tied and untied embeddings; llama3,
linear and yarn rope scaling) must reproduce HF `generate(do_sample=False)`
token for token: one prompt, a batch of mixed lengths, forced chunked prefill,
forced preemption, and a sharded checkpoint; those runs also ask for the top-5
logprobs of every generated token, which must be HF's (log_softmax of a dense fp32
forward over prompt + generated tokens, within 1e-4: logprob_check.py), so an
error too small to flip an argmax still fails. Mistral with a sliding window shorter
than most prompts, Gemma 3 (local and global layers: two KV cache groups) and
DeepSeek-V2 / V3 (multi-head latent attention over a latent KV cache, DeepSeek
MoE routing) run through all of it. The rope inverse frequencies are
also compared with HF's ROPE_INIT_FUNCTIONS directly.
"""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from safetensors import safe_open

from conftest import (MODEL_SPECS, NUM_NEW, PARITY_MODELS, TinyModel, build_checkpoint,
                      hf_greedy, make_llm, preempt_pool, scheduler_of)
from logprob_check import K, check_completion
from tokenmill import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
GREEDY_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True,
                                 logprobs=K)


def run_greedy(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def run_greedy_logprobs(llm, prompts) -> list:
    """Greedy completions (CompletionOutput) with the top-K logprobs of each token."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_LOGPROBS,
                        use_tqdm=False)
    return [o.outputs[0] for o in outs]


def assert_same_tokens(tm: TinyModel, prompts, got):
    for i, (p, g) in enumerate(zip(prompts, got)):
        ref = tm.reference(p)
        assert len(ref) == NUM_NEW
        assert g == ref, (f"{tm.name}: prompt {i} (len {len(p)}) diverges from HF at "
                          f"token {next(k for k in range(len(ref)) if k >= len(g) or g[k] != ref[k])}"
                          f"\n  hf:        {ref}\n  tokenmill: {g}")


def assert_same_tokens_and_logprobs(tm: TinyModel, prompts, comps, ref=None):
    """HF's greedy tokens (tm.reference, or `ref` when given), then every generated
    token's top-K logprobs against HF's dense forward (logprob_check)."""
    if ref is None:
        assert_same_tokens(tm, prompts, [c.token_ids for c in comps])
    else:
        for p, c, r in zip(prompts, comps, ref):
            assert c.token_ids == r, f"{tm.name}\n  hf:        {r}\n  tokenmill: {c.token_ids}"
    for i, (p, c) in enumerate(zip(prompts, comps)):
        check_completion(tm, p, c, K, f"{tm.name}: prompt {i} (len {len(p)})", greedy=True)


def record_schedules(llm) -> list:
    """Wrap the scheduler so every SchedulerOutput is kept for inspection."""
    sched = scheduler_of(llm)
    seen = []
    orig = sched.schedule

    def schedule():
        so = orig()
        seen.append(so)
        return so

    sched.schedule = schedule
    return seen


@pytest.mark.parametrize("name", PARITY_MODELS)
def test_single_prompt(tiny_model_factory, name):
    tm = tiny_model_factory(name)
    prompt = tm.prompts[1]
    ref = hf_greedy(tm.hf, prompt, NUM_NEW)  # one unpadded HF generate call
    llm = make_llm(tm.path)
    assert_same_tokens_and_logprobs(tm, [prompt], run_greedy_logprobs(llm, [prompt]), [ref])
    # The batched (left-padded) HF references used elsewhere agree with it.
    assert tm.reference(prompt) == ref


@pytest.mark.parametrize("name", PARITY_MODELS)
def test_batch_of_mixed_lengths(tiny_model_factory, name):
    tm = tiny_model_factory(name)
    prompts = tm.prompts
    assert len({len(p) for p in prompts}) == len(prompts)
    llm = make_llm(tm.path)
    assert_same_tokens_and_logprobs(tm, prompts, run_greedy_logprobs(llm, prompts))
    assert scheduler_of(llm).kv_cache_manager.num_used_blocks == 0


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("name", PARITY_MODELS)
def test_chunked_prefill(tiny_model_factory, name, block_size):
    tm = tiny_model_factory(name)
    prompts = tm.prompts
    llm = make_llm(tm.path, max_num_batched_tokens=16, block_size=block_size)
    seen = record_schedules(llm)
    assert_same_tokens_and_logprobs(tm, prompts, run_greedy_logprobs(llm, prompts))
    # The budget really forced chunks: some prompt was scheduled in pieces.
    assert max(so.total_num_scheduled_tokens for so in seen) <= 16
    prompt_len = {nr.req_id: len(nr.prompt_token_ids)
                  for so in seen for nr in so.scheduled_new_reqs}
    first_chunk = {nr.req_id: so.num_scheduled_tokens[nr.req_id]
                   for so in seen for nr in so.scheduled_new_reqs}
    assert any(first_chunk[r] < prompt_len[r] for r in prompt_len)


PREEMPT_CONFIGS = {
    # 24 usable blocks of 8 tokens: two full-length (96-token) sequences.
    "pool": dict(max_model_len=96, block_size=8, num_kv_blocks=25),
    # The same pressure in 4-token blocks, with prompts chunked by a 16-token budget.
    "pool_chunked": dict(max_model_len=96, block_size=4, num_kv_blocks=49,
                         max_num_batched_tokens=16),
}


@pytest.mark.parametrize("config", list(PREEMPT_CONFIGS))
@pytest.mark.parametrize("name", PARITY_MODELS)
def test_preemption(tiny_model_factory, name, config):
    check_preemption(tiny_model_factory(name), config)


def check_preemption(tm, config: str) -> None:
    """Greedy tokens and their logprobs equal HF's under a KV pool that forces preemption."""
    prompts = tm.prompts
    llm = make_llm(tm.path, **preempt_pool(tm.name, PREEMPT_CONFIGS[config]))
    got = run_greedy_logprobs(llm, prompts)
    sched = scheduler_of(llm)
    assert sched.num_preemptions > 0, "the config was meant to force preemption"
    assert_same_tokens_and_logprobs(tm, prompts, got)
    assert sched.kv_cache_manager.num_used_blocks == 0


@pytest.mark.parametrize("name", ["llama_mqa_llama3", "qwen3_headdim"])
def test_block_size_one_and_no_chunked_prefill(tiny_model_factory, name):
    tm = tiny_model_factory(name)
    prompts = tm.prompts
    llm = make_llm(tm.path, block_size=1, max_num_batched_tokens=16)
    assert_same_tokens_and_logprobs(tm, prompts, run_greedy_logprobs(llm, prompts))
    llm = make_llm(tm.path, enable_chunked_prefill=False, max_num_batched_tokens=128,
                   max_num_seqs=3)
    seen = record_schedules(llm)
    assert_same_tokens_and_logprobs(tm, prompts, run_greedy_logprobs(llm, prompts))
    for so in seen:  # every prompt went in whole
        for nr in so.scheduled_new_reqs:
            assert so.num_scheduled_tokens[nr.req_id] == len(nr.prompt_token_ids)


@pytest.mark.parametrize("max_model_len,block_size", [(30, 16), (45, 8)])
@pytest.mark.parametrize("name", ["llama_gqa_tied", "qwen3_headdim"])
def test_max_model_len_not_a_multiple_of_block_size(tiny_model_factory, name, max_model_len,
                                                     block_size):
    """Sequences run to max_model_len, whose last block is only partly usable."""
    tm = tiny_model_factory(name)
    prompts = [tm.prompts[4][:n] for n in (5, 17, 20)]
    llm = make_llm(tm.path, max_model_len=max_model_len, block_size=block_size,
                   max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref = hf_greedy(tm.hf, p, max_model_len - len(p))
        assert o.outputs[0].token_ids == ref
        assert o.outputs[0].finish_reason == "length"
    assert scheduler_of(llm).kv_cache_manager.num_used_blocks == 0


@pytest.mark.parametrize("name", ["llama_gqa_tied", "qwen2_yarn", "qwen3_headdim"])
def test_staggered_arrivals(tiny_model_factory, name):
    """Requests join a running engine (1- and 2-token prompts among them) and still match HF."""
    tm = tiny_model_factory(name)
    engine = make_llm(tm.path, block_size=4, max_num_batched_tokens=24).llm_engine
    prompts = tm.prompts[:4] + [[17], [300, 2]]
    arrivals = {0: [0, 4], 2: [1], 3: [5], 6: [2], 9: [3]}  # step -> prompt indices
    got = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i in arrivals.get(step, []):
            engine.add_request(f"p{i}", {"prompt_token_ids": prompts[i]}, GREEDY_LOGPROBS)
        for out in engine.step():
            if out.finished:
                got[int(out.request_id[1:])] = out.outputs[0]
        step += 1
        assert step < 500
    assert sorted(got) == list(range(len(prompts)))
    assert_same_tokens_and_logprobs(tm, prompts, [got[i] for i in range(len(prompts))])


@pytest.mark.parametrize("name", ["llama_gqa_tied", "qwen2_tied", "qwen3_mqa_tied"])
def test_tied_embeddings(tiny_model_factory, name):
    tm = tiny_model_factory(name)
    assert tm.hf_config["tie_word_embeddings"] is True
    llm = make_llm(tm.path)
    model = llm.llm_engine.engine_core.runner.model
    # The head is the embedding, though the checkpoint stores no lm_head tensor.
    emb = tm.hf.get_input_embeddings().weight
    assert model.lm_head.weight is model.embed_tokens.weight  # tied: one tensor
    assert torch.equal(model.lm_head.dense_weight(), emb)
    prompts = tm.prompts[:3]
    assert_same_tokens_and_logprobs(tm, prompts, run_greedy_logprobs(llm, prompts))


@pytest.mark.parametrize("name", ["llama_mqa_llama3", "qwen2_yarn", "qwen3_headdim"])
def test_untied_embeddings_load_their_own_head(tiny_model_factory, name):
    tm = tiny_model_factory(name)
    assert not tm.hf_config.get("tie_word_embeddings", False)
    llm = make_llm(tm.path)
    model = llm.llm_engine.engine_core.runner.model
    assert torch.equal(model.lm_head.dense_weight(), tm.hf.lm_head.weight)
    assert not torch.equal(model.lm_head.dense_weight(), model.embed_tokens.weight)


@pytest.mark.parametrize("name", ["qwen3_headdim", "llama_gqa_tied"])
def test_sharded_checkpoint(tmp_path_factory, name):
    arch, overrides = MODEL_SPECS[name]
    path = str(tmp_path_factory.mktemp(f"{name}_sharded"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = build_checkpoint(path, arch, overrides, seed=7, max_shard_size="60KB")
    index = os.path.join(path, "model.safetensors.index.json")
    assert os.path.exists(index)
    assert not os.path.exists(os.path.join(path, "model.safetensors"))
    weight_map = json.load(open(index))["weight_map"]
    assert len(set(weight_map.values())) > 1
    tm = TinyModel(name + "_sharded", path, arch, hf)
    prompts = tm.prompts[:4]
    llm = make_llm(path)
    assert_same_tokens_and_logprobs(tm, prompts, run_greedy_logprobs(llm, prompts))


def test_tied_checkpoint_has_no_separate_head(tiny_model_factory):
    """Precondition of test_tied_embeddings: the tied path is really exercised."""
    tm = tiny_model_factory("llama_gqa_tied")
    names = set()
    for f in os.listdir(tm.path):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(tm.path, f), framework="pt") as st:
                names.update(st.keys())
    assert "model.embed_tokens.weight" in names
    assert "lm_head.weight" not in names


# ---- rope inverse frequencies vs HF ----------------------------------------------

ROPE_CASES = [
    # (id, rope_type, theta, scaling fields (no rope_type / theta), head_dim, max_pos)
    ("default", "default", 10000.0, {}, 16, 256),
    ("default_theta1e6_hd32", "default", 1e6, {}, 32, 256),
    ("linear", "linear", 10000.0, {"factor": 2.0}, 16, 256),
    ("linear_f4_hd32", "linear", 500000.0, {"factor": 4.0}, 32, 512),
    ("llama3", "llama3", 500000.0, {"factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64}, 16, 256),
    ("llama3_hd64", "llama3", 500000.0, {"factor": 32.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192},
     64, 131072),
    ("yarn", "yarn", 10000.0, {"factor": 4.0, "original_max_position_embeddings": 64}, 16, 256),
    ("yarn_betas", "yarn", 1e6, {"factor": 8.0, "original_max_position_embeddings": 32,
                                 "beta_fast": 16, "beta_slow": 2}, 32, 256),
    ("yarn_mscale", "yarn", 10000.0, {"factor": 4.0, "original_max_position_embeddings": 64,
                                      "mscale": 1.0, "mscale_all_dim": 0.5}, 16, 256),
    ("yarn_attention_factor", "yarn", 10000.0, {"factor": 2.0, "attention_factor": 1.3,
                                                "original_max_position_embeddings": 128},
     16, 256),
    ("yarn_no_truncate", "yarn", 10000.0, {"factor": 4.0, "truncate": False,
                                           "original_max_position_embeddings": 64}, 16, 256),
]


def _hf_inv_freq(rope_type, theta, fields, head_dim, max_pos, form):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    base = dict(vocab_size=64, hidden_size=4 * head_dim, intermediate_size=32,
                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                head_dim=head_dim, max_position_embeddings=max_pos)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if form == "old":
            scaling = None if rope_type == "default" else {"rope_type": rope_type, **fields}
            cfg = LlamaConfig(rope_theta=theta, rope_scaling=scaling, **base)
        else:
            cfg = LlamaConfig(rope_parameters={"rope_type": rope_type, "rope_theta": theta,
                                               **fields}, **base)
    if rope_type in ROPE_INIT_FUNCTIONS:
        inv, scale = ROPE_INIT_FUNCTIONS[rope_type](cfg, None)
    else:  # transformers 5 keeps "default" on the rotary class
        assert rope_type == "default"
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        inv, scale = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    return inv.float(), float(scale), cfg


@pytest.mark.parametrize("form", ["old", "new"])
@pytest.mark.parametrize("case", ROPE_CASES, ids=[c[0] for c in ROPE_CASES])
def test_rope_inv_freq_matches_hf(case, form):
    from tokenmill.models.layers.rotary import compute_inv_freq, rope_parameters_from_config
    _, rope_type, theta, fields, head_dim, max_pos = case
    hf_inv, hf_scale, hf_cfg = _hf_inv_freq(rope_type, theta, fields, head_dim, max_pos, form)
    if form == "old":
        # config.json of a transformers 4 checkpoint: rope_theta + rope_scaling.
        cfg = {"rope_theta": theta, "max_position_embeddings": max_pos,
               "rope_scaling": None if rope_type == "default"
               else {"rope_type": rope_type, **fields}}
    else:
        # transformers 5: everything in rope_parameters.
        cfg = {"max_position_embeddings": max_pos,
               "rope_parameters": {"rope_type": rope_type, "rope_theta": theta, **fields}}
    for source in (cfg, hf_cfg.to_dict()):  # the hand-written form and what HF writes
        params = rope_parameters_from_config(source)
        assert params["rope_type"] == rope_type
        inv, scale = compute_inv_freq(params, head_dim, max_pos)
        assert inv.shape == hf_inv.shape == (head_dim // 2,)
        torch.testing.assert_close(inv.float(), hf_inv, rtol=1e-6, atol=0)
        assert scale == pytest.approx(hf_scale, rel=1e-9)


def test_rope_legacy_type_key_matches_hf():
    """Old checkpoints spell the type as "type" (e.g. {"type": "linear"})."""
    from tokenmill.models.layers.rotary import compute_inv_freq, rope_parameters_from_config
    hf_inv, _, _ = _hf_inv_freq("linear", 10000.0, {"factor": 3.0}, 16, 256, "new")
    params = rope_parameters_from_config({"rope_theta": 10000.0, "max_position_embeddings": 256,
                                          "rope_scaling": {"type": "linear", "factor": 3.0}})
    inv, _ = compute_inv_freq(params, 16, 256)
    torch.testing.assert_close(inv.float(), hf_inv, rtol=1e-6, atol=0)


def test_rope_scaling_changes_frequencies():
    """Guard: every scaled case above differs from plain rope of the same theta/head_dim."""
    from tokenmill.models.layers.rotary import compute_inv_freq, rope_parameters_from_config
    for case_id, rope_type, theta, fields, hd, mp in ROPE_CASES:
        if rope_type == "default":
            continue
        default, _ = compute_inv_freq(rope_parameters_from_config({"rope_theta": theta}), hd, mp)
        inv, _ = compute_inv_freq(rope_parameters_from_config(
            {"rope_parameters": {"rope_type": rope_type, "rope_theta": theta, **fields}}), hd, mp)
        assert not torch.allclose(inv, default), case_id


def test_unsupported_rope_type_is_rejected():
    from tokenmill.models.layers.rotary import rope_parameters_from_config
    with pytest.raises(ValueError, match="rope_type"):
        rope_parameters_from_config({"rope_parameters": {"rope_type": "dynamic",
                                                         "rope_theta": 1e4}})


# ---- sliding windows: no cap on the context --------------------------------------------

def test_sliding_window_no_longer_caps_max_model_len(tmp_path):
    """A Phi-3 whose sliding window (48) is shorter than its positions runs to its
    max_position_embeddings, HF's tokens past the window; Qwen2's unused window
    (use_sliding_window false) stays full attention."""
    path = str(tmp_path / "phi3_window")
    hf = build_checkpoint(path, "phi3", dict(sliding_window=48, tie_word_embeddings=False))
    from tokenmill import LLM
    llm = LLM(path, dtype="float32", device="cpu", block_size=8)
    assert llm.llm_engine.model_config.max_model_len == 256
    tm = TinyModel("phi3_window", path, "phi3", hf)
    prompts = [tm.prompts[4], tm.prompts[1]]  # 70 tokens (past the window) and 17
    assert run_greedy(llm, prompts) == [tm.reference(p) for p in prompts]
    assert scheduler_of(llm).kv_cache_manager.sliding  # a sliding group
    qwen2 = str(tmp_path / "qwen2_unused_window")  # Qwen2 keeps a window it does not use
    build_checkpoint(qwen2, "qwen2", dict(sliding_window=32, use_sliding_window=False))
    llm = LLM(qwen2, dtype="float32", device="cpu")
    assert not scheduler_of(llm).kv_cache_manager.sliding
