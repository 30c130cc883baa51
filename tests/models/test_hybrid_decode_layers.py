"""Decode steps run all Qwen3.5 / Qwen3-Next layers in one native call
(layers/hybrid_decode_layers.py, kernels/cpu_hybrid_decode_layers.cpp): the residual
stream, the Gated DeltaNet states and the KV cache bit-identical to the Python layers',
and only where every layer would take its native path.

The bit-identity tests run at each capability level this CPU runs, with the GEMMs
widened as on a CPU without native bf16 (`widened`), so the packed path is tested
whatever CPU the suite lands on."""
from __future__ import annotations

import pytest
import torch

from conftest import make_llm, runner_of
from test_hybrid_parity import HYBRID, MOE, build_hybrid
from tokenmill import SamplingParams
from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.models.layers.hybrid_decode_layers import HybridDecodeLayers
from tokenmill.platforms import cpu as cpu_platform

# Checkpoints varied as real ones vary: Hv > Hk with partial rotary (Qwen3.5's 0.25,
# here 4 of 16 features) and the attention layer last; attention at layers 1 and 3, one
# value head per key head, a q/k/v/o bias, full rotary, tied embeddings; wider heads.
CONFIGS = {
    "qwen3_5": ("qwen3_5", dict(HYBRID, tie_word_embeddings=False)),
    "qwen3_5_alt": ("qwen3_5", dict(
        HYBRID, linear_num_value_heads=2, attention_bias=True, tie_word_embeddings=True,
        layer_types=["linear_attention", "full_attention", "linear_attention",
                     "full_attention"],
        rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                             partial_rotary_factor=1.0))),
    "qwen3_5_wide": ("qwen3_5", dict(
        HYBRID, num_hidden_layers=2, head_dim=32, linear_key_head_dim=32,
        linear_value_head_dim=48, linear_num_key_heads=1, linear_num_value_heads=3,
        layer_types=["full_attention", "linear_attention"], tie_word_embeddings=False)),
}
PROMPT_LENGTHS = [9, 1, 23, 4, 15, 2]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            arch, overrides = CONFIGS[name]
            path = str(tmp_path_factory.mktemp(name))
            build_hybrid(path, arch, overrides, seed=3)
            cache[name] = path
        return cache[name]

    return get


@pytest.fixture
def widened(monkeypatch):
    """bf16 models keep fp32 GEMMs plus packed bf16 weights, as where bf16 is emulated."""
    monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: False)


def _prompts(vocab: int, lengths=PROMPT_LENGTHS) -> list[dict]:
    g = torch.Generator().manual_seed(11)
    return [{"prompt_token_ids": torch.randint(0, vocab, (n,), generator=g).tolist()}
            for n in lengths]


def _vocab(llm) -> int:
    return runner_of(llm).model.config.vocab_size


