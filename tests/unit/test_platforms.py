"""The CPU platform (tokenmill/platforms/cpu.py): the one place that decides which
kernels run, from the CPU's capabilities and the engine arguments, and hands the
decisions to the layers at load.

The choices are checked at every capability level this CPU runs (`kernel_level`
forces each with kernels.capability_override; a level it cannot run is skipped
with its name), on a CPU without native bf16 (`widened`: the packed path) and
with it, and with the plain PyTorch kernels. The kernels' own abilities
(`has_fast_linear_bf16`, `has_greedy_lm_head`) are read from the level's module,
so the expectations hold whichever levels have which kernels.
"""
from __future__ import annotations

import json
import logging

import pytest
import torch

from conftest import make_llm, runner_of
from tokenmill import SamplingParams, kernels
from tokenmill.platforms import cpu as cpu_platform
from tokenmill.platforms import CudaPlatform, create_platform
from tokenmill.platforms.cpu import CpuPlatform, check_cpu_args
from tokenmill.engine.engine_args import EngineArgs
from tokenmill.entrypoints.cli import main
from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.models.layers.decode_layers import DecodeLayers
from tokenmill.models.layers.greedy_head import GreedyHead
from tokenmill.models.layers.linear import ALL_ROWS, Linear
from tokenmill.models.layers.linear_methods import (OneDNNPrepackedLinearMethod,
                                                    PackedBf16FusedMoEMethod,
                                                    PackedBf16LinearMethod)
from tokenmill.models.layers.mlp import GatedMLP
from tokenmill.models.layers.norm import RMSNorm

BF16, FP32 = torch.bfloat16, torch.float32


def below_avx512(level: str) -> bool:
    levels = kernels.all_levels()
    return "avx512" in levels and levels.index(level) < levels.index("avx512")


@pytest.fixture
def widened(monkeypatch):
    """A CPU without native bf16 GEMMs (as the bench machine's Xeon)."""
    monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: False)


@pytest.fixture
def native_bf16(monkeypatch):
    """A CPU with AVX512-BF16 (without AMX: test_amx_cpu_keeps_onednn_below_the_amx_level)."""
    monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(cpu_platform, "cpu_has_amx", lambda: False)


