import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm as one fused op (bit-identical to HF's formula in fp32).

    For bf16 / fp16 on CPU, PyTorch's rms_norm is a chain of small ops: the
    native kernel does the row in one pass, with HF's rounding. Whether it runs is
    the platform's `norm` decision, handed over once at load (`set_norm_kernels`).
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self._ops = None  # the native kernels (platform norm == "native"), else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The kernel's contract: contiguous rows in the weight's dtype (a q/k norm over a
        # strided view of the fused qkv rows, or fp32 norm weights, take ATen's op).
        if self._ops is not None and x.is_contiguous() and self.weight.dtype == x.dtype:
            return self._ops.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_forward(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual += x (in place: the residual stream), then the norm of it, in one pass."""
        if (self._ops is not None and residual.is_contiguous() and x.is_contiguous()
                and x.dtype == residual.dtype == self.weight.dtype):
            return self._ops.add_rms_norm_(residual, x, self.weight, self.eps)
        return self.forward(residual.add_(x))

    def set_norm_kernels(self, ops) -> None:
        self._ops = ops
