"""The quad layout of the native quantized kernels (tokenmill/kernels/cpu_quant_linear.cpp,
the avx2, avx512, avx512_vnni and avx512_bf16 levels): 4- and 8-bit codes multiplied with integer dot
products (vpdpbusd at avx512_vnni, vpmaddwd on zero-extended codes below it) on
activations rounded to 15 bits per block of at most 128 k within a group.

Checked against an independent float64 model of that rounding (written here from the
rule, not read from the kernel): per row and block, scale = amax / 16383, xq =
round-half-even(x * (16383 / amax)) in fp32; the kernel's output must equal
(xq * scale) @ W'^T to fp32 rounding, and stay within the rounding's own bound of the
unrounded product. Also: the layout round-trips through dequantize_quant, NaN / inf
stay in their row, the refusals, and the platform asking for it for bf16 models only.
Every level with the layout computes the same integer sums and closes them with the same
fp32 operations: their outputs must equal each other bit for bit.
"""
import pytest
import torch

from tokenmill import kernels
from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.models.layers.linear_methods.quantized_cpu import (PackedQuantizedWeight,
                                                                  quad_layout_fits)
from tokenmill.models.layers.linear_methods.quantized_weight import QuantizedWeight
from tokenmill.platforms.cpu import quad_exact_from

from test_quant_linear_kernel import _layer, _random  # noqa: E402 (the same random weights)

# (N, K, group): one group = K (per channel) with K not a multiple of 128, groups of 8,
# 32, 64, 128, 192 and 512 (> 128: two or four activation blocks per group, the last one
# short for 192), N not a multiple of 32 (nor of 16), a lone column, the bench model's
# shapes at group 32
SHAPES = [(45, 264, 264), (33, 128, 32), (1, 64, 64), (70, 512, 128), (64, 40, 8),
          (96, 576, 192), (40, 1536, 1536), (57, 384, 64), (83, 1024, 512),
          (112, 512, 32), (48, 1536, 32)]
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 31, 64]  # every tail of the 4- and 2-row micro-kernels
ACT_BLOCK, ACT_MAX = 128, 16383.0


# Rows from which a level's quad kernel multiplies exactly: the platform's mirror of
# cpu_quant_linear.cpp's quad_dequant_min_rows, which the tests below hold it to.
_exact_from = quad_exact_from


@pytest.fixture
def quad_ops(ops):
    if not ops.has_quant_quad:
        pytest.skip(f"no quad layout at the {ops.capability} level (avx2 and above)")
    return ops


def _symmetric(qw):
    """qw with GPTQ's symmetric zero point (2^(bits-1) for every group and column)."""
    zeros = torch.full_like(qw.zeros, 1 << (qw.bits - 1))
    return QuantizedWeight(qw.codes, qw.scales, zeros, qw.bits, qw.group_size).check()


def _pack(ops, qw, quad=True):
    return ops.pack_quant_weight(qw.codes, qw.scales, qw.zeros, qw.bits, qw.group_size, quad)


def _blocks(k, group):
    """The activation blocks (k0, k1): at most 128 k, never across a group boundary."""
    for g0 in range(0, k, group):
        g1 = min(k, g0 + group)
        for k0 in range(g0, g1, ACT_BLOCK):
            yield k0, min(g1, k0 + ACT_BLOCK)


