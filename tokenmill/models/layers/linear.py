"""Linear layers whose GEMM may run in a wider dtype than the activations.

On CPUs without native bf16 (no AVX512-BF16 / AMX), oneDNN emulates bf16
GEMMs at ~26 GFLOP/s while fp32 GEMMs reach ~120 on the same cores. A bf16
weight upcast to fp32 is exact, bf16 x bf16 products are exact in fp32, and
oneDNN's bf16 GEMM accumulates in fp32 too: computing in fp32 and rounding the
result to bf16 is the same math (up to summation order), about 4x faster, at
the cost of fp32 weight memory.

At a few rows (decode of one to a few sequences) the layer is bound by reading
its weights instead, and fp32 weights double the bytes: then the native
`gemv_bf16` kernel reads the original bf16 weights (kept beside the fp32 copy)
and accumulates in fp32, the same math again.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


# Up to this many rows take the bf16 GEMV kernel (TOKENMILL_GEMV_MAX_ROWS). Off by
# default: on the 2-core bench machine it did not beat the fp32 GEMM at batch 1
# (66 vs 67 tok/s single stream) and lost at throughput (336 vs 374 tok/s).
GEMV_MAX_ROWS = int(os.environ.get("TOKENMILL_GEMV_MAX_ROWS", "0"))


class Linear(nn.Linear):
    compute_dtype: torch.dtype | None = None
    gemv_weight: torch.Tensor | None = None  # the bf16 weights, for gemv_bf16
    _gemv = None

    def set_compute_dtype(self, dtype: torch.dtype) -> bool:
        """Keep the weights in `dtype` and run the GEMM there; False if they already were."""
        if self.weight.dtype == dtype:
            return False
        old = self.weight.detach()
        self.weight = nn.Parameter(old.to(dtype), requires_grad=False)
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.detach().to(dtype), requires_grad=False)
        self.compute_dtype = dtype
        if old.dtype == torch.bfloat16 and old.device.type == "cpu":
            from tokenmill.kernels import cpu_ops
            ops = cpu_ops()
            if ops is not None:
                self.gemv_weight = old.contiguous()
                self._gemv = ops.gemv_bf16
                self._no_bias = torch.empty(0)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype is None:
            return F.linear(x, self.weight, self.bias)
        if self._gemv is not None and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS:
            return self._gemv(x, self.gemv_weight,
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