@pytest.fixture
def no_cpu_ops(monkeypatch):
    """Any call of kernels.cpu_ops fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("cpu_ops() was called")
    monkeypatch.setattr(kernels, "cpu_ops", refuse)


# ---- the choices, per capability level ---------------------------------------------
def test_bf16_model_without_native_bf16(ops, kernel_level, widened):
    p = CpuPlatform.create("cpu", BF16)
    fast, screen = ops.has_fast_linear_bf16, ops.has_greedy_lm_head
    assert p.capability == kernel_level and p.ops is ops and p.kernels == "native"
    assert p.model_dtype == "bfloat16" and p.gemm_dtype == "float32" and p.widen_to == FP32
    assert p.linear == ("packed_bf16" if fast else "torch")
    # Packed, the kernel takes every input and the packed bf16 weights are the only copy.
    assert p.linear_bf16_max_rows == (ALL_ROWS if fast else 0)
    assert p.weights == ("packed bf16 only" if fast else "fp32 copy")
    assert p.gemm == "torch"  # no bf16 weights kept for oneDNN where it emulates bf16
    assert p.lm_head == ("greedy_int8" if fast and screen else "full")
    assert p.greedy_head_max_rows == (4 if fast and screen else 0)
    assert p.decode_layers == fast
    assert (p.attention, p.norm, p.activation) == ("native",) * 3
    assert p.capability_forced == (kernel_level != kernels.runnable_levels()[-1])


def test_bf16_model_with_native_bf16(ops, kernel_level, native_bf16):
    """bf16 GEMMs stay bf16 (oneDNN's, native), the packed kernel takes the decode-sized
    inputs, unless the level is forced below avx512, which takes an AVX2 CPU's path:
    fp32 math and, where the level has it, packed weights only."""
    p = CpuPlatform.create("cpu", BF16)
    fast = ops.has_fast_linear_bf16
    assert p.linear == ("packed_bf16" if fast else "torch")
    if below_avx512(kernel_level):
        assert p.gemm_dtype == "float32"
        assert p.linear_bf16_max_rows == (ALL_ROWS if fast else 0)
    elif getattr(ops, "has_bf16_dot_gemm", False):
        # The packed kernel's many-row path on vdpbf16ps (avx512_bf16) keeps pace with
        # oneDNN's bf16 GEMM: it takes every input and no oneDNN copy is kept.
        assert p.gemm_dtype == "bfloat16" and p.widen_to is None
        assert p.linear_bf16_max_rows == ALL_ROWS and p.gemm == "torch"
        assert p.weights == "packed bf16 only" and p.decode_layers
        assert "linear packed_bf16 every input, weights packed bf16 only" in p.describe()
        # The engine argument still keeps the oneDNN copy for the larger inputs.
        q = CpuPlatform.create("cpu", BF16, linear_bf16_max_rows=8)
        onednn = cpu_platform.onednn_prepack_works(BF16)
        assert q.linear_bf16_max_rows == 8
        assert q.gemm == ("onednn_prepacked" if onednn else "torch")
        assert "packed_bf16 up to 8 rows" in q.describe()
    else:
        assert p.gemm_dtype == "bfloat16" and p.widen_to is None
        assert p.linear_bf16_max_rows == (cpu_platform.DEFAULT_NATIVE_BF16_PACKED_ROWS
                                          if fast else 0)
        # The larger inputs take oneDNN's GEMM over prepacked weights where this torch
        # build has it (the plain bf16 weights otherwise).
        onednn = cpu_platform.onednn_prepack_works(BF16)
        assert p.gemm == ("onednn_prepacked" if onednn else "torch")
        dense = "bfloat16 prepacked for oneDNN" if onednn else "bfloat16 (the model's)"
        assert p.weights == ("packed bf16 + " + dense if fast else dense)
        assert p.decode_layers == fast
    assert (p.attention, p.norm, p.activation) == ("native",) * 3


def test_fp32_model(ops, kernel_level, widened):
    p = CpuPlatform.create("cpu", FP32)
    assert p.gemm_dtype == "float32" and p.widen_to is None
    # fp32 activations: decode-sized inputs take the packed fp32 kernel (where the level
    # vectorises it), larger ones oneDNN's GEMM over prepacked weights (where this torch
    # build has it); RMSNorm stays PyTorch's.
    packed = ops.has_fast_linear_bf16
    assert p.linear == ("packed_f32" if packed else "torch")
    onednn = cpu_platform.onednn_prepack_works(FP32)
    assert p.gemm == ("onednn_prepacked" if onednn else "torch")
    assert p.weights.endswith("float32 prepacked for oneDNN" if onednn else "(the model's)")
    assert p.linear_f32_max_rows == (cpu_platform.DEFAULT_F32_PACKED_ROWS if packed else 0)
    # The int8-screened greedy head over the packed fp32 lm_head.
    assert (p.lm_head, p.norm) == ("greedy_int8" if packed else "full", "torch")
    assert p.greedy_head_max_rows == (cpu_platform.DEFAULT_GREEDY_HEAD_MAX_ROWS if packed else 0)
    assert p.decode_layers == packed  # the native loop serves packed fp32 linears too
    assert (p.attention, p.activation) == ("native", "native")
    assert ("packed_f32" in p.describe()) == packed


def test_cpu_capability_argument_picks_the_level(kernel_level, widened):
    best = kernels.runnable_levels()[-1]
    p = CpuPlatform.create("cpu", BF16, cpu_capability=kernel_level.upper())
    assert p.capability == kernel_level
    assert p.capability_forced == (kernel_level != best)
    ops = kernels.cpu_ops(kernel_level)
    assert p.ops is ops
    if ops is not None:
        assert ops.capability == kernel_level
        assert ("forced" in p.describe()) == (kernel_level != best)


def test_cpu_kernels_torch_never_touches_the_native_kernels(kernel_level, widened, no_cpu_ops):
    p = CpuPlatform.create("cpu", BF16, cpu_kernels="torch")
    assert p.ops is None and p.kernels == "torch"
    assert (p.linear, p.attention, p.norm, p.activation, p.lm_head, p.decode_layers) == (
        "torch", "torch", "torch", "torch", "full", False)
    # The GEMM dtype rule does not depend on the kernels: the CPU has no native bf16.
    assert p.gemm_dtype == "float32" and p.capability == kernel_level


def test_cpu_kernels_native_needs_the_kernels(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_ops", lambda level=None: None)  # no compiler
    assert CpuPlatform.create("cpu", BF16).kernels == "torch"  # auto: PyTorch then
    with pytest.raises(ValueError, match="cpu_kernels='native'.*not available"):
        CpuPlatform.create("cpu", BF16, cpu_kernels="native")


def test_arguments_that_turn_kernels_off(ops, kernel_level, widened):
    if not ops.has_fast_linear_bf16:
        pytest.skip(f"the {kernel_level} kernels have no fast packed linear")
    no_linear = CpuPlatform.create("cpu", BF16, linear_bf16_max_rows=0)
    # Nothing packed: no screen and no decode loop either (both need the packed weights).
    assert (no_linear.linear, no_linear.lm_head, no_linear.decode_layers) == (
        "torch", "full", False)
    few = CpuPlatform.create("cpu", BF16, linear_bf16_max_rows=2, greedy_head_max_rows=4)
    assert few.linear_bf16_max_rows == 2 and few.weights == "packed bf16 + fp32 copy"
    assert few.greedy_head_max_rows == (2 if ops.has_greedy_lm_head else 0)
    off = CpuPlatform.create("cpu", BF16, greedy_head_max_rows=0, decode_layers=False)
    assert off.linear == "packed_bf16"
    assert (off.lm_head, off.greedy_head_max_rows, off.decode_layers) == ("full", 0, False)


def test_not_a_cpu_device(no_cpu_ops):
    p = CpuPlatform.create("meta", BF16)
    assert p.capability is None and p.ops is None and p.gemm_dtype == "bfloat16"
    assert (p.linear, p.attention, p.lm_head, p.decode_layers) == ("torch", "torch", "full",
                                                                   False)
    assert not p.cuda_graphs
    assert "not a CPU device" in p.describe()


def test_cuda_device_decisions(no_cpu_ops, monkeypatch):
    """CUDA (decided without a GPU: only imports are looked at): Triton attention and
    decode graphs where triton imports, fla where it imports; --enforce-eager and a
    missing triton turn the graphs off; no CPU kernel anywhere."""
    from tokenmill.platforms import cuda as cuda_platform
    have = {"triton": True, "fla": False}
    monkeypatch.setattr(cuda_platform, "module_available", lambda name: have[name])
    p = create_platform("cuda", BF16)
    assert isinstance(p, CudaPlatform)
    assert (p.attention, p.linear_attention, p.cuda_graphs) == ("triton", "torch", True)
    assert (p.linear, p.lm_head, p.decode_layers, p.ops) == ("torch", "full", False, None)
    assert p.gemm_dtype == "bfloat16" and "CUDA graphs" in p.describe()
    assert not create_platform("cuda", BF16, enforce_eager=True).cuda_graphs
    have.update(triton=False, fla=True)
    p = create_platform("cuda", BF16)
    assert (p.attention, p.linear_attention, p.cuda_graphs) == ("torch", "fla", False)
    assert "eager (no Triton)" in p.describe()
    # an fp32 model keeps the exact PyTorch Gated DeltaNet (fla may multiply in TF32)
    assert create_platform("cuda", torch.float32).linear_attention == "torch"


def test_amx_cpu_keeps_onednn_below_the_amx_level(ops, kernel_level, monkeypatch):
    """On a CPU with AMX, oneDNN's bf16 GEMM runs on the tiles: the packed kernel takes
    every input only at a level that multiplies on them too (amx); at avx512_bf16
    (forced there) vdpbf16ps is 5-10x behind at batch, so the oneDNN copy serves the
    larger inputs."""
    monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(cpu_platform, "cpu_has_amx", lambda: True)
    if below_avx512(kernel_level) or not getattr(ops, "has_bf16_dot_gemm", False):
        pytest.skip("the level has no many-row dot-product path")
    p = CpuPlatform.create("cpu", BF16)
    if ops.has_amx_gemm:
        assert p.linear_bf16_max_rows == ALL_ROWS and p.weights == "packed bf16 only"
    else:
        assert p.linear_bf16_max_rows == cpu_platform.DEFAULT_NATIVE_BF16_PACKED_ROWS
        assert p.gemm == ("onednn_prepacked" if cpu_platform.onednn_prepack_works(BF16)
                          else "torch")
    monkeypatch.setattr(cpu_platform, "cpu_has_amx", lambda: False)  # AVX512-BF16 only
    assert CpuPlatform.create("cpu", BF16).linear_bf16_max_rows == ALL_ROWS


def test_amx_detection(monkeypatch):
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert not cpu_platform.cpu_has_amx()
    monkeypatch.setattr(kernels, "_cpu_flags",
                        lambda: frozenset({"avx512_bf16", "amx_tile", "amx_bf16"}))
    assert cpu_platform.cpu_has_amx()
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: None)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not cpu_platform.cpu_has_amx()


def test_native_bf16_detection(monkeypatch):
    """From the CPU flags (tokenmill.kernels reads /proc/cpuinfo once); without that
    file (macOS, Windows), from torch's own probes."""
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert not cpu_platform.cpu_has_native_bf16()
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))
    assert cpu_platform.cpu_has_native_bf16()
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: None)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not cpu_platform.cpu_has_native_bf16()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert cpu_platform.cpu_has_native_bf16()


