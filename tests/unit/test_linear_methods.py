"""The GEMM layers' methods (tokenmill/models/layers/linear_methods/) and the platform's
choice of them (Platform.linear_method / moe_method, tokenmill/platforms/interface.py).

- the platform picks the expected method for each model dtype and kernel setting
  (cpu_kernels torch / native, a CPU with native bf16 or without), at every
  capability level this CPU runs; a method it did not make (a quantized format's)
  is kept;
- every method's `apply` is F.linear on the same weights (fp32: close, at 1, 8, 9 and
  64 rows, either side of the packed kernels' limit; bf16: within bf16 rounding),
  and each row count takes the kernel it took before (packed up to max_rows, the
  fallback above);
- `dense_weight` gives the loaded weights back from whichever copy a method keeps;
- the MoE methods match the unquantized experts.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.linear_methods import (ALL_ROWS, LinearMethod,
                                                    OneDNNPrepackedLinearMethod,
                                                    PackedBf16FusedMoEMethod,
                                                    PackedBf16LinearMethod,
                                                    PackedF32LinearMethod,
                                                    SyncFreeFusedMoEMethod,
                                                    UnquantizedFusedMoEMethod,
                                                    UnquantizedLinearMethod)
from tokenmill.models.layers.moe import FusedMoE, route
from tokenmill.platforms import cpu as cpu_platform
from tokenmill.platforms.cpu import CpuPlatform
from tokenmill.platforms.cuda import CudaPlatform

BF16, FP32 = torch.bfloat16, torch.float32
ROWS = (1, 8, 9, 64)


def _platform(dtype, native_bf16: bool, amx: bool = False, **kw) -> CpuPlatform:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_platform, "cpu_has_native_bf16", lambda: native_bf16)
        mp.setattr(cpu_platform, "cpu_has_amx", lambda: amx)
        return CpuPlatform.create("cpu", dtype, **kw)


def _linear(dtype, n=200, k=48, bias=True, seed=0) -> Linear:
    torch.manual_seed(seed)
    return Linear(k, n, bias=bias).to(dtype).requires_grad_(False)


def _experts(dtype, seed=0) -> FusedMoE:
    g = torch.Generator().manual_seed(seed)
    moe = FusedMoE(8, 40, 24)
    with torch.no_grad():
        moe.gate_up_proj.copy_(torch.randn(moe.gate_up_proj.shape, generator=g) * 0.2)
        moe.down_proj.copy_(torch.randn(moe.down_proj.shape, generator=g) * 0.2)
    return moe.to(dtype).requires_grad_(False)


def _gemm(dtype):
    """The method the platform gives the inputs past the packed kernels."""
    if cpu_platform.onednn_prepack_works(dtype):
        return OneDNNPrepackedLinearMethod
    return UnquantizedLinearMethod


# ---- the platform's choice -------------------------------------------------------------
def test_cpu_kernels_torch_keeps_f_linear(kernel_level):
    """No native kernels: F.linear in the model's dtype, or widened to fp32 where bf16 is
    emulated (or a level below avx512 is forced); the experts' grouped GEMMs likewise."""
    for dtype, native in ((FP32, True), (BF16, True), (BF16, False)):
        platform = _platform(dtype, native, cpu_kernels="torch")
        widen = FP32 if dtype == BF16 and (not native or platform.gemm_dtype == "float32") \
            else None
        assert platform.widen_to == widen
        lin, moe = _linear(dtype), _experts(dtype)
        method, moe_method = platform.linear_method(lin), platform.moe_method(moe)
        assert type(method) is UnquantizedLinearMethod and method.compute_dtype == widen
        assert type(moe_method) is UnquantizedFusedMoEMethod
        assert moe_method.compute_dtype == widen
        if widen is None:  # nothing to change: the layer's own method stays
            assert method is lin.method and moe_method is moe.method


def test_fp32_model_takes_packed_f32_then_onednn(ops):
    platform = _platform(FP32, True)
    lin = _linear(FP32)
    method = platform.linear_method(lin)
    if not ops.has_fast_linear_bf16:
        assert type(method) is _gemm(FP32)
        return
    assert isinstance(method, PackedF32LinearMethod) and method.packed_dtype == FP32
    assert method.max_rows == cpu_platform.DEFAULT_F32_PACKED_ROWS
    assert type(method.fallback) is _gemm(FP32)
    assert method.ops is ops


