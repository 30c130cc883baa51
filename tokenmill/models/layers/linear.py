"""Linear layers whose GEMM may run in a wider dtype than the activations.

On CPUs without native bf16 (no AVX512-BF16 / AMX), oneDNN emulates bf16
GEMMs at ~26 GFLOP/s while fp32 GEMMs reach ~120 on the same cores. A bf16
weight upcast to fp32 is exact, bf16 x bf16 products are exact in fp32, and
oneDNN's bf16 GEMM accumulates in fp32 too: computing in fp32 and rounding the
result to bf16 is the same math (up to summation order), about 4x faster, at
the cost of fp32 weight memory.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    compute_dtype: torch.dtype | None = None

    def set_compute_dtype(self, dtype: torch.dtype) -> bool:
        """Keep the weights in `dtype` and run the GEMM there; False if they already were."""
        if self.weight.dtype == dtype:
            return False
        self.weight = nn.Parameter(self.weight.detach().to(dtype), requires_grad=False)
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.detach().to(dtype), requires_grad=False)
        self.compute_dtype = dtype
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype is None:
            return F.linear(x, self.weight, self.bias)
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