def test_as_dict_and_describe(ops, widened):
    p = CpuPlatform.create("cpu", BF16)
    d = json.loads(json.dumps(p.as_dict()))  # JSON-ready
    assert "ops" not in d and d["description"] == p.describe()
    for key in ("capability", "runnable_levels", "cpu_bf16", "gemm_dtype", "linear",
                "attention", "norm", "activation", "lm_head", "decode_layers", "cpu_kernels"):
        assert key in d, key
    assert d["capability"] == ops.capability and d["runnable_levels"] == kernels.runnable_levels()
    text = p.describe()
    assert "\n" not in text and ops.capability in text and f"GEMMs in {p.gemm_dtype}" in text
    assert f"linear {p.linear}" in text and "lm_head" in text and "decode layers" in text


def test_describe_names_the_fp32_norms(ops):
    """An fp32 model: RMSNorm keeps ATen's op ("norm torch"), the zero-centred and gated
    norms take the native kernel (`fp32_norm`); the log line says both. bf16: one word."""
    f32 = CpuPlatform.create("cpu", torch.float32)
    assert (f32.norm, f32.fp32_norm) == ("torch", "native")
    assert "norm torch (zero-centred and gated norms native)," in f32.describe()
    bf16 = CpuPlatform.create("cpu", BF16)
    assert (bf16.norm, bf16.fp32_norm) == ("native", "native")
    assert "norm native, activation" in bf16.describe()
    torch_paths = CpuPlatform.create("cpu", torch.float32, cpu_kernels="torch")
    assert "norm torch, activation" in torch_paths.describe()


