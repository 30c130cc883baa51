"""The native W4A16 / W8A16 kernels (tokenmill/kernels/cpu_quant_linear.cpp) at every
capability level this CPU runs, and `QuantizedLinearMethod` on them
(linear_methods/quantized_cpu.py): the packed layout round-trips exactly, the GEMM
matches the exact product as closely as the PyTorch reference does, odd shapes (K
not a multiple of the group, N not a multiple of the pack, one group per row), act-order.

The vec.h primitives the kernel widens codes with (load_u8, load_u4_pairs) are checked
lane by lane in tests/kernels/vec_check.cpp (tests/unit/test_vec_header.py: every
level, the plain-array fallback, aarch64 NEON under qemu).
"""
import pytest
import torch

from tokenmill import kernels
from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.linear_methods.quantized_linear import QuantizedLinearMethod
from tokenmill.models.layers.linear_methods.quantized_weight import (QuantizedWeight,
                                                                     reference_linear)

# (N, K, group): K not a multiple of the group, N not a multiple of 32, one group = K
SHAPES = [(45, 100, 48), (33, 128, 32), (1, 64, 64), (70, 256, 128), (64, 96, 96)]
ROWS = [1, 2, 3, 4, 7, 15, 16, 17, 33, 64]


def _random(n, k, bits, group, perm=False, fp16_scales=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    top = 1 << bits
    scales = torch.rand(n, groups, generator=g) * 0.01 + 1e-3
    if fp16_scales:
        scales = scales.half().float()
    return QuantizedWeight(torch.randint(0, top, (n, k), generator=g).to(torch.uint8), scales,
                           torch.randint(0, top, (n, groups), generator=g).to(torch.uint8),
                           bits, group,
                           torch.randperm(k, generator=g) if perm else None).check()


def _pack(ops, qw):
    return ops.pack_quant_weight(qw.codes, qw.scales, qw.zeros, qw.bits, qw.group_size)


def _exact(qw, x, bias):
    """x (kernel column order) W'^T + b in float64, and the magnitude |x| |W'|^T + |b|
    that bounds fp32 rounding (summation order differs between the two fp32 paths)."""
    return exact_linear(qw.dequantize_rows(0, qw.shape[0]), x, bias)


def exact_linear(w, x, bias):
    """x W^T + b in float64 and |x| |W|^T + |b|, the bound of fp32 rounding (also the
    fp8 kernel's tests')."""
    xd, wd = x.double(), w.double()
    y, mag = xd @ wd.T, xd.abs() @ wd.abs().T
    if bias is not None:
        y, mag = y + bias.double(), mag + bias.double().abs()
    return y, mag


def _close(y, exact, mag, rel=0.0):
    """Within 1e-5 of the magnitude (plus `rel` of the value: a bf16 output's rounding)."""
    err = (y.double() - exact).abs()
    return bool((err <= 1e-5 * mag + rel * exact.abs() + 1e-30).all())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("fp16_scales", [False, True])
def test_packed_layout_round_trips(ops, bits, n, k, group, fp16_scales):
    qw = _random(n, k, bits, group, fp16_scales=fp16_scales)
    codes, scales, zeros = _pack(ops, qw)
    nb = -(-n // 32)
    assert tuple(codes.shape) == (nb, k, 32 if bits == 8 else 16)
    # fp16 where every scale is exactly one (half the bytes), else fp32
    assert scales.dtype == (torch.float16 if fp16_scales else torch.float32)
    whole = ops.dequantize_quant(codes, scales, zeros, n, bits, group, 0, n)
    assert tuple(whole.shape) == (k, n)
    assert torch.equal(whole.t(), qw.dequantize_rows(0, n))
    if n > 32:
        assert torch.equal(ops.dequantize_quant(codes, scales, zeros, n, bits, group, 32, n).t(),
                           qw.dequantize_rows(32, n))
    # bf16 tiles (the tiled path's, on bf16 inputs): the fp32 values rounded as torch
    # rounds them, partial 32-column blocks included.
    for r0 in (0, 32) if n > 32 else (0,):
        half = ops.dequantize_quant(codes, scales, zeros, n, bits, group, r0, n, True)
        assert half.dtype == torch.bfloat16
        assert torch.equal(half.t(), qw.dequantize_rows(r0, n).to(torch.bfloat16))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group", SHAPES)
def test_linear_quant_matches_the_exact_product(ops, bits, n, k, group):
    qw = _random(n, k, bits, group, seed=n + k)
    packed = _pack(ops, qw)
    g = torch.Generator().manual_seed(1)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g)
        for bias in (None, torch.randn(n, generator=g)):
            y = ops.linear_quant(x, *packed, n, bits, group,
                                 bias if bias is not None else torch.empty(0))
            exact, mag = _exact(qw, x, bias)
            assert y.dtype == torch.float32 and y.shape == (rows, n)
            assert _close(y, exact, mag), (rows, (y.double() - exact).abs().max())
            # as close as the PyTorch reference is
            ref = reference_linear(qw, x, bias)
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=2e-5 * float(mag.max()))
            xb = x.bfloat16()
            yb = ops.linear_quant(xb, *packed, n, bits, group,
                                  bias if bias is not None else torch.empty(0))
            exact_b, mag_b = _exact(qw, xb.float(), bias)
            assert yb.dtype == torch.bfloat16
            assert _close(yb, exact_b, mag_b, rel=2.0 ** -8), rows


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 5, 20])
def test_a_wrong_zero_point_code_or_scale_is_caught(ops, bits, rows):
    """The comparison above is tight enough to see one value off in one group."""
    n, k, group = 45, 100, 48
    qw = _random(n, k, bits, group, fp16_scales=True)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3))
    exact, mag = _exact(qw, x, None)
    top = (1 << bits) - 1

    def kernel(q):
        return ops.linear_quant(x, *_pack(ops, q), n, bits, group, torch.empty(0))

    assert _close(kernel(qw), exact, mag)
    for field, idx in (("zeros", (44, 1)), ("codes", (40, 70)), ("scales", (33, 0))):
        bad = QuantizedWeight(qw.codes.clone(), qw.scales.clone(), qw.zeros.clone(), bits, group)
        t = getattr(bad, field)
        if field == "scales":
            t[idx] *= 1.5
        else:
            t[idx] = 0 if int(t[idx]) > top // 2 else top
        assert not _close(kernel(bad), exact, mag), field


