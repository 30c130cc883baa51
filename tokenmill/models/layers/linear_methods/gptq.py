"""GPTQ checkpoints as AutoGPTQ / GPTQModel publish them, per Linear [N, K]:

- `qweight` int32 [ceil(K*bits/32), N]: the codes, packed along the input dim;
- `qzeros` int32 [G, ceil(N*bits/32)]: each group's zero point, packed along the
  output dim; `checkpoint_format` "gptq" (v1) stores zero - 1, "gptq_v2" the zero;
- `scales` fp16 [G, N];
- `g_idx` int32 [K] (optional): the group of each input column; `desc_act`
  checkpoints shuffle it (act-order), otherwise it is k // group_size.

G = ceil(K / group_size), group_size -1 meaning one group of K. The weight is
W[n, k] = (code[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n], bits 4 or 8
(int_packing.py holds the packing; the canonical form quantized_weight.py).
"""
from __future__ import annotations

import torch

from tokenmill.models.layers.linear_methods.act_order_share import row_share_form
from tokenmill.models.layers.linear_methods.int_layout import (G_IDX, GROUP, INDEX_DTYPES,
                                                               SCALE_DTYPES, IntLayout,
                                                               IntLinearMethod, TensorSpec,
                                                               split_shards)
from tokenmill.models.layers.linear_methods.int_packing import (act_order_perm,
                                                                gptq_zero_points, packed_len,
                                                                per_word, unpack_int32)
from tokenmill.models.layers.linear_methods.quantized_weight import QuantizedWeight


class GptqLayout(IntLayout):
    name = "gptq"
    marker = "qweight"
    KINDS = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, bits: int, group_size: int, v1_zeros: bool, g_idx: bool = True):
        self.bits, self.group_size = int(bits), int(group_size)
        self.v1_zeros, self.g_idx = bool(v1_zeros), bool(g_idx)

    def group(self, k: int) -> int:
        return k if self.group_size == -1 else self.group_size

    def specs(self, k: int, n: int, groups_k: int | None = None) -> dict[str, TensorSpec]:
        groups = -(-(groups_k or k) // self.group(k))
        out = {"qweight": TensorSpec((packed_len(k, self.bits), n), ("I32",), torch.int32, 1),
               "qzeros": TensorSpec((groups, packed_len(n, self.bits)), ("I32",),
                                    torch.int32, 1),
               "scales": TensorSpec((groups, n), SCALE_DTYPES, torch.float32, 1)}
        if self.g_idx:
            out["g_idx"] = TensorSpec((k,), INDEX_DTYPES, torch.int64, 0)
        return out

    def out_features(self, shapes) -> int:
        return shapes["qweight"][-1]

    def tp_dims(self, kind: str) -> tuple:
        per = per_word(self.bits)
        return {"qweight": ((1, 1), (0, per)), "qzeros": ((1, per), (0, GROUP)),
                "scales": ((1, 1), (0, GROUP)), "g_idx": (None, (0, G_IDX))}[kind]

    def tp_group_size(self) -> int | None:
        return None if self.group_size == -1 else self.group_size

    def keeps_groups_on_row_split(self) -> bool:
        return self.g_idx and self.group_size != -1

    def whole_words(self, n: int) -> bool:
        return n * self.bits % 32 == 0

    def convert(self, t, k, shards, where, groups_k=None) -> QuantizedWeight:
        n, bits = sum(shards), self.bits
        codes = unpack_int32(t["qweight"], bits, 0, k).t()
        stored = unpack_int32(t["qzeros"], bits, 1, n)
        zeros = gptq_zero_points(stored, bits, self.v1_zeros, where).t().contiguous()
        group = self.group(k)
        if groups_k is not None:  # a row-parallel share: global g_idx, every group
            g_idx = split_shards(t["g_idx"], len(shards), "g_idx", where)
            return row_share_form(codes, t["scales"].float().t().contiguous(), zeros, g_idx,
                                  bits, group, where)
        perm = None
        if "g_idx" in t:
            g_idx = split_shards(t["g_idx"], len(shards), "g_idx", where)
            perm = act_order_perm(g_idx, group, where)
        if perm is not None:
            codes = codes.index_select(1, perm)
        return QuantizedWeight(codes.contiguous(), t["scales"].float().t().contiguous(),
                               zeros, bits, group, perm)

    def describe(self) -> str:
        fmt = "gptq" if self.v1_zeros else "gptq_v2"
        return f"{fmt} {self.bits}-bit, group {self.group_size}"


class GptqLinearMethod(IntLinearMethod):
    """A Linear loaded from GPTQ's qweight / qzeros / scales / g_idx."""