def _rounded_x(x, group):
    """x as the quad kernel multiplies it, float64, and the rounding's bound per
    element (half a step: amax / 32766)."""
    x = x.float()
    out = torch.empty(x.shape, dtype=torch.float64)
    half_step = torch.empty(x.shape, dtype=torch.float64)
    for k0, k1 in _blocks(x.shape[1], group):
        blk = x[:, k0:k1]
        amax = blk.abs().amax(dim=1, keepdim=True)
        inv = torch.where(amax > 0, torch.tensor(ACT_MAX) / amax, torch.zeros_like(amax))
        xq = torch.round(blk * inv)  # fp32 product, rounded half to even
        out[:, k0:k1] = xq.double() * (amax / torch.tensor(ACT_MAX)).double()
        half_step[:, k0:k1] = (amax.double() / (2 * ACT_MAX)).expand(-1, k1 - k0)
    return out, half_step


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("fp16_scales", [False, True])
def test_quad_layout_round_trips(quad_ops, bits, n, k, group, fp16_scales):
    qw = _random(n, k, bits, group, fp16_scales=fp16_scales)
    codes, scales, zeros = _pack(quad_ops, qw)
    assert tuple(codes.shape) == (-(-n // 32), k // (8 if bits == 4 else 4), 128)
    assert codes.numel() == _pack(quad_ops, qw, quad=False)[0].numel()  # the same bytes
    whole = quad_ops.dequantize_quant(codes, scales, zeros, n, bits, group, 0, n)
    assert torch.equal(whole.t(), qw.dequantize_rows(0, n))
    if n > 32:
        part = quad_ops.dequantize_quant(codes, scales, zeros, n, bits, group, 32, n, True)
        assert torch.equal(part.t(), qw.dequantize_rows(32, n).bfloat16())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sym", [False, True])
def test_quad_kernel_is_the_product_of_the_rounded_activations(quad_ops, bits, n, k, group,
                                                                dtype, sym):
    qw = _random(n, k, bits, group, seed=n + k)
    if sym:
        qw = _symmetric(qw)
    packed = _pack(quad_ops, qw)
    w = qw.dequantize_rows(0, n).double()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(k)
    for rows in [r for r in ROWS if r < _exact_from(quad_ops.capability, bits)]:
        x = torch.randn(rows, k, generator=g)
        x[:, :8] *= 40  # a block with an outlier: its other elements round coarser
        x[rows // 2, :] *= 1e-3  # rows of very different magnitudes
        x = x.to(dtype)
        y = quad_ops.linear_quant(x, *packed, n, bits, group, bias)
        assert y.dtype == dtype and tuple(y.shape) == (rows, n)
        xr, half_step = _rounded_x(x, group)
        want = xr @ w.T + bias.double()
        mag = xr.abs() @ w.abs().T + bias.double().abs()
        out_rounding = 2.0 ** -8 * want.abs() if dtype == torch.bfloat16 else 0.0
        err = (y.double() - want).abs()
        assert bool((err <= 1e-5 * mag + out_rounding + 1e-30).all()), rows
        # ... and within the rounding's bound of the product of x as it came
        true = x.double() @ w.T + bias.double()
        bound = half_step @ w.abs().T + 1e-5 * mag + out_rounding
        assert bool(((y.double() - true).abs() <= bound + 1e-30).all()), rows


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quad_kernel_multiplies_many_rows_exactly(quad_ops, bits, dtype):
    """From 65 rows (4-bit at avx2: 32) the quad kernel dequantizes each block and
    multiplies it in fp32, as the widening kernel does: the exact product, no rounding of
    the activations (the outliers below would move the rounded product outside this
    bound)."""
    n, k, group = 70, 576, 192
    qw = _random(n, k, bits, group, seed=5)
    packed = _pack(quad_ops, qw)
    w = qw.dequantize_rows(0, n).double()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(6))
    g = torch.Generator().manual_seed(7)
    first = _exact_from(quad_ops.capability, bits)
    for rows in sorted({first, 65, 80}):
        x = torch.randn(rows, k, generator=g)
        x[:, :8] *= 1000
        x = x.to(dtype)
        y = quad_ops.linear_quant(x, *packed, n, bits, group, bias)
        want = x.double() @ w.T + bias.double()
        mag = x.double().abs() @ w.abs().T + bias.double().abs()
        out_rounding = 2.0 ** -8 * want.abs() if dtype == torch.bfloat16 else 0.0
        assert bool(((y.double() - want).abs() <= 1e-5 * mag + out_rounding + 1e-30).all())
        if dtype == torch.float32:  # (bf16 outputs' own rounding would hide it)
            rounded = _rounded_x(x, group)[0] @ w.T + bias.double()
            assert not bool(((rounded - want).abs() <= 1e-5 * mag).all())


@pytest.mark.parametrize("bits", [4, 8])
def test_quad_kernel_switches_to_the_exact_product_at_its_row_limit(quad_ops, bits):
    """One row below the level's limit the activations are rounded (the product of the
    rounded x, not of x itself), from the limit on they are not: the limit is where
    _exact_from says, at every level."""
    n, k, group = 40, 256, 32
    qw = _random(n, k, bits, group, seed=21)
    packed = _pack(quad_ops, qw)
    w = qw.dequantize_rows(0, n).double()
    first = _exact_from(quad_ops.capability, bits)
    g = torch.Generator().manual_seed(22)
    for rows, exact in ((first - 1, False), (first, True)):
        x = torch.randn(rows, k, generator=g)
        x[:, :8] *= 1000  # outliers: the rounded product is far from the exact one
        y = quad_ops.linear_quant(x, *packed, n, bits, group, torch.empty(0)).double()
        mag = x.double().abs() @ w.abs().T
        near_exact = bool(((y - x.double() @ w.T).abs() <= 1e-5 * mag).all())
        rounded = _rounded_x(x, group)[0] @ w.T
        near_rounded = bool(((y - rounded).abs() <= 1e-5 * mag).all())
        assert (near_exact, near_rounded) == (exact, not exact), rows


def test_quad_kernel_catches_a_wrong_code_or_zero_point(quad_ops):
    """The comparison above can fail: one code or zero point changed in the packed
    layout moves its column's output out of the bound."""
    n, k, group = 64, 256, 64
    qw = _random(n, k, 8, group)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3))
    w = qw.dequantize_rows(0, n).double()
    xr, _ = _rounded_x(x, group)
    mag = xr.abs() @ w.abs().T
    for tensor_index in (0, 2):  # codes, zeros
        packed = list(_pack(quad_ops, qw))
        t = packed[tensor_index].clone()
        t.view(-1)[77] ^= 0x10
        packed[tensor_index] = t
        y = quad_ops.linear_quant(x, *packed, n, 8, group, torch.empty(0))
        assert not bool(((y.double() - xr @ w.T).abs() <= 1e-5 * mag).all())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 128, 512])
