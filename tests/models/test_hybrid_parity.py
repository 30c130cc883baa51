"""Hybrid models (Gated DeltaNet + gated full attention): greedy parity with HF.

Qwen3.5, Qwen3.5-MoE, Qwen3-Next (two MoE layouts) and text-only requests on
Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration checkpoints
(saved by HF with a tiny vision tower, loaded with it; images on them:
test_vl_parity.py) must
reproduce HF `generate(do_sample=False)` token for token, fp32:

  (a) one prompt;
  (b) a batch of 8 prompts of 1..90 tokens (1-, 2- and 3-token prompts are
      shorter than the conv kernel of 4);
  (c) forced chunked prefill: budgets of 3 and 5 tokens make prompt chunks of
      1, 2 and 3 tokens that continue a prompt, also while other rows decode,
      so the conv and SSM state is carried across chunks shorter than the kernel;
  (d) forced preemption: the recurrent state is dropped and recomputed;
  (e) n=2 seeded sampling: each completion equals a lone request with seed + i,
      and no prompt blocks are shared (a recurrent state cannot be shared).

(a)-(d) also ask for the top-5 logprobs of every generated token, which must be
HF's (log_softmax of a dense fp32 forward over prompt + generated tokens, within
1e-4: logprob_check.py).

The HF references of the 8 prompts come from one left-padded batch per model
(HF masks the padding in its DeltaNet layers; test_single_prompt checks the
batched reference against an unpadded generate).
"""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from conftest import NUM_NEW, TINY, TinyModel, build_checkpoint, hf_greedy, make_llm, \
    make_prompts, runner_of, scheduler_of
from logprob_check import K
from test_hf_parity import assert_same_tokens_and_logprobs, record_schedules, run_greedy_logprobs
from tokenmill import SamplingParams
from vl_checkpoint import hybrid_like_trained

# 4 layers: layer_types default to 3 linear-attention layers, then 1 full-attention layer.
# 2 key heads serve 4 value heads (Hv > Hk); conv kernel 4. Weights drawn with std 0.1
# (a gain of ~0.8 per 64-wide projection, as trained checkpoints' ~0.02 at width 2048):
# TINY's 0.2 (gain 1.6) over 4 layers amplified fp32 rounding past the 1e-4 of the
# logprob checks. The decay parameters and norms: vl_checkpoint.hybrid_like_trained.
HYBRID = dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
              linear_conv_kernel_dim=4, initializer_range=0.1)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)

# name -> (conftest._classes architecture, overrides on conftest.TINY)
HYBRID_SPECS: dict[str, tuple[str, dict]] = {
    "qwen3_5": ("qwen3_5", dict(HYBRID, tie_word_embeddings=False)),
    "qwen3_5_moe": ("qwen3_5_moe", dict(HYBRID, **MOE, tie_word_embeddings=False)),
    "qwen3_next": ("qwen3_next", dict(HYBRID, **MOE, decoder_sparse_step=1,
                                      norm_topk_prob=True, tie_word_embeddings=False)),
    # Layers 0 and 2 dense (decoder_sparse_step 2), 1 dense (mlp_only_layers), 3 sparse;
    # raw top-k weights; attention at layers 1 and 3; one value head per key head; tied.
    "qwen3_next_step2": ("qwen3_next", dict(
        HYBRID, **MOE, decoder_sparse_step=2, mlp_only_layers=[1], norm_topk_prob=False,
        linear_num_value_heads=2,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        tie_word_embeddings=True)),
    # ...ForConditionalGeneration checkpoints with a tiny vision tower (built below).
    "qwen3_5_vl": ("qwen3_5_vl", dict(HYBRID, tie_word_embeddings=False)),
    "qwen3_5_moe_vl": ("qwen3_5_moe_vl", dict(HYBRID, **MOE, tie_word_embeddings=False)),
}
HYBRID_MODELS = list(HYBRID_SPECS)