def test_bf16_model_without_native_bf16_is_packed_only(ops):
    """bf16 emulated: the packed kernel takes every input and its copy is the only one;
    with a row limit, an fp32 copy takes the larger inputs."""
    lin, moe = _linear(BF16), _experts(BF16)
    method = _platform(BF16, False).linear_method(lin)
    moe_method = _platform(BF16, False).moe_method(moe)
    if not ops.has_fast_linear_bf16:
        assert type(method) is UnquantizedLinearMethod and method.compute_dtype == FP32
        assert type(moe_method) is UnquantizedFusedMoEMethod
        return
    assert isinstance(method, PackedBf16LinearMethod) and method.packed_dtype == BF16
    assert method.max_rows == ALL_ROWS and method.fallback is None
    assert isinstance(moe_method, PackedBf16FusedMoEMethod) and moe_method.max_rows == ALL_ROWS
    limited = _platform(BF16, False, linear_bf16_max_rows=8).linear_method(lin)
    assert isinstance(limited, PackedBf16LinearMethod) and limited.max_rows == 8
    assert type(limited.fallback) is UnquantizedLinearMethod
    assert limited.fallback.compute_dtype == FP32
    moe_limited = _platform(BF16, False, linear_bf16_max_rows=8).moe_method(moe)
    assert moe_limited.max_rows == 8 and moe_limited.compute_dtype == FP32


def test_bf16_model_with_native_bf16_takes_onednn_above_the_packed_rows(ops, kernel_level):
    """Native bf16: the packed kernel takes the decode rows and oneDNN the rest, except
    where the level has the packed kernel's many-row path on vdpbf16ps (avx512_bf16) or
    AMX tiles (amx): there it takes every input and no oneDNN copy is made, unless a row
    limit asks. (A CPU with AMX: test_platforms.py::test_amx_cpu_keeps_onednn_below_the_amx_level.)"""
    platform = _platform(BF16, True)
    method = platform.linear_method(_linear(BF16))
    below_avx512 = platform.gemm_dtype == "float32"  # takes an AVX2 CPU's path: widened
    if not ops.has_fast_linear_bf16:
        assert type(method) is (UnquantizedLinearMethod if below_avx512 else _gemm(BF16))
        return
    assert isinstance(method, PackedBf16LinearMethod)
    if below_avx512 or ops.has_bf16_dot_gemm:
        assert method.max_rows == ALL_ROWS and method.fallback is None
    else:
        assert method.max_rows == cpu_platform.DEFAULT_NATIVE_BF16_PACKED_ROWS
        assert type(method.fallback) is _gemm(BF16)
    if not below_avx512:
        limited = _platform(BF16, True, linear_bf16_max_rows=8).linear_method(_linear(BF16))
        assert isinstance(limited, PackedBf16LinearMethod) and limited.max_rows == 8
        assert type(limited.fallback) is _gemm(BF16)


def test_a_tied_weight_is_kept(kernel_level):
    """A weight another module holds too (a tied lm_head) is not dropped for the
    prepacked copy: dropping it would free nothing."""
    platform = _platform(FP32, True, cpu_kernels="native")
    if platform.gemm != "onednn_prepacked":
        pytest.skip("no oneDNN prepacking in this torch build")
    emb = torch.nn.Embedding(200, 48)
    lin = _linear(FP32)
    lin.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": lin})
    platform.prepare_model(model)
    gemm = getattr(lin.method, "fallback", lin.method)
    assert isinstance(gemm, OneDNNPrepackedLinearMethod) and gemm.keep_weight
    assert lin.weight is emb.weight and not lin.weight.is_meta


def test_cuda_platform_keeps_f_linear_and_takes_sync_free_experts():
    platform = CudaPlatform.create("cuda", BF16)
    lin, moe = _linear(BF16), _experts(BF16)
    assert platform.linear_method(lin) is lin.method
    assert type(platform.moe_method(moe)) is SyncFreeFusedMoEMethod


class _Quantized(UnquantizedLinearMethod):
    """Stands in for a quantized format's method: the platform must not replace it."""


def test_a_method_the_platform_did_not_make_is_kept(ops):
    lin = _linear(BF16)
    lin.method = _Quantized()
    platform = _platform(BF16, False)
    assert platform.linear_method(lin) is lin.method
    platform.prepare_model(lin)
    assert type(lin.method) is _Quantized
    # Nor is a method it chose already: preparing twice changes nothing.
    lin2 = _linear(BF16)
    platform.prepare_model(lin2)
    chosen = lin2.method
    platform.prepare_model(lin2)
    assert lin2.method is chosen


def test_forward_is_the_method(kernel_level):
    class Twice(UnquantizedLinearMethod):
        def apply(self, layer, x):
            return 2 * F.linear(x, layer.weight, layer.bias)

    lin = _linear(FP32)
    x = torch.randn(3, 48)
    ref = lin(x)
    lin.set_method(Twice())
    assert torch.equal(lin(x), 2 * ref)
    assert isinstance(lin.method, LinearMethod)


