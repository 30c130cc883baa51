"""The integer formats' readers against their layouts as the formats describe them,
independently of tokenmill's writer: tiny tensors whose int32 words are written out
by hand here (hex, most significant nibble first), converted by each layout into the
canonical QuantizedWeight and dequantized. Plus the writer's round trip and the
act-order g_idx rules."""
from __future__ import annotations

import pytest
import torch

from tokenmill.models.layers.linear_methods.awq import AwqLayout
from tokenmill.models.layers.linear_methods.compressed_tensors import CompressedTensorsLayout
from tokenmill.models.layers.linear_methods.gptq import GptqLayout
from tokenmill.models.layers.linear_methods.int_packing import (act_order_perm, pack_int32,
                                                                unpack_int32)
from tokenmill.models.layers.linear_methods.quantized_weight import reference_linear
from tokenmill.models.quant_formats.encode import (encode_awq, encode_compressed_tensors,
                                                   encode_gptq)
from tokenmill.models.quant_formats.rtn import quantize_rtn


def i32(word: int) -> int:
    """A 32-bit pattern as the signed int32 safetensors stores."""
    return word - (1 << 32) if word >= 1 << 31 else word


def words(*ws) -> torch.Tensor:
    return torch.tensor([i32(w) for w in ws], dtype=torch.int32)


@pytest.mark.parametrize("v1", [True, False])
def test_gptq_4bit_hand_packed(v1):
    """K = 8, N = 2, one group. Column 0's codes 1..8 along k, lowest nibble first:
    0x87654321; column 1: 15 then zeros: 0x0000000F. qzeros packs the two columns'
    stored zeros 7 and 2 into one word along N: 0x27 (v1: zero points 8 and 3)."""
    t = {"qweight": words(0x87654321, 0x0000000F).reshape(1, 2),
         "qzeros": words(0x27).reshape(1, 1),
         "scales": torch.tensor([[0.5, 0.25]], dtype=torch.float16).float(),
         "g_idx": torch.zeros(8, dtype=torch.int64)}
    qw = GptqLayout(4, -1, v1_zeros=v1).convert(t, 8, (2,), "test").check()
    z0, z1 = (8, 3) if v1 else (7, 2)
    want = torch.tensor([[(c - z0) * 0.5 for c in range(1, 9)],
                         [(15 - z1) * 0.25] + [(0 - z1) * 0.25] * 7])
    assert torch.equal(qw.dequantize(), want)
    assert qw.perm is None


def test_gptq_8bit_hand_packed_two_groups():
    """8 bits: four codes a word. K = 8, N = 1, group 4: column 0's codes 0x01, 0x80,
    0xFF, 0x10 | 0x02 x4 -> words 0x10FF8001, 0x02020202; v2 zeros 0x80 and 0x01 for
    the two groups (one column: one word each)."""
    t = {"qweight": words(0x10FF8001, 0x02020202).reshape(2, 1),
         "qzeros": words(0x80, 0x01).reshape(2, 1),
         "scales": torch.tensor([[2.0], [0.5]])}
    qw = GptqLayout(8, 4, v1_zeros=False, g_idx=False).convert(t, 8, (1,), "test")
    want = torch.tensor([[(0x01 - 128) * 2.0, 0.0, (0xFF - 128) * 2.0, (0x10 - 128) * 2.0,
                          0.5, 0.5, 0.5, 0.5]])
    assert torch.equal(qw.check().dequantize(), want)


def test_gptq_act_order_g_idx_by_hand():
    """K = 4, group 2, g_idx [1, 0, 0, 1]: columns 1 and 2 form group 0, 0 and 3 group 1.
    Codes 1, 2, 3, 4 (word 0x4321); zeros 0 (v2); scales group 0: 1, group 1: 10."""
    t = {"qweight": words(0x4321).reshape(1, 1), "qzeros": words(0, 0).reshape(2, 1),
         "scales": torch.tensor([[1.0], [10.0]]),
         "g_idx": torch.tensor([1, 0, 0, 1])}
    qw = GptqLayout(4, 2, v1_zeros=False).convert(t, 4, (1,), "test").check()
    assert qw.perm.tolist() == [1, 2, 0, 3]
    assert torch.equal(qw.dequantize(), torch.tensor([[10.0, 2.0, 3.0, 40.0]]))
    x = torch.randn(3, 4)
    assert torch.allclose(qw.dequantize() @ x.T, torch.tensor([[10.0, 2.0, 3.0, 40.0]]) @ x.T)