def test_bad_arguments_are_refused(ops):
    qw = _random(40, 64, 4, 32)
    codes, scales, zeros = _pack(ops, qw)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="bits"):
        ops.linear_quant(x, codes, scales, zeros, 40, 8, 32, torch.empty(0))
    with pytest.raises(RuntimeError, match=r"x must be \[M, K\]"):
        ops.linear_quant(torch.randn(2, 63), codes, scales, zeros, 40, 4, 32, torch.empty(0))
    with pytest.raises(RuntimeError, match="column count"):
        ops.linear_quant(x, codes, scales, zeros, 65, 4, 32, torch.empty(0))
    with pytest.raises(RuntimeError, match="scales"):
        ops.linear_quant(x, codes, scales, zeros, 40, 4, 16, torch.empty(0))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.dequantize_quant(codes, scales, zeros, 40, 4, 32, 5, 40)
    with pytest.raises(RuntimeError, match="exceeds 15"):
        ops.pack_quant_weight(torch.full((4, 64), 16, dtype=torch.uint8), qw.scales[:4],
                              qw.zeros[:4], 4, 32)


# ---- the linear method on the kernels ------------------------------------------------------

class _Canonical(QuantizedLinearMethod):
    """A format whose checkpoint holds the canonical form itself (the tests' format)."""
    CHECKPOINT_TENSORS = ("q_codes", "q_scales", "q_zeros", "q_perm")

    def __init__(self, qw: QuantizedWeight):
        self.src = qw

    def create_weights(self, layer, in_features, out_features, bias, dtype=None):
        self._register_bias(layer, out_features, bias, dtype)
        q = self.src
        for name, t in (("q_codes", q.codes), ("q_scales", q.scales), ("q_zeros", q.zeros),
                        ("q_perm", q.perm)):
            layer.register_buffer(name, None if t is None else t.clone())

    def to_quantized(self, layer) -> QuantizedWeight:
        return QuantizedWeight(layer.q_codes, layer.q_scales, layer.q_zeros, self.src.bits,
                               self.src.group_size, layer.q_perm)


def _layer(qw, bias, dtype=torch.float32):
    n, k = qw.shape
    layer = Linear(k, n, bias=bias, method=_Canonical(qw), dtype=dtype)
    if bias:
        layer.bias.data.copy_(torch.randn(n, generator=torch.Generator().manual_seed(5)))
    return layer


def _platform(model_dtype):
    from tokenmill.platforms.cpu import CpuPlatform
    return CpuPlatform.create("cpu", model_dtype)


@pytest.mark.parametrize("bits,group,perm,bias", [(4, 32, True, True), (8, 100, False, False),
                                                  (4, 48, False, True), (8, 16, True, False)])
def test_method_on_the_platform_kernels_matches_the_reference(ops, bits, group, perm, bias):
    n, k = 70, 100
    qw = _random(n, k, bits, group, perm=perm, fp16_scales=True, seed=7)
    platform = _platform(torch.float32)
    assert platform.quantized_max_rows > 0 and platform.ops is ops
    native = _layer(qw, bias)
    native.set_method(platform.linear_method(native))
    method = native.method
    assert method.packed is not None and method.qweight is None  # the only copy
    assert not any(hasattr(native, name) for name in _Canonical.CHECKPOINT_TENSORS)
    assert "native up to" in method.describe()
    ref = _layer(qw, bias)
    ref.set_method(ref.method)  # no kernels: the PyTorch reference
    assert ref.method.packed is None
    assert torch.equal(native.dense_weight(), qw.dequantize())
    assert torch.equal(native.dense_weight(), ref.dense_weight())
    g = torch.Generator().manual_seed(2)
    # 300 rows: above the platform's limit, dequantized tiles and the library GEMM
    for shape in [(1, k), (3, k), (2, 5, k), (300, k)]:
        x = torch.randn(*shape, generator=g)
        want = ref(x)
        got = native(x)
        assert got.shape == want.shape
        xk = x.reshape(-1, k)[:, qw.perm] if perm else x.reshape(-1, k)
        exact, mag = _exact(qw, xk, native.bias)
        assert _close(got.reshape(-1, n), exact, mag), shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5 * float(mag.max()))


