"""The native kernels' e4m3 kind (tokenmill/kernels/cpu_quant_linear.cpp, bits =
ops.QUANT_E4M3) at every capability level this CPU runs, and `Fp8BlockLinearMethod`
on them (linear_methods/fp8.py, quantized_cpu.py `PackedQuantizedWeight.e4m3`).

The reference is fp8.py's dequantization, W = e4m3 value * block scale in fp32
(`dequantize_block_fp8`): the packed layout gives it back exactly, every one of the
254 non-NaN codes (subnormals included) widens exactly, and the GEMM matches the
float64 product of x and W as closely as the integer kinds do (within 1e-5 of
|x| |W|^T), over odd shapes: N not a multiple of the 32-column pack, K not a
multiple of bk, block rows of 1 (per-channel), 3 and 128, rows 1..64 (the one-row,
row-blocked and dequantized-block paths), fp32 and bf16 inputs, with and without bias.
"""
import dataclasses

import pytest
import torch

from tokenmill.kernels import testing
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.linear_methods.fp8 import (FP8_DTYPE, Fp8BlockLinearMethod,
                                                        dequantize_block_fp8,
                                                        per_channel_block)
from test_quant_linear_kernel import (_close, check_bf16_layers,  # the int kernel's checks
                                      exact_linear as _exact)

# (N, K, [bn, bk]): per-channel (one-row blocks spanning K); K = 100 not a multiple of
# bk = 48; bn = 3 (block rows straddle the 32-column packs); bn = 128 > N; one column.
SHAPES = [(45, 100, (1, 100)), (70, 100, (3, 48)), (33, 256, (128, 128)),
          (100, 96, (128, 32)), (1, 64, (1, 64)), (64, 130, (3, 64))]
ROWS = [1, 2, 3, 4, 7, 15, 16, 17, 33, 64]
# The fixtures that run a test once per capability level (tokenmill/kernels/testing.py).
kernel_level, ops = testing.kernel_level, testing.ops
NAN_CODES = (0x7F, 0xFF)
FINITE_CODES = torch.tensor([c for c in range(256) if c not in NAN_CODES], dtype=torch.uint8)


