"""Decode steps run all Llama-family layers in one native call
(layers/decode_layers.py, kernels/cpu_decode_layers.cpp): bit-identical to the
Python layers, and only where every layer would take its native path.

Every test runs at each capability level this CPU runs (the layers' packed bf16
linears, and so this path, exist where the level's `has_fast_linear_bf16` says so;
elsewhere the Python layers run), with the GEMMs widened as on a CPU without native
bf16 (`widened`), so the packed path is tested whatever CPU the suite lands on. The
CPU platform (tokenmill/platforms/cpu.py) decides whether a model gets the loop; the
engine argument decode_layers=False turns it off."""
from __future__ import annotations

import pytest
import torch

from conftest import make_llm, runner_of
from tokenmill import SamplingParams
from tokenmill.platforms import cpu as cpu_platform
from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.models.layers.decode_layers import DecodeLayers


@pytest.fixture
def widened(monkeypatch):
    """bf16 models keep fp32 GEMMs plus packed bf16 weights, as where bf16 is emulated."""
    monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: False)


def _spy(monkeypatch, compare: bool):
    """Record the rows of every native call; with `compare`, also run the Python
    layers on a copy of the residual stream first and require equal bits."""
    rows = []
    real = DecodeLayers.__call__

    def call(self, x, cos, sin, meta, start=0, end=None, **taps):
        ref = None
        if compare:
            # The Python layers write the same K/V to the same slots: harmless.
            ref = x.clone()
            for layer in self.model.layers[start:end]:
                ref = layer(ref, cos, sin, self.model.rotary, meta)
        out = real(self, x, cos, sin, meta, start, end, **taps)
        if ref is not None:
            assert torch.equal(out, ref), "native decode layers differ from the Python layers"
        rows.append(x.shape[0])
        return out

    monkeypatch.setattr(DecodeLayers, "__call__", call)
    return rows


# q/k norm and head_dim != hidden / heads; q/k/v/o and MLP biases; qkv bias with tied
# embeddings; MQA with llama3 rope scaling; Qwen2 with a full and a sliding layer (two KV
# cache groups: one native call per group's run of layers).
@pytest.mark.parametrize("name", ["qwen3_headdim", "llama_bias", "qwen2_tied",
                                  "llama_mqa_llama3", "qwen2_swa"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_native_decode_layers_are_bit_identical(tiny_model_factory, monkeypatch, widened, ops,
                                                name, dtype):
    """bf16 (packed bf16 linears, native norms) and fp32 (packed fp32 linears,
    PyTorch's fp32 rms_norm called from C++)."""
    tm = tiny_model_factory(name)
    rows = _spy(monkeypatch, compare=True)
    llm = make_llm(tm.path, dtype=dtype, max_num_seqs=4)
    supported = runner_of(llm).model.decode_layers is not None
    assert supported == ops.has_fast_linear_bf16  # no packed linears without the fast kernel
    assert llm.llm_engine.platform.decode_layers == supported
    prompts = [{"prompt_token_ids": p} for p in tm.prompts[:6]]
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True)
              for i in range(6)]
    llm.generate(prompts, params, use_tqdm=False)
    if supported:
        assert len(rows) > 15 and max(rows) == 4 and min(rows) == 1
        runs = runner_of(llm).model.decode_layers._runs
        groups = {layer.self_attn.attn.kv_group for layer in runner_of(llm).model.layers}
        assert len(runs) == len(groups) == (2 if name == "qwen2_swa" else 1)
        if name == "qwen2_swa":  # layer 0 full, layer 1 sliding (window 12)
            assert [(r[0], r[1], r[3]) for r in runs] == [(0, 1, None), (1, 2, 12)]
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
    del rows[:]
    python = make_llm(tm.path, dtype="bfloat16", max_num_seqs=3, decode_layers=False)
    assert runner_of(python).model.decode_layers is None
    assert not python.llm_engine.platform.decode_layers
    assert with_native == [o.outputs[0].token_ids for o in python.generate(prompts, params,
                                                                             use_tqdm=False)]
    assert rows == []  # decode_layers=False: the C++ loop never ran