def test_method_tiles_above_max_rows_and_widens_bf16(ops, monkeypatch):
    """A bf16 model where bf16 is emulated: GEMMs in fp32, bf16 in and out; past
    max_rows, tiles of weight rows (a few per call here) dequantized one at a time."""
    from tokenmill.models.layers.linear_methods import quantized_cpu
    monkeypatch.setattr(quantized_cpu, "ROW_TILE_ELEMENTS", 64 * 40)  # 32-row tiles
    n, k = 100, 64
    qw = _random(n, k, 4, 16, fp16_scales=True, seed=9)
    native = _layer(qw, True, torch.bfloat16)
    native.set_method(native.method.for_platform(ops, torch.float32, 2))
    ref = _layer(qw, True, torch.bfloat16)
    ref.set_method(ref.method.for_platform(None, torch.float32, 0))
    check_bf16_layers(native, ref, qw.dequantize_rows(0, n), k)


def check_bf16_layers(native, ref, w, k):
    """A bf16 layer on the native kernel against the exact product with W (fp32 [N, K])
    and against `ref`, the same layer without the kernel, at decode-sized row counts."""
    for rows in (1, 2, 3, 9):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got, want = native(x), ref(x)
        assert got.dtype == torch.bfloat16
        exact, mag = exact_linear(w, x.float(), native.bias.float())
        assert _close(got, exact, mag, rel=2.0 ** -8), rows
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-4)


@pytest.mark.parametrize("bits,group", [(4, 128), (4, 32), (8, 128), (8, 1024)])
def test_resident_bytes_stay_within_1_1x_of_the_checkpoint(ops, bits, group):
    """A GPTQ / AWQ checkpoint: codes at `bits` bits, fp16 scales, zero points at `bits`."""
    n, k = 256, 1024
    qw = _random(n, k, bits, group, fp16_scales=True)
    layer = _layer(qw, False)
    layer.set_method(layer.method.for_platform(ops, None, 8))
    groups = -(-k // group)
    checkpoint = n * k * bits // 8 + n * groups * 2 + n * groups * bits // 8
    assert layer.method.packed.nbytes() <= 1.1 * checkpoint


@pytest.mark.parametrize("native_bf16", [False, True])
def test_platform_sets_the_quantized_row_limit(ops, kernel_level, native_bf16, monkeypatch):
    """Both CPU kinds on every machine: whether bf16 is native is the platform's
    reading of the CPU flags, stood in for here."""
    from tokenmill.platforms import cpu
    from tokenmill.platforms.cpu import (DEFAULT_NATIVE_BF16_QUANTIZED_ROWS,
                                         DEFAULT_QUANT_DOT_ROWS, DEFAULT_QUANTIZED_ROWS,
                                         CpuPlatform)
    monkeypatch.setattr(cpu, "cpu_has_native_bf16", lambda: native_bf16)
    p = CpuPlatform.create("cpu", torch.float32)
    want = DEFAULT_QUANTIZED_ROWS if ops.has_fast_linear_bf16 else 0
    assert p.quantized_max_rows == want
    assert p.as_dict()["quantized_max_rows"] == want
    assert ("int4 / int8 / fp8 weights native" in p.describe()) == bool(want)
    # A bf16 model: the limit measured where bf16 GEMMs are native, else the fp32 one.
    b = CpuPlatform.create("cpu", torch.bfloat16)
    # (an x86 level forced below avx512 widens as an AVX2 CPU would)
    levels = kernels.all_levels()
    below = "avx512" in levels and levels.index(kernel_level) < levels.index("avx512")
    assert (b.gemm_dtype == "bfloat16") == (native_bf16 and not below)
    # (with vdpbf16ps, linear_quant_dot takes the bf16 rows past the decode sizes)
    dot = getattr(ops, "has_quant_dot", False)
    native = (DEFAULT_QUANTIZED_ROWS if b.gemm_dtype != "bfloat16" else
              DEFAULT_QUANT_DOT_ROWS if dot else DEFAULT_NATIVE_BF16_QUANTIZED_ROWS)
    assert b.quantized_max_rows == (native if want else 0)
    assert ("vdpbf16ps" in b.describe()) == bool(want and dot and b.gemm_dtype == "bfloat16")
    assert CpuPlatform.create("cpu", torch.float32, cpu_kernels="torch").quantized_max_rows == 0
