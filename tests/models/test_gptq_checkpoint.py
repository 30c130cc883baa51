"""GPTQ checkpoints as published (AutoGPTQ v1 zeros, GPTQModel gptq_v2) load, dense and
MoE: tiny random checkpoints quantized by tokenmill.models.quant_formats'
write_gptq_checkpoint (qweight / qzeros / scales fp16 / g_idx), against HF transformers
on the dequantized fp32 twin: greedy tokens equal, logprobs within 1e-4.

Variants: 4 and 8 bits; group 32, 128 (more than K = 64: one partial group) and -1;
desc_act with shuffled g_idx; symmetric and asymmetric; v1 and v2 zeros; a Llama with
a tied head; Qwen3-MoE, hybrid Qwen3.5-MoE and DeepSeek-V3 targets with GPTQ experts;
every capability level this CPU runs; bf16; chunked prefill and prefix caching.
The layout itself is checked by hand-packed words in test_int_quant_layouts.py.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from conftest import NUM_NEW, make_llm, runner_of, scheduler_of
from tokenmill import SamplingParams
from tokenmill.kernels.testing import kernel_level  # noqa: F401 (fixture)
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.linear_methods.gptq import GptqLinearMethod
from tokenmill.models.layers.linear_methods.quantized_moe import QuantizedFusedMoEMethod
from tokenmill.models.quant_formats import write_gptq_checkpoint

sys.path.insert(0, os.path.dirname(__file__))
from int_quant_check import LLAMA_TIED, QWEN3, build_quantized, check_parity  # noqa: E402
from test_checkpoint_refusals import load  # noqa: E402
from test_prefix_caching import shared_prefix_prompts, stats  # noqa: E402
from test_hybrid_parity import HYBRID_SPECS, build_hybrid  # noqa: E402
from test_moe_parity import MOE_SPECS  # noqa: E402
from conftest import MODEL_SPECS  # noqa: E402

# name -> (model spec, writer arguments)
CASES = {
    "qwen3_4bit_g32_sym_v1": (QWEN3, dict(bits=4, group_size=32, sym=True)),
    "qwen3_4bit_g128_asym_v2": (QWEN3, dict(bits=4, group_size=128, sym=False,
                                            checkpoint_format="gptq_v2")),
    "llama_8bit_gall_sym_v1": (LLAMA_TIED, dict(bits=8, group_size=-1, sym=True)),
    "llama_4bit_g32_descact_asym_v1": (LLAMA_TIED, dict(bits=4, group_size=32, sym=False,
                                                        desc_act=True)),
    "qwen3_8bit_g32_descact_asym_v2": (QWEN3, dict(bits=8, group_size=32, sym=False,
                                                   desc_act=True,
                                                   checkpoint_format="gptq_v2")),
    # GPTQ's lm_head true: the (untied) lm_head quantized too, group 32, asymmetric.
    "qwen3_4bit_g32_lmhead": (QWEN3, dict(bits=4, group_size=32, sym=False, lm_head=True)),
    "qwen3_moe_4bit_g32_descact_sym": (MOE_SPECS["qwen3_moe_norm"],
                                       dict(bits=4, group_size=32, sym=True, desc_act=True)),
    # Hybrid (Gated DeltaNet + attention, MoE): the *_proj Linears and experts GPTQ.
    "qwen3_5_moe_4bit_g32_descact": (HYBRID_SPECS["qwen3_5_moe"],
                                     dict(bits=4, group_size=32, desc_act=True,
                                          build=build_hybrid)),
    # DeepSeek-V3: MLPs, shared and routed experts GPTQ; MLA attention plain (its
    # interleaved rope rows cannot be reordered in packed words: refused, see
    # test_int_quant_refusals.py).
    "deepseek_v3_mlp_4bit_g16": (MODEL_SPECS["deepseek_v3"], dict(
        bits=4, group_size=16, keep=tuple(f"model.layers.{i}.self_attn" for i in range(3)))),
}


@pytest.fixture(scope="module")
def gptq_model(tmp_path_factory):
    cache = {}

    def get(case: str):
        if case not in cache:
            spec, kw = CASES[case]
            cache[case] = build_quantized(tmp_path_factory, case, spec,
                                          write_gptq_checkpoint, **kw)
        return cache[case]
    return get


@pytest.mark.parametrize("case", list(CASES))
def test_gptq_greedy_tokens_and_logprobs_match_hf_dequantized(gptq_model, case):
    check_parity(gptq_model(case), case)


@pytest.mark.parametrize("case", ["llama_4bit_g32_descact_asym_v1", "qwen3_8bit_g32_descact_asym_v2",
                                  "qwen3_moe_4bit_g32_descact_sym"])
def test_gptq_parity_at_every_capability_level(gptq_model, kernel_level, case):
    """The engine forced to each level this CPU runs (the quantized kernels the
    platform hands the layers at that level): still HF's tokens and logprobs."""
    check_parity(gptq_model(case), f"{case} at {kernel_level}")