# Mixed lengths in a mixed order; 1, 2 and 3 are shorter than the conv kernel.
HYBRID_LENGTHS = [33, 1, 90, 3, 17, 2, 70, 5]
MAX_LEN = 112  # the 90-token prompt + NUM_NEW fit

TINY_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64,
                   out_hidden_size=64, patch_size=4, num_position_embeddings=16,
                   initializer_range=0.2)


class HybridModel(TinyModel):
    def __init__(self, name: str, path: str, arch: str, hf_model):
        self.name, self.path, self.arch, self.hf = name, path, arch, hf_model
        self.hf_config = json.load(open(os.path.join(path, "config.json")))
        # A ...ForConditionalGeneration config nests the text model's fields.
        self.text_config = self.hf_config.get("text_config", self.hf_config)
        self.vocab_size = self.text_config["vocab_size"]
        self._refs: dict[tuple, list[int]] = {}

    @property
    def prompts(self) -> list[list[int]]:
        return make_prompts(HYBRID_LENGTHS, self.vocab_size, seed=5)


def build_hybrid(path: str, arch: str, overrides: dict, seed: int = 0):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if arch.endswith("_vl"):
            return _build_vl(path, arch, overrides, seed)
        hf = build_checkpoint(path, arch, overrides, seed=seed)
        hybrid_like_trained(hf)
        hf.save_pretrained(path)  # again, with the new A_log, dt_bias and norms
    return hf


def _build_vl(path: str, arch: str, overrides: dict, seed: int):
    import transformers as tf
    cfg_cls, model_cls = {
        "qwen3_5_vl": (tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration),
        "qwen3_5_moe_vl": (tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration),
    }[arch]
    text = dict(TINY)
    text.update(overrides)
    torch.manual_seed(seed)
    config = cfg_cls(text_config=text, vision_config=TINY_VISION, tie_word_embeddings=False)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    hybrid_like_trained(model)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
    cache: dict[str, HybridModel] = {}

    def get(name: str) -> HybridModel:
        if name not in cache:
            arch, overrides = HYBRID_SPECS[name]
            path = str(tmp_path_factory.mktemp(name))
            hf = build_hybrid(path, arch, overrides)
            cache[name] = HybridModel(name, path, arch, hf)
        return cache[name]

    return get


def hybrid_llm(tm: HybridModel, **kw):
    kw.setdefault("max_model_len", MAX_LEN)
    return make_llm(tm.path, **kw)


def assert_idle(llm):
    """Nothing left held: no KV blocks, every state slot free."""
    assert scheduler_of(llm).kv_cache_manager.num_used_blocks == 0
    slots = runner_of(llm).state_slots
    assert slots is not None and not slots.slot_of and slots.num_free == slots.num_slots


# ---- (a) one prompt --------------------------------------------------------------------

@pytest.mark.parametrize("name", HYBRID_MODELS)
def test_single_prompt(hybrid_model, name):
    tm = hybrid_model(name)
    prompt = tm.prompts[0]
    ref = hf_greedy(tm.hf, prompt, NUM_NEW)  # unpadded HF generate
    llm = hybrid_llm(tm)
    runner = runner_of(llm)
    # The hybrid topology: a full-attention group and a recurrent-state group.
    config = runner.kv_cache_config
    assert config.attention_group_id == 0 and config.state_group_id == 1
    n_linear = tm.text_config["layer_types"].count("linear_attention")
    assert len(runner.state_caches) == n_linear
    # Layer by layer, the same token mixer and the same MLP kind (dense / sparse) as HF.
    from tokenmill.models.layers.moe import SparseMoeBlock
    hf_layers = getattr(tm.hf.model, "language_model", tm.hf.model).layers
    ours = [(layer.is_linear, isinstance(layer.mlp, SparseMoeBlock))
            for layer in runner.model.layers]
    assert ours == [(hasattr(h, "linear_attn"), "Sparse" in type(h.mlp).__name__)
                    for h in hf_layers]
    assert_same_tokens_and_logprobs(tm, [prompt], run_greedy_logprobs(llm, [prompt]), [ref])
    assert tm.reference(prompt) == ref  # the left-padded batch reference agrees
    assert_idle(llm)