@pytest.mark.parametrize("sign", [1.0, -1.0, 0.0])
def test_quad_sums_at_their_largest(quad_ops, bits, group, sign):
    """The largest integer sums the layout can make: every code at its top, every zero
    point 0, every activation of a block at +-amax (xq = +-16383: VNNI's hi -128 / 127,
    lo 1 / 127), one row and two, activation blocks of 32 to 128 k; sign 0: runs of 8 k
    at +1 and -1 by turns. An accumulator that overflowed (a narrower lane, a longer run
    between widenings: a vpmaddubsw kernel summing 8 lines in int16 failed here) would
    be off by far more than fp32 rounding."""
    n, k = 48, 512
    top = (1 << bits) - 1
    groups = k // group
    qw = QuantizedWeight(torch.full((n, k), top, dtype=torch.uint8),
                         torch.rand(n, groups, generator=torch.Generator().manual_seed(4)) + 0.5,
                         torch.zeros(n, groups, dtype=torch.uint8), bits, group).check()
    packed = _pack(quad_ops, qw)
    w = qw.dequantize_rows(0, n).double()
    for rows in (1, 2):
        x = torch.full((rows, k), sign if sign else 1.0)
        if not sign:
            x.view(rows, -1, 8)[:, 1::2] = -1.0
        x[rows - 1] *= 3.0  # another amax, the same codes
        y = quad_ops.linear_quant(x, *packed, n, bits, group, torch.empty(0))
        want = x.double() @ w.T  # x is its own rounding: every |x| is its block's amax
        assert bool(((y.double() - want).abs() <= 1e-6 * (x.double().abs() @ w.T)).all()), rows