def test_not_used_where_a_layer_would_not_go_native(tiny_model_factory, monkeypatch, widened,
                                                    ops):
    rows = _spy(monkeypatch, compare=False)
    tm = tiny_model_factory("qwen3_headdim")
    prompt = [{"prompt_token_ids": tm.prompts[0]}]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    make_llm(tm.path, dtype="float32", cpu_kernels="torch").generate(prompt, params,
                                                                      use_tqdm=False)
    assert rows == []  # no native kernels: PyTorch layers
    # Prefill steps (the prompt, here in two chunks) take the Python layers too: only
    # the 3 decode steps after the first token come through.
    llm = make_llm(tm.path, dtype="bfloat16", max_num_batched_tokens=8)
    llm.generate(prompt, params, use_tqdm=False)
    assert rows == ([1, 1, 1] if ops.has_fast_linear_bf16 else [])


def test_used_where_bf16_gemms_are_native(tiny_model_factory, monkeypatch):
    """A CPU with AVX512-BF16 / AMX keeps oneDNN's bf16 GEMMs for large inputs, but its
    decode-sized inputs take the packed kernel, so decode steps take the native loop
    too, with the Python layers' tokens."""
    monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: True)
    tm = tiny_model_factory("qwen3_headdim")
    llm = make_llm(tm.path, dtype="bfloat16", max_num_seqs=3)
    if not llm.llm_engine.platform.ops.has_fast_linear_bf16:
        pytest.skip("this level's kernels have no packed linear")
    assert runner_of(llm).model.decode_layers is not None
    assert llm.llm_engine.platform.decode_layers
    python = make_llm(tm.path, dtype="bfloat16", max_num_seqs=3, decode_layers=False)
    assert runner_of(python).model.decode_layers is None
    prompts = [{"prompt_token_ids": p} for p in tm.prompts[:3]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = [[o.outputs[0].token_ids for o in m.generate(prompts, params, use_tqdm=False)]
              for m in (llm, python)]
    assert tokens[0] == tokens[1]


def test_moe_layers_are_not_supported(tmp_path, widened, ops):
    from conftest import build_checkpoint
    build_checkpoint(str(tmp_path), "qwen3_moe", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        decoder_sparse_step=1, mlp_only_layers=[]))
    llm = make_llm(str(tmp_path), dtype="bfloat16")
    # The platform would run the loop (a dense model would get it); the MoE model cannot.
    assert llm.llm_engine.platform.decode_layers == ops.has_fast_linear_bf16
    model = runner_of(llm).model
    assert model.decode_layers is None
    assert not DecodeLayers(model, ops, 128).supported


# ---- quantized linears (GPTQ, AWQ, --quantization int8 / fp8): linear_quant --------

QUANTIZED = {
    # act-order (each linear's inputs permuted first), 4-bit, asymmetric
    "gptq_int4_descact": ("qwen3_headdim", "gptq", dict(bits=4, group_size=32, sym=False,
                                                        desc_act=True)),
    # 8-bit, one group per row; attention and MLP biases
    "gptq_int8_gall": ("llama_bias", "gptq", dict(bits=8, group_size=-1, sym=True)),
    "awq_int4_g32": ("qwen3_headdim", "awq", dict(group_size=32)),
    # the attention projections kept bf16: packed float and integer linears in one layer
    "gptq_int4_mlp_only": ("qwen3_headdim", "gptq", dict(bits=4, group_size=16, keep=(
        "model.layers.0.self_attn", "model.layers.1.self_attn"))),
}


def _quantized_checkpoint(tiny_model_factory, tmp_path, case: str) -> str:
    from tokenmill.models import quant_formats
    name, fmt, kw = QUANTIZED[case]
    write = {"gptq": quant_formats.write_gptq_checkpoint,
             "awq": quant_formats.write_awq_checkpoint}[fmt]
    write(tiny_model_factory(name).path, str(tmp_path), return_dequantized=False, **kw)
    return str(tmp_path)


def _quantized_linears(model) -> int:
    from tokenmill.models.layers.decode_layers import _linears, _native_quantized
    return sum(_native_quantized(lin) is not None for layer in model.layers
               for lin in _linears(layer))


