"""Decode steps run all Llama-family layers in one native call
(layers/decode_layers.py, kernels/cpu_decode_layers.cpp): bit-identical to the
Python layers, and only where every layer would take its native path.

Every test runs at each capability level this CPU runs (the layers' packed bf16
linears, and so this path, exist wherever the module has_fast_linear_bf16; without
them the Python layers run), with the GEMMs widened as on a CPU without native bf16
(`widened`), so the packed path is tested whatever CPU the suite lands on."""
from __future__ import annotations

import pytest
import torch

from conftest import make_llm, runner_of
from tokenmill import SamplingParams
from tokenmill import config as config_mod
from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.models.layers.decode_layers import DecodeLayers


@pytest.fixture
def widened(monkeypatch):
    """bf16 models keep fp32 GEMMs plus packed bf16 weights, as where bf16 is emulated."""
    monkeypatch.setattr(config_mod, "cpu_has_native_bf16", lambda: False)


def _spy(monkeypatch, compare: bool):
    """Record the rows of every native call; with `compare`, also run the Python
    layers on a copy of the residual stream first and require equal bits."""
    rows = []
    real = DecodeLayers.__call__

    def call(self, x, cos, sin, meta):
        ref = None
        if compare:
            # The Python layers write the same K/V to the same slots: harmless.
            ref = x.clone()
            for layer in self.model.layers:
                ref = layer(ref, cos, sin, self.model.rotary, meta)
        out = real(self, x, cos, sin, meta)
        if ref is not None:
            assert torch.equal(out, ref), "native decode layers differ from the Python layers"
        rows.append(x.shape[0])
        return out

    monkeypatch.setattr(DecodeLayers, "__call__", call)
    return rows


# q/k norm and head_dim != hidden / heads; q/k/v/o and MLP biases; qkv bias with tied
# embeddings; MQA with llama3 rope scaling.
@pytest.mark.parametrize("name", ["qwen3_headdim", "llama_bias", "qwen2_tied",
                                  "llama_mqa_llama3"])
def test_native_decode_layers_are_bit_identical(tiny_model_factory, monkeypatch, widened, ops,
                                                name):
    tm = tiny_model_factory(name)
    rows = _spy(monkeypatch, compare=True)
    llm = make_llm(tm.path, dtype="bfloat16", max_num_seqs=4)
    supported = DecodeLayers(runner_of(llm).model).supported
    assert supported == ops.has_fast_linear_bf16  # no packed linears, no native layers
    prompts = [{"prompt_token_ids": p} for p in tm.prompts[:6]]
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True)
              for i in range(6)]
    llm.generate(prompts, params, use_tqdm=False)
    if supported:
        assert len(rows) > 15 and max(rows) == 4 and min(rows) == 1
    else:
        assert rows == []


def test_tokens_equal_with_python_layers(tiny_model_factory, monkeypatch, widened, ops):
    tm = tiny_model_factory("qwen3_headdim")
    prompts = [{"prompt_token_ids": p} for p in tm.prompts]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    rows = _spy(monkeypatch, compare=False)
    native = make_llm(tm.path, dtype="bfloat16", max_num_seqs=3)
    with_native = [o.outputs[0].token_ids for o in native.generate(prompts, params,
                                                                     use_tqdm=False)]
    assert bool(rows) == ops.has_fast_linear_bf16
    monkeypatch.setattr(DecodeLayers, "applies", lambda self, x, meta: False)
    python = make_llm(tm.path, dtype="bfloat16", max_num_seqs=3)
    assert with_native == [o.outputs[0].token_ids for o in python.generate(prompts, params,
                                                                             use_tqdm=False)]


def test_not_used_where_a_layer_would_not_go_native(tiny_model_factory, monkeypatch, widened,
                                                    ops):
    rows = _spy(monkeypatch, compare=False)
    tm = tiny_model_factory("qwen3_headdim")
    prompt = [{"prompt_token_ids": tm.prompts[0]}]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    make_llm(tm.path, dtype="float32").generate(prompt, params, use_tqdm=False)
    assert rows == []  # fp32: the norms and linears run in PyTorch
    # Prefill steps (the prompt, here in two chunks) take the Python layers too: only
    # the 3 decode steps after the first token come through.
    llm = make_llm(tm.path, dtype="bfloat16", max_num_batched_tokens=8)
    llm.generate(prompt, params, use_tqdm=False)
    assert rows == ([1, 1, 1] if ops.has_fast_linear_bf16 else [])


def test_not_used_where_bf16_gemms_are_native(tiny_model_factory, monkeypatch):
    """A CPU with AVX512-BF16 / AMX keeps bf16 GEMMs: no packed linears, no native layers."""
    monkeypatch.setattr(config_mod, "cpu_has_native_bf16", lambda: True)
    tm = tiny_model_factory("qwen3_headdim")
    llm = make_llm(tm.path, dtype="bfloat16")
    assert not DecodeLayers(runner_of(llm).model).supported


def test_moe_layers_are_not_supported(tmp_path):
    from conftest import build_checkpoint
    build_checkpoint(str(tmp_path), "qwen3_moe", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        decoder_sparse_step=1, mlp_only_layers=[]))
    llm = make_llm(str(tmp_path), dtype="bfloat16")
    assert not DecodeLayers(runner_of(llm).model).supported