# ---- (b) a batch of mixed lengths --------------------------------------------------------

@pytest.mark.parametrize("name", HYBRID_MODELS)
def test_batch_of_mixed_lengths(hybrid_model, name):
    tm = hybrid_model(name)
    prompts = tm.prompts
    assert sorted(len(p) for p in prompts) == sorted(HYBRID_LENGTHS)
    llm = hybrid_llm(tm)
    assert_same_tokens_and_logprobs(tm, prompts, run_greedy_logprobs(llm, prompts))
    assert_idle(llm)


# ---- (c) chunked prefill -----------------------------------------------------------------

def _chunk_log(seen) -> list[tuple[int, int, int, bool]]:
    """(num_computed, num_scheduled, prompt_len, other rows decode) of every prompt chunk
    that leaves part of its prompt for a later step."""
    prompt_len: dict[str, int] = {}
    log = []
    for so in seen:
        computed = {}
        for nr in so.scheduled_new_reqs:
            prompt_len[nr.req_id] = len(nr.prompt_token_ids)
            computed[nr.req_id] = nr.num_computed_tokens
        c = so.scheduled_cached_reqs
        computed.update(zip(c.req_ids, c.num_computed_tokens))
        decoding = {r for r in computed if computed[r] >= prompt_len[r]}
        for rid, n in so.num_scheduled_tokens.items():
            if computed[rid] + n < prompt_len[rid]:
                log.append((computed[rid], n, prompt_len[rid], bool(decoding - {rid})))
    return log


@pytest.mark.parametrize("name", HYBRID_MODELS)
def test_chunked_prefill(hybrid_model, name):
    tm = hybrid_model(name)
    prompts = tm.prompts
    log = []
    for budget, block_size in ((3, 4), (5, 16)):
        # Prefix caching off: with it, chunks that stop short end at block boundaries
        # (test_hybrid_prefix_caching.py), which would change the chunk shapes sought here.
        llm = hybrid_llm(tm, max_num_batched_tokens=budget, block_size=block_size,
                         enable_prefix_caching=False)
        seen = record_schedules(llm)
        assert_same_tokens_and_logprobs(tm, prompts, run_greedy_logprobs(llm, prompts))
        assert max(so.total_num_scheduled_tokens for so in seen) <= budget
        log += _chunk_log(seen)
        assert_idle(llm)
    # Chunks of 1, 2 and 3 tokens (shorter than the conv kernel) that continue a
    # prompt and leave more of it, also in steps where other rows decode.
    continuing = {n for computed, n, _, _ in log if computed > 0}
    assert {1, 2, 3} <= continuing
    assert {1, 2, 3} <= {n for computed, n, _, dec in log if computed > 0 and dec}
    assert {1, 2} <= {n for computed, n, _, _ in log if computed == 0}  # first chunks too


# ---- (d) preemption ----------------------------------------------------------------------

