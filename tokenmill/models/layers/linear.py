"""Linear layers whose GEMM may run in a wider dtype than the activations.

On CPUs without native bf16 (no AVX512-BF16 / AMX), oneDNN emulates bf16
GEMMs at ~26 GFLOP/s while fp32 GEMMs reach ~120 on the same cores. A bf16
weight upcast to fp32 is exact, bf16 x bf16 products are exact in fp32, and
oneDNN's bf16 GEMM accumulates in fp32 too: computing in fp32 and rounding the
result to bf16 is the same math (up to summation order), about 4x faster, at
the cost of fp32 weight memory.

At decode sizes (up to 128 rows) the layer is bound by reading its weights,
or by oneDNN's poor fp32 kernels for thin matrices, and fp32 weights double
the bytes: there the native `linear_bf16` kernel reads the original bf16
weights (packed once at load, kept beside the fp32 copy) and widens them in
registers - the same math again, fp32 products and sums. The kernel is AVX-512
code: at a lower capability level (tokenmill.kernels) the fp32 GEMM stays.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


# Up to this many rows take the packed bf16 kernel (TOKENMILL_LINEAR_BF16_MAX_ROWS;
# 0 turns it off). Measured on the 2-vCPU bench machine, all 33 GEMMs of the bench
# model in one run: 10 vs 18 ms at 1 row, 15 vs 49 at 8, and 87-108 vs 80-95
# GFLOP/s at 32-128 rows; at prefill sizes (512-2048 rows) oneDNN's fp32 GEMM is
# about 20% ahead (docs/benchmarks.md).
BF16_MAX_ROWS = int(os.environ.get("TOKENMILL_LINEAR_BF16_MAX_ROWS", "128"))


class Linear(nn.Linear):
    compute_dtype: torch.dtype | None = None
    packed_bf16: torch.Tensor | None = None  # the bf16 weights in linear_bf16's layout
    _linear_bf16 = None

    def set_compute_dtype(self, dtype: torch.dtype) -> bool:
        """Keep the weights in `dtype` and run the GEMM there; False if they already were."""
        if self.weight.dtype == dtype:
            return False
        old = self.weight.detach()
        self.weight = nn.Parameter(old.to(dtype), requires_grad=False)
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.detach().to(dtype), requires_grad=False)
        self.compute_dtype = dtype
        if old.dtype == torch.bfloat16 and old.device.type == "cpu" and dtype == torch.float32:
            from tokenmill.kernels import cpu_ops
            ops = cpu_ops()
            # Only where the kernel is vectorised at this capability level (AVX-512):
            # below it, linear_bf16 would unpack the weights on every call.
            if ops is not None and getattr(ops, "has_fast_linear_bf16", False):
                self.packed_bf16 = ops.pack_bf16_weight(old.contiguous())
                self._linear_bf16 = ops.linear_bf16
                self._no_bias = torch.empty(0)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype is None:
            return F.linear(x, self.weight, self.bias)
        if (self._linear_bf16 is not None and x.dim() == 2 and x.shape[0] <= BF16_MAX_ROWS
                and x.dtype in (torch.float32, torch.bfloat16)):
            return self._linear_bf16(x, self.packed_bf16, self.out_features,
                                     self.bias if self.bias is not None else self._no_bias)
        return F.linear(x.to(self.compute_dtype), self.weight, self.bias).to(x.dtype)


def widen_gemms(model: nn.Module, dtype: torch.dtype) -> int:
    """Run every GEMM layer of `model` in `dtype`; returns how many were changed.

    A GEMM layer is any module with `set_compute_dtype(dtype) -> bool`: `Linear`,
    and the stacked experts of an MoE block (layers/moe.py `FusedMoE`).
    """
    changed = 0
    for module in model.modules():
        set_compute_dtype = getattr(module, "set_compute_dtype", None)
        if set_compute_dtype is not None and set_compute_dtype(dtype):
            changed += 1
    return changed
