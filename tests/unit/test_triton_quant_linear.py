"""The Triton quantized-weight GEMMs (tokenmill/ops/triton_quant_linear.py) against the
PyTorch reference of each format, on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1 must be set before triton is imported). Tiny shapes: the
interpreter runs each program in Python."""
import pytest

from conftest import interpret_triton_or_skip, random_quantized_weight

triton = interpret_triton_or_skip(__name__)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

tq = pytest.importorskip("tokenmill.ops.triton_quant_linear")

from tokenmill.models.layers.linear_methods.fp8 import dequantize_block_fp8  # noqa: E402
from tokenmill.models.layers.linear_methods.quantized_weight import reference_linear  # noqa: E402


def _qw(n, k, bits, group, perm=False, seed=0):
    return random_quantized_weight(n, k, bits, group, perm, seed)


@pytest.mark.parametrize("bits,n,k,group,rows,perm", [
    (4, 70, 100, 32, 1, False),    # N not a multiple of the tile, K odd tail of groups
    (4, 64, 131, 48, 3, True),     # odd K (a half-filled last byte), act-order
    (8, 33, 96, 96, 20, False),    # one group per row, a second row tile
    (8, 16, 64, 16, 2, True),
])
def test_int_weight_gemm_equals_the_reference(bits, n, k, group, rows, perm):
    qw = _qw(n, k, bits, group, perm)
    x = torch.randn(rows, k)
    bias = torch.randn(n)
    got = tq.IntWeightTriton(qw, "cpu").linear(x, bias)
    torch.testing.assert_close(got, reference_linear(qw, x, bias), rtol=1e-5, atol=1e-5)
    # A wrong zero point in one group of one row is seen.
    bad = _qw(n, k, bits, group, perm)
    bad.zeros[n // 2, 0] ^= 1
    assert not torch.allclose(tq.IntWeightTriton(bad, "cpu").linear(x, bias),
                              reference_linear(qw, x, bias), rtol=1e-5, atol=1e-5)


def test_int_weight_gemm_in_bf16_rounds_the_weights_as_a_bf16_model():
    qw = _qw(40, 64, 4, 32)
    x = torch.randn(2, 64).to(torch.bfloat16)
    got = tq.IntWeightTriton(qw, "cpu").linear(x, None)
    assert got.dtype == torch.bfloat16
    want = F.linear(x.float(), qw.dequantize(torch.bfloat16).float())
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("bits,k,group,split", [(4, 300, 32, 3), (8, 257, 64, 2),
                                                  (4, 128, 128, 8)])
def test_int_weight_gemm_split_over_k_equals_the_reference(bits, k, group, split):
    """K cut into ranges (decode rows on a GPU with idle SMs): the partials summed equal
    one pass; K not a multiple of the split's range (a short last split), more splits
    asked than K blocks (clamped)."""
    qw = _qw(40, k, bits, group, perm=bits == 4)
    x = torch.randn(2, k)
    bias = torch.randn(40)
    gpu = tq.IntWeightTriton(qw, "cpu")
    want = reference_linear(qw, x, bias)
    torch.testing.assert_close(gpu.linear(x, bias, split_k=split), want, rtol=1e-5, atol=1e-5)
    got = gpu.linear(x.to(torch.bfloat16), None, split_k=split)
    assert got.dtype == torch.bfloat16
    want_b = F.linear(x.to(torch.bfloat16).float(), qw.dequantize(torch.bfloat16).float())
    # (the output rounded to bf16: a few ulps of the largest output)
    torch.testing.assert_close(got.float(), want_b, rtol=1e-2,
                               atol=1e-2 * want_b.abs().max().item())


@pytest.mark.parametrize("dtype,group", [(torch.float32, 64), (torch.float32, 16),
                                         (torch.bfloat16, 32), (torch.float32, 48)])
def test_no_scale_is_read_past_the_last_group(dtype, group):
    """A split's tiles past K (and a partial last group) read no scale or zero point
    beyond the last group's: NaNs stored right after them never reach the output (one
    scale row per tile, whole groups per tile, and per code)."""
    qw = _qw(40, 257, 8, group)
    layer = tq.IntWeightTriton(qw, "cpu")
    for name, fill in (("scales", float("nan")), ("zeros", 255)):
        t = getattr(layer, name)
        padded = torch.cat([t, torch.full((4, t.shape[1]), fill, dtype=t.dtype)])
        setattr(layer, name, padded[:t.shape[0]])  # the padding lies just past the view
    x = torch.randn(2, 257).to(dtype)
    for split in (1, 2, 3):
        got = layer.linear(x, None, split_k=split)
        assert torch.isfinite(got).all(), split
        want = F.linear(x.float(), qw.dequantize(dtype).float())
        torch.testing.assert_close(got.float(), want, rtol=1e-2,
                                   atol=1e-2 * want.abs().max().item())


def test_fp8_block_gemm_split_over_k_equals_one_pass():
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(48, 200, generator=g) * 50).to(torch.float8_e4m3fn)
    s = torch.rand(3, 5, generator=g) * 0.01 + 1e-3
    x = torch.randn(3, 200, generator=g)
    bias = torch.randn(48, generator=g)
    layer = tq.Fp8WeightTriton(w, s, (16, 48))
    want = F.linear(x, dequantize_block_fp8(w, s, (16, 48)), bias)
    torch.testing.assert_close(layer.linear(x, bias, split_k=3), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["int4-g32-actorder", "int8-channel", "fp8-b128"])
