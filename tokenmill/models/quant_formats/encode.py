"""A canonical QuantizedWeight [N, K] -> the tensors each format stores for it (the
writers' half of the layouts the readers in layers/linear_methods/ take; the packing
itself is int_packing.py's, shared by both)."""
from __future__ import annotations

import torch

from tokenmill.models.layers.linear_methods.int_packing import (awq_interleave, pack_int32,
                                                                gptq_stored_zeros)
from tokenmill.models.layers.linear_methods.quantized_weight import QuantizedWeight
from tokenmill.models.quant_formats.rtn import act_order_g_idx, checkpoint_order_codes


def encode_gptq(qw: QuantizedWeight, v1_zeros: bool, scale_dtype=torch.float16,
                g_idx: bool = True) -> dict[str, torch.Tensor]:
    """qweight [K*bits/32, N], qzeros [G, N*bits/32] (v1: zero - 1), scales [G, N],
    g_idx [K] (act-order: the shuffled group assignment)."""
    codes = checkpoint_order_codes(qw)
    out = {"qweight": pack_int32(codes.t(), qw.bits, 0),
           "qzeros": pack_int32(gptq_stored_zeros(qw.zeros.t(), qw.bits, v1_zeros), qw.bits, 1),
           "scales": qw.scales.t().to(scale_dtype).contiguous()}
    if g_idx or qw.perm is not None:
        out["g_idx"] = act_order_g_idx(qw)
    return out


def encode_awq(qw: QuantizedWeight, scale_dtype=torch.float16) -> dict[str, torch.Tensor]:
    """qweight [K, N/8] and qzeros [G, N/8] packed along N in AWQ's order, scales [G, N]."""
    if qw.bits != 4 or qw.perm is not None:
        raise ValueError("AWQ stores 4-bit weights without act-order")
    return {"qweight": pack_int32(awq_interleave(qw.codes.t()), 4, 1),
            "qzeros": pack_int32(awq_interleave(qw.zeros.t()), 4, 1),
            "scales": qw.scales.t().to(scale_dtype).contiguous()}


def encode_compressed_tensors(qw: QuantizedWeight, symmetric: bool,
                              scale_dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """weight_packed [N, K*bits/32], weight_scale [N, G], weight_zero_point
    [N*bits/32, G] (asymmetric), weight_shape [2], weight_g_idx [K] (act-order)."""
    n, k = qw.shape
    if symmetric and not bool((qw.zeros == 1 << (qw.bits - 1)).all()):
        raise ValueError("a symmetric compressed-tensors weight has zero point 2**(bits-1)")
    out = {"weight_packed": pack_int32(checkpoint_order_codes(qw), qw.bits, 1),
           "weight_scale": qw.scales.to(scale_dtype).contiguous(),
           "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if not symmetric:
        out["weight_zero_point"] = pack_int32(qw.zeros, qw.bits, 0)
    if qw.perm is not None:
        out["weight_g_idx"] = act_order_g_idx(qw)
    return out


class Fp8BlockWeight:
    """e4m3 codes [N, K] and their fp32 dequantization scales per [bn, bk] block
    ([ceil(N / bn), ceil(K / bk)]; the edge blocks cover what is left): W = codes * scale."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]):
        self.codes, self.scales, self.block = codes, scales, block

    def dequantize(self) -> torch.Tensor:
        bn, bk = self.block
        n, k = self.codes.shape
        full = self.scales.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        return self.codes.float() * full


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int]) -> Fp8BlockWeight:
    """Round to nearest: each block's scale = its amax / 448 (e4m3's largest value),
    codes = w / scale rounded to e4m3."""
    bn, bk = block
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:n, :k] = w.float()
    amax = padded.abs().view(rows, bn, cols, bk).amax(dim=(1, 3))
    scales = amax.clamp(min=1e-12) / 448.0
    full = scales.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    codes = (w.float() / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return Fp8BlockWeight(codes, scales, block)


def encode_compressed_tensors_fp8_block(fw: Fp8BlockWeight) -> dict[str, torch.Tensor]:
    """compressed-tensors float-quantized, strategy "block": weight e4m3 [N, K] and
    weight_scale fp32 [ceil(N / bn), ceil(K / bk)], the dequantization factor (not its
    inverse, whatever quant_method fp8's `weight_scale_inv` name suggests)."""
    return {"weight": fw.codes, "weight_scale": fw.scales}
