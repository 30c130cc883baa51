"""Quantized weights in the native CPU kernels' packed layout
(tokenmill/kernels/cpu_quant_linear.cpp), for `QuantizedLinearMethod` (integer codes)
and `Fp8BlockLinearMethod` (float8_e4m3fn codes, `PackedQuantizedWeight.e4m3`) when
the platform hands them the kernels.

The packed form is the only copy the layer keeps (the uint8 codes [N, K] of the
canonical `QuantizedWeight`, the e4m3 [N, K] weight, are dropped after packing):
4-bit codes two to a byte, 8-bit and e4m3 codes a byte each, scales in fp16 where
that is exact, else fp32; e4m3 weights have no zero point. Inputs of up to
`max_rows` rows take `linear_quant` (the codes widened in registers, fp32 math);
larger ones dequantize tiles of weight rows (`dequantize_quant`, exactly the
reference's W') and multiply them with the library GEMM in the compute dtype, never
the whole matrix at once - except bf16 GEMMs at a level with vdpbf16ps (`ops.has_quant_dot`:
avx512_bf16), which take `linear_quant_dot`: the same bf16(W') made block by block
in the kernel's scratch and multiplied there (cpu_quant_linear.cpp, cpu_linear_dot.cpp).

`quad`: 4- and 8-bit codes in the kernels' quad layout, where the module has it (the
avx2, avx512, avx512_vnni and avx512_bf16 levels) and the shape allows it (K a multiple of 8, groups
a multiple of 8 or the whole row): `linear_quant` then multiplies with integer dot
products (vpdpbusd, or vpmaddwd below avx512_vnni: the same integer sums) on activations rounded to 15 bits per block of 128 (error at most max|x_block| / 32766
per element, below a bf16 activation's own rounding for all but the block's smallest
elements): the platform asks for it for bf16 models only, fp32 ones stay exact.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.models.layers.linear_methods.quantized_weight import (ROW_TILE_ELEMENTS,
                                                                     QuantizedWeight,
                                                                     checkpoint_order)

_NO_BIAS = torch.empty(0)
_NO_ZEROS = torch.empty(0, dtype=torch.uint8)
_KERNEL_INPUTS = (torch.float32, torch.bfloat16)
PACK = 32  # output columns per packed block (the kernel's)


def quad_layout_fits(ops, bits: int, in_features: int, group_size: int) -> bool:
    """Whether `ops` packs a `bits`-bit [N, in_features] weight with this group size in
    the quad layout (cpu_quant_linear.cpp: no line of 8 k may span two groups)."""
    return (getattr(ops, "has_quant_quad", False) and bits in (4, 8)
            and in_features % 8 == 0 and (group_size % 8 == 0 or group_size >= in_features))


class PackedQuantizedWeight:
    """A `QuantizedWeight` packed once for the native kernels of `ops` (or, `e4m3`,
    block-scaled e4m3 weights). `kind`: the kernels' `bits` argument (4, 8, or
    ops.QUANT_E4M3); `bits`: the codes' width."""

    perm: torch.Tensor | None = None
    quad = False  # the quad layout (integer dot products on 15-bit activations)

    def __init__(self, ops, qw: QuantizedWeight, quad: bool = False):
        self.ops = ops
        self.out_features, self.in_features = qw.shape  # (the input's width: perm may pad)
        self.bits, self.group_size, self.perm = qw.bits, qw.group_size, qw.perm
        self.kind = qw.bits
        self.quad = quad and quad_layout_fits(ops, qw.bits, qw.codes.shape[1], qw.group_size)
        self.codes, self.scales, self.zeros = ops.pack_quant_weight(
            qw.codes.contiguous(), qw.scales.contiguous(), qw.zeros.contiguous(), qw.bits,
            qw.group_size, self.quad)

    @classmethod
    def e4m3(cls, ops, weight: torch.Tensor, scale_inv: torch.Tensor,
             block_size: tuple[int, int]) -> "PackedQuantizedWeight":
        """e4m3 `weight` [N, K] with fp32 block scales `scale_inv` [ceil(N/bn),
        ceil(K/bk)] (fp8.py): the kernel's groups are the blocks' bk columns, each
        column's scale its block row's (expanded here, one per column and group)."""
        bn, bk = block_size
        n, k = weight.shape
        packed = cls.__new__(cls)
        packed.ops, packed.out_features, packed.in_features = ops, n, k
        packed.bits, packed.kind, packed.group_size = 8, ops.QUANT_E4M3, bk
        scales = scale_inv.float().repeat_interleave(bn, 0)[:n].contiguous()
        packed.codes, packed.scales, packed.zeros = ops.pack_quant_weight(
            weight.contiguous(), scales, _NO_ZEROS, packed.kind, bk)
        return packed

    def nbytes(self) -> int:
        """Resident bytes (the packed tensors and the act-order permutation)."""
        t = [self.codes, self.scales, self.zeros] + ([self.perm] if self.perm is not None
                                                     else [])
        return sum(x.numel() * x.element_size() for x in t)

    def dequantize_t(self, r0: int, r1: int, bf16: bool = False) -> torch.Tensor:
        """W'[r0:r1]^T, fp32 [K, r1 - r0] (kernel column order; r0 a multiple of 32);
        `bf16`: rounded to bf16 in the kernel (equal to .to(torch.bfloat16) of the fp32
        tile, without writing and reading it)."""
        return self.ops.dequantize_quant(self.codes, self.scales, self.zeros,
                                         self.out_features, self.kind, self.group_size,
                                         r0, r1, bf16)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] in the checkpoint's column order."""
        w = self.dequantize_t(0, self.out_features).t().to(dtype)
        return checkpoint_order(w, self.perm, self.in_features).contiguous()

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
            y = self.ops.linear_quant(x2, self.codes, self.scales, self.zeros, n, self.kind,
                                      self.group_size, bias if bias is not None else _NO_BIAS)
        elif (compute_dtype or x.dtype) == torch.bfloat16 and self.dot:
            y = self._dot(x2, bias).to(x.dtype)
        else:
            y = self._tiled(x2, bias, compute_dtype or x.dtype).to(x.dtype)
        return y.view(*x.shape[:-1], n)

    @property
    def dot(self) -> bool:
        """Whether bf16 inputs past `max_rows` take `linear_quant_dot` (the kernels'
        level has vdpbf16ps: avx512_bf16) rather than the tiles."""
        return getattr(self.ops, "has_quant_dot", False)

    def _dot(self, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """bf16 x @ bf16(W')^T + b on vdpbf16ps, each block's codes dequantized to bf16
        pairs in the kernel's cache-resident scratch: no tile of W' is written, read
        back or repacked (the library GEMM on a fresh tile does all three each call)."""
        return self.ops.linear_quant_dot(x2.to(torch.bfloat16), self.codes, self.scales,
                                         self.zeros, self.out_features, self.kind,
                                         self.group_size,
                                         bias if bias is not None else _NO_BIAS)

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
            if dtype == torch.bfloat16:
                y[:, r0:r1] = xc @ self.dequantize_t(r0, r1, bf16=True)
            else:
                y[:, r0:r1] = xc @ self.dequantize_t(r0, r1).to(dtype)
        if bias is not None:
            y += bias.to(dtype)
        return y


class PackedQuantizedExperts:
    """Every MoE expert's gate_up and down packed for the native kernels (integer codes,
    or e4m3 with block scales), run per expert group by `fused_experts` (its `packed`
    argument): a group of up to `max_rows` rows (every decode step's) reads its expert's
    packed codes once; a larger one dequantizes tiles of them for the library GEMM in
    `compute_dtype`. The packed copies are the experts' only ones."""

    def __init__(self, w13: list[PackedQuantizedWeight], w2: list[PackedQuantizedWeight],
                 max_rows: int, compute_dtype: torch.dtype | None):
        self.w13, self.w2 = w13, w2
        self.max_rows, self.compute_dtype = max_rows, compute_dtype

    @classmethod
    def from_quantized(cls, ops, w13: list[QuantizedWeight], w2: list[QuantizedWeight],
                       max_rows: int, quad_max_rows: int,
                       compute_dtype: torch.dtype | None) -> "PackedQuantizedExperts":
        """Integer experts; `quad_max_rows` > 0: the quad layout with that row limit
        (kept only where every expert's shape takes it: one limit for all)."""
        quad = quad_max_rows > 0
        p13 = [PackedQuantizedWeight(ops, qw, quad=quad) for qw in w13]
        p2 = [PackedQuantizedWeight(ops, qw, quad=quad) for qw in w2]
        every_quad = all(p.quad for p in p13 + p2)
        return cls(p13, p2, quad_max_rows if quad and every_quad else max_rows, compute_dtype)

    @classmethod
    def from_e4m3(cls, ops, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor,
                  s2: torch.Tensor, block_size: tuple[int, int], max_rows: int,
                  compute_dtype: torch.dtype | None) -> "PackedQuantizedExperts":
        """Stacked e4m3 experts [E, N, K] with their block scales [E, N/bn, K/bk]."""
        return cls([PackedQuantizedWeight.e4m3(ops, w, s, block_size) for w, s in zip(w13, s13)],
                   [PackedQuantizedWeight.e4m3(ops, w, s, block_size) for w, s in zip(w2, s2)],
                   max_rows, compute_dtype)

    def with_compute_dtype(self, dtype: torch.dtype | None) -> "PackedQuantizedExperts":
        return PackedQuantizedExperts(self.w13, self.w2, self.max_rows, dtype)

    @property
    def quad(self) -> bool:
        return all(p.quad for p in self.w13 + self.w2)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.w13 + self.w2)

    def describe(self) -> str:
        return f", native up to {self.max_rows} rows per expert" + (
            " (integer dot products, 15-bit activations)" if self.quad else "")

    def grouped(self, xs: torch.Tensor, packed: list, n: int, groups, w, gemm_dtype
                ) -> torch.Tensor:
        out = xs.new_empty(xs.shape[0], n)
        for e, lo, hi in groups:
            out[lo:hi] = packed[e].linear(xs[lo:hi], None, self.max_rows, self.compute_dtype)
        return out


def drop_stacked_experts(layer, scale_suffix: str) -> None:
    """Once the experts are packed, the packed copy is the only one: the layer's stacked
    `gate_up_proj` / `down_proj` become meta tensors (shapes and dtype still readable)
    and their scale tensors (`<name><scale_suffix>`) go."""
    for name in ("gate_up_proj", "down_proj"):
        setattr(layer, name, nn.Parameter(torch.empty_like(getattr(layer, name), device="meta"),
                                          requires_grad=False))
        delattr(layer, name + scale_suffix)
