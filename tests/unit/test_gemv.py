"""The bf16 GEMV kernel behind small-batch Linear layers (tokenmill/kernels/cpu_gemv.cpp)."""
from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import cpu_ops
from tokenmill.models.layers import linear as linear_mod
from tokenmill.models.layers.linear import Linear

ops = cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="no native CPU kernels (no compiler)")


@pytest.mark.parametrize("m,n,k", [(1, 64, 32), (2, 37, 19), (3, 130, 48), (4, 8, 16),
                                   (5, 33, 100), (8, 256, 512), (1, 3, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_bf16_matches_fp32_matmul(m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else torch.empty(0)
    ref = x @ w.float().t() + (b if bias else 0)
    out = ops.gemv_bf16(x, w, b)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # bf16 activations: the same fp32 math, rounded once at the end.
    xb = x.bfloat16()
    outb = ops.gemv_bf16(xb, w, b)
    assert outb.dtype == torch.bfloat16
    refb = (xb.float() @ w.float().t() + (b if bias else 0)).bfloat16()
    torch.testing.assert_close(outb.float(), refb.float(), rtol=1e-2, atol=1e-2)


def test_widened_linear_uses_gemv_for_few_rows_and_matches_the_gemm(monkeypatch):
    monkeypatch.setattr(linear_mod, "GEMV_MAX_ROWS", 8)  # off by default (measured)
    torch.manual_seed(0)
    lin = Linear(96, 200, bias=True).bfloat16()
    ref_w, ref_b = lin.weight.detach().float(), lin.bias.detach().float()
    assert lin.set_compute_dtype(torch.float32)
    assert lin.gemv_weight is not None and lin.gemv_weight.dtype == torch.bfloat16
    calls = []
    real = lin._gemv
    lin._gemv = lambda *a: calls.append(1) or real(*a)
    for rows in (1, 3, linear_mod.GEMV_MAX_ROWS, linear_mod.GEMV_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 96).bfloat16()
        before = len(calls)
        out = lin(x)
        assert out.dtype == torch.bfloat16
        used = len(calls) > before
        assert used == (rows <= linear_mod.GEMV_MAX_ROWS)
        ref = (x.float() @ ref_w.t() + ref_b).bfloat16()
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 3, 32), (33, 130)])
def test_native_rms_norm_matches_hf_formula(dtype, shape):
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