@pytest.mark.parametrize("bits,group", [(8, 512), (4, 32), (4, 128)])
def test_non_finite_activations_stay_in_their_row(quad_ops, bits, group):
    """A NaN / inf anywhere in a row (here in one group of many) makes every output of
    that row NaN, as the fp32 product's would be, and no other row's."""
    n, k = 70, 512
    qw = _random(n, k, bits, group)
    packed = _pack(quad_ops, qw)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for rows in (3, 6):
            x = torch.randn(rows, k)
            x[1, 300] = bad
            y = quad_ops.linear_quant(x, *packed, n, bits, group, torch.empty(0))
            others = [r for r in range(rows) if r != 1]
            assert bool(y[others].isfinite().all())
            assert bool(y[1].isnan().all())
    zero = quad_ops.linear_quant(torch.zeros(2, k), *packed, n, bits, group, torch.empty(0))
    assert torch.equal(zero, torch.zeros(2, n))


@pytest.mark.parametrize("bits,group", [(8, 512), (4, 32), (4, 128)])
def test_vanishing_activation_blocks_count_as_zero(quad_ops, bits, group):
    """An activation block whose largest |x| is so small that 1 / its step overflows
    (here 1e-36 and a subnormal 1e-40) gives finite outputs: that block adds zero, the
    row's other blocks are multiplied as usual (a row of nothing but such values gives
    the bias-free zero)."""
    n, k = 70, 512
    qw = _random(n, k, bits, group)
    packed = _pack(quad_ops, qw)
    w = qw.dequantize().double()
    for tiny in (1e-36, 1e-40):
        x = torch.randn(3, k)
        x[1, :128] = tiny  # the first activation block of the row
        x[2] = tiny
        y = quad_ops.linear_quant(x, *packed, n, bits, group, torch.empty(0))
        assert bool(y.isfinite().all())
        assert torch.equal(y[2], torch.zeros(n))
        kept = x.clone()
        kept[1, :128] = 0
        want = kept[:2].double() @ w.T
        mag = kept[:2].double().abs() @ w.abs().T
        assert bool(((y[:2].double() - want).abs() <= 1e-3 * mag + 1e-6).all())


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 128), (4, 512)])
def test_quad_bf16_outputs_are_the_fp32_ones_rounded(quad_ops, bits, group):
    """bf16 outputs are written straight from the kernel's registers: the fp32 call's
    outputs on the same (bf16) inputs, rounded as torch rounds, bit for bit (odd N:
    partial vectors; rows 1..8 and across the 4-row micro-kernel)."""
    n, k = 83, 512
    qw = _random(n, k, bits, group, seed=9)
    packed = _pack(quad_ops, qw)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(8)
    for rows in (1, 2, 3, 4, 5, 8, 13):
        x = torch.randn(rows, k, generator=g).bfloat16()
        y16 = quad_ops.linear_quant(x, *packed, n, bits, group, bias)
        y32 = quad_ops.linear_quant(x.float(), *packed, n, bits, group, bias)
        assert y16.dtype == torch.bfloat16
        assert torch.equal(y16, y32.bfloat16()), rows


def test_quad_results_do_not_depend_on_the_thread_split(quad_ops):
    """Column blocks are split over threads only when each thread's share is large
    enough; every split computes each block alone, so the bits are the same."""
    saved = torch.get_num_threads()
    qw = _random(3072, 512, 4, 32, seed=11)
    packed = _pack(quad_ops, qw)
    g = torch.Generator().manual_seed(12)
    try:
        for rows in (1, 4, 9):
            x = torch.randn(rows, 512, generator=g).bfloat16()
            outs = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                outs.append(quad_ops.linear_quant(x, *packed, 3072, 4, 32, torch.empty(0)))
            assert all(torch.equal(o, outs[0]) for o in outs[1:]), rows
    finally:
        torch.set_num_threads(saved)


def test_quad_refusals(ops):
    qw = _random(40, 64, 8, 32)
    if not ops.has_quant_quad:
        with pytest.raises(RuntimeError, match="quad layout needs the avx2 kernel level"):
            _pack(ops, qw)
        return
    for k, group in ((60, 60), (64, 12)):  # K not a multiple of 8; groups of 12
        bad = _random(40, k, 8, group)
        with pytest.raises(RuntimeError, match="quad layout takes 4- or 8-bit codes"):
            _pack(ops, bad)
        assert not quad_layout_fits(ops, 8, k, group)
    codes = torch.zeros(40, 64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="quad layout"):
        ops.pack_quant_weight(codes, torch.ones(40, 1), torch.empty(0, dtype=torch.uint8),
                              ops.QUANT_E4M3, 64, True)
    # a plain-layout module's codes with the quad shape: refused by the group check
    c, s, z = _pack(ops, qw)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ops.linear_quant(torch.randn(1, 64), c, s, z, 40, 8, 12, torch.empty(0))


