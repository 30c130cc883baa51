"""Integer-quantized weight matrices in one canonical form, whatever checkpoint format
they came from (GPTQ, AWQ, compressed-tensors, int8 made at load), and the PyTorch
reference that multiplies by them.

Every format's loader turns its tensors (packed int32 words, its zero-point
convention, its scale layout) into a `QuantizedWeight`; the kernels (native CPU, the
PyTorch reference here) take only this form, so a new format is a conversion, never
a new kernel. The weight a `QuantizedWeight` stands for is

    W'[n, k] = (codes[n, k] - zeros[n, k // group_size]) * scales[n, k // group_size]

computed in fp32 (the integers and their difference are exact there, the product is
one rounding: what dequantizing the checkpoint in fp32 gives). `perm` is GPTQ's
act-order: the checkpoint's column `perm[k]` is stored as column k, so that every
group is a contiguous run of columns; the layer computes y = x[..., perm] W'^T.
`perm` may also repeat input columns (act_order_share.py: a row-parallel rank's
act-order share, its groups padded with columns whose W' is exactly 0): then the
codes have more columns than the input (`in_features`), and the padding adds
exactly 0 to the product.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Elements of W dequantized at once by the reference (whole rows, at least one).
ROW_TILE_ELEMENTS = 1 << 22
BITS = (4, 8)


@dataclass
class QuantizedWeight:
    codes: torch.Tensor   # uint8 [N, K]: each weight's unsigned code, < 2**bits
    scales: torch.Tensor  # fp32 [N, G], G = ceil(K / group_size)
    zeros: torch.Tensor   # uint8 [N, G]: the code that stands for 0.0 in each group
    bits: int             # 4 or 8
    group_size: int       # columns per group (K: one group per row, "per channel")
    perm: torch.Tensor | None = None  # int64 [K] (act-order), None: columns in order
    in_features: int | None = None  # the input's width where perm pads (None: K)

    @property
    def shape(self) -> tuple[int, int]:
        """(N, the input's width): the matrix it stands for."""
        n, k = self.codes.shape
        return (n, k if self.in_features is None else self.in_features)

    @property
    def padded(self) -> bool:
        """Whether the codes have padding columns (perm repeats input columns)."""
        return self.in_features is not None and self.in_features != self.codes.shape[1]

    def check(self, where: str = "quantized weight") -> "QuantizedWeight":
        """Raise ValueError naming what does not fit the canonical form."""
        if self.bits not in BITS:
            raise ValueError(f"{where}: {self.bits}-bit weights are not implemented "
                             f"(bits {BITS})")
        if self.codes.dim() != 2 or self.codes.dtype != torch.uint8:
            raise ValueError(f"{where}: codes must be uint8 [N, K], got "
                             f"{self.codes.dtype} {tuple(self.codes.shape)}")
        n, k = self.codes.shape
        if not 0 < self.group_size:
            raise ValueError(f"{where}: group_size must be positive, got {self.group_size}")
        groups = -(-k // self.group_size)
        if tuple(self.scales.shape) != (n, groups) or self.scales.dtype != torch.float32:
            raise ValueError(f"{where}: scales must be fp32 [{n}, {groups}], got "
                             f"{self.scales.dtype} {tuple(self.scales.shape)}")
        if tuple(self.zeros.shape) != (n, groups) or self.zeros.dtype != torch.uint8:
            raise ValueError(f"{where}: zeros must be uint8 [{n}, {groups}], got "
                             f"{self.zeros.dtype} {tuple(self.zeros.shape)}")
        top = (1 << self.bits) - 1
        if self.bits < 8 and (int(self.codes.max()) > top or int(self.zeros.max()) > top):
            raise ValueError(f"{where}: a code or zero point exceeds {top} ({self.bits} bits)")
        if not bool(torch.isfinite(self.scales).all()):
            raise ValueError(f"{where}: scales hold a NaN or an infinity")
        if self.padded:
            p, width = self.perm, self.in_features
            if (p is None or p.dim() != 1 or p.numel() != k or not 0 < width < k
                    or int(p.min()) < 0 or int(p.max()) >= width
                    or not bool((torch.bincount(p, minlength=width) > 0).all())):
                raise ValueError(f"{where}: a padded perm must have one entry per code "
                                 f"column ({k}) and cover each of the {width} input columns")
        elif self.perm is not None:
            p = self.perm
            if (p.dim() != 1 or p.numel() != k
                    or not torch.equal(torch.sort(p).values,
                                       torch.arange(k, device=p.device))):
                raise ValueError(f"{where}: perm must be a permutation of the {k} columns")
        return self

    def dequantize_rows(self, r0: int, r1: int,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows r0:r1 of W' (kernel column order), computed in fp32 then cast."""
        k = self.codes.shape[1]
        g = self.group_size
        # Codes and zero points are small integers, exact in fp32, and so is their
        # difference: the same numbers as integer math, in one fp32 buffer.
        w = self.codes[r0:r1].to(torch.float32)
        zeros = self.zeros[r0:r1].to(torch.float32)
        scales = self.scales[r0:r1]
        if zeros.shape[1] == 1:  # one group per row: broadcast, no [N, K] scale tensors
            w.sub_(zeros).mul_(scales)
        elif k % g == 0:  # whole groups: broadcast over a [rows, G, g] view
            v = w.view(w.shape[0], -1, g)
            v.sub_(zeros.unsqueeze(-1)).mul_(scales.unsqueeze(-1))
        else:
            w.sub_(zeros.repeat_interleave(g, 1)[:, :k]).mul_(
                scales.repeat_interleave(g, 1)[:, :k])
        return w.to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] in the checkpoint's column order."""
        return checkpoint_order(self.dequantize_rows(0, self.codes.shape[0], dtype),
                                self.perm, self.shape[1])

    def nbytes(self) -> int:
        """Bytes of this form as stored (codes one byte each, whatever the bits)."""
        t = [self.codes, self.scales, self.zeros] + ([self.perm] if self.perm is not None
                                                     else [])
        return sum(x.numel() * x.element_size() for x in t)


def checkpoint_order(w: torch.Tensor, perm: torch.Tensor | None,
                     in_features: int) -> torch.Tensor:
    """W' [N, K'] in kernel column order -> W [N, in_features] in the checkpoint's:
    column perm[k] of W is column k of W'. A padded perm (repeats) sums its columns
    into their input column: the padding's are exactly 0, so the sum is the real one."""
    if perm is None:
        return w
    perm = perm.to(w.device)
    if perm.numel() == in_features:
        out = torch.empty_like(w)
        out[:, perm] = w
        return out
    return w.new_zeros(w.shape[0], in_features).index_add_(1, perm, w)


def reference_linear(qw: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None,
                     compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x W^T + b by the canonical form, in tiles of rows of W' dequantized and
    multiplied one at a time (no dequantized copy of the whole matrix): the PyTorch
    path, and the kernels' reference. `compute_dtype`: the GEMM's dtype (None: x's)."""
    dtype = compute_dtype or x.dtype
    n, k = qw.codes.shape
    xc = x.to(dtype)
    if qw.perm is not None:
        xc = xc.index_select(-1, qw.perm.to(xc.device))
    tile = max(1, ROW_TILE_ELEMENTS // max(1, k))
    if tile >= n:
        y = F.linear(xc, qw.dequantize_rows(0, n, dtype))
    else:
        y = xc.new_empty(*x.shape[:-1], n)
        for r0 in range(0, n, tile):
            r1 = min(n, r0 + tile)
            y[..., r0:r1] = F.linear(xc, qw.dequantize_rows(r0, r1, dtype))
    if bias is not None:
        y = y + bias.to(dtype)
    return y.to(x.dtype)


def quantize_int8_per_channel(w: torch.Tensor,
                              amax: torch.Tensor | None = None) -> QuantizedWeight:
    """Symmetric per-channel int8 of w [N, K] (vLLM's on-the-fly int8 weights): scale =
    max|w[n]| / 127, code = round(w / scale) + 128, zero 128 (a zero row: scale 1).
    `amax` [N, 1]: the rows' max |w| when w holds only part of each row (a row-parallel
    rank's share: the whole row's, so every rank quantizes as one would)."""
    wf = w.detach().float()
    if amax is None:
        amax = wf.abs().amax(dim=1, keepdim=True)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.clamp(torch.round(wf / scales), -127, 127).to(torch.int16) + 128
    n = w.shape[0]
    return QuantizedWeight(q.to(torch.uint8), scales, torch.full((n, 1), 128, dtype=torch.uint8),
                           8, w.shape[1])
