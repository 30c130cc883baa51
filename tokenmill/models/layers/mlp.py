"""The gated SiLU MLP of Llama-family models (also the shared expert of MoE blocks)."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from tokenmill.models.layers.linear import Linear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up packed in one `gate_up_proj`. The
    kernels module (silu_mul) comes from the CPU platform at load (`set_native_ops`)."""

    native_ops = None

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if gate_up.device.type == "cpu" and gate_up.dim() == 2:
            ops = self.native_ops
            if ops is not None:  # one op instead of split + silu + mul
                return self.down_proj(ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def set_native_ops(self, ops) -> None:
        self.native_ops = ops
