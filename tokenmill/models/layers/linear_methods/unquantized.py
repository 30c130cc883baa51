"""Methods over a checkpoint's plain [N, K] weights: PyTorch's GEMM (in the model's
dtype, or widened), and oneDNN's GEMM over weights reordered once.

Widening: on CPUs without native bf16 (no AVX512-BF16 / AMX), oneDNN emulates bf16
GEMMs at ~26 GFLOP/s while fp32 GEMMs reach ~120 on the same cores. A bf16 weight
upcast to fp32 is exact, bf16 x bf16 products are exact in fp32, and oneDNN's bf16
GEMM accumulates in fp32 too: computing in fp32 and rounding the result to bf16 is
the same math (up to summation order), about 4x faster.

Prepacking: inputs past the packed kernels' rows (batched decode, prefill) run
oneDNN's GEMM on weights reordered once into its blocked layout
(torch.ops.mkldnn's _reorder_linear_weight / _linear_pointwise, what PyTorch's own
CPU compiler uses for frozen weights) instead of F.linear on the plain weights:
1.3-3x the fp32 GEMM speed and 1.0-1.8x the bf16 one at 9-2048 rows on the machines
measured, the same bf16 results bit for bit, fp32 ones up to summation order.

`UnquantizedLinearMethod` on a fused gate_up `Linear` (layers/mlp.py) is the
reference's `UnquantizedMlpGateUpMethod`: the gate and up rows are one [2I, K] matrix,
one GEMM, through whatever method the platform gives that layer (no method of its own).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.layers.linear_methods.base import LinearMethod


def drop_weight(layer) -> None:
    """Leave `weight` on the meta device (same shape, no data): a kernel's own copy
    replaced it, and any other use of it fails loudly."""
    layer.weight = nn.Parameter(torch.empty_like(layer.weight, device="meta"),
                                requires_grad=False)


class UnquantizedLinearMethod(LinearMethod):
    """F.linear over `weight` [N, K]; with `compute_dtype` (widened) the weights are
    kept in it and the result is rounded back to the input's dtype."""

    def __init__(self, compute_dtype: torch.dtype | None = None):
        self.compute_dtype = compute_dtype

    def create_weights(self, layer, in_features, out_features, bias, dtype=None):
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        layer.register_parameter(
            "bias", nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None)
        # nn.Linear's initialisation (a layer used before or without loading, as the
        # tests do, gets the same numbers it used to).
        nn.init.kaiming_uniform_(layer.weight, a=math.sqrt(5))
        if layer.bias is not None:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
            nn.init.uniform_(layer.bias, -bound, bound)

    def process_weights_after_loading(self, layer) -> None:
        dtype = self.compute_dtype
        if dtype is None or layer.weight.dtype == dtype:
            return
        layer.weight = nn.Parameter(layer.weight.detach().to(dtype), requires_grad=False)
        if layer.bias is not None:
            layer.bias = nn.Parameter(layer.bias.detach().to(dtype), requires_grad=False)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype is None:
            return F.linear(x, layer.weight, layer.bias)
        return F.linear(x.to(self.compute_dtype), layer.weight, layer.bias).to(x.dtype)

    def dense_weight(self, layer) -> torch.Tensor:
        return layer.weight.detach()

    def describe(self) -> str:
        wide = "" if self.compute_dtype is None else f"(in {self.compute_dtype})"
        return type(self).__name__ + wide


class OneDNNPrepackedLinearMethod(UnquantizedLinearMethod):
    """oneDNN's GEMM over the weights reordered once into its blocked layout; the
    reordered copy replaces `weight` unless `keep_weight` (a weight another module
    holds too, as a tied embedding: dropping it here would free nothing)."""

    def __init__(self, keep_weight: bool = False):
        super().__init__()
        self.keep_weight = keep_weight
        self.prepacked: torch.Tensor | None = None

    def process_weights_after_loading(self, layer) -> None:
        w = layer.weight.detach()
        self.prepacked = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
        if not self.keep_weight:
            drop_weight(layer)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // layer.in_features
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, layer.in_features),
                                               self.prepacked, layer.bias, "none", [], "")
        return y if x.dim() == 2 else y.view(*x.shape[:-1], layer.out_features)

    def dense_weight(self, layer) -> torch.Tensor:
        if not layer.weight.is_meta:
            return layer.weight.detach()
        return self.prepacked.to_dense()
