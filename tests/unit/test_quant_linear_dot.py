"""Quantized weights at many bf16 rows on vdpbf16ps or AMX tiles (`linear_quant_dot`,
tokenmill/kernels/cpu_quant_linear.cpp over cpu_linear_dot.cpp's driver, and at the amx
level cpu_linear_amx.cpp's): each packed block's codes are dequantized to bf16(W') pair
words in the kernel's scratch. Each level is skipped where the CPU cannot run it.

Reference: x @ bf16(W')^T + b in float64, bf16(W') from `dequantize_quant(bf16=True)`
(the old tiles' values: the kernel must make the same ones). vdpbf16ps multiplies bf16
pairs exactly into fp32 and sums in fp32, so before any output rounding the error is at
most (K + 1) * 2^-24 * (|x| @ |W'|^T + |b|); a bf16 output adds half an ulp (2^-8 of
the value). A wrong code, zero point, scale, group or pair is off by O(|x| |W'|) and
fails this bound (test_the_bound_catches_a_wrong_weight).
"""
from __future__ import annotations

import pytest
import torch

from tokenmill import kernels
from tokenmill.kernels.testing import BF16_DOT_LEVELS, bf16_dot_ops
from tokenmill.models.layers.linear_methods.quantized_cpu import PackedQuantizedWeight
from tokenmill.models.layers.linear_methods.quantized_weight import QuantizedWeight

NO_BIAS = torch.empty(0)


@pytest.fixture(scope="module", params=BF16_DOT_LEVELS)
def ops(request):
    return bf16_dot_ops(request.param)


def _weight(n, k, bits, group, sym, seed):
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g)
    zeros = (torch.full((n, groups), 1 << (bits - 1), dtype=torch.uint8) if sym else
             torch.randint(0, 1 << bits, (n, groups), dtype=torch.uint8, generator=g))
    scales = torch.rand(n, groups, generator=g) * 0.02 + 0.001
    return QuantizedWeight(codes, scales, zeros, bits, group)