@pytest.mark.parametrize("case", list(QUANTIZED) + ["int8_at_load", "fp8_at_load"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_quantized_linears_take_the_native_loop(tiny_model_factory, tmp_path, monkeypatch,
                                                widened, ops, case, dtype):
    """Quantized checkpoints (and --quantization int8) keep the native loop: its
    linear_quant calls (act-order permutation, biases, packed float linears beside
    integer ones) are bit-identical to the Python layers'."""
    if case.endswith("_at_load"):
        path = tiny_model_factory("qwen3_headdim").path
        kw = dict(quantization=case.split("_")[0])
    else:
        path, kw = _quantized_checkpoint(tiny_model_factory, tmp_path, case), {}
    rows = _spy(monkeypatch, compare=True)
    llm = make_llm(path, dtype=dtype, max_num_seqs=4, **kw)
    model = runner_of(llm).model
    # The loop exists where the quantized kernel does (and, with float linears left,
    # the packed float kernel too).
    native = hasattr(ops, "linear_quant") and (case != "gptq_int4_mlp_only"
                                               or ops.has_fast_linear_bf16)
    assert (model.decode_layers is not None) == native
    if native:
        expected = 2 * 2 + 2 * 2 if case != "gptq_int4_mlp_only" else 2 * 2
        assert _quantized_linears(model) == expected
    prompts = [{"prompt_token_ids": p} for p in tiny_model_factory("qwen3_headdim").prompts[:5]]
    params = [SamplingParams(max_tokens=5 + 2 * i, temperature=0.0, ignore_eos=True)
              for i in range(5)]
    llm.generate(prompts, params, use_tqdm=False)
    if native:
        assert len(rows) > 10 and max(rows) == 4 and min(rows) == 1
    else:
        assert rows == []


def test_quantized_loop_rows_follow_the_quantized_kernels_limit(tiny_model_factory, tmp_path,
                                                                monkeypatch, widened, ops):
    """Steps with more rows than the quantized linears' native limit would take their
    dequantized tiles in the Python layers: the loop leaves those steps to them."""
    if not hasattr(ops, "linear_quant"):
        pytest.skip("this level has no quantized kernel")
    monkeypatch.setattr(cpu_platform, "DEFAULT_QUANTIZED_ROWS", 2)  # GEMMs widened: this
    monkeypatch.setattr(cpu_platform, "DEFAULT_QUAD_QUANTIZED_ROWS", 2)  # bf16 at avx512_vnni
    path = _quantized_checkpoint(tiny_model_factory, tmp_path, "gptq_int4_descact")
    rows = _spy(monkeypatch, compare=True)
    llm = make_llm(path, dtype="bfloat16", max_num_seqs=4)
    assert llm.llm_engine.platform.quantized_max_rows == 2
    loop = runner_of(llm).model.decode_layers
    assert loop is not None and loop.max_rows == 2
    prompts = [{"prompt_token_ids": p} for p in tiny_model_factory("qwen3_headdim").prompts[:4]]
    # 4 rows at first (the Python layers), then 2 and 1 as requests finish (the loop)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (3, 5, 9, 12)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert rows and max(rows) <= 2 and len(rows) < 11
    python = make_llm(path, dtype="bfloat16", max_num_seqs=4, decode_layers=False)
    ref = python.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


@pytest.mark.parametrize("taps", [(1,), (0, 1), (1, 0, 2)])
def test_drafter_taps_keep_the_native_loop(tiny_model_factory, monkeypatch, widened, ops, taps):
    """A drafter's taps of the residual stream (EAGLE-3, DFlash) keep the native loop
    whole: one call per decode step, which copies the tapped layers' inputs itself
    (splitting the loop at the taps cost a call, a copy and the dispatch around them
    per tap, every step); the same tokens and bit-identical taps as the Python layers
    (2 = past the last layer: the final normed output)."""
    tm = tiny_model_factory("qwen3_headdim")
    calls = []
    real = DecodeLayers.__call__

    def spy(self, x, cos, sin, meta, start=0, end=None, taps=None, tap_ids=()):
        calls.append((start, end, tuple(tap_ids)))
        return real(self, x, cos, sin, meta, start, end, taps, tap_ids)

    monkeypatch.setattr(DecodeLayers, "__call__", spy)
    prompts = [{"prompt_token_ids": p} for p in tm.prompts[:3]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs, taps_seen = [], []
    for native in (True, False):
        llm = make_llm(tm.path, dtype="bfloat16", max_num_seqs=3, decode_layers=native)
        runner_of(llm).model.aux_layer_ids = taps
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)])
        taps_seen.append(runner_of(llm).model.aux_hidden)
    assert outs[0] == outs[1]
    assert torch.equal(taps_seen[0], taps_seen[1])
    assert taps_seen[0].shape[1] == len(taps) * 64
    if ops.has_fast_linear_bf16:
        assert calls and set(calls) == {(0, None, taps)}
    else:
        assert calls == []


