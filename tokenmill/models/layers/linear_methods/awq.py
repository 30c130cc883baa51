"""AWQ checkpoints in AutoAWQ's GEMM layout ("version": "gemm"), per Linear [N, K]:

- `qweight` int32 [K, N/8]: 4-bit codes packed along the output dim in AWQ's
  order (int_packing.py: nibble i of word w holds output column 8w + AWQ_ORDER[i]);
- `qzeros` int32 [G, N/8]: the groups' zero points, packed the same way (stored as
  they are, no offset);
- `scales` fp16 [G, N].

G = ceil(K / group_size) (group_size -1: one group of K). W[n, k] =
(code[k, n] - zero[k // group_size, n]) * scale[k // group_size, n].
"""
from __future__ import annotations

import torch

from tokenmill.models.layers.linear_methods.int_layout import (GROUP, SCALE_DTYPES, IntLayout,
                                                               IntLinearMethod, TensorSpec)
from tokenmill.models.layers.linear_methods.int_packing import (awq_deinterleave,
                                                                unpack_int32)
from tokenmill.models.layers.linear_methods.quantized_weight import QuantizedWeight

BITS = 4


class AwqLayout(IntLayout):
    name = "awq"
    marker = "qweight"
    KINDS = ("qweight", "qzeros", "scales")

    def __init__(self, group_size: int):
        self.group_size = int(group_size)

    def group(self, k: int) -> int:
        return k if self.group_size == -1 else self.group_size

    def specs(self, k: int, n: int, groups_k: int | None = None) -> dict[str, TensorSpec]:
        groups = -(-k // self.group(k))
        return {"qweight": TensorSpec((k, n // 8), ("I32",), torch.int32, 1),
                "qzeros": TensorSpec((groups, n // 8), ("I32",), torch.int32, 1),
                "scales": TensorSpec((groups, n), SCALE_DTYPES, torch.float32, 1)}

    def out_features(self, shapes) -> int:
        return shapes["qweight"][-1] * 8

    def tp_dims(self, kind: str) -> tuple:
        return {"qweight": ((1, 8), (0, 1)), "qzeros": ((1, 8), (0, GROUP)),
                "scales": ((1, 1), (0, GROUP))}[kind]

    def tp_group_size(self) -> int | None:
        return None if self.group_size == -1 else self.group_size

    def whole_words(self, n: int) -> bool:
        return n % 8 == 0

    def convert(self, t, k, shards, where, groups_k=None) -> QuantizedWeight:
        n = sum(shards)
        codes = awq_deinterleave(unpack_int32(t["qweight"], BITS, 1, n)).t()
        zeros = awq_deinterleave(unpack_int32(t["qzeros"], BITS, 1, n)).t()
        return QuantizedWeight(codes.contiguous(), t["scales"].float().t().contiguous(),
                               zeros.contiguous(), BITS, self.group(k))

    def describe(self) -> str:
        return f"awq 4-bit, group {self.group_size}"


class AwqLinearMethod(IntLinearMethod):
    """A Linear loaded from AWQ's (GEMM) qweight / qzeros / scales."""
