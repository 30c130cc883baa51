"""Integer-quantized weights in the native CPU kernels' packed layout
(tokenmill/kernels/cpu_quant_linear.cpp), for `QuantizedLinearMethod` when the
platform hands it the kernels.

The packed form is the only copy the layer keeps (the uint8 codes [N, K] of the
canonical `QuantizedWeight` are dropped after packing): 4-bit codes two to a byte,
scales in fp16 where that is exact, else fp32. Inputs of up to `max_rows` rows take
`linear_quant` (the codes widened in registers, fp32 math); larger ones dequantize
tiles of weight rows (`dequantize_quant`, exactly the reference's W') and multiply
them with the library GEMM in the compute dtype, never the whole matrix at once.
"""
from __future__ import annotations

import torch

from tokenmill.models.layers.linear_methods.quantized_weight import (ROW_TILE_ELEMENTS,
                                                                     QuantizedWeight)

_NO_BIAS = torch.empty(0)
_KERNEL_INPUTS = (torch.float32, torch.bfloat16)
PACK = 32  # output columns per packed block (the kernel's)


class PackedQuantizedWeight:
    """A `QuantizedWeight` packed once for the native kernels of `ops`."""

    def __init__(self, ops, qw: QuantizedWeight):
        self.ops = ops
        self.out_features, self.in_features = qw.shape
        self.bits, self.group_size, self.perm = qw.bits, qw.group_size, qw.perm
        self.codes, self.scales, self.zeros = ops.pack_quant_weight(
            qw.codes.contiguous(), qw.scales.contiguous(), qw.zeros.contiguous(), qw.bits,
            qw.group_size)

    def nbytes(self) -> int:
        """Resident bytes (the packed tensors and the act-order permutation)."""
        t = [self.codes, self.scales, self.zeros] + ([self.perm] if self.perm is not None
                                                     else [])
        return sum(x.numel() * x.element_size() for x in t)

    def dequantize_t(self, r0: int, r1: int) -> torch.Tensor:
        """W'[r0:r1]^T, fp32 [K, r1 - r0] (kernel column order; r0 a multiple of 32)."""
        return self.ops.dequantize_quant(self.codes, self.scales, self.zeros,
                                         self.out_features, self.bits, self.group_size,
                                         r0, r1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] in the checkpoint's column order."""
        w = self.dequantize_t(0, self.out_features).t().to(dtype)
        if self.perm is None:
            return w.contiguous()
        out = torch.empty(w.shape, dtype=dtype)
        out[:, self.perm] = w
        return out

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, max_rows: int,
               compute_dtype: torch.dtype | None) -> torch.Tensor:
        """y = x W^T + b; x [..., K] in the checkpoint's column order."""
        k, n = self.in_features, self.out_features
        rows = x.numel() // k
        x2 = x.reshape(rows, k)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if (rows <= max_rows and x.dtype in _KERNEL_INPUTS
                and compute_dtype in (None, torch.float32)):
            y = self.ops.linear_quant(x2, self.codes, self.scales, self.zeros, n, self.bits,
                                      self.group_size, bias if bias is not None else _NO_BIAS)
        else:
            y = self._tiled(x2, bias, compute_dtype or x.dtype).to(x.dtype)
        return y.view(*x.shape[:-1], n)

    def _tiled(self, x2: torch.Tensor, bias: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
        """Tiles of weight rows dequantized (fp32, then `dtype`) and multiplied one at a
        time: the library GEMM for the inputs the kernel does not take."""
        k, n = self.in_features, self.out_features
        tile = max(PACK, ROW_TILE_ELEMENTS // max(1, k) // PACK * PACK)
        xc = x2.to(dtype)
        y = xc.new_empty(x2.shape[0], n)
        for r0 in range(0, n, tile):
            r1 = min(n, r0 + tile)
            y[:, r0:r1] = xc @ self.dequantize_t(r0, r1).to(dtype)
        if bias is not None:
            y += bias.to(dtype)
        return y