# ---- each method against F.linear -------------------------------------------------------
def _methods(ops, dtype):
    """(name, method) for every method this dtype can run here."""
    out = [("plain", UnquantizedLinearMethod())]
    if cpu_platform.onednn_prepack_works(dtype):
        out.append(("onednn", OneDNNPrepackedLinearMethod()))
    if dtype == FP32:
        out.append(("packed_f32", PackedF32LinearMethod(ops, 8, UnquantizedLinearMethod())))
        if cpu_platform.onednn_prepack_works(FP32):
            out.append(("packed_f32+onednn",
                        PackedF32LinearMethod(ops, 8, OneDNNPrepackedLinearMethod())))
    else:
        out += [("widened", UnquantizedLinearMethod(FP32)),
                ("packed_bf16 only", PackedBf16LinearMethod(ops, ALL_ROWS, None)),
                ("packed_bf16+fp32", PackedBf16LinearMethod(ops, 8, UnquantizedLinearMethod(FP32)))]
        if cpu_platform.onednn_prepack_works(BF16):
            out.append(("packed_bf16+onednn",
                        PackedBf16LinearMethod(ops, 8, OneDNNPrepackedLinearMethod())))
    return out


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_every_method_is_f_linear(ops, dtype, bias):
    for name, method in _methods(ops, dtype):
        lin = _linear(dtype, n=70, k=40, bias=bias, seed=1)
        w = lin.weight.detach().clone()
        b = lin.bias.detach().clone() if bias else None
        lin.set_method(method)
        assert torch.equal(lin.dense_weight().to(dtype), w), name  # round trip
        kernel = getattr(method, "kernel", None)
        calls = []
        if kernel is not None:
            method.kernel = lambda *a, _k=kernel: calls.append(1) or _k(*a)
        for rows in ROWS:
            for shape in ((rows, 40), (1, rows, 40)):  # flat tokens, or a batch dim
                x = torch.randn(*shape).to(dtype)
                before = len(calls)
                got = lin(x)
                assert got.shape == (*shape[:-1], 70) and got.dtype == dtype, name
                # fp32 products of the (exact) weights, rounded once to the dtype
                want = F.linear(x.float(), w.float(), None if b is None else b.float())
                if dtype == FP32:
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                else:
                    torch.testing.assert_close(got.float(), want.to(BF16).float(),
                                               rtol=1.6e-2, atol=1e-2)
                packed = len(calls) > before
                assert packed == (kernel is not None and rows <= method.max_rows), (name, rows)


def test_unquantized_bf16_is_f_linear_bit_for_bit():
    lin = _linear(BF16)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    x = torch.randn(9, 48).to(BF16)
    assert torch.equal(lin(x), F.linear(x, w, b))
    if cpu_platform.onednn_prepack_works(BF16):
        lin.set_method(OneDNNPrepackedLinearMethod())
        assert lin.weight.is_meta  # the reordered copy replaced it
        assert torch.equal(lin(x), F.linear(x, w, b))
        assert torch.equal(lin.dense_weight(), w)


def test_widened_weights_and_packed_only_weights(ops):
    """A widened layer keeps an exact fp32 copy; a packed-only one keeps no other."""
    lin = _linear(BF16)
    w = lin.weight.detach().clone()
    lin.set_method(UnquantizedLinearMethod(FP32))
    assert lin.weight.dtype == lin.bias.dtype == FP32 and torch.equal(lin.weight, w.float())
    only = _linear(BF16)
    only.set_method(PackedBf16LinearMethod(ops, ALL_ROWS, None))
    assert only.weight.is_meta and only.weight.shape == w.shape
    assert torch.equal(only.dense_weight(), w)
    with pytest.raises(ValueError, match="every input"):
        PackedBf16LinearMethod(ops, 8, None)


# ---- the experts --------------------------------------------------------------------------
def _routing(tokens=23):
    torch.manual_seed(0)
    logits = torch.randn(tokens, 8)
    logits[:, :2] += 3.0  # experts 0 and 1 get most tokens, the others a few
    return route(logits, 2, True)


def test_moe_methods_match_the_unquantized_experts(ops):
    weights, ids = _routing()
    x32 = torch.randn(23, 40)
    ref_moe = _experts(FP32)
    ref = ref_moe(x32, weights, ids)
    sync_free = _experts(FP32)
    sync_free.set_method(SyncFreeFusedMoEMethod())
    torch.testing.assert_close(sync_free(x32, weights, ids), ref, rtol=1e-5, atol=1e-5)
    # bf16 experts: widened, and packed (every slice / slices of up to 3 rows)
    x = x32.to(BF16)
    wide = _experts(BF16)
    wide.set_method(UnquantizedFusedMoEMethod(FP32))
    assert wide.gate_up_proj.dtype == FP32
    want = wide(x, weights.to(BF16), ids)
    for max_rows in (ALL_ROWS, 3):
        moe = _experts(BF16)
        moe.set_method(PackedBf16FusedMoEMethod(ops, max_rows, FP32))
        assert moe.gate_up_proj.is_meta == (max_rows == ALL_ROWS)
        got = moe(x, weights.to(BF16), ids)
        assert got.dtype == BF16
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(want.float(), ref, rtol=5e-2, atol=5e-2)
