"""The packed bf16 linear kernel behind small-batch Linear layers
(tokenmill/kernels/cpu_linear.cpp) and the native RMSNorm, at every capability
level this CPU runs."""
from __future__ import annotations

import pytest
import torch

from tokenmill.platforms import cpu as cpu_platform
from tokenmill.platforms.cpu import CpuPlatform
from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.linear_methods import PackedBf16LinearMethod, UnquantizedLinearMethod


# Row counts cover the one-row kernel, the remainders of the 12-row micro-kernel,
# the pre-widened path (24+ rows, K over one 256 chunk) and more than one 128-row
# cache block (200 x 300: a block's bf16 rows widened by both threads); column counts
# cover partial 32-column blocks; K covers odd sizes.
# (The fp32 kernel's K chunks of 256 are covered by k = 300 and 512.)
@pytest.mark.parametrize("m,n,k", [(1, 64, 32), (2, 37, 19), (3, 130, 48), (4, 8, 16),
                                   (5, 33, 100), (7, 31, 7), (8, 256, 512), (1, 3, 1),
                                   (9, 70, 20), (11, 40, 16), (13, 300, 64), (24, 65, 40),
                                   (31, 96, 33), (35, 64, 300), (130, 47, 24), (300, 100, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_f32_matches_fp32_matmul(ops, m, n, k, bias):
    """The packed fp32 kernel (fp32 models' decode-sized inputs): F.linear's math up to
    summation order, for every row / column / K remainder."""
    g = torch.Generator().manual_seed(m * 1000 + n + k + 7)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else torch.empty(0)
    packed = ops.pack_f32_weight(w)
    assert packed.shape == ((n + 31) // 32, k, 32) and packed.dtype == torch.float32
    out = ops.linear_f32(x, packed, n, b)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b if bias else None),
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="pack_f32_weight"):
        ops.linear_f32(x, w, n, b)  # not packed
    with pytest.raises(RuntimeError, match="fp32"):
        ops.linear_f32(x.bfloat16(), packed, n, b)


@pytest.mark.parametrize("m,n,k", [(1, 64, 32), (2, 37, 19), (3, 130, 48), (4, 8, 16),
                                   (5, 33, 100), (7, 31, 7), (8, 256, 512), (1, 3, 1),
                                   (9, 70, 20), (11, 40, 16), (13, 300, 64), (24, 65, 40),
                                   (31, 96, 33), (35, 64, 300), (130, 47, 24), (300, 100, 8),
                                   (200, 40, 300)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_bf16_matches_fp32_matmul(ops, m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else torch.empty(0)
    packed = ops.pack_bf16_weight(w)
    assert packed.shape == ((n + 31) // 32, k, 32) and packed.dtype == torch.bfloat16
    ref = x @ w.float().t() + (b if bias else 0)
    out = ops.linear_bf16(x, packed, n, b)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)  # summation order only
    # bf16 activations: the same fp32 math, rounded once at the end (nearest even).
    xb = x.bfloat16()
    outb = ops.linear_bf16(xb, packed, n, b)
    assert outb.dtype == torch.bfloat16 and outb.shape == (m, n)
    refb = (xb.float() @ w.float().t() + (b if bias else 0)).bfloat16()
    torch.testing.assert_close(outb.float(), refb.float(), rtol=1e-2, atol=1e-2)
    assert (outb == refb).float().mean() > 0.98


def test_linear_bf16_rejects_unpacked_weights(ops):
    with pytest.raises(RuntimeError, match="pack_bf16_weight"):
        ops.linear_bf16(torch.randn(2, 16), torch.randn(8, 16).bfloat16(), 8, torch.empty(0))


def test_widened_linear_uses_the_packed_kernel_for_few_rows(ops, monkeypatch):
    """Where the level has the vector kernel (`has_fast_linear_bf16`) the CPU platform
    packs a widened Linear's bf16 weights and it takes linear_bf16 up to
    linear_bf16_max_rows rows; elsewhere it keeps the fp32 GEMM (linear_bf16 there
    unpacks the weights per call). Same results either way."""
    monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: False)
    platform = CpuPlatform.create("cpu", torch.bfloat16, linear_bf16_max_rows=8)
    packs = ops.has_fast_linear_bf16
    assert platform.ops is ops and platform.gemm_dtype == "float32"
    assert platform.linear == ("packed_bf16" if packs else "torch")
    torch.manual_seed(0)
    lin = Linear(96, 200, bias=True).bfloat16()
    ref_w, ref_b = lin.weight.detach().float(), lin.bias.detach().float()
    platform.prepare_model(lin)
    assert lin.weight.dtype == torch.float32
    calls = []
    if packs:
        method = lin.method
        assert isinstance(method, PackedBf16LinearMethod)
        assert method.packed_weight.dtype == torch.bfloat16 and method.max_rows == 8
        assert method.fallback.compute_dtype == torch.float32  # the fp32 copy above 8 rows
        real = method.kernel
        method.kernel = lambda *a: calls.append(1) or real(*a)
    else:
        assert type(lin.method) is UnquantizedLinearMethod
        assert lin.method.compute_dtype == torch.float32 and lin.method.packed_weight is None
    for rows in (1, 3, 8, 9, 40):
        x = torch.randn(rows, 96).bfloat16()
        before = len(calls)
        out = lin(x)
        assert out.dtype == torch.bfloat16
        used = len(calls) > before
        assert used == (packs and rows <= 8)
        ref = (x.float() @ ref_w.t() + ref_b).bfloat16()
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 3, 32), (33, 130)])
def test_native_rms_norm_matches_hf_formula(ops, dtype, shape):
    """HF's Llama/Qwen RMSNorm: fp32 statistics, the normalised value rounded to the
    input dtype, then times the weight (in the input dtype)."""
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    ref = w * normed
    out = ops.rms_norm(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    # Nearly every element bit-identical (summation order can move one rounding).
    assert (out == ref).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (70, 512), (3, 40)])
def test_native_add_rms_norm_matches_add_then_norm(ops, dtype, shape):
    g = torch.Generator().manual_seed(shape[0])
    residual = (torch.randn(*shape, generator=g) * 3).to(dtype)
    x = torch.randn(*shape, generator=g).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    summed = residual + x
    ref = ops.rms_norm(summed, w, 1e-6)
    out = ops.add_rms_norm_(residual, x, w, 1e-6)
    assert torch.equal(residual, summed)  # the stream was updated in place, same rounding
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    assert (out == ref).float().mean() > 0.99