PREEMPT_CONFIGS = {
    # 19 usable blocks of 8 tokens: the 8 sequences need ~50.
    "pool": dict(block_size=8, num_kv_blocks=20),
    # 4-token blocks and 16-token prompt chunks.
    "pool_chunked": dict(block_size=4, num_kv_blocks=36, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("config", list(PREEMPT_CONFIGS))
@pytest.mark.parametrize("name", HYBRID_MODELS)
def test_preemption(hybrid_model, name, config):
    tm = hybrid_model(name)
    prompts = tm.prompts
    llm = hybrid_llm(tm, **PREEMPT_CONFIGS[config])
    seen = record_schedules(llm)
    got = run_greedy_logprobs(llm, prompts)
    sched = scheduler_of(llm)
    assert sched.num_preemptions > 0, "the config was meant to force preemption"
    # Preempted requests came back from the start (their state recomputed).
    assert any(any(so.scheduled_cached_reqs.resumed_from_preemption) for so in seen)
    assert_same_tokens_and_logprobs(tm, prompts, got)
    assert_idle(llm)


# ---- (e) n = 2 with a seed -------------------------------------------------------------

@pytest.mark.parametrize("name", HYBRID_MODELS)
def test_n2_seeded_sampling_prefills_each_completion(hybrid_model, name):
    tm = hybrid_model(name)
    prompt = tm.prompts[0]  # 33 tokens: two full 16-token blocks a dense model would share
    llm = hybrid_llm(tm)
    seed = 1234

    def params(**kw):
        return SamplingParams(temperature=1.0, top_k=50, max_tokens=12, ignore_eos=True, **kw)

    out = llm.generate([{"prompt_token_ids": prompt}], params(n=2, seed=seed),
                       use_tqdm=False)[0]
    assert sorted(c.index for c in out.outputs) == [0, 1]
    both = {c.index: c.token_ids for c in out.outputs}
    assert scheduler_of(llm).num_shared_prompt_blocks == 0
    assert_idle(llm)
    lone = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": prompt}] * 2,
        [params(seed=seed), params(seed=seed + 1)], use_tqdm=False)]
    for i in range(2):
        assert len(both[i]) == 12
        assert both[i] == lone[i], f"completion {i} differs from a lone request with seed+{i}"
    assert both[0] != both[1]
    assert scheduler_of(llm).num_shared_prompt_blocks == 0


# ---- the vision-language checkpoint ------------------------------------------------------

@pytest.mark.parametrize("name,arch", [("qwen3_5_vl", "Qwen3_5ForConditionalGeneration"),
                                       ("qwen3_5_moe_vl", "Qwen3_5MoeForConditionalGeneration")])
def test_vl_checkpoint_loads_the_tower(hybrid_model, name, arch):
    """The checkpoint's tower and text model both load, each tensor where HF has it
    (a config without mrope_section: the reference's default sections)."""
    tm = hybrid_model(name)
    assert tm.hf_config["architectures"] == [arch]
    assert "mrope_section" not in tm.text_config.get("rope_parameters", {})
    llm = hybrid_llm(tm)
    model = runner_of(llm).model
    from tokenmill.models.layers.linear import Linear
    hf_visual = dict(tm.hf.model.visual.named_parameters())
    ours = {}
    for mname, mod in model.visual.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if isinstance(mod, Linear) and pname == "weight":
                p = mod.dense_weight()  # (packed at load: the parameter is a placeholder)
            ours[f"{mname}.{pname}"] = p
    assert ours.keys() == hf_visual.keys()
    for n, p in ours.items():
        assert torch.equal(p, hf_visual[n]), n
    lm = tm.hf.model.language_model
    assert torch.equal(model.embed_tokens.weight, lm.embed_tokens.weight)
    assert torch.equal(model.lm_head.dense_weight(), tm.hf.lm_head.weight)
    assert torch.equal(model.layers[0].linear_attn.A_log, lm.layers[0].linear_attn.A_log)


# ---- fault isolation: a failed step resets the batch; every state is recomputed ----------

@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_a_fault_fails_only_its_request(hybrid_model, name):
    """A request whose sampling faults fails alone; the others are requeued from a clean
    batch with fresh state slots, and still give HF's tokens and logprobs."""
    from tokenmill import faults
    tm = hybrid_model(name)
    prompts = tm.prompts[:4]
    llm = hybrid_llm(tm)
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=K)
    for i, p in enumerate(prompts[:3]):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, greedy)
    finals = {}

    def step():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out

    step()
    step()
    faults.arm("sampler", "rid:victim")
    try:
        engine.add_request("victim", {"prompt_token_ids": prompts[3]}, greedy)
        while engine.has_unfinished_requests():
            step()
    finally:
        faults.disarm_all()
    assert finals["victim"].outputs[0].finish_reason == "error"
    got = [finals[f"r{i}"].outputs[0] for i in range(3)]
    assert_same_tokens_and_logprobs(tm, prompts[:3], got)
    assert_idle(llm)