# ---- bad argument values --------------------------------------------------------------
@pytest.mark.parametrize("kwargs, name", [
    (dict(cpu_kernels="fast"), "cpu_kernels"),
    (dict(cpu_kernels=None), "cpu_kernels"),
    (dict(cpu_capability="sse9"), "cpu_capability"),
    (dict(cpu_capability=2), "cpu_capability"),
    (dict(linear_bf16_max_rows=-1), "linear_bf16_max_rows"),
    (dict(linear_bf16_max_rows=1.5), "linear_bf16_max_rows"),
    (dict(linear_bf16_max_rows=True), "linear_bf16_max_rows"),
    (dict(greedy_head_max_rows=-1), "greedy_head_max_rows"),
    (dict(greedy_head_max_rows=129), "greedy_head_max_rows"),  # the kernel's limit is 128
    (dict(greedy_head_max_rows="4"), "greedy_head_max_rows"),
    (dict(decode_layers="no"), "decode_layers"),
])
def test_bad_values_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        check_cpu_args(**kwargs)
    with pytest.raises(ValueError, match=name):
        EngineArgs(model="unused", **kwargs).validate()
    with pytest.raises(ValueError, match=name):
        CpuPlatform.create("cpu", BF16, **kwargs)


def test_a_level_the_cpu_cannot_run_is_refused(monkeypatch):
    monkeypatch.setattr(kernels, "runnable_levels", lambda: ["default"])
    top = kernels.all_levels()[-1]
    if top == "default":
        pytest.skip("this architecture has one level only")
    with pytest.raises(ValueError, match=f"cpu_capability='{top}': this CPU cannot run"):
        check_cpu_args(cpu_capability=top)
    assert check_cpu_args(cpu_capability=" Default ") == "default"