def test_awq_hand_packed_nibble_order():
    """K = 1, N = 8: output j's code is 15 - j and its zero point j + 1. AWQ's word
    holds output AWQ_ORDER[i] = (0, 2, 4, 6, 1, 3, 5, 7)[i] in nibble i: codes
    15, 13, 11, 9, 14, 12, 10, 8 -> 0x8ACE9BDF; zeros 1, 3, 5, 7, 2, 4, 6, 8 ->
    0x86427531."""
    t = {"qweight": words(0x8ACE9BDF).reshape(1, 1), "qzeros": words(0x86427531).reshape(1, 1),
         "scales": torch.full((1, 8), 0.5)}
    qw = AwqLayout(-1).convert(t, 1, (8,), "test").check()
    assert qw.codes[:, 0].tolist() == [15 - j for j in range(8)]
    assert qw.zeros[:, 0].tolist() == [j + 1 for j in range(8)]
    assert torch.equal(qw.dequantize()[:, 0], torch.tensor([(14 - 2 * j) * 0.5
                                                           for j in range(8)]))


def test_compressed_tensors_hand_packed():
    """Signed codes q = -8, -1, 0, 1, 7, 3, -3, 2 stored + 8 = 0, 7, 8, 9, 15, 11, 5, 10
    along the input dim: 0xA5BF9870. Symmetric: zero point 0. Asymmetric zero points
    of 8 rows, packed along the output dim: -1, 0, 1, 2, 3, -8, 7, -2 stored
    7, 8, 9, 10, 11, 0, 15, 6 -> 0x6F0BA987."""
    q = torch.tensor([-8, -1, 0, 1, 7, 3, -3, 2], dtype=torch.float32)
    t = {"weight_packed": words(0xA5BF9870).reshape(1, 1),
         "weight_scale": torch.tensor([[0.5]]), "weight_shape": torch.tensor([1, 8])}
    qw = CompressedTensorsLayout(4, None, True).convert(t, 8, (1,), "test").check()
    assert torch.equal(qw.dequantize()[0], q * 0.5)
    t = {"weight_packed": words(*[0xA5BF9870] * 8).reshape(8, 1),
         "weight_scale": torch.full((8, 1), 0.25), "weight_shape": torch.tensor([8, 8]),
         "weight_zero_point": words(0x6F0BA987).reshape(1, 1)}
    qw = CompressedTensorsLayout(4, 8, False).convert(t, 8, (8,), "test").check()
    zp = torch.tensor([-1, 0, 1, 2, 3, -8, 7, -2], dtype=torch.float32)
    assert torch.equal(qw.dequantize(), (q[None, :] - zp[:, None]) * 0.25)


def test_compressed_tensors_8bit_hand_packed():
    """8 bits: q = -128, 127, 0, -1 stored 0, 255, 128, 127 -> 0x7F80FF00."""
    t = {"weight_packed": words(0x7F80FF00).reshape(1, 1),
         "weight_scale": torch.tensor([[1.0]]), "weight_shape": torch.tensor([1, 4])}
    qw = CompressedTensorsLayout(8, None, True).convert(t, 4, (1,), "test").check()
    assert qw.dequantize()[0].tolist() == [-128.0, 127.0, 0.0, -1.0]