def _spy(monkeypatch, compare: bool):
    """Record the rows of every native call; with `compare`, first run the Python layers
    (PreNormBlock.forward_deferred, as the model's forward does) on a copy of the stream
    from the same states, then put the states back, run the loop, and require equal bits
    in the stream, its final norm and every DeltaNet state."""
    rows = []
    real = HybridDecodeLayers.__call__

    def call(self, x, cos, sin, meta):
        model = self.model
        ref = ref_states = None
        if compare:
            before = [tuple(s.clone() for s in m.state) for m in model.state_layers()]
            ref, pending = x.clone(), None
            for layer in model.layers:  # (the same K/V to the same slots: harmless)
                ref, pending = layer.forward_deferred(ref, pending, cos, sin, model.rotary,
                                                      meta)
            ref_normed = model.norm.add_forward(ref, pending)
            ref_states = [tuple(s.clone() for s in m.state) for m in model.state_layers()]
            for m, saved in zip(model.state_layers(), before):
                for s, b in zip(m.state, saved):
                    s.copy_(b)
        out = real(self, x, cos, sin, meta)
        if compare:
            assert torch.equal(out, ref), "the stream differs from the Python layers'"
            assert torch.equal(model.norm(out), ref_normed)
            for m, states in zip(model.state_layers(), ref_states):
                for s, r in zip(m.state, states):
                    assert torch.equal(s, r), "a state differs from the Python layers'"
        rows.append(x.shape[0])
        return out

    monkeypatch.setattr(HybridDecodeLayers, "__call__", call)
    return rows


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_native_decode_layers_are_bit_identical(checkpoints, monkeypatch, widened, ops, name,
                                                dtype):
    """bf16 (packed bf16 linears) and fp32 (packed fp32 linears; the zero-centred and
    gated norms native in fp32 too); rows 1 to 4 (the team's loop) in varied mixes."""
    rows = _spy(monkeypatch, compare=True)
    llm = make_llm(checkpoints(name), dtype=dtype, max_num_seqs=4, max_model_len=64)
    loop = runner_of(llm).model.decode_layers
    assert (loop is not None) == ops.has_fast_linear_bf16
    params = [SamplingParams(max_tokens=5 + 3 * i, temperature=0.0, ignore_eos=True)
              for i in range(len(PROMPT_LENGTHS))]
    llm.generate(_prompts(_vocab(llm)), params, use_tqdm=False)
    if loop is not None:
        assert len(rows) > 10 and max(rows) == 4 and min(rows) == 1
        assert loop.num_calls == len(rows)
    else:
        assert rows == []


@pytest.mark.parametrize("kw", [dict(dtype="bfloat16"), dict(dtype="float32"),
                                dict(dtype="bfloat16", kv_cache_dtype="fp8"),
                                dict(dtype="bfloat16", quantization="int8"),
                                dict(dtype="float32", enable_prefix_caching=True)],
                         ids=["bf16", "fp32", "fp8_kv", "int8", "fp32_prefix_caching"])
