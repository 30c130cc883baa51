"""A checkpoint's per-layer FP8 KV cache scales (model.layers.N.self_attn.k_scale /
v_scale) end to end, on a tiny fp32 Llama written so that they matter.

The checkpoint: a well-conditioned tiny Llama (weights' std 0.05) whose k_proj is
multiplied by C_K = 2000 and q_proj divided by it (scores unchanged: rotary is linear),
v_proj multiplied by C_V = 0.003 and o_proj divided by it (outputs unchanged). HF runs
it as the original model. Its K are then mostly beyond e4m3's +-448 and its V near
e4m3's smallest subnormal (2^-9): an fp8 cache without scales saturates K and rounds
V to a few codes or zero. The checkpoint's k_scale = 8.0 and v_scale = 0.005 bring
them back into range.

- Exactness: HF with its attention's K/V stored as (x / scale) rounded through e4m3
  and multiplied back (a registered attention function), greedy tokens equal and
  logprobs within 1e-4, with the native kernels and the PyTorch path, chunked
  prefill included; the native decode loop bit-equal to the Python layers.
- Cost: prompt logprobs of the fp8 cache with scales within FP8_COST_BOUND (0.1) of the
  fp32 cache's (measured 0.030); the same checkpoint with its scale tensors removed is
  far off (measured 0.46; asserted > 0.3 and > 5x the scaled cost): the test fails if
  the scales are dropped.
- The scales do nothing to a cache that is not fp8 (one log line says so).
- The prefix cache and the external tier restore scaled pages (same outputs).
- compressed-tensors' kv_cache_scheme (FP8, per tensor) and vLLM's kv_scale /
  attn.k_scale spellings load; scales that are not finite positive are refused by name.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import warnings

import pytest
import torch

from conftest import TINY, build_checkpoint, make_llm, make_prompts, runner_of
from logprob_check import K
from tokenmill import SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint_refusals import read_tensors, write_variant  # noqa: E402

FP8 = torch.float8_e4m3fn
C_K, C_V = 2000.0, 0.003
K_SCALE, V_SCALE = 8.0, 0.005
# The values the layers hold: the checkpoint's fp32 scalars.
SCALES_F32 = (K_SCALE, float(torch.tensor(V_SCALE)))
NEW = 12
TOL = 1e-4  # against HF with the same scaled e4m3 rounding (test_kv_cache_fp8.py's)
FP8_COST_BOUND = 0.1  # against the fp32 cache, prompt logprobs (test_kv_cache_fp8.py's)
# What ignoring the scales costs at least (measured 0.46, against 0.030 with them).
DROPPED_AT_LEAST = 0.3
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=K)
PROMPTS = make_prompts([5, 17, 40], TINY["vocab_size"], seed=3)


def _rescaled(tensors: dict) -> dict:
    """The same function with K x C_K and V x C_V inside attention."""
    out = dict(tensors)
    for name, t in tensors.items():
        for proj, factor in (("q_proj", 1 / C_K), ("k_proj", C_K), ("v_proj", C_V),
                             ("o_proj", 1 / C_V)):
            if name.endswith(f"self_attn.{proj}.weight"):
                out[name] = t * factor
    return out


def _scale_tensors(num_layers: int, spelling: str = "self_attn.{}_scale") -> dict:
    out = {}
    for i in range(num_layers):
        out[f"model.layers.{i}.{spelling.format('k')}"] = torch.tensor(K_SCALE)
        out[f"model.layers.{i}.{spelling.format('v')}"] = torch.tensor(V_SCALE)
    return out


def _through_scaled_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    s = torch.tensor(scale, dtype=torch.float32)
    return ((x.float() / s).clamp(-448.0, 448.0).to(FP8).float() * s).to(x.dtype)


class ScaledFp8Reference:
    """tokens -> [len, vocab] log-probs of HF with a scaled e4m3 KV cache emulated."""

    def __init__(self, path: str):
        from transformers import AttentionInterface, AutoModelForCausalLM
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        def scaled_fp8_kv_sdpa(module, query, key, value, *args, **kwargs):
            return sdpa_attention_forward(module, query, _through_scaled_fp8(key, K_SCALE),
                                          _through_scaled_fp8(value, V_SCALE), *args,
                                          **kwargs)

        AttentionInterface.register("tokenmill_scaled_fp8_kv", scaled_fp8_kv_sdpa)
        AttentionMaskInterface.register("tokenmill_scaled_fp8_kv", sdpa_mask)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.hf = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="tokenmill_scaled_fp8_kv").eval()
        self._rows: dict[tuple, torch.Tensor] = {}

    @torch.no_grad()
    def __call__(self, tokens: list[int]) -> torch.Tensor:
        key = tuple(tokens)
        if key not in self._rows:
            self._rows[key] = self.hf(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
        return self._rows[key]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_scaled_checkpoint(tmp_path_factory)


def build_scaled_checkpoint(tmp_path_factory):
    """(with scales, the same without them, HF reference over the latter)."""
    src = str(tmp_path_factory.mktemp("llama_src"))
    build_checkpoint(src, "llama", dict(tie_word_embeddings=True, initializer_range=0.05))
    cfg = json.load(open(os.path.join(src, "config.json")))
    weights = _rescaled(read_tensors(src))
    bare = write_variant(src, str(tmp_path_factory.mktemp("llama_rescaled")), weights)
    scaled = write_variant(src, str(tmp_path_factory.mktemp("llama_kv_scales")),
                           {**weights, **_scale_tensors(cfg["num_hidden_layers"])})
    return scaled, bare, ScaledFp8Reference(bare)


def _generate(llm, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _check_against_reference(ref, prompts, outs) -> int:
    checked = 0
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        hf = ref(prompt + list(comp.token_ids))[len(prompt) - 1:-1]
        for i, t in enumerate(comp.token_ids):
            top2 = hf[i].topk(2).values
            if top2[0] - top2[1] < 2 * TOL:
                break  # a near tie: the rest may follow the other branch
            assert t == int(hf[i].argmax()), (prompt[:3], i)
            for tok, lp in comp.logprobs[i].items():
                assert lp.logprob == pytest.approx(hf[i, tok].item(), abs=TOL)
            checked += 1
    return checked


@pytest.mark.parametrize("cpu_kernels", ["auto", "torch"])
def test_scaled_fp8_cache_matches_hf_with_scaled_e4m3_kv(ckpt, cpu_kernels):
    path, _, ref = ckpt
    llm = make_llm(path, kv_cache_dtype="fp8", cpu_kernels=cpu_kernels,
                   max_num_batched_tokens=16)
    runner = runner_of(llm)
    layers = runner.model.attention_layers()
    assert [(a.impl.k_scale, a.impl.v_scale) for a in layers] == [SCALES_F32] * 2
    assert all(c.dtype == FP8 for c in runner.kv_caches.values())
    assert _check_against_reference(ref, PROMPTS, _generate(llm, PROMPTS)) == len(PROMPTS) * NEW


def test_native_decode_loop_equals_python_layers_with_scales(ckpt):
    path, _, _ = ckpt
    llms = [make_llm(path, kv_cache_dtype="fp8", decode_layers=on) for on in (True, False)]
    loop = runner_of(llms[0]).model.decode_layers
    assert loop is not None and runner_of(llms[1]).model.decode_layers is None
    real, scales_passed = loop.ops, []

    class Spy:  # the kernels module, recording the scales each decode_layers call gets
        def __getattr__(self, name):
            return getattr(real, name)

        def decode_layers(self, *args):
            scales_passed.append(list(args[-1]))
            return real.decode_layers(*args)

    loop.ops = Spy()
    outs = [_generate(llm, PROMPTS) for llm in llms]
    assert scales_passed and all(s == list(SCALES_F32) * 2 for s in scales_passed)
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in d.items()} for d in a.outputs[0].logprobs] == \
            [{t: lp.logprob for t, lp in d.items()} for d in b.outputs[0].logprobs]


def _worst_prompt_logprob_gap(a_outs, b_outs) -> float:
    worst = 0.0
    for a, b in zip(a_outs, b_outs):
        for j in range(1, len(a.prompt_token_ids)):
            t = a.prompt_token_ids[j]
            worst = max(worst, abs(a.prompt_logprobs[j][t].logprob
                                   - b.prompt_logprobs[j][t].logprob))
    return worst


def test_scales_cost_little_and_dropping_them_costs_a_lot(ckpt):
    scaled, bare, _ = ckpt
    prompts = make_prompts([5, 17, 40, 90], TINY["vocab_size"])
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    full = _generate(make_llm(bare, max_model_len=160), prompts, params)
    with_scales = _generate(make_llm(scaled, max_model_len=160, kv_cache_dtype="fp8"),
                            prompts, params)
    dropped = _generate(make_llm(bare, max_model_len=160, kv_cache_dtype="fp8"), prompts,
                        params)
    cost = _worst_prompt_logprob_gap(full, with_scales)
    lost = _worst_prompt_logprob_gap(full, dropped)
    assert 0 < cost <= FP8_COST_BOUND, cost
    assert lost > DROPPED_AT_LEAST and lost > 5 * cost, (lost, cost)


def test_scales_ignored_without_an_fp8_cache(ckpt, caplog):
    scaled, bare, _ = ckpt
    with caplog.at_level(logging.INFO):
        llm = make_llm(scaled)
    assert "KV cache scales (2 layers) are not used" in caplog.text
    assert all((a.impl.k_scale, a.impl.v_scale) == (1.0, 1.0)
               for a in runner_of(llm).model.attention_layers())
    a, b = _generate(llm, PROMPTS), _generate(make_llm(bare), PROMPTS)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].cumulative_logprob == y.outputs[0].cumulative_logprob


SHARED = make_prompts([48], TINY["vocab_size"], seed=7)[0]
TAILS = [SHARED + t for t in make_prompts([3, 9, 5], TINY["vocab_size"], seed=8)]


def _greedy_ids(llm, prompts):
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in _generate(llm, prompts, sp)]


def test_prefix_cache_and_external_tier_restore_scaled_pages(ckpt, tmp_path):
    path, _, _ = ckpt
    kw = dict(kv_cache_dtype="fp8", block_size=16)
    cold = _greedy_ids(make_llm(path, enable_prefix_caching=False, **kw), TAILS)
    llm = make_llm(path, enable_prefix_caching=True, **kw)
    assert _greedy_ids(llm, TAILS[:1]) == cold[:1]
    assert _greedy_ids(llm, TAILS[1:]) == cold[1:]
    assert llm.llm_engine.engine_core.kv_cache_stats()["prefix_cache_hits"] >= 2 * 48
    spec = f"disk:{tmp_path / 'kv'}"
    store = make_llm(path, kv_connector=[spec], enable_prefix_caching=False, **kw)
    assert _greedy_ids(store, TAILS) == cold
    reload = make_llm(path, kv_connector=[spec], enable_prefix_caching=False, **kw)
    assert _greedy_ids(reload, TAILS) == cold  # every prompt's blocks from the store
    s = reload.llm_engine.engine_core.kv_cache_stats()["external"]
    assert s["hit_tokens"] >= len(TAILS) * 48 and s["load_failures"] == 0


@pytest.mark.parametrize("spelling", ["self_attn.attn.{}_scale", "self_attn.kv_scale",
                                      "self_attn.{}_proj.output_scale"])
def test_other_spellings_load(ckpt, tmp_path, spelling):
    scaled, bare, _ = ckpt
    tensors = read_tensors(bare)
    if spelling == "self_attn.kv_scale":
        extra = {f"model.layers.{i}.self_attn.kv_scale": torch.tensor([2.0]) for i in range(2)}
        want = (2.0, 2.0)
    else:
        extra, want = _scale_tensors(2, spelling), SCALES_F32
    path = write_variant(bare, str(tmp_path / "v"), {**tensors, **extra})
    llm = make_llm(path, kv_cache_dtype="fp8")
    assert [(a.impl.k_scale, a.impl.v_scale)
            for a in runner_of(llm).model.attention_layers()] == [want] * 2


def test_compressed_tensors_kv_cache_scheme_loads(ckpt, tmp_path):
    """A compressed-tensors FP8 checkpoint (per-tensor weights) with an FP8 per-tensor
    kv_cache_scheme: accepted, its k_scale / v_scale used."""
    sys.path.insert(0, os.path.dirname(__file__))
    from test_fp8_scales import compressed_tensors_fp8, scales_variant
    _, bare, _ = ckpt
    qc = compressed_tensors_fp8(static=False, per_channel=False)
    qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "symmetric": True,
                             "dynamic": False, "strategy": "tensor"}
    weights = str(tmp_path / "w")
    scales_variant(bare, weights, lambda n: (), qc=qc)
    path = write_variant(weights, str(tmp_path / "ct"),
                         {**read_tensors(weights), **_scale_tensors(2)})
    llm = make_llm(path, kv_cache_dtype="fp8")
    assert [(a.impl.k_scale, a.impl.v_scale)
            for a in runner_of(llm).model.attention_layers()] == [SCALES_F32] * 2
    assert _generate(llm, PROMPTS[:1])[0].outputs[0].token_ids


@pytest.mark.parametrize("bad,message", [
    (torch.tensor(0.0), "is 0.0: it must be a finite positive number"),
    (torch.tensor(-4.0), "is -4.0: it must be a finite positive"),
    (torch.tensor(float("nan")), "is nan: it must be a finite positive"),
    (torch.tensor(float("inf")), "is inf: it must be a finite positive"),
    (torch.tensor([4.0, 4.0]), r"shape \(2,\); only one scale per layer"),
])
def test_bad_scales_refused_by_name(ckpt, tmp_path, bad, message):
    scaled, _, _ = ckpt
    tensors = read_tensors(scaled)
    tensors["model.layers.1.self_attn.v_scale"] = bad
    path = write_variant(scaled, str(tmp_path / "bad"), tensors)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.v_scale.*" + message):
        make_llm(path, kv_cache_dtype="fp8")


def test_scale_of_no_attention_layer_refused_by_name(ckpt, tmp_path):
    scaled, _, _ = ckpt
    tensors = {**read_tensors(scaled), "model.layers.7.self_attn.k_scale": torch.tensor(2.0)}
    path = write_variant(scaled, str(tmp_path / "bad"), tensors)
    with pytest.raises(ValueError, match=r"model\.layers\.7\.self_attn\.k_scale belongs to "
                                         r"no paged attention layer"):
        make_llm(path, kv_cache_dtype="fp8")