def test_bad_values_on_the_command_line(llama_tiny, capsys):
    assert main(["generate", "--model", llama_tiny.path, "--prompt", "x",
                 "--linear-bf16-max-rows", "-3"]) == 2
    assert "linear_bf16_max_rows must be None (auto) or an int >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", llama_tiny.path, "--prompt", "x", "--cpu-kernels", "fast"])
    assert "--cpu-kernels: invalid choice: 'fast'" in capsys.readouterr().err


# ---- the engine arguments reach the platform and the layers -------------------------
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _generate(llm, tm, n=3):
    outs = llm.generate([{"prompt_token_ids": p} for p in tm.prompts[:n]], GREEDY,
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _handed(module, ops) -> bool:
    """Whether a layer that takes kernels at load got `ops` (None: the PyTorch ops);
    True for every other module."""
    if isinstance(module, RMSNorm) or hasattr(module, "set_qk_norm_rope"):
        return module._ops is ops
    if isinstance(module, GatedMLP):
        return module.act_and_mul == (ops.silu_mul if ops is not None
                                      else module._torch_act_and_mul)
    return True


def test_layers_get_the_platform_at_load(tiny_model_factory, ops, kernel_level, widened,
                                         monkeypatch):
    tm = tiny_model_factory("qwen3_headdim")
    # (no prefix cache: the second generate below must compute exactly what the first
    # did; a cached prompt's last row takes the decode kernel, whose bf16 rounding
    # differs from the prefill kernel's, e.g. avx512_bf16's bf16 P)
    llm = make_llm(tm.path, dtype="bfloat16", max_num_seqs=4, linear_bf16_max_rows=16,
                   enable_prefix_caching=False)
    platform = llm.llm_engine.platform
    runner = runner_of(llm)
    assert platform is llm.llm_engine.engine_core.platform is runner.platform
    assert platform.ops is ops
    assert {b.name for b in runner.attn_backends.values()} == {"cpu_native"}
    assert all(b.ops is ops for b in runner.attn_backends.values())
    assert all(layer.impl.ops is ops for layer in runner.attention_layers().values())
    model = runner.model
    packed = platform.linear == "packed_bf16"
    for m in model.modules():
        assert _handed(m, ops)
        if isinstance(m, Linear):
            assert m.weight.dtype == FP32 and not m.weight.is_meta
            assert (m.method.packed_dtype == BF16) == packed
            assert m.method.max_rows == (16 if packed else 0)
    assert (model.decode_layers is not None) == platform.decode_layers
    reference = _generate(llm, tm)
    # Decided once: the hot path never asks tokenmill.kernels again.
    monkeypatch.setattr(kernels, "cpu_ops", lambda *a, **k: pytest.fail("cpu_ops() per call"))
    assert _generate(llm, tm) == reference


def test_decode_layers_argument(tiny_model_factory, ops, kernel_level, widened, monkeypatch):
    if not ops.has_fast_linear_bf16:
        pytest.skip(f"the {kernel_level} kernels have no fast packed linear (no decode loop)")
    tm = tiny_model_factory("qwen3_headdim")
    calls = []
    real = DecodeLayers.__call__
    monkeypatch.setattr(DecodeLayers, "__call__",
                        lambda self, *a: calls.append(1) or real(self, *a))
    on = make_llm(tm.path, dtype="bfloat16", max_num_seqs=4)
    tokens = _generate(on, tm)
    assert on.llm_engine.platform.decode_layers and calls  # the C++ loop ran
    calls.clear()
    off = make_llm(tm.path, dtype="bfloat16", max_num_seqs=4, decode_layers=False)
    assert not off.llm_engine.platform.decode_layers
    assert runner_of(off).model.decode_layers is None
    assert _generate(off, tm) == tokens
    assert calls == []  # never called


def test_greedy_head_max_rows_argument(tiny_model_factory, ops, kernel_level, widened,
                                       monkeypatch):
    if not (ops.has_fast_linear_bf16 and ops.has_greedy_lm_head):
        pytest.skip(f"the {kernel_level} kernels have no greedy lm_head screen")
    tm = tiny_model_factory("qwen3_headdim")
    on = make_llm(tm.path, dtype="bfloat16", max_num_seqs=4, greedy_head_max_rows=3)
    assert runner_of(on).greedy_head is not None and runner_of(on).greedy_head_max_rows == 3
    tokens = _generate(on, tm)
    monkeypatch.setattr(GreedyHead, "build",
                        classmethod(lambda cls, *a: pytest.fail("GreedyHead.build called")))
    off = make_llm(tm.path, dtype="bfloat16", max_num_seqs=4, greedy_head_max_rows=0)
    assert off.llm_engine.platform.lm_head == "full"
    assert runner_of(off).greedy_head is None and runner_of(off).greedy_head_max_rows == 0
    assert _generate(off, tm) == tokens


def test_cpu_capability_argument_reaches_the_layers(tiny_model_factory, widened):
    tm = tiny_model_factory("llama_gqa_tied")
    level = kernels.runnable_levels()[0]
    llm = make_llm(tm.path, dtype="bfloat16", cpu_capability=level)
    platform = llm.llm_engine.platform
    assert platform.capability == level
    if platform.ops is None:
        pytest.skip("no native CPU kernels (no compiler, or TOKENMILL_NO_NATIVE=1)")
    norms = [m for m in runner_of(llm).model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m._ops.capability == level for m in norms)
    assert all(b.ops.capability == level for b in runner_of(llm).attn_backends.values())


def test_cpu_kernels_torch_end_to_end(tiny_model_factory, no_cpu_ops):
    """The plain PyTorch path everywhere, tokenmill.kernels never asked: HF's tokens."""
    tm = tiny_model_factory("llama_gqa_tied")
    llm = make_llm(tm.path, dtype="float32", cpu_kernels="torch", max_num_seqs=4)
    runner = runner_of(llm)
    assert runner.greedy_head is None
    assert {b.name for b in runner.attn_backends.values()} == {"torch"}
    assert all(_handed(m, None) for m in runner.model.modules())
    outs = llm.generate([{"prompt_token_ids": p} for p in tm.prompts[:3]],
                        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)
    for p, out in zip(tm.prompts[:3], outs):
        assert out.outputs[0].token_ids == tm.reference(p, 20)


def test_the_platform_is_logged_at_engine_start(llama_tiny, caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.llm_engine"):
        llm = make_llm(llama_tiny.path, cpu_kernels="torch")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("platform: ")]
    assert lines == [f"platform: {llm.llm_engine.platform.describe()}"]


def test_packed_weights_are_the_only_copy_without_native_bf16(tiny_model_factory, ops,
                                                              kernel_level, widened):
    """Where bf16 is emulated the bf16 model keeps its Linear weights in bf16, packed, and
    no fp32 copy (`weight` is left on the meta device); every input, prefill included,
    takes the packed kernel, and the tokens equal those of a run that keeps fp32 copies
    for inputs over 2 rows (the same math: fp32 products of bf16 weights)."""
    if not ops.has_fast_linear_bf16:
        pytest.skip(f"the {kernel_level} kernels have no fast packed linear")
    tm = tiny_model_factory("qwen3_headdim")
    llm = make_llm(tm.path, dtype="bfloat16", max_num_seqs=4)
    assert llm.llm_engine.platform.weights == "packed bf16 only"
    linears = [m for m in runner_of(llm).model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.method, PackedBf16LinearMethod)
                           and m.method.fallback is None and m.weight.is_meta for m in linears)
    assert all(m.method.packed_weight.dtype == BF16 for m in linears)
    fp32_bytes = sum(p.numel() * p.element_size() for m in linears for p in m.parameters()
                     if not p.is_meta and p.dtype == FP32 and p.dim() == 2)
    assert fp32_bytes == 0
    # The unpacked view of the packed weights is the checkpoint's bf16 weights.
    lm_head = runner_of(llm).model.lm_head
    assert isinstance(lm_head, Linear)
    assert torch.equal(lm_head.dense_weight(), tm.hf.lm_head.weight.detach().bfloat16())
    both = make_llm(tm.path, dtype="bfloat16", max_num_seqs=4, linear_bf16_max_rows=2)
    assert both.llm_engine.platform.weights == "packed bf16 + fp32 copy"
    assert _generate(llm, tm) == _generate(both, tm)