def test_pack_unpack_round_trip_odd_lengths():
    g = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        codes = torch.randint(0, 1 << bits, (5, 13), generator=g)
        for dim in (0, 1):
            w = pack_int32(codes, bits, dim)
            assert w.dtype == torch.int32
            assert w.shape[dim] == -(-codes.shape[dim] * bits // 32)
            assert torch.equal(unpack_int32(w, bits, dim, codes.shape[dim]).long(), codes)


@pytest.mark.parametrize("bits, group, sym, v1", [(4, 16, True, True), (4, 8, False, True),
                                                  (8, -1, False, False)])
def test_writer_round_trip_through_the_readers(bits, group, sym, v1):
    """quantize_rtn -> each format's encoding -> its reader: the same QuantizedWeight."""
    torch.manual_seed(0)
    w = torch.randn(24, 32)
    perm = torch.randperm(32)
    qw = quantize_rtn(w, bits, group, sym, perm, min_zero=1 if v1 else 0)
    back = GptqLayout(bits, group, v1).convert(encode_gptq(qw, v1), 32, (24,), "t")
    assert torch.equal(back.dequantize(), qw.dequantize())
    assert (qw.dequantize() - w).abs().max() <= qw.scales.max() * (1 if sym else 0.51)
    ct = quantize_rtn(w, bits, group, sym, perm, torch.bfloat16)
    back = CompressedTensorsLayout(bits, None if group == -1 else group, sym, True).convert(
        encode_compressed_tensors(ct, sym), 32, (24,), "t")
    assert torch.equal(back.dequantize(), ct.dequantize())
    if bits == 4:
        awq = quantize_rtn(w, 4, group, False)
        back = AwqLayout(group).convert(encode_awq(awq), 32, (24,), "t")
        assert torch.equal(back.dequantize(), awq.dequantize())


def test_act_order_perm_rules():
    assert act_order_perm(torch.arange(10) // 4, 4, "t") is None
    perm = act_order_perm(torch.tensor([2, 0, 1, 0, 2, 1]), 2, "t")
    assert perm.tolist() == [1, 3, 2, 5, 0, 4]
    with pytest.raises(ValueError, match="group 0 3 columns where groups of 2 over 6 "
                                         "columns need 2: not a valid group assignment"):
        act_order_perm(torch.tensor([0, 0, 0, 1, 2, 2]), 2, "t")
    with pytest.raises(ValueError, match=r"outside 0\.\.2 .*not a valid group assignment"):
        act_order_perm(torch.tensor([0, 0, 1, 1, 3, 3]), 2, "t")


def test_gptq_v1_zero_of_the_top_code_is_refused():
    """v1 stores zero - 1: a stored 15 (4 bits) would be zero point 16."""
    t = {"qweight": words(0).reshape(1, 1), "qzeros": words(0xF).reshape(1, 1),
         "scales": torch.ones(1, 1)}
    with pytest.raises(ValueError, match="qzeros holds 15, which a gptq \\(v1\\) checkpoint "
                                         "stores for a zero point of 16"):
        GptqLayout(4, -1, v1_zeros=True, g_idx=False).convert(t, 8, (1,), "test")


@pytest.mark.parametrize("bits", [4, 8])
def test_odd_shapes_round_trip(bits):
    """K = 20 in groups of 8 (the last group partial; 4-bit words padded along K) and
    N = 5 (GPTQ's qzeros and compressed-tensors' zero points padded along N); act-order
    too. The readers give back the writer's QuantizedWeight, and a GEMM through it
    equals one through the dequantized matrix."""
    torch.manual_seed(1)
    w = torch.randn(5, 20)
    for perm in (None, torch.randperm(20)):
        qw = quantize_rtn(w, bits, 8, False, perm, min_zero=1)
        t = encode_gptq(qw, v1_zeros=True)
        assert t["qweight"].shape == (-(-20 * bits // 32), 5)
        assert t["qzeros"].shape == (3, 1 if bits == 4 else 2)
        back = GptqLayout(bits, 8, True).convert(t, 20, (5,), "t").check()
        assert torch.equal(back.dequantize(), qw.dequantize())
        ct = quantize_rtn(w, bits, 8, False, perm, torch.bfloat16)
        t = encode_compressed_tensors(ct, False)
        assert t["weight_zero_point"].shape == (1 if bits == 4 else 2, 3)
        back = CompressedTensorsLayout(bits, 8, False, perm is not None).convert(
            t, 20, (5,), "t").check()
        assert torch.equal(back.dequantize(), ct.dequantize())
        x = torch.randn(3, 20)
        assert torch.allclose(reference_linear(back, x, None), x @ ct.dequantize().T,
                              atol=1e-5)