def test_prefill_rows_take_the_dequantized_weights(fmt):
    """From DEQUANT_MIN_ROWS rows W^T is dequantized (a Triton kernel) for torch's GEMM:
    fp32 equal to the reference; the dequantized weights exactly the reference's
    rounded to the dtype; bf16 close to a bf16 model's F.linear."""
    g = torch.Generator().manual_seed(6)
    n, k = 72, 256
    if fmt.startswith("fp8"):
        w = (torch.randn(n, k, generator=g) * 50).to(torch.float8_e4m3fn)
        s = torch.rand(1, 2, generator=g) * 0.01 + 1e-3
        layer, ref_w = tq.Fp8WeightTriton(w, s, (128, 128)), dequantize_block_fp8(w, s, (128, 128))
    else:
        qw = _qw(n, k, 4, 32, perm=True) if fmt.startswith("int4") else _qw(n, k, 8, k)
        layer, ref_w = tq.IntWeightTriton(qw, "cpu"), qw.dequantize()
    x = torch.randn(tq.DEQUANT_MIN_ROWS + 3, k, generator=g)
    bias = torch.randn(n, generator=g)
    torch.testing.assert_close(layer.linear(x, bias), F.linear(x, ref_w, bias),
                               rtol=1e-5, atol=1e-4)
    perm = getattr(layer, "perm", None)
    ref_wt = (ref_w if perm is None else ref_w[:, perm]).t()  # (act-order: the codes' order)
    wt = torch.empty(k, n)
    layer._dequantize_into(wt)
    assert torch.equal(wt, ref_wt)
    # bf16: the interpreter's fp32 -> bf16 conversion truncates (a GPU's rounds to
    # nearest even: exact there, tests/gpu/test_cuda_quant.py), so within one bf16 step
    wt = torch.empty(k, n, dtype=torch.bfloat16)
    layer._dequantize_into(wt)
    assert ((wt.float() - ref_wt).abs() <= ref_wt.abs() * 2 ** -7).all()
    xb = x.to(torch.bfloat16)
    want = F.linear(xb, ref_w.to(torch.bfloat16), bias.to(torch.bfloat16)).float()
    torch.testing.assert_close(layer.linear(xb, bias).float(), want, rtol=1e-2,
                               atol=1e-2 * want.abs().max().item())


def test_fp8_decode_tile_within_a_block_reads_one_scale_row():
    """bf16 decode rows over 128 x 128 blocks (the tile inside one block column: its
    scales loaded as a row), split over K, against a bf16 model's weights."""
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(96, 384, generator=g) * 50).to(torch.float8_e4m3fn)
    s = torch.rand(1, 3, generator=g) * 0.01 + 1e-3
    xb = torch.randn(2, 384, generator=g).to(torch.bfloat16)
    want = F.linear(xb.float(), dequantize_block_fp8(w, s, (128, 128)).to(torch.bfloat16).float())
    for split in (1, 3):
        got = tq.Fp8WeightTriton(w, s, (128, 128)).linear(xb, None, split_k=split)
        torch.testing.assert_close(got.float(), want, rtol=1e-2,
                                   atol=1e-2 * want.abs().max().item())


def test_split_k_fills_the_sms_at_decode_rows_only():
    # Qwen3-0.6B's down_proj at one row (16 tiles of 64 columns, 24 K blocks of 128) on
    # 132 SMs, 4 programs per SM asked: 8 splits of 3 K blocks (16 would leave 1.5)
    assert tq.pick_split_k(16, 24, 132, 4) == 8
    assert tq.pick_split_k(16, 3, 132, 4) == 1   # each split keeps >= 2 K blocks
    assert tq.pick_split_k(64 * 16, 48, 132) == 1  # a batch's tiles fill the SMs
    assert tq.pick_split_k(16, 48, 1) == 1


def test_e4m3_decode_covers_every_finite_bit_pattern():
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = torch.isfinite(bits.view(torch.float8_e4m3fn).float())
    w = bits[finite].view(1, -1).repeat(16, 1)  # 16 rows, each every finite pattern
    k = w.shape[1]
    fp8 = tq.Fp8WeightTriton(w.view(torch.float8_e4m3fn), torch.ones(1, 1), (16, k))
    got = fp8.linear(torch.eye(k), None)  # x = I: y[j, n] = W[n, j]
    assert torch.equal(got, w.view(torch.float8_e4m3fn).float().t())