def test_tokens_and_logprobs_equal_with_python_layers(checkpoints, monkeypatch, kw):
    """End to end on this CPU's own level: greedy tokens and their logprobs equal with
    and without the loop (decode_layers=False), incl. an fp8 KV cache (the loop's
    scales), int8 weights (linear_quant in the loop) and prefix caching (steps that
    write a state snapshot run the Python layers, the others the loop)."""
    rows = _spy(monkeypatch, compare=False)
    path = checkpoints("qwen3_5")
    results = []
    for decode_layers in (True, False):
        llm = make_llm(path, max_num_seqs=3, max_model_len=64, decode_layers=decode_layers,
                       **kw)
        outs = llm.generate(_prompts(_vocab(llm)),
                            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                           logprobs=2), use_tqdm=False)
        results.append([(o.outputs[0].token_ids,
                         [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
                        for o in outs])
        loop = runner_of(llm).model.decode_layers
        if decode_layers:
            if llm.llm_engine.platform.ops is None or loop is None:
                pytest.skip("no native loop on this CPU's level")
            assert rows and max(rows) == 3
            del rows[:]
        else:
            assert loop is None and rows == []
    assert results[0] == results[1]


def test_only_decode_steps_take_the_loop(checkpoints, monkeypatch, widened, ops):
    """Prompt chunks (here in chunks of 4 tokens) run the Python layers; the decode steps
    after the first token take the loop."""
    rows = _spy(monkeypatch, compare=False)
    llm = make_llm(checkpoints("qwen3_5"), dtype="bfloat16", max_num_batched_tokens=4,
                   max_model_len=64)
    if runner_of(llm).model.decode_layers is None:
        pytest.skip("no packed linears at this level")
    prompt = _prompts(_vocab(llm), [10])
    llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    assert rows == [1, 1, 1]


def test_not_used_without_native_kernels_or_for_moe(checkpoints, tmp_path, monkeypatch,
                                                     widened, ops):
    rows = _spy(monkeypatch, compare=False)
    path = checkpoints("qwen3_5")
    prompt = _prompts(300, [5])
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm = make_llm(path, dtype="float32", cpu_kernels="torch", max_model_len=64)
    assert runner_of(llm).model.decode_layers is None
    llm.generate(prompt, params, use_tqdm=False)
    # MoE layers are not in the loop: the model keeps its Python layers.
    moe = str(tmp_path / "moe")
    build_hybrid(moe, "qwen3_5_moe", dict(HYBRID, **MOE, tie_word_embeddings=False))
    llm = make_llm(moe, dtype="bfloat16", max_model_len=64)
    assert runner_of(llm).model.decode_layers is None
    llm.generate(prompt, params, use_tqdm=False)
    assert rows == []


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_speculative_verify_steps_are_bit_identical(checkpoints, monkeypatch, widened, dtype):
    """n-gram speculation: a verifying row's tokens run the DeltaNet layers token by token
    from read to write slots (StateMetadata.decode_steps); the loop's stream and every
    state slot equal the Python layers', and the output equals the plain engine's."""
    from tokenmill.platforms.cpu import CpuPlatform
    # Drafts at every batch size: the CPU's row budget would leave a batch without them.
    monkeypatch.setattr(CpuPlatform, "fast_decode_rows", property(lambda self: None))
    steps = []
    real_applies = HybridDecodeLayers.applies

    def applies(self, x, meta):
        ok = real_applies(self, x, meta)
        if ok and meta.state.decode_steps is not None:
            steps.append(len(meta.state.decode_steps))
        return ok

    monkeypatch.setattr(HybridDecodeLayers, "applies", applies)
    rows = _spy(monkeypatch, compare=True)
    path = checkpoints("qwen3_5")
    spec = make_llm(path, dtype=dtype, max_model_len=256, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    if runner_of(spec).model.decode_layers is None:
        pytest.skip("no packed linears at this level")
    # Half the token ids in each prompt, once each: about every other token the model
    # emits is found there, so the n-gram proposer drafts the prompt's next ids (mostly
    # rejected, some accepted).
    vocab = _vocab(spec)
    g = torch.Generator().manual_seed(4)
    prompts = [{"prompt_token_ids": torch.randperm(vocab, generator=g)[:vocab // 2].tolist()}
               for _ in range(3)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert steps and max(steps) > 1 and rows  # verify steps of several tokens a row ran
    plain = make_llm(path, dtype=dtype, max_model_len=256, decode_layers=False)
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params,
                                                                  use_tqdm=False)]


def test_fp32_models_take_the_zero_centred_and_gated_norm_kernels(checkpoints):
    """The zero-centred and gated norms have no fused ATen op (their PyTorch forms are 7-9
    ops, a pass over the rows each), so an fp32 model takes their kernels too
    (`native_fp32_norm`, the CPU platform's `fp32_norm`), in the Python layers and the
    loop alike; with cpu_kernels="torch" they stay PyTorch's."""
    from tokenmill.models.layers.gated_deltanet import GatedRMSNorm
    from tokenmill.models.qwen3_next import ZeroCenteredRMSNorm
    llm = make_llm(checkpoints("qwen3_5"), dtype="float32", max_model_len=64)
    platform = llm.llm_engine.platform
    if platform.ops is None:
        pytest.skip("no native CPU kernels")
    assert platform.norm == "torch" and platform.fp32_norm == "native"
    norms = [m for m in runner_of(llm).model.modules()
             if isinstance(m, (ZeroCenteredRMSNorm, GatedRMSNorm))]
    assert len(norms) == 4 * 2 + 3 + 2 + 1  # per layer 2; the DeltaNet's, q/k, final
    assert all(n._ops is platform.ops for n in norms)
    torch_llm = make_llm(checkpoints("qwen3_5"), dtype="float32", max_model_len=64,
                         cpu_kernels="torch")
    assert all(m._ops is None for m in runner_of(torch_llm).model.modules()
               if isinstance(m, (ZeroCenteredRMSNorm, GatedRMSNorm)))