def _first_logprobs(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=NUM_NEW, logprobs=5,
                                       ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def _agreeing_tokens(got, ref, ref_logprobs, n, tol):
    """Whether got's first n tokens are ref's up to the first position where the fp32
    run's top two are within 2 * tol (a near-tie, which bf16 may break either way: the
    sequences may part there and after)."""
    for pos in range(n):
        top = sorted((x.logprob for x in ref_logprobs[pos].values()), reverse=True)
        if top[0] - top[1] <= 2 * tol:
            return True
        if got[pos] != ref[pos]:
            return False
    return True


def test_gptq_bf16_runs_close_to_hf(gptq_model):
    """bf16 activations over the same integer weights (widened where the platform
    widens; the MoE's experts through the packed kernels): the first token's logprobs
    stay near the fp32 run's (HF-exact: the parity tests), and the first tokens agree
    up to a position where the fp32 run's top two are closer than that error (a
    near-tie; the MoE's routing flips in bf16 sooner, as the unquantized bf16 run of its
    twin does)."""
    for case, n, tol in (("qwen3_4bit_g32_sym_v1", 3, 0.1),
                         ("qwen3_moe_4bit_g32_descact_sym", 1, 0.2)):
        m = gptq_model(case)
        ref_ids, ref = _first_logprobs(make_llm(m.path), m.prompts)
        got, lps = _first_logprobs(make_llm(m.path, dtype="bfloat16"), m.prompts)
        assert all(len(g) == NUM_NEW for g in got)
        for g, r, lp, rl in zip(got, ref_ids, lps, ref):
            shared = [t for t in rl[0] if t in lp[0]]
            assert len(shared) >= 3, (case, g, r)
            err = max(abs(lp[0][t].logprob - rl[0][t].logprob) for t in shared)
            assert err < tol, (case, err)
            assert _agreeing_tokens(g, r, rl, n, tol), (case, g, r)
        assert sum(g[:n] == r[:n] for g, r in zip(got, ref_ids)) >= len(got) // 2


def test_gptq_chunked_prefill_prefix_caching_and_preemption(gptq_model):
    """Act-order GPTQ under the scheduler's paths: prompts sharing a 40-token prefix cut
    into 16-token chunks, run twice over the prefix cache, in a KV pool small enough
    to preempt: HF's tokens and logprobs every time."""
    m = gptq_model("llama_4bit_g32_descact_asym_v1")
    prompts = shared_prefix_prompts(m.vocab_size, prefix_len=40, n=6, seed=3, suffix=(1, 20))
    llm = check_parity(m, "chunked + prefix cache", prompts, max_model_len=96, block_size=8,
                       num_kv_blocks=25, max_num_batched_tokens=16,
                       enable_prefix_caching=True)
    check_parity(m, "cached", prompts[::-1], llm=llm)
    assert stats(llm)["prefix_cache_hits"] > 0
    assert scheduler_of(llm).num_preemptions > 0, "the pool was meant to force preemption"


def test_gptq_layers_hold_the_canonical_form(gptq_model):
    """Every decoder Linear is GPTQ, lm_head and embeddings stay plain, no checkpoint
    tensor is left on the layer, dense_weight() is the dequantized W exactly; act-order
    layers keep a perm; MoE experts hold one QuantizedWeight per expert, or one packed
    weight per expert where the platform has the native kernels."""
    m = gptq_model("llama_4bit_g32_descact_asym_v1")
    model = load(m.path)
    quantized = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, Linear):
            continue
        if name == "lm_head":
            assert not isinstance(mod.method, GptqLinearMethod)
            continue
        assert isinstance(mod.method, GptqLinearMethod), name
        quantized += 1
        assert mod.weight.is_meta
        assert not any(hasattr(mod, k) for k in ("qweight", "qzeros", "scales", "g_idx"))
        qw = mod.method.weight_form
        assert qw.bits == 4 and qw.group_size == 32 and qw.perm is not None
    assert quantized == 2 * 4
    down = model.layers[1].mlp.down_proj
    assert torch.equal(down.dense_weight(), m.deq["model.layers.1.mlp.down_proj.weight"])
    qkv = model.layers[0].self_attn.qkv_proj
    want = torch.cat([m.deq[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv.dense_weight(), want)

    moe = load(gptq_model("qwen3_moe_4bit_g32_descact_sym").path)
    experts = moe.layers[1].mlp.experts
    method = experts.method
    assert isinstance(method, QuantizedFusedMoEMethod)
    # On the CPU with native kernels each expert is packed once and the canonical
    # codes dropped (the packed copy the only one); elsewhere the canonical form.
    forms = method.w13 if method.packed is None else method.packed.w13
    assert experts.gate_up_proj.is_meta and len(forms) == experts.num_experts
    from tokenmill import kernels
    if kernels.runnable_levels():
        assert method.packed is not None and method.w13 is None and method.w2 is None
        assert "native up to" in method.describe()
        assert method.nbytes() == sum(p.nbytes() for p in forms + method.packed.w2)
    assert not any(n.startswith("gate_up_proj_") for n, _ in experts.named_parameters())


def test_gptq_quantized_lm_head(gptq_model, tmp_path):
    """lm_head true: the lm_head takes the GPTQ method (its dense weight the dequantized
    one exactly; no int8 greedy screen over it), parity with HF on the twin is the
    parametrized test's; tied to the embedding, or under tensor parallelism: refused
    by name."""
    import json

    from conftest import build_checkpoint
    m = gptq_model("qwen3_4bit_g32_lmhead")
    cfg = json.load(open(os.path.join(m.path, "config.json")))
    assert cfg["quantization_config"]["lm_head"] is True
    llm = make_llm(m.path)
    model = runner_of(llm).model
    assert isinstance(model.lm_head.method, GptqLinearMethod)
    assert torch.equal(model.lm_head.dense_weight(), m.deq["lm_head.weight"])
    assert runner_of(llm).greedy_head is None
    llm.llm_engine.engine_core.shutdown()
    with pytest.raises(ValueError, match=r"quantized lm_head with tensor parallelism"):
        make_llm(m.path, tensor_parallel_size=2)
    # A tied model's lm_head is the embedding: a quantized copy of it is refused.
    src, dst = str(tmp_path / "src"), str(tmp_path / "tied")
    build_checkpoint(src, *LLAMA_TIED)
    write_gptq_checkpoint(src, dst, bits=4, group_size=32, lm_head=True)
    from safetensors.torch import load_file, save_file
    t = load_file(os.path.join(dst, "model.safetensors"))
    for kind in ("qweight", "qzeros", "scales", "g_idx"):
        t[f"lm_head.{kind}"] = t[f"model.layers.0.mlp.down_proj.{kind}"].clone()
    save_file(t, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lm_head\.qweight is quantized: a quantized "
                                         r"weight tied to the embedding"):
        load(dst)


def test_gptq_writer_keeps_the_source_sharding(tmp_path):
    """A sharded source (the bench models are) is written shard by shard, with an index
    naming every tensor in its file; the result loads and the dequantized twin matches."""
    import json

    from conftest import build_checkpoint
    from test_checkpoint_refusals import read_tensors
    src, dst, ref = (str(tmp_path / d) for d in ("src", "gptq", "ref"))
    build_checkpoint(src, *QWEN3, max_shard_size="100KB")
    deq = write_gptq_checkpoint(src, dst, bits=4, group_size=32, reference_dir=ref)
    index = json.load(open(os.path.join(dst, "model.safetensors.index.json")))["weight_map"]
    assert len(set(index.values())) > 1
    tensors = read_tensors(dst)
    assert set(index) == set(tensors)
    assert "model.layers.0.mlp.down_proj.qweight" in index
    assert not any(n.endswith("_proj.weight") for n in index)
    reference = read_tensors(ref)
    assert set(reference) == set(read_tensors(src))
    for name, w in deq.items():
        assert torch.equal(reference[name], w)
    down = load(dst).layers[1].mlp.down_proj
    assert torch.equal(down.dense_weight(), deq["model.layers.1.mlp.down_proj.weight"])


@pytest.mark.parametrize("case", ["qwen3_8bit_g32_descact_asym_v2", "qwen3_4bit_g32_sym_v1"])
def test_gptq_bf16_quad_layout_is_as_close_as_the_widening_kernel(gptq_model, monkeypatch,
                                                                  case):
    """bf16 models at the levels with the quad layout (avx2 and above) multiply 4- / 8-bit weights with integer dot
    products on activations rounded to 15 bits (the quad layout): the first token's
    logprobs stay as close to the fp32 run (HF-exact, above) as the bf16 run on the
    widening kernel's, i.e. the rounding adds nothing beyond bf16's own."""
    from tokenmill.kernels import cpu_ops
    from tokenmill.platforms import cpu as cpu_platform
    ops = cpu_ops()
    if ops is None or not ops.has_quant_quad:
        pytest.skip("the quad layout needs the avx2 kernel level or above")
    m = gptq_model(case)
    prompts = [{"prompt_token_ids": p} for p in m.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)

    def first_logprobs(**kw):
        llm = make_llm(m.path, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return llm, [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()}
                     for o in outs]

    def worst(got, ref):
        return max(abs(g[t] - r[t]) for g, r in zip(got, ref) for t in g.keys() & r.keys())

    _, ref = first_logprobs(dtype="float32")
    llm, quad = first_logprobs(dtype="bfloat16")
    layer = runner_of(llm).model.layers[0].mlp.down_proj
    assert layer.method.packed.quad, layer.method.describe()
    monkeypatch.setattr(cpu_platform, "QUAD_LEVELS", frozenset())  # the widening kernel
    llm, plain = first_logprobs(dtype="bfloat16")
    layer = runner_of(llm).model.layers[0].mlp.down_proj
    assert not layer.method.packed.quad
    assert worst(quad, ref) <= 2 * worst(plain, ref) + 5e-3, (worst(quad, ref),
                                                              worst(plain, ref))
