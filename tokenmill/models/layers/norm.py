import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm as one fused op (bit-identical to HF's formula in fp32).

    For bf16 / fp16 on CPU, PyTorch's rms_norm is a chain of small ops: the
    native kernel does the row in one pass, with HF's rounding. The kernels module
    comes from the CPU platform at load (`set_native_ops`; None: PyTorch).
    """

    native_ops = None

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 and x.device.type == "cpu" and x.is_contiguous():
            ops = self.native_ops
            if ops is not None and self.weight.dtype == x.dtype:
                return ops.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_forward(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual += x (in place: the residual stream), then the norm of it, in one pass."""
        if (residual.dtype != torch.float32 and residual.device.type == "cpu"
                and residual.is_contiguous() and x.is_contiguous() and x.dtype == residual.dtype):
            ops = self.native_ops
            if ops is not None and self.weight.dtype == x.dtype:
                return ops.add_rms_norm_(residual, x, self.weight, self.eps)
        return self.forward(residual.add_(x))

    def set_native_ops(self, ops) -> None:
        self.native_ops = ops