@pytest.mark.parametrize("native_bf16", [False, True])
def test_platform_asks_for_the_quad_layout_for_bf16_models_only(ops, kernel_level,
                                                                native_bf16, monkeypatch):
    from tokenmill.platforms import cpu
    from tokenmill.platforms.cpu import (DEFAULT_AMX_QUAD_QUANTIZED_ROWS,
                                         DEFAULT_QUAD_QUANTIZED_ROWS, QUAD_LEVELS,
                                         CpuPlatform)
    monkeypatch.setattr(cpu, "cpu_has_native_bf16", lambda: native_bf16)
    bf16 = CpuPlatform.create("cpu", torch.bfloat16)
    f32 = CpuPlatform.create("cpu", torch.float32)
    assert f32.quantized_quad_max_rows == 0  # fp32 models stay exact
    # tiles in fp32 (bf16 emulated, or a level below avx512): as many rows as the
    # widening kernel takes; native bf16 tiles: the quad limit, lower where the rows past
    # it go to AMX tiles
    rows = (max(DEFAULT_QUAD_QUANTIZED_ROWS, bf16.quantized_max_rows)
            if bf16.gemm_dtype != "bfloat16"
            else DEFAULT_AMX_QUAD_QUANTIZED_ROWS if getattr(ops, "has_amx_gemm", False)
            else DEFAULT_QUAD_QUANTIZED_ROWS)
    want = rows if ops.has_quant_quad and kernel_level in QUAD_LEVELS else 0
    assert bf16.quantized_quad_max_rows == want
    assert ("15-bit activations" in bf16.describe()) == bool(want)
    if want:  # the rows the kernel really takes as integers, not the layer's limit
        int4, int8 = (min(want, quad_exact_from(kernel_level, b) - 1) for b in (4, 8))
        assert (f"int4 / int8 up to {int4}" if int4 == int8
                else f"int4 up to {int4}, int8 up to {int8}") in bf16.describe()
    qw = _random(70, 128, 4, 32)
    for platform, dtype in ((bf16, torch.bfloat16), (f32, torch.float32)):
        layer = _layer(qw, True, dtype)
        layer.set_method(platform.linear_method(layer))
        packed = layer.method.packed
        assert packed is not None
        assert packed.quad == (dtype == torch.bfloat16 and bool(want))
        if packed.quad:
            assert layer.method.max_rows == want
            assert "15-bit activations" in layer.method.describe()
        assert torch.equal(layer.dense_weight().float(), qw.dequantize().to(dtype).float())


def test_packed_weight_falls_back_to_the_plain_layout_where_the_shape_does_not_fit(quad_ops):
    for k, group, quad in ((100, 100, False), (96, 12, False), (96, 24, True), (96, 96, True)):
        qw = _random(40, k, 8, group)
        packed = PackedQuantizedWeight(quad_ops, qw, quad=True)
        assert packed.quad == quad
        x = torch.randn(2, k).bfloat16()
        y = packed.linear(x, None, 64, None)
        xr, half_step = (_rounded_x(x, group) if quad else (x.double(), torch.zeros(x.shape)))
        w = qw.dequantize_rows(0, 40).double()
        want = xr @ w.T
        bound = 1e-5 * (xr.abs() @ w.abs().T) + 2.0 ** -8 * want.abs()
        assert bool(((y.double() - want).abs() <= bound + 1e-30).all()), (k, group)


def test_levels_without_the_layout_report_it(kernel_level):
    module = kernels.cpu_ops(kernel_level)
    if module is None:
        pytest.skip("no native kernels")
    assert module.has_quant_quad == (kernel_level != "default")