@pytest.mark.parametrize("n,k,block,rows", [(70, 100, (32, 32), 1), (64, 128, (16, 64), 18)])
def test_fp8_block_gemm_equals_the_dequantized_weights(n, k, block, rows):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(n, k, generator=g) * 50).to(torch.float8_e4m3fn)
    s = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 0.01 + 1e-3
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g)
    got = tq.Fp8WeightTriton(w, s, block).linear(x, bias)
    want = F.linear(x, dequantize_block_fp8(w, s, block), bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _cuda_platform(monkeypatch):
    from tokenmill.platforms import cuda
    monkeypatch.setattr(cuda, "module_available", lambda name: name == "triton")
    return cuda.CudaPlatform.create("cpu", torch.float32)  # (decisions only: no GPU here)


def test_the_cuda_platform_gives_quantized_layers_the_triton_gemms(monkeypatch):
    """An int8 layer (--quantization int8) and a block-fp8 layer, through the CUDA
    platform's choice: the Triton GEMMs hold the weights (no other copy) and compute
    what the PyTorch methods compute."""
    from tokenmill.models.layers.linear import Linear
    from tokenmill.models.layers.linear_methods.fp8 import Fp8BlockLinearMethod
    from tokenmill.models.layers.linear_methods.int8_at_load import Int8AtLoadLinearMethod
    platform = _cuda_platform(monkeypatch)
    assert platform.quantized_gemm == "triton"
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 64, generator=g)

    layer = Linear(64, 48, bias=True)
    layer.weight.data = torch.randn(48, 64, generator=g)
    layer.bias.data = torch.randn(48, generator=g)
    dense = layer.weight.detach().clone()
    layer.use_method(Int8AtLoadLinearMethod(), torch.float32)
    layer.weight.data = dense.clone()
    layer.bias.data = torch.randn(48, generator=g)
    layer.set_method(platform.linear_method(layer))
    assert layer.method.gpu is not None and layer.method.qweight is None
    assert "Triton" in layer.method.describe()
    ref = layer.method.gpu.dequantize()
    torch.testing.assert_close(layer(x), F.linear(x, ref, layer.bias), rtol=1e-5, atol=1e-5)
    assert ((ref - dense).abs() <= dense.abs().amax(1, keepdim=True) / 254 + 1e-6).all()

    fp8 = Linear(64, 48, bias=False)
    fp8.use_method(Fp8BlockLinearMethod((16, 32)), torch.float32)
    fp8.weight.data = (torch.randn(48, 64, generator=g) * 30).to(torch.float8_e4m3fn)
    fp8.weight_scale_inv.data = torch.rand(3, 2, generator=g) * 0.01
    want = fp8(x)  # the PyTorch method
    fp8.set_method(platform.linear_method(fp8))
    assert fp8.method.gpu is not None and "Triton" in fp8.method.describe()
    torch.testing.assert_close(fp8(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits,group,perm", [(4, 16, True), (8, 64, False)])
def test_triton_layout_dequantizes_back_to_the_canonical_weights(bits, group, perm):
    qw = _qw(24, 63, bits, group, perm)
    assert torch.equal(tq.IntWeightTriton(qw, "cpu").dequantize(), qw.dequantize())


@pytest.mark.parametrize("bits", [4, 8])
def test_int_weight_gemm_on_a_padded_act_order_share(bits):
    """A row-parallel rank's act-order share (act_order_share.py): perm repeats input
    columns for the padding, whose codes sit at the zero point; the GEMM and
    dequantize() equal the reference's."""
    from tokenmill.models.layers.linear_methods.act_order_share import row_share_form
    g = torch.Generator().manual_seed(3)
    n, k, groups, group = 24, 40, 6, 16  # 40 of a 96-column matrix's columns
    codes = torch.randint(0, 1 << bits, (n, k), generator=g).to(torch.uint8)
    scales = torch.rand(n, groups, generator=g) * 0.02 + 1e-3
    zeros = torch.randint(0, 1 << bits, (n, groups), generator=g).to(torch.uint8)
    g_idx = torch.randperm(96, generator=g)[:k] // group
    qw = row_share_form(codes, scales, zeros, g_idx, bits, group, "t").check()
    assert qw.padded
    x = torch.randn(3, k)
    w = tq.IntWeightTriton(qw, "cpu")
    torch.testing.assert_close(w.linear(x, None), reference_linear(qw, x, None),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(w.dequantize(), qw.dequantize())
    want = (codes.float() - zeros[:, g_idx].float()) * scales[:, g_idx]
    assert torch.equal(qw.dequantize(), want)


def test_quant_gemm_bench_runs_every_format_against_bf16():
    """bench/quant_gemm.py (timed on a GPU by scripts/gpu_check.sh) runs each format, here
    under the interpreter: a row per shape x rows x format, ratios against bf16."""
    from tokenmill.bench import quant_gemm
    rows = quant_gemm.run([(40, 256)], [1, 3], list(quant_gemm.FORMATS), "cpu", 1, None)
    assert [(r["rows"], r["format"]) for r in rows] == [
        (m, f) for m in (1, 3) for f in quant_gemm.FORMATS]
    assert all(r["us"] > 0 and r["weight_bytes"] > 0 for r in rows)
    assert all(("speed_over_bf16" in r) == (r["format"] != "bf16") for r in rows)
    by = {r["format"]: r["weight_bytes"] for r in rows}
    assert by["int4-g128"] < by["int8"] < by["bf16"]  # the stored widths are what is read
