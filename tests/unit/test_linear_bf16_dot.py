"""linear_bf16's many-row path on native bf16 dot products: bf16 inputs of
`bf16_dot_gemm_min_rows` rows and more, on vdpbf16ps at the avx512_bf16 level
(tokenmill/kernels/cpu_linear_dot.cpp) and on AMX tiles at the amx level
(cpu_linear_amx.cpp). Each level is skipped where the CPU (or its OS) cannot run it.

Reference: x @ W^T + b in float64 on the same bf16 values. vdpbf16ps (and TDPBF16PS)
multiply bf16 pairs exactly into fp32 and sum in fp32, so before the output's bf16 rounding the
error is at most (K + 1) * 2^-24 * (|x| @ |W|^T + |b|) (one fp32 rounding per
addition, K products and the bias); the rounding to bf16 adds half an ulp, 2^-8 of
the value. A wrong pair, column or row is off by O(1) and fails this bound.
"""
from __future__ import annotations

import pytest
import torch

from tokenmill import kernels
from tokenmill.kernels.testing import BF16_DOT_LEVELS, bf16_dot_ops

NO_BIAS = torch.empty(0)


@pytest.fixture(scope="module", params=BF16_DOT_LEVELS)
def ops(request):
    return bf16_dot_ops(request.param)


def check_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    xd, wd = x.double(), w.double()
    ref = xd @ wd.t() + (b.double() if b is not None else 0)
    mag = xd.abs() @ wd.abs().t() + (b.double().abs() if b is not None else 0)
    k = x.shape[1]
    bound = (k + 1) * 2.0 ** -24 * mag * (1 + 2.0 ** -8) + 2.0 ** -8 * ref.abs() + 1e-30
    err = (out.double() - ref).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"error above the vdpbf16ps bound by {worst} (max error {err.max()})"


def test_the_level_has_the_path(ops):
    # Decode rows (<= 8) keep linear_bf16's widening path: the greedy head and the
    # decode-layer loop rely on its exact results there.
    assert ops.has_bf16_dot_gemm and ops.bf16_dot_gemm_min_rows == 9
    assert ops.has_amx_gemm == (ops.capability == "amx")


def test_lower_levels_do_not(ops):
    for level in kernels.runnable_levels():
        if level not in BF16_DOT_LEVELS:
            other = kernels.cpu_ops(level)
            if other is not None:
                assert not other.has_bf16_dot_gemm and other.bf16_dot_gemm_min_rows == 0
                assert not other.has_amx_gemm


# Rows: the threshold (9), the 12-row micro-kernel's remainders and balanced groups
# (13, 23), the in-register path's edge (40 / 41), more than one row chunk (129, 300
# with short K; 200 with K = 1100: 192-row chunks of 512-k pieces). K odd (a padded
# pair), not a multiple of 32, and long enough for K chunks (1100, 2049); N partial
# 32-column blocks and a single block (split by rows over the threads). K = 1024 / 2048
# (rows 2 / 4 KB apart): x copied to a spread-out stride first, in the reused buffer.
@pytest.mark.parametrize("m,n,k", [(9, 70, 20), (13, 300, 63), (23, 33, 19), (24, 64, 100),
                                   (25, 47, 75), (31, 96, 33), (64, 1024, 512), (129, 47, 24),
                                   (300, 100, 9), (200, 65, 1100), (37, 20, 2049),
                                   (48, 31, 1), (26, 130, 1536), (40, 2100, 70), (41, 70, 300),
                                   (50, 40, 1024), (27, 33, 2048)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_float64_reference(ops, m, n, k, bias, threads):
    g = torch.Generator().manual_seed(m * 1000 + n + k + threads)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    packed = ops.pack_bf16_weight(w)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = ops.linear_bf16(x, packed, n, b if bias else NO_BIAS)
        # Strided input: made contiguous first, same results.
        xt = x.t().contiguous().t()
        again = ops.linear_bf16(xt, packed, n, b if bias else NO_BIAS)
    finally:
        torch.set_num_threads(saved)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    check_close(out, x, w, b)
    assert torch.equal(out, again)


@pytest.mark.parametrize("k", [1300, 2048])
def test_results_do_not_depend_on_threads_or_row_split(ops, k):
    """Each value is one fp32 accumulator over the same pairs in the same order, whatever
    the row groups, K chunks and threads: a row's result is the same computed alone
    (from 9 rows), in a batch, or by another thread count (K 2048: x copied, into a
    buffer reused from call to call at every row count)."""
    g = torch.Generator().manual_seed(3)
    n = 200
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(300, k, generator=g).bfloat16()
    packed = ops.pack_bf16_weight(w)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        full = ops.linear_bf16(x, packed, n, NO_BIAS)
        torch.set_num_threads(2)
        assert torch.equal(ops.linear_bf16(x, packed, n, NO_BIAS), full)
        for lo, hi in ((0, 9), (5, 30), (100, 250), (291, 300)):
            assert torch.equal(ops.linear_bf16(x[lo:hi], packed, n, NO_BIAS), full[lo:hi])
    finally:
        torch.set_num_threads(saved)


def test_nan_and_inf_rows_propagate(ops):
    g = torch.Generator().manual_seed(5)
    m, n, k = 40, 70, 64
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    x[3, 10] = float("nan")
    x[17, 0] = float("inf")
    x[30] = 0
    out = ops.linear_bf16(x, ops.pack_bf16_weight(w), n, NO_BIAS).float()
    assert out[3].isnan().all()
    # inf times weights of both signs: +-inf per column (never a finite value)
    assert not out[17].isfinite().any()
    assert torch.equal(out[17].sign(), w[:, 0].float().sign())
    assert (out[30] == 0).all()
    others = [r for r in range(m) if r not in (3, 17)]
    assert out[others].isfinite().all()
    check_close(out[others], x[others], w, None)


def test_fp32_inputs_keep_the_widening_path(ops):
    """fp32 rows are not rounded to bf16: the fp32 math of the widened weights."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(50, 100, generator=g).bfloat16()
    x = torch.randn(40, 100, generator=g)
    out = ops.linear_bf16(x, ops.pack_bf16_weight(w), 50, NO_BIAS)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, x @ w.float().t(), rtol=1e-5, atol=1e-5)
