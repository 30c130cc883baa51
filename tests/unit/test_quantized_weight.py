"""The canonical quantized weight (layers/linear_methods/quantized_weight.py): its
dequantization, act-order permutation, reference GEMM and the int8 made at load."""
import pytest
import torch
import torch.nn.functional as F

from tokenmill.models.layers.linear_methods.quantized_weight import (
    QuantizedWeight, quantize_int8_per_channel, reference_linear)


def _random(n, k, bits, group, perm=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    top = 1 << bits
    qw = QuantizedWeight(torch.randint(0, top, (n, k), generator=g).to(torch.uint8),
                         torch.rand(n, groups, generator=g) * 0.01 + 1e-3,
                         torch.randint(0, top, (n, groups), generator=g).to(torch.uint8),
                         bits, group,
                         torch.randperm(k, generator=g) if perm else None)
    return qw.check()


@pytest.mark.parametrize("bits,group,perm", [(4, 32, False), (4, 16, True), (8, 40, False),
                                             (8, 100, True)])
def test_dequantize_matches_the_formula(bits, group, perm):
    qw = _random(7, 100, bits, group, perm)
    w = torch.empty(7, 100)
    for n in range(7):
        for k in range(100):
            g = k // group
            w[n, k] = (int(qw.codes[n, k]) - int(qw.zeros[n, g])) * float(qw.scales[n, g])
    if perm:
        w_ckpt = torch.empty_like(w)
        w_ckpt[:, qw.perm] = w  # checkpoint column perm[k] is kernel column k
        w = w_ckpt
    assert torch.equal(qw.dequantize(), w)


@pytest.mark.parametrize("perm", [False, True])
def test_reference_linear_in_tiles_equals_the_dense_gemm(perm, monkeypatch):
    from tokenmill.models.layers.linear_methods import quantized_weight as mod
    qw = _random(50, 64, 4, 16, perm)
    x = torch.randn(3, 64)
    bias = torch.randn(50)
    want = F.linear(x, qw.dequantize(), bias)
    torch.testing.assert_close(reference_linear(qw, x, bias), want, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(mod, "ROW_TILE_ELEMENTS", 64 * 7)  # tiles of 7 rows
    torch.testing.assert_close(reference_linear(qw, x, bias), want, rtol=1e-5, atol=1e-5)


def test_int8_per_channel_round_trip():
    w = torch.randn(16, 64)
    w[3] = 0
    qw = quantize_int8_per_channel(w).check()
    deq = qw.dequantize()
    step = w.abs().amax(1, keepdim=True) / 127
    assert bool(((deq - w).abs() <= step / 2 + 1e-7).all())
    assert torch.equal(deq[3], torch.zeros(64))
    assert int(qw.codes.min()) >= 1 and int(qw.codes.max()) <= 255


def test_check_names_what_is_wrong():
    qw = _random(4, 32, 4, 16)
    qw.codes[0, 0] = 16
    with pytest.raises(ValueError, match="exceeds 15"):
        qw.check()
    qw = _random(4, 32, 4, 16)
    qw.scales[1, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        qw.check()
    qw = _random(4, 32, 4, 16)
    qw.perm = torch.zeros(32, dtype=torch.int64)
    with pytest.raises(ValueError, match="permutation"):
        qw.check()
