"""The native CPU kernels' packed layouts: decode-sized inputs read weights packed once
for `linear_bf16` / `linear_f32` (tokenmill/kernels); larger inputs go to a fallback
method (oneDNN-prepacked, a widened fp32 copy or the plain GEMM).

`PackedBf16LinearMethod`: a bf16 model's weights packed in bf16 and widened to fp32
in registers - fp32 products and sums, the math of a widened GEMM, over half the
bytes of fp32 weights (a decode step is bound by reading them). Which layers do so,
for how many rows, and what takes the larger inputs is the CPU platform's decision
(tokenmill/platforms/cpu.py: the measured reasons); with `max_rows` ALL_ROWS the
packed copy takes every input and is the only copy kept.

`PackedF32LinearMethod`: an fp32 model's decode-sized inputs take `linear_f32` the same
way - the math of F.linear up to summation order, but streaming the weights at the
memory's pace where a batch-1 F.linear does not; larger inputs keep oneDNN.
"""
from __future__ import annotations

import torch

from tokenmill.models.layers.linear_methods.base import ALL_ROWS
from tokenmill.models.layers.linear_methods.unquantized import (UnquantizedLinearMethod,
                                                                drop_weight)

_NO_BIAS = torch.empty(0)
_BF16_INPUTS = (torch.float32, torch.bfloat16)


def _packed_linear(kernel, packed: torch.Tensor, layer, x: torch.Tensor,
                   rows: int) -> torch.Tensor:
    y = kernel(x.reshape(rows, layer.in_features), packed, layer.out_features,
               layer.bias if layer.bias is not None else _NO_BIAS)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], layer.out_features)


def _describe(method) -> str:
    if method.fallback is None:
        return f"{type(method).__name__}(every input)"
    return (f"{type(method).__name__}(up to {method.max_rows} rows, then "
            f"{method.fallback.describe()})")


class PackedBf16LinearMethod(UnquantizedLinearMethod):
    """`ops.linear_bf16` over the bf16 weights packed [N/32, K, 32] for inputs of up to
    `max_rows` rows (fp32 or bf16), `fallback` for the others; no fallback: the packed
    copy is the only one (`max_rows` ALL_ROWS)."""

    packed_dtype = torch.bfloat16

    def __init__(self, ops, max_rows: int, fallback: UnquantizedLinearMethod | None):
        super().__init__()
        if fallback is None and max_rows < ALL_ROWS:
            raise ValueError("a packed layer without a fallback must take every input")
        self.ops = ops
        self.kernel = ops.linear_bf16
        self.max_rows = max_rows
        self.fallback = fallback

    def process_weights_after_loading(self, layer) -> None:
        # Packed from the checkpoint's bf16 weights, before a fallback widens or
        # reorders them.
        self.packed_weight = self.ops.pack_bf16_weight(layer.weight.detach().contiguous())
        if self.fallback is None:
            drop_weight(layer)
        else:
            self.fallback.process_weights_after_loading(layer)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // layer.in_features
        if rows <= self.max_rows and x.dtype in _BF16_INPUTS:
            return _packed_linear(self.kernel, self.packed_weight, layer, x, rows)
        if self.fallback is None:
            raise TypeError(f"a packed-only bf16 layer takes fp32 / bf16 inputs, not {x.dtype}")
        return self.fallback.apply(layer, x)

    def describe(self) -> str:
        return _describe(self)

    def dense_weight(self, layer) -> torch.Tensor:
        """The bf16 weights, unpacked: [N/32, K, 32] whose 32 columns are pairs
        (column i, column 16 + i)."""
        nb, k, cols = self.packed_weight.shape
        w = self.packed_weight.view(nb, k, cols // 2, 2).permute(0, 3, 2, 1)
        return w.reshape(nb * cols, k)[:layer.out_features]


class PackedF32LinearMethod(UnquantizedLinearMethod):
    """`ops.linear_f32` over the fp32 weights packed [N/32, K, 32] for fp32 inputs of up
    to `max_rows` rows, `fallback` (oneDNN-prepacked or plain) for the others."""

    packed_dtype = torch.float32

    def __init__(self, ops, max_rows: int, fallback: UnquantizedLinearMethod):
        super().__init__()
        self.ops = ops
        self.kernel = ops.linear_f32
        self.max_rows = max_rows
        self.fallback = fallback

    def process_weights_after_loading(self, layer) -> None:
        self.packed_weight = self.ops.pack_f32_weight(layer.weight.detach().contiguous())
        self.fallback.process_weights_after_loading(layer)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // layer.in_features
        if rows <= self.max_rows and x.dtype == torch.float32:
            return _packed_linear(self.kernel, self.packed_weight, layer, x, rows)
        return self.fallback.apply(layer, x)

    def describe(self) -> str:
        return _describe(self)

    def dense_weight(self, layer) -> torch.Tensor:
        """The fp32 weights, unpacked: [N/32, K, 32], columns in order."""
        nb, k, cols = self.packed_weight.shape
        return self.packed_weight.permute(0, 2, 1).reshape(nb * cols, k)[:layer.out_features]
