"""The gated SiLU MLP of Llama-family models (also the shared expert of MoE blocks)."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from tokenmill.models.layers.linear import Linear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up packed in one `gate_up_proj`: one GEMM
    through whatever method the platform gives that Linear (the reference's
    `UnquantizedMlpGateUpMethod` is `UnquantizedLinearMethod` on this fused Linear).
    The activation is the platform's `activation` decision, handed over once at load
    (`set_activation_kernels`): the native silu_mul (one op instead of split + silu +
    mul) or PyTorch's. Tensor parallel: gate_up column-parallel (each rank its gate
    and up rows), down row-parallel."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias,
                                   tp="column", output_sizes=(intermediate_size,) * 2)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, tp="row")
        self.act_and_mul = self._torch_act_and_mul

    def forward(self, x):
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))

    def _torch_act_and_mul(self, gate_up):
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return F.silu(gate) * up

    def set_activation_kernels(self, ops) -> None:
        # The kernel takes [T, 2I] rows (the layer's input is always flattened tokens).
        self.act_and_mul = ops.silu_mul if ops is not None else self._torch_act_and_mul