def _e4m3(ops, n, k, group, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 4).to(torch.float8_e4m3fn)
    scales = torch.rand(-(-n // 16), -(-k // group), generator=g) + 0.01
    return PackedQuantizedWeight.e4m3(ops, w, scales, (16, group))


def _call(ops, pq, x, b, fp32_out=True):
    return ops.linear_quant_dot(x, pq.codes, pq.scales, pq.zeros, pq.out_features, pq.kind,
                                pq.group_size, b if b is not None else NO_BIAS, fp32_out)


def excess(out, x, wt, b, bf16_out):
    """How far `out` is above the bound (<= 0: within); wt: bf16(W')^T [K, N]."""
    xd, wd = x.double(), wt.double()
    ref = xd @ wd + (b.double() if b is not None else 0)
    mag = xd.abs() @ wd.abs() + (b.double().abs() if b is not None else 0)
    bound = (x.shape[1] + 1) * 2.0 ** -24 * mag * (1 + 2.0 ** -8) + 1e-30
    if bf16_out:
        bound = bound + 2.0 ** -8 * (ref.abs() + bound)
    return ((out.double() - ref).abs() - bound).max().item()


def check(ops, pq, x, b, threads=1):
    wt = pq.dequantize_t(0, pq.out_features, bf16=True)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y32 = _call(ops, pq, x, b)
        y16 = _call(ops, pq, x, b, fp32_out=False)
    finally:
        torch.set_num_threads(saved)
    assert y32.dtype == torch.float32 and y16.dtype == torch.bfloat16
    assert y32.shape == y16.shape == (x.shape[0], pq.out_features)
    assert excess(y32, x, wt, b, False) <= 0
    assert excess(y16, x, wt, b, True) <= 0
    # the bf16 output is the fp32 one rounded once (c10's rounding)
    assert torch.equal(y16, y32.bfloat16())
    return y32


def test_the_level_has_the_path(ops):
    assert ops.has_quant_dot
    for level in kernels.runnable_levels():
        other = kernels.cpu_ops(level) if level not in BF16_DOT_LEVELS else None
        if other is not None:
            assert not getattr(other, "has_quant_dot", False)


# Kinds 4 / 8, symmetric or not; groups of 32, 128, the whole row, and sizes that are
# not multiples of 32 (5: odd, groups inside a pair; 48); K odd (a padded pair), long
# enough for K chunks (1100); N partial blocks; rows around the driver's thresholds
# (9, 12 / 13: the micro-kernel's 12 rows, 24, 64 / 65, 128, 300: more than one chunk).
@pytest.mark.parametrize("bits,group,sym", [(8, 32, False), (8, -1, True), (4, 32, False),
                                            (4, 128, True), (4, 5, False), (8, 48, False)])
@pytest.mark.parametrize("m,n,k", [(9, 70, 63), (12, 33, 256), (13, 100, 129), (24, 64, 100),
                                   (64, 47, 1100), (65, 96, 75), (128, 130, 512),
                                   (300, 40, 160)])
def test_plain_layout_matches_float64(ops, bits, group, sym, m, n, k):
    group = k if group < 0 else group
    pq = PackedQuantizedWeight(ops, _weight(n, k, bits, group, sym, m + n + k + bits))
    assert not pq.quad
    g = torch.Generator().manual_seed(m * 7 + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    check(ops, pq, x, torch.randn(n, generator=g) if m % 2 else None)


# The quad layout (K a multiple of 8; groups a multiple of 8 or the whole row): its
# lines hold 4 (8-bit) or 8 (4-bit) k of a column per dword.
@pytest.mark.parametrize("bits,group", [(8, 32), (4, 32), (4, 128), (8, -1), (4, 8)])
@pytest.mark.parametrize("m,n,k", [(9, 70, 64), (13, 33, 256), (65, 100, 1096), (128, 64, 128)])
def test_quad_layout_matches_float64(ops, bits, group, m, n, k):
    group = k if group < 0 else group
    pq = PackedQuantizedWeight(ops, _weight(n, k, bits, group, False, m + n + bits), quad=True)
    assert pq.quad
    g = torch.Generator().manual_seed(m * 5 + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    check(ops, pq, x, torch.randn(n, generator=g))


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("m,n,k", [(9, 70, 63), (64, 100, 256), (300, 33, 1100)])
def test_e4m3_matches_float64(ops, group, m, n, k):
    pq = _e4m3(ops, n, k, group, m + k)
    g = torch.Generator().manual_seed(m + 3 * k)
    x = torch.randn(m, k, generator=g).bfloat16()
    check(ops, pq, x, torch.randn(n, generator=g) if m % 2 else None)


def test_groups_whose_scales_need_c10s_rounding(ops):
    """Groups with a tiny (denormal W'), infinite or NaN scale take the exact rounding
    path; the others beside them the fast one: finite columns within the bound, a NaN
    scale's column NaN, an infinite one's non-finite."""
    n, k, m = 64, 256, 20
    qw = _weight(n, k, 8, 32, False, 12)
    qw.zeros[:, :] = 100
    qw.scales[3, 2] = 2.0 ** -130   # denormal W' in group 2 of column 3
    qw.codes[7, 32:64] = 101        # column 7, group 1: W' = +inf
    qw.scales[7, 1] = float("inf")
    qw.scales[40, 5] = float("nan")
    pq = PackedQuantizedWeight(ops, qw)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(13)).bfloat16()
    y = _call(ops, pq, x, None)
    assert y[:, 40].isnan().all()
    assert not y[:, 7].isfinite().any()
    finite = [c for c in range(n) if c not in (7, 40)]
    wt = pq.dequantize_t(0, n, bf16=True)
    assert excess(y[:, finite], x, wt[:, finite], None, False) <= 0


def test_results_do_not_depend_on_threads_or_rows(ops):
    """One fp32 accumulator per value over the same pairs in the same order, whatever
    the row groups, K chunks and threads."""
    n, k = 200, 1300
    pq = PackedQuantizedWeight(ops, _weight(n, k, 4, 128, False, 1))
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    full = check(ops, pq, x, None, threads=1)
    assert torch.equal(check(ops, pq, x, None, threads=2), full)
    for lo, hi in ((0, 9), (5, 30), (100, 250), (291, 300)):
        assert torch.equal(_call(ops, pq, x[lo:hi], None), full[lo:hi])


def test_the_bound_catches_a_wrong_weight(ops):
    """The reference with one code, zero point or scale changed is outside the bound: the
    tests above could fail."""
    qw = _weight(64, 128, 4, 32, False, 4)
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(6)).bfloat16()
    out = _call(ops, PackedQuantizedWeight(ops, qw), x, None)
    for field in ("codes", "zeros", "scales"):
        t = getattr(qw, field).clone()
        t[5, 1] = t[5, 1] + 1 if field != "scales" else t[5, 1] * 1.5
        if field != "scales":
            t[5, 1] = t[5, 1] % 16
        wrong = QuantizedWeight(*(t if f == field else getattr(qw, f)
                                  for f in ("codes", "scales", "zeros")), 4, 32)
        wt = PackedQuantizedWeight(ops, wrong).dequantize_t(0, 64, bf16=True)
        assert excess(out, x, wt, None, False) > 0, field


def test_engine_path_takes_it_and_agrees_with_the_tiles(ops):
    """PackedQuantizedWeight.linear past max_rows in bf16 takes linear_quant_dot; the old
    tiles (library bf16 GEMM, bias added in bf16) agree within both paths' bounds."""
    n, k, m = 96, 256, 40
    pq = PackedQuantizedWeight(ops, _weight(n, k, 8, 64, False, 8))
    assert pq.dot
    g = torch.Generator().manual_seed(9)
    x = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g)
    y = pq.linear(x, b, 8, torch.bfloat16)
    assert torch.equal(y, _call(ops, pq, x, b, fp32_out=False))
    assert torch.equal(pq.linear(x.float(), b, 8, torch.bfloat16),
                       _call(ops, pq, x, b, fp32_out=False).float())
    tiled = pq._tiled(x, b, torch.bfloat16)
    wt = pq.dequantize_t(0, n, bf16=True)
    # the tiles round the product to bf16, then the sum with the bf16 bias again
    xd, wd = x.double(), wt.double()
    mag = xd.abs() @ wd.abs() + b.double().abs()
    bound = (k + 1) * 2.0 ** -24 * mag * 1.01 + 2.0 ** -7 * mag
    assert ((y.double() - tiled.double()).abs() <= 2 * bound).all()
    # rows up to max_rows keep the widening kernel (fp32 math: not this path)
    small = pq.linear(x[:8], b, 8, None)
    assert not torch.equal(small, _call(ops, pq, x[:8], b, fp32_out=False))


def test_other_levels_keep_the_tiles(ops, monkeypatch):
    """Without the flag (other levels) bf16 inputs past max_rows take the tiles."""
    pq = PackedQuantizedWeight(ops, _weight(64, 128, 4, 32, False, 10))
    x = torch.randn(20, 128, generator=torch.Generator().manual_seed(1)).bfloat16()

    class NoDot:
        def __getattr__(self, name):
            if name == "has_quant_dot":
                return False
            return getattr(ops, name)

    pq.ops = NoDot()
    assert not pq.dot
    assert torch.equal(pq.linear(x, None, 8, torch.bfloat16), pq._tiled(x, None, torch.bfloat16))


def test_bad_arguments_are_refused(ops):
    pq = PackedQuantizedWeight(ops, _weight(64, 128, 8, 32, False, 11))
    with pytest.raises(RuntimeError, match="bf16"):
        _call(ops, pq, torch.randn(20, 128), None)
    with pytest.raises(RuntimeError, match="bf16"):
        _call(ops, pq, torch.randn(20, 64).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bias"):
        _call(ops, pq, torch.randn(20, 128).bfloat16(), torch.randn(3))


def test_moe_experts_take_it_past_max_rows(ops):
    """PackedQuantizedExperts.grouped: an expert group past max_rows in bf16 takes
    linear_quant_dot (the quad layout too), smaller groups the kernel."""
    from tokenmill.models.layers.linear_methods.quantized_cpu import PackedQuantizedExperts
    n, k = 64, 128
    w13 = [_weight(2 * n, k, 4, 32, False, 20 + e) for e in range(3)]
    w2 = [_weight(k, n, 4, 32, False, 30 + e) for e in range(3)]
    experts = PackedQuantizedExperts.from_quantized(ops, w13, w2, 8, 8, None)
    assert experts.quad
    xs = torch.randn(50, k, generator=torch.Generator().manual_seed(21)).bfloat16()
    groups = [(0, 0, 30), (2, 30, 35), (1, 35, 50)]  # (expert, lo, hi): 30, 5, 15 rows
    out = experts.grouped(xs, experts.w13, 2 * n, groups, None, None)
    for e, lo, hi in groups:
        want = (_call(ops, experts.w13[e], xs[lo:hi], None, fp32_out=False) if hi - lo > 8
                else experts.w13[e].linear(xs[lo:hi], None, 8, None))
        assert torch.equal(out[lo:hi], want)
    assert not torch.equal(out[30:35], _call(ops, experts.w13[2], xs[30:35], None, False))