# ---- Gemma 3: several KV cache groups, two rope tables, Gemma's norms and MLP ----------

def _spy_gemma(monkeypatch, compare: bool):
    """As _spy, for the Gemma loop: the Python layers on a copy first, equal bits."""
    from tokenmill.models.layers.gemma_decode_layers import GemmaDecodeLayers
    rows = []
    real = GemmaDecodeLayers.__call__

    def call(self, x, cos_sin, meta):
        ref = None
        if compare:
            ref = x.clone()
            for layer in self.model.layers:
                cos, sin = cos_sin[layer.kind]
                ref = layer(ref, cos, sin, self.model.rotary[layer.kind], meta)
        out = real(self, x, cos_sin, meta)
        if ref is not None:
            assert torch.equal(out, ref), "native Gemma layers differ from the Python layers"
        rows.append(x.shape[0])
        return out

    monkeypatch.setattr(GemmaDecodeLayers, "__call__", call)
    return rows


def _staggered_decode_ran_native(llm, loop, rows) -> bool:
    """Six prompts past the window (12) and within it, finishing at different steps, so
    decode batches shrink from 4 rows to 1. With a native loop: every decode step ran
    it (the model's own count agrees with the spy's rows); without: none did."""
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(1, 384, (n,), generator=g).tolist()}
               for n in (5, 17, 33, 8, 40, 12)]
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True)
              for i in range(6)]
    llm.generate(prompts, params, use_tqdm=False)
    if loop is None:
        assert rows == []
        return False
    assert len(rows) > 15 and max(rows) == 4 and min(rows) == 1
    assert loop.num_calls == len(rows)
    return True


@pytest.fixture(scope="module")
def gemma3_capped(tmp_path_factory):
    """Gemma 3 with attention soft-capping (tight, so it bites), qkv bias, two local
    layers per global one (three KV cache groups)."""
    from conftest import build_checkpoint
    path = str(tmp_path_factory.mktemp("gemma3_capped"))
    build_checkpoint(path, "gemma3", dict(
        num_hidden_layers=3, head_dim=32, sliding_window=12, sliding_window_pattern=3,
        query_pre_attn_scalar=24, attn_logit_softcapping=2.0, attention_bias=True,
        final_logit_softcapping=30.0, tie_word_embeddings=True))
    return path