def _quad_modules():
    """{level: module} for every level this CPU runs that has the quad layout."""
    out = {}
    for level in kernels.runnable_levels():
        module = kernels.cpu_ops(level)
        if module is not None and module.has_quant_quad:
            out[level] = module
    return out


def _same_bits(a, b):
    """Equal values, NaN where the other is NaN, and the same signs of zero."""
    nan = a.isnan()
    return (torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])
            and torch.equal(a[~nan].signbit(), b[~nan].signbit()))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sym", [False, True])
def test_every_level_with_the_quad_layout_gives_the_same_bits(bits, n, k, group, dtype, sym):
    """vpmaddwd (avx2, avx512) and vpdpbusd (avx512_vnni, avx512_bf16) make the same exact
    integer sums and the same fp32 closing: the same bits, NaN / inf rows included (an
    AVX-512 CPU without VNNI still compares its avx512 and avx2 builds). Row counts that
    a level multiplies exactly (_exact_from) are compared among the levels that do."""
    modules = _quad_modules()
    if len(modules) < 2:
        pytest.skip("needs two levels with the quad layout "
                    f"(this CPU runs {', '.join(kernels.runnable_levels())})")
    ref = list(modules)[-1]
    qw = _random(n, k, bits, group, seed=3 * n + k, fp16_scales=bits == 4)
    if sym:
        qw = _symmetric(qw)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(n)
    packed = {level: _pack(module, qw) for level, module in modules.items()}
    for level in modules:  # one layout: the packed bytes are the same at every level
        assert all(torch.equal(a, b) for a, b in zip(packed[level], packed[ref]))
    for rows in ROWS:
        # (levels whose kernel multiplies these rows exactly are compared with each other)
        path = {level: rows >= _exact_from(level, bits) for level in modules}
        x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 10
        x[:, 1] *= 300  # an outlier per row
        if rows >= 3:
            x[rows - 1] = 0.0
            x[1, k // 2] = float("nan") if rows % 2 else float("inf")
        x = x.to(dtype)
        want = {}
        for level, module in modules.items():
            y = module.linear_quant(x, *packed[level], n, bits, group, bias)
            want.setdefault(path[level], y)
            assert _same_bits(y, want[path[level]]), (level, rows)


def test_amx_rows_past_the_quad_limit_take_the_tiles(ops, kernel_level, monkeypatch):
    """At amx a bf16 layer's first DEFAULT_AMX_QUAD_QUANTIZED_ROWS rows take the quad
    kernel and more rows linear_quant_dot on AMX tiles: the layer's output equals the
    chosen kernel's bit for bit on each side of the limit (and the two kernels round
    differently, so the other one would show)."""
    if not getattr(ops, "has_amx_gemm", False) or not ops.has_quant_quad:
        pytest.skip(f"the amx level's routing ({ops.capability} here)")
    from tokenmill.platforms import cpu
    monkeypatch.setattr(cpu, "cpu_has_native_bf16", lambda: True)
    platform = cpu.CpuPlatform.create("cpu", torch.bfloat16)
    limit = cpu.DEFAULT_AMX_QUAD_QUANTIZED_ROWS
    assert platform.quantized_quad_max_rows == limit
    qw = _random(70, 128, 4, 32)
    layer = _layer(qw, False, torch.bfloat16)
    layer.set_method(platform.linear_method(layer))
    packed = layer.method.packed
    assert packed.quad
    args = (packed.codes, packed.scales, packed.zeros, 70, packed.kind, packed.group_size,
            torch.empty(0))
    g = torch.Generator().manual_seed(3)
    for rows in (1, limit, limit + 1, 64):
        x = torch.randn(rows, 128, generator=g).bfloat16()
        quad = ops.linear_quant(x, *args).to(torch.bfloat16)
        tiles = ops.linear_quant_dot(x, *args).to(torch.bfloat16)
        want, other = (quad, tiles) if rows <= limit else (tiles, quad)
        y = layer(x)
        assert torch.equal(y, want), rows
        assert not torch.equal(y, other), rows