def test_moe_experts_are_packed_without_native_bf16(tmp_path, ops, kernel_level, widened):
    """The experts of a bf16 MoE model are packed like its Linear layers where bf16 is
    emulated: no fp32 copy of them (their stacked weights are left on the meta device),
    and the tokens equal those of a run that keeps fp32 copies for inputs over 2 rows."""
    from conftest import build_checkpoint
    from tokenmill.models.layers.moe import FusedMoE
    if not ops.has_fast_linear_bf16:
        pytest.skip(f"the {kernel_level} kernels have no fast packed linear")
    build_checkpoint(str(tmp_path), "qwen3_moe", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True))
    prompts = [{"prompt_token_ids": [5 + i, 17, 3 * i + 1, 40, 9]} for i in range(3)]

    def run(llm):
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    llm = make_llm(str(tmp_path), dtype="bfloat16", max_num_seqs=4)
    experts = [m for m in runner_of(llm).model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(isinstance(m.method, PackedBf16FusedMoEMethod)
                           and m.method.max_rows == ALL_ROWS and m.gate_up_proj.is_meta
                           and m.down_proj.is_meta for m in experts)
    both = make_llm(str(tmp_path), dtype="bfloat16", max_num_seqs=4, linear_bf16_max_rows=2)
    assert all(m.gate_up_proj.dtype == FP32 for m in runner_of(both).model.modules()
               if isinstance(m, FusedMoE))
    assert run(llm) == run(both)


def test_onednn_prepacked_layers_match_f_linear(tiny_model_factory, ops, kernel_level):
    """fp32 and bf16 (native) models: Linear layers keep oneDNN's prepacked weights in
    place of the plain ones, and inputs over the packed kernels' rows take them: the
    F.linear result (bf16: bit for bit; fp32: up to summation order)."""
    import torch.nn.functional as F
    for dtype in (FP32, BF16):
        if not cpu_platform.onednn_prepack_works(dtype):
            continue
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cpu_platform, "cpu_has_native_bf16", lambda: True)
            # (bf16 at avx512_bf16 keeps no oneDNN copy unless asked for: the row limit)
            platform = CpuPlatform.create(
                "cpu", dtype, linear_bf16_max_rows=cpu_platform.DEFAULT_NATIVE_BF16_PACKED_ROWS)
        if platform.gemm_dtype != platform.model_dtype:
            continue  # a level forced below avx512 widens bf16 GEMMs instead
        torch.manual_seed(3)
        lin = Linear(48, 200, bias=True).to(dtype)
        ref_w, ref_b = lin.weight.detach().clone(), lin.bias.detach().clone()
        platform.prepare_model(lin)
        # (behind the packed kernel's method where the level has one)
        gemm = getattr(lin.method, "fallback", lin.method)
        assert isinstance(gemm, OneDNNPrepackedLinearMethod) and lin.weight.is_meta
        assert torch.equal(lin.dense_weight(), ref_w)
        x = torch.randn(2, 40, 48).to(dtype)  # 80 rows: past the packed kernels
        got, want = lin(x), F.linear(x, ref_w, ref_b)
        assert got.shape == want.shape and got.dtype == dtype
        if dtype == BF16:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    tm = tiny_model_factory("qwen3_headdim")
    llm = make_llm(tm.path)  # fp32: HF's greedy tokens with prepacked prefill GEMMs
    if llm.llm_engine.platform.gemm == "onednn_prepacked":
        assert any(isinstance(getattr(m.method, "fallback", m.method),
                              OneDNNPrepackedLinearMethod)
                   for m in runner_of(llm).model.modules() if isinstance(m, Linear))
    assert _generate(llm, tm) == [tm.reference(p, 8) for p in tm.prompts[:3]]