# ---- the native CPU kernels (kernels/cpu_gated_delta.cpp, cpu_causal_conv.cpp) ----------

def _count_calls(fn, log: list, tag: str):
    def counted(*args, **kw):
        log.append(tag)
        return fn(*args, **kw)
    return counted


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_native_kernels_take_every_step(hybrid_model, prefix_caching):
    """Where the native kernels build, the runs above go through them and never through
    the PyTorch functions: without prefix caching each Gated DeltaNet layer's conv and
    delta rule once per step (the rows one sequence each: the whole step in one call);
    with it, piece by piece between the state snapshots. Tokens and logprobs stay HF's
    with chunked prefill mixing prompt chunks and decode rows."""
    from tokenmill import kernels
    if kernels.cpu_ops() is None:
        pytest.skip("no native CPU kernels")
    tm = hybrid_model("qwen3_5")
    llm = hybrid_llm(tm, max_num_batched_tokens=16, enable_prefix_caching=prefix_caching)
    layers = runner_of(llm).model.state_layers()
    calls: list[str] = []

    def refuse(*args, **kw):
        raise AssertionError("a path this test rules out ran")

    for layer in layers:
        nk = layer._native
        assert nk is not None and nk.conv is not None
        if prefix_caching:  # steps that write snapshots go piece by piece, others whole
            layer._native = nk._replace(
                rule=_count_calls(nk.rule, calls, "rule"),
                conv=_count_calls(nk.conv, calls, "conv"),
                prefill=_count_calls(nk.prefill, calls, "rule piece"),
                decode=_count_calls(nk.decode, calls, "rule piece"),
                conv_prefill=_count_calls(nk.conv_prefill, calls, "conv piece"),
                conv_decode=_count_calls(nk.conv_decode, calls, "conv piece"))
        else:
            layer._native = nk._replace(rule=_count_calls(nk.rule, calls, "rule"),
                                        conv=_count_calls(nk.conv, calls, "conv"),
                                        prefill=refuse, decode=refuse, conv_prefill=refuse,
                                        conv_decode=refuse)
        layer._prefill = layer._decode = refuse
    prompts = tm.prompts[:4]
    assert_same_tokens_and_logprobs(tm, prompts, run_greedy_logprobs(llm, prompts))
    assert calls and calls.count("rule") == calls.count("conv")
    assert calls.count("rule") % len(layers) == 0  # every layer alike
    assert calls.count("rule piece") == calls.count("conv piece")
    assert (calls.count("rule piece") > 0) == prefix_caching
    assert_idle(llm)


def test_bf16_native_path_is_logprobs_close_to_hf_bf16(hybrid_model):
    """bf16: the native conv, delta rule and norms (zero-centered, gated) against HF's
    bf16 forward: each greedy token HF's, or both tokens in each other's top 5."""
    import copy

    from test_cpu_paths import TOP, check_logprobs_close, hf_greedy_with_logprobs
    tm = hybrid_model("qwen3_5")
    hf = copy.deepcopy(tm.hf).to(torch.bfloat16)
    prompts = tm.prompts[:4]
    refs = [hf_greedy_with_logprobs(hf, p, NUM_NEW) for p in prompts]
    llm = hybrid_llm(tm, dtype="bfloat16", enable_prefix_caching=False)
    from tokenmill import kernels
    if kernels.cpu_ops() is not None:  # the native norms are the ones compared
        model = runner_of(llm).model
        assert all(layer.norm._ops is not None for layer in model.state_layers())
        assert model.layers[0].input_layernorm._ops is not None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True,
                                       logprobs=TOP), use_tqdm=False)
    for p, (ref_tokens, ref_tops), out in zip(prompts, refs, outs):
        got = out.outputs[0]
        got_tops = [{t: lp.logprob for t, lp in pos.items()} for pos in got.logprobs]
        check_logprobs_close(ref_tokens, ref_tops, got.token_ids, got_tops,
                             f"qwen3_5 bf16, prompt of {len(p)} tokens")
    assert_idle(llm)