def _random(n, k, block, seed=0):
    """e4m3 weight [n, k] (every finite code, as far as n * k allows, then random ones)
    and positive block scales [ceil(n/bn), ceil(k/bk)]."""
    bn, bk = block
    g = torch.Generator().manual_seed(seed)
    codes = FINITE_CODES[torch.randint(0, len(FINITE_CODES), (n * k,), generator=g)]
    head = min(n * k, len(FINITE_CODES))
    codes[:head] = FINITE_CODES[torch.randperm(len(FINITE_CODES), generator=g)[:head]]
    weight = codes.view(n, k).view(FP8_DTYPE)
    scale = torch.rand(-(-n // bn), -(-k // bk), generator=g) * 0.01 + 1e-3
    return weight, scale


def _pack(ops, weight, scale, block):
    bn, bk = block
    scales = scale.repeat_interleave(bn, 0)[:weight.shape[0]].contiguous()
    return ops.pack_quant_weight(weight, scales, torch.empty(0, dtype=torch.uint8),
                                 ops.QUANT_E4M3, bk)




@pytest.mark.parametrize("n,k,block", SHAPES)
def test_packed_e4m3_dequantizes_exactly_to_the_reference(ops, n, k, block):
    weight, scale = _random(n, k, block)
    codes, scales, zeros = _pack(ops, weight, scale, block)
    assert tuple(codes.shape) == (-(-n // 32), k, 32) and codes.dtype == torch.uint8
    assert zeros.numel() == 0  # no zero point
    want = dequantize_block_fp8(weight, scale, block)
    got = ops.dequantize_quant(codes, scales, zeros, n, ops.QUANT_E4M3, block[1], 0, n)
    assert tuple(got.shape) == (k, n)
    assert torch.equal(got.t(), want)
    if n > 32:
        part = ops.dequantize_quant(codes, scales, zeros, n, ops.QUANT_E4M3, block[1], 32, n)
        assert torch.equal(part.t(), want[32:])
    half = ops.dequantize_quant(codes, scales, zeros, n, ops.QUANT_E4M3, block[1], 0, n, True)
    assert torch.equal(half.t(), want.to(torch.bfloat16))


def test_every_finite_code_widens_exactly_on_every_path(ops):
    """All 254 non-NaN codes (both zeros, the subnormals, +-448) in one [254, 33]
    weight; one-hot rows of x pick single weights, so each path's output is exactly
    code * scale (one product, one rounding, as the reference): the one-row and
    row-blocked kernels (1, 5 rows) and the dequantized block (all 33 rows)."""
    n, k = len(FINITE_CODES), 33
    idx = (torch.arange(n)[:, None] + torch.arange(k)[None]) % n  # every code per column
    weight = FINITE_CODES[idx].view(FP8_DTYPE)
    scale = torch.rand(n, 1, generator=torch.Generator().manual_seed(4)) + 0.5
    block = per_channel_block(k)
    packed = _pack(ops, weight, scale, block)
    want = dequantize_block_fp8(weight, scale, block)
    eye = torch.eye(k)
    for rows in (eye[:1], eye[3:8], eye):
        y = ops.linear_quant(rows, *packed, n, ops.QUANT_E4M3, k, torch.empty(0))
        assert torch.equal(y, rows @ want.T), len(rows)
    subnormal = weight.view(torch.uint8)[:, 0] & 0x78 == 0
    assert int(subnormal.sum()) == 16  # +-0 and the 14 subnormals were among them


@pytest.mark.parametrize("n,k,block", SHAPES)
def test_linear_e4m3_matches_the_exact_product(ops, n, k, block):
    weight, scale = _random(n, k, block, seed=n + k)
    packed = _pack(ops, weight, scale, block)
    w = dequantize_block_fp8(weight, scale, block)
    g = torch.Generator().manual_seed(1)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g)
        for bias in (None, torch.randn(n, generator=g)):
            b = bias if bias is not None else torch.empty(0)
            y = ops.linear_quant(x, *packed, n, ops.QUANT_E4M3, block[1], b)
            exact, mag = _exact(w, x, bias)
            assert y.dtype == torch.float32 and y.shape == (rows, n)
            assert _close(y, exact, mag), (rows, (y.double() - exact).abs().max())
            xb = x.bfloat16()
            yb = ops.linear_quant(xb, *packed, n, ops.QUANT_E4M3, block[1], b)
            exact_b, mag_b = _exact(w, xb.float(), bias)
            assert yb.dtype == torch.bfloat16
            assert _close(yb, exact_b, mag_b, rel=2.0 ** -8), rows


@pytest.mark.parametrize("rows", [1, 2, 5, 20])
def test_a_wrong_code_or_scale_is_caught(ops, rows):
    """The comparison above is tight enough to see one weight or one scale off."""
    n, k, block = 45, 100, (3, 48)
    weight, scale = _random(n, k, block, seed=3)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3))
    exact, mag = _exact(dequantize_block_fp8(weight, scale, block), x, None)

    def kernel(wt, sc):
        return ops.linear_quant(x, *_pack(ops, wt, sc, block), n, ops.QUANT_E4M3, block[1],
                                torch.empty(0))

    assert _close(kernel(weight, scale), exact, mag)
    bad = weight.view(torch.uint8).clone()
    bad[40, 70] ^= 0x40  # the top exponent bit: a different magnitude
    assert not _close(kernel(bad.view(FP8_DTYPE), scale), exact, mag)
    bad_scale = scale.clone()
    bad_scale[11, 1] *= 1.5  # rows 33..35, columns 48..95
    assert not _close(kernel(weight, bad_scale), exact, mag)


def test_bad_e4m3_arguments_are_refused(ops):
    weight, scale = _random(40, 64, (1, 64))
    codes, scales, zeros = _pack(ops, weight, scale, (1, 64))
    e4m3, x = ops.QUANT_E4M3, torch.randn(2, 64)
    with pytest.raises(RuntimeError, match=r"pack_quant_weight: an e4m3 code is NaN"):
        nan = weight.view(torch.uint8).clone()
        nan[3, 5] = 0xFF
        ops.pack_quant_weight(nan, scale, zeros, e4m3, 64)
    with pytest.raises(RuntimeError, match=r"pack_quant_weight: zeros must be empty"):
        ops.pack_quant_weight(weight, scale, torch.zeros(40, 1, dtype=torch.uint8), e4m3, 64)
    with pytest.raises(RuntimeError, match=r"linear_quant: zeros must be empty"):
        ops.linear_quant(x, codes, scales, torch.zeros(2, 1, 32, dtype=torch.uint8), 40, e4m3,
                         64, torch.empty(0))
    with pytest.raises(RuntimeError, match=r"bits must be 4, 8 or 228 \(e4m3\), got 7"):
        ops.linear_quant(x, codes, scales, zeros, 40, 7, 64, torch.empty(0))
    with pytest.raises(RuntimeError, match="codes must come from pack_quant_weight"):
        ops.linear_quant(x, codes, scales, zeros, 40, 4, 64, torch.empty(0))


# ---- Fp8BlockLinearMethod on the kernels ---------------------------------------------------

def _layer(weight, scale, block, bias, dtype=torch.float32):
    n, k = weight.shape
    layer = Linear(k, n, bias=bias, method=Fp8BlockLinearMethod(block), dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.weight_scale_inv.copy_(scale)
        if bias:
            layer.bias.copy_(torch.randn(n, generator=torch.Generator().manual_seed(5)))
    return layer


def _platform(model_dtype, **changes):
    from tokenmill.platforms.cpu import CpuPlatform
    return dataclasses.replace(CpuPlatform.create("cpu", model_dtype), **changes)


@pytest.mark.parametrize("n,k,block,bias", [(70, 100, (3, 48), True), (45, 100, (1, 100), False),
                                            (33, 256, (128, 128), True)])
def test_method_on_the_platform_kernels_matches_the_reference(ops, n, k, block, bias):
    weight, scale = _random(n, k, block, seed=7)
    platform = _platform(torch.float32)
    assert platform.quantized_max_rows > 0 and platform.ops is ops
    native = _layer(weight, scale, block, bias)
    native.set_method(platform.linear_method(native))
    method = native.method
    assert method.packed is not None and method.ops is ops
    # the packed copy is the only one: the e4m3 weight and its scales are meta now
    assert native.weight.is_meta and native.weight.dtype == FP8_DTYPE
    assert native.weight_scale_inv.is_meta and tuple(native.weight_scale_inv.shape) == \
        tuple(scale.shape)
    assert f"native up to {platform.quantized_max_rows} rows" in method.describe()
    ref = _layer(weight, scale, block, bias)  # no kernels: dequantized per call
    want_w = dequantize_block_fp8(weight, scale, block)
    assert torch.equal(native.dense_weight(), want_w)
    assert torch.equal(native.dense_weight(), ref.dense_weight())
    g = torch.Generator().manual_seed(2)
    # 300 rows: above the platform's limit, dequantized tiles and the library GEMM
    for shape in [(1, k), (3, k), (2, 5, k), (300, k)]:
        x = torch.randn(*shape, generator=g)
        got, want = native(x), ref(x)
        assert got.shape == want.shape
        exact, mag = _exact(want_w, x.reshape(-1, k), native.bias)
        assert _close(got.reshape(-1, n), exact, mag), shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5 * float(mag.max()))


def test_method_tiles_above_max_rows_and_widens_bf16(ops, monkeypatch):
    """A bf16 model where bf16 is emulated: GEMMs in fp32, bf16 in and out; past
    max_rows, tiles of weight rows (a few per call here) dequantized one at a time."""
    from tokenmill.models.layers.linear_methods import quantized_cpu
    monkeypatch.setattr(quantized_cpu, "ROW_TILE_ELEMENTS", 64 * 40)  # 32-row tiles
    n, k, block = 100, 64, (3, 16)
    weight, scale = _random(n, k, block, seed=9)
    platform = _platform(torch.bfloat16, gemm_dtype="float32", quantized_max_rows=2)
    native = _layer(weight, scale, block, True, torch.bfloat16)
    native.set_method(platform.linear_method(native))
    assert native.method.compute_dtype == torch.float32 and native.method.packed is not None
    ref = _layer(weight, scale, block, True, torch.bfloat16)
    ref.set_method(_platform(torch.bfloat16, gemm_dtype="float32",
                             quantized_max_rows=0).linear_method(ref))
    assert ref.method.packed is None and ref.method.compute_dtype == torch.float32
    w = dequantize_block_fp8(weight, scale, block)
    assert native.dense_weight().dtype == torch.bfloat16
    assert torch.equal(native.dense_weight(), w.bfloat16())
    check_bf16_layers(native, ref, w, k)


@pytest.mark.parametrize("block", [(128, 128), (1, 1024), (64, 64)])
def test_resident_bytes_stay_within_1_1x_of_the_checkpoint(ops, block):
    """The checkpoint: a byte a weight and an fp32 scale per block. Packed: a byte a
    weight and an fp32 scale per column and bk group (blocks of bk >= 64)."""
    n, k = 256, 1024
    weight, scale = _random(n, k, block)
    layer = _layer(weight, scale, block, False)
    layer.set_method(layer.method.for_platform(ops, None, 8))
    checkpoint = n * k + scale.numel() * 4
    assert layer.method.packed.nbytes() <= 1.1 * checkpoint
    assert not any(t.device.type != "meta" for t in layer.parameters())


def test_platform_keeps_the_method_without_kernels_or_widening():
    """No kernels (PyTorch CPU kernels) and no widening: the same method object."""
    weight, scale = _random(48, 32, (16, 16))
    layer = _layer(weight, scale, (16, 16), False)
    platform = _platform(torch.float32, quantized_max_rows=0)
    assert platform.linear_method(layer) is layer.method
