"""The pre-norm decoders' layer loop (Llama family, DeepSeek-V2/V3) folds each layer's last
residual add (x += mlp(...)) into the next layer's fused add + norm, and the last one into
the final norm (PreNormBlock.forward_deferred, HiddenStateTaps.run_layers' `deferred`): the same
roundings as adding first, so every logprob must be the same bits as the unfolded loop's;
the same for the hybrids (Qwen3.5 / Qwen3-Next), whose norms fuse the add natively;
and a step with taps (whose stream must be whole between layers) takes the plain loop."""
from __future__ import annotations

import pytest
import torch

from conftest import make_llm, runner_of
from tokenmill import SamplingParams
from tokenmill.models.layers.taps import HiddenStateTaps, PreNormBlock


def _run(tm, dtype):
    llm = make_llm(tm.path, dtype=dtype, max_num_seqs=4, max_num_batched_tokens=32,
                   enable_chunked_prefill=True)
    prompts = [{"prompt_token_ids": p} for p in tm.prompts[:3]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3,
                            prompt_logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [(o.outputs[0].token_ids,
                  [sorted((k, v.logprob) for k, v in d.items()) for d in o.outputs[0].logprobs],
                  [None if d is None else sorted((k, v.logprob) for k, v in d.items())
                   for d in o.prompt_logprobs]) for o in outs]


@pytest.mark.parametrize("name", ["qwen3_headdim", "llama_bias", "qwen2_tied", "deepseek_v2",
                                  "deepseek_v3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_folded_residual_adds_are_bit_identical(tiny_model_factory, monkeypatch, name, dtype):
    tm = tiny_model_factory(name)
    calls = {"deferred": 0, "plain": 0}
    real_deferred, real_forward = PreNormBlock.forward_deferred, PreNormBlock.forward

    def deferred(self, *a):
        calls["deferred"] += 1
        return real_deferred(self, *a)

    def plain(self, *a):
        calls["plain"] += 1
        return real_forward(self, *a)
    monkeypatch.setattr(PreNormBlock, "forward_deferred", deferred)
    monkeypatch.setattr(PreNormBlock, "forward", plain)
    _, folded = _run(tm, dtype)
    assert calls["deferred"] > 0 and calls["plain"] == 0

    real_run_layers = HiddenStateTaps.run_layers

    def unfolded(self, x, step, norm, span=None, tapped=None, deferred=None):
        return real_run_layers(self, x, step, norm, span, tapped)
    monkeypatch.setattr(HiddenStateTaps, "run_layers", unfolded)
    calls.update(deferred=0, plain=0)
    _, reference = _run(tm, dtype)
    assert calls["plain"] > 0
    assert folded == reference


HYBRID = dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
              initializer_range=0.1, tie_word_embeddings=False)


@pytest.mark.parametrize("arch,overrides", [
    ("qwen3_5", {}),
    ("qwen3_next", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48, decoder_sparse_step=1)),
], ids=["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_hybrid_folded_adds_are_bit_identical(tmp_path, monkeypatch, arch, overrides, dtype):
    """Qwen3.5 / Qwen3-Next layers (Gated DeltaNet and gated attention, dense and MoE
    MLPs): both residual adds through the zero-centered norm's add_forward (in bf16 the
    native add_rms_norm_zero_centered_), the MLP's folded into the next layer's norm,
    bit for bit the unfused loop's (each add, then the norm) over chunked prefill and
    decode, logprobs and prompt logprobs."""
    from conftest import build_checkpoint, make_prompts
    from tokenmill.models.qwen3_next import ZeroCenteredRMSNorm
    path = str(tmp_path / arch)
    hf = build_checkpoint(path, arch, dict(HYBRID, **overrides), seed=2)
    tm = type("Tiny", (), {"path": path,
                           "prompts": make_prompts([40, 9, 70], hf.config.vocab_size, seed=4)})
    calls = {"fused": 0}
    real_add_forward = ZeroCenteredRMSNorm.add_forward

    def counted(self, residual, x):
        calls["fused"] += 1
        return real_add_forward(self, residual, x)
    monkeypatch.setattr(ZeroCenteredRMSNorm, "add_forward", counted)
    _, folded = _run(tm, dtype)
    assert calls["fused"] > 0

    def unfused(self, residual, x):  # the layer as it was: x + h, then the norm
        return self(residual.add_(x))
    real_run_layers = HiddenStateTaps.run_layers

    def unfolded(self, x, step, norm, span=None, tapped=None, deferred=None):
        return real_run_layers(self, x, step, norm, span, tapped)
    monkeypatch.setattr(ZeroCenteredRMSNorm, "add_forward", unfused)
    monkeypatch.setattr(HiddenStateTaps, "run_layers", unfolded)
    _, reference = _run(tm, dtype)
    assert folded == reference


def test_taps_take_the_plain_loop(tiny_model_factory):
    """With taps the stream entering each tapped layer is copied whole: no fold; the taps
    hold HF's hidden_states[i] (the stream before layer i), whatever the loop."""
    tm = tiny_model_factory("qwen3_headdim")
    llm = make_llm(tm.path, dtype="float32", max_num_seqs=2)
    model = runner_of(llm).model
    n = len(model.layers)
    ids = torch.tensor([tm.prompts[0]])
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tm.path, torch_dtype=torch.float32)
    with torch.no_grad():
        want = hf(ids, output_hidden_states=True).hidden_states
    model.aux_layer_ids = (1, n)
    try:
        llm.generate([{"prompt_token_ids": tm.prompts[0]}],
                     SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        width = model.config.hidden_size
        taps = model.aux_hidden
        assert taps is not None and taps.shape[1] == 2 * width
        t = len(tm.prompts[0])
        torch.testing.assert_close(taps[:t, :width], want[1][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(taps[:t, width:], want[n][0], rtol=1e-5, atol=1e-5)
    finally:
        model.aux_layer_ids = ()
