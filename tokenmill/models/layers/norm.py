import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm as one fused op (bit-identical to HF's formula in fp32).

    For bf16 / fp16 on CPU, PyTorch's rms_norm is a chain of small ops: the
    native kernel does the row in one pass, with HF's rounding. Whether it runs is
    the platform's `norm` decision, handed over once at load (`set_norm_kernels`),
    which binds `forward` / `add_forward` to one implementation or the other.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self._ops = None  # the native kernels (platform norm == "native"), else None
        self._norm, self._add_norm = self._torch_norm, self._torch_add_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x)

    def add_forward(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual += x (in place: the residual stream), then the norm of it, in one pass."""
        return self._add_norm(residual, x)

    def set_norm_kernels(self, ops) -> None:
        self._ops = ops
        native = ops is not None
        self._norm = self._native_norm if native else self._torch_norm
        self._add_norm = self._native_add_norm if native else self._torch_add_norm

    def _torch_norm(self, x):
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def _torch_add_norm(self, residual, x):
        return self._torch_norm(residual.add_(x))

    # The kernels' contract: contiguous rows in the weight's dtype. A q/k norm over a
    # strided view of the fused qkv rows, or fp32 norm weights, take ATen's op.
    def _native_norm(self, x):
        if x.is_contiguous() and self.weight.dtype == x.dtype:
            return self._ops.rms_norm(x, self.weight, self.eps)
        return self._torch_norm(x)

    def _native_add_norm(self, residual, x):
        if (residual.is_contiguous() and x.is_contiguous()
                and x.dtype == residual.dtype == self.weight.dtype):
            return self._ops.add_rms_norm_(residual, x, self.weight, self.eps)
        return self._native_norm(residual.add_(x))