@pytest.mark.parametrize("model", ["gemma3", "gemma3_capped"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gemma3_native_decode_layers_are_bit_identical(tiny_model_factory, gemma3_capped,
                                                       monkeypatch, widened, ops, model, dtype):
    path = gemma3_capped if model == "gemma3_capped" else tiny_model_factory(model).path
    rows = _spy_gemma(monkeypatch, compare=True)
    llm = make_llm(path, dtype=dtype, max_num_seqs=4)
    loop = runner_of(llm).model.decode_layers
    assert (loop is not None) == ops.has_fast_linear_bf16
    assert llm.llm_engine.platform.decode_layers == (loop is not None)
    if _staggered_decode_ran_native(llm, loop, rows):
        if model == "gemma3_capped":
            assert loop.softcap == 2.0 and len(set(loop._group_ids)) == 3


def test_gemma3_tokens_equal_with_python_layers(tiny_model_factory, monkeypatch, widened, ops):
    tm = tiny_model_factory("gemma3")
    prompts = [{"prompt_token_ids": p} for p in tm.prompts]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    rows = _spy_gemma(monkeypatch, compare=False)
    native = make_llm(tm.path, dtype="bfloat16", max_num_seqs=3)
    with_native = [o.outputs[0].token_ids for o in native.generate(prompts, params,
                                                                     use_tqdm=False)]
    assert bool(rows) == ops.has_fast_linear_bf16
    del rows[:]
    python = make_llm(tm.path, dtype="bfloat16", max_num_seqs=3, decode_layers=False)
    assert runner_of(python).model.decode_layers is None
    assert with_native == [o.outputs[0].token_ids for o in python.generate(prompts, params,
                                                                             use_tqdm=False)]
    assert rows == []


# ---- Gemma 4: per-layer shapes, k = v, KV sharing, per-layer inputs, layer_scalar -----

def _spy_gemma4(monkeypatch, compare: bool):
    """As _spy_gemma, for the Gemma 4 loop (its layers take the step's shared K/V and
    their per-layer inputs)."""
    from tokenmill.models.layers.gemma_decode_layers import Gemma4DecodeLayers
    rows = []
    real = Gemma4DecodeLayers.__call__

    def call(self, x, cos_sin, meta, per_layer=None):
        ref = None
        if compare:
            ref, shared_kv = x.clone(), {}
            for i, layer in enumerate(self.model.layers):
                cos, sin = cos_sin[layer.kind]
                ref = layer(ref, cos, sin, self.model.rotary[layer.kind], meta, shared_kv,
                            per_layer[:, i] if per_layer is not None else None)
        out = real(self, x, cos_sin, meta, per_layer)
        if ref is not None:
            assert torch.equal(out, ref), "native Gemma 4 layers differ from the Python layers"
        rows.append(x.shape[0])
        return out

    monkeypatch.setattr(Gemma4DecodeLayers, "__call__", call)
    return rows


@pytest.fixture(scope="module")
def gemma4_dense_all(tmp_path_factory):
    """Every dense Gemma 4 feature the loop takes: per-layer inputs, k = v on the global
    layers (one KV head), 3 of 6 layers KV-shared with double-wide MLPs, q/k/v/o bias."""
    from conftest import GEMMA4, GEMMA4_PLE, build_checkpoint
    path = str(tmp_path_factory.mktemp("gemma4_dense_all"))
    build_checkpoint(path, "gemma4", dict(
        GEMMA4, **GEMMA4_PLE, num_hidden_layers=6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        attention_k_eq_v=True, num_global_key_value_heads=1, num_kv_shared_layers=3,
        use_double_wide_mlp=True, attention_bias=True))
    return path


@pytest.mark.parametrize("model", ["gemma4", "gemma4_dense_all"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gemma4_native_decode_layers_are_bit_identical(tiny_model_factory, gemma4_dense_all,
                                                       monkeypatch, widened, ops, model, dtype):
    path = gemma4_dense_all if model == "gemma4_dense_all" else tiny_model_factory(model).path
    rows = _spy_gemma4(monkeypatch, compare=True)
    llm = make_llm(path, dtype=dtype, max_num_seqs=4)
    loop = runner_of(llm).model.decode_layers
    assert (loop is not None) == ops.has_fast_linear_bf16
    if _staggered_decode_ran_native(llm, loop, rows):
        if model == "gemma4_dense_all":  # shared layers: their source's cache and group
            layers = loop.model.layers
            assert layers[3].self_attn.attn.kv_cache is layers[1].self_attn.attn.kv_cache
            assert loop._info[3 * 9 + 7] == 1 and loop._info[2 * 9 + 6] == 1  # shared, k = v


def test_gemma4_tokens_equal_with_python_layers(gemma4_dense_all, monkeypatch, widened, ops):
    from conftest import make_prompts
    prompts = [{"prompt_token_ids": p} for p in make_prompts([5, 17, 33, 8, 70], 384)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
    rows = _spy_gemma4(monkeypatch, compare=False)
    native = make_llm(gemma4_dense_all, dtype="float32", max_num_seqs=3)
    outs = native.generate(prompts, params, use_tqdm=False)
    assert bool(rows) == ops.has_fast_linear_bf16
    del rows[:]
    python = make_llm(gemma4_dense_all, dtype="float32", max_num_seqs=3, decode_layers=False)
    assert runner_of(python).model.decode_layers is None
    for a, b in zip(outs, python.generate(prompts, params, use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob
    assert rows == []


def test_gemma4_moe_keeps_its_python_layers(tiny_model_factory, widened, ops):
    llm = make_llm(tiny_model_factory("gemma4_moe_keqv").path, dtype="bfloat16")
    assert runner_of(llm).model.decode_layers is None
