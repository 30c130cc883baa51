"""compressed-tensors "pack-quantized" checkpoints (llm-compressor's W4A16 / W8A16), per
Linear [N, K]:

- `weight_packed` int32 [N, ceil(K*bits/32)]: signed codes q in [-2**(bits-1),
  2**(bits-1)) stored offset by 2**(bits-1), packed along the input dim;
- `weight_scale` [N, G] in the model's dtype (strategy "group": G = ceil(K /
  group_size); "channel": G = 1);
- `weight_zero_point` int32 [ceil(N*bits/32), G] (asymmetric only): the offset
  zero points, packed along the output dim; symmetric: zero point 0;
- `weight_shape` int [2]: (N, K);
- `weight_g_idx` int32 [K] (optional, `actorder`): the group of each input column.

W[n, k] = (q[n, k] - zp[n, g]) * scale[n, g]: with both offset, the stored values are
the canonical codes and zero points as they are.
"""
from __future__ import annotations

import torch

from tokenmill.models.layers.linear_methods.act_order_share import row_share_form
from tokenmill.models.layers.linear_methods.int_layout import (G_IDX, GROUP, INDEX_DTYPES,
                                                               SCALE_DTYPES, SHAPE, IntLayout,
                                                               IntLinearMethod, TensorSpec,
                                                               split_shards)
from tokenmill.models.layers.linear_methods.int_packing import (act_order_perm, packed_len,
                                                                per_word, unpack_int32)
from tokenmill.models.layers.linear_methods.quantized_weight import QuantizedWeight


class CompressedTensorsLayout(IntLayout):
    name = "compressed-tensors"
    marker = "weight_packed"
    KINDS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
             "weight_g_idx")

    def __init__(self, bits: int, group_size: int | None, symmetric: bool,
                 g_idx: bool = False):
        """group_size None: strategy "channel" (one group of K per row)."""
        self.bits, self.group_size = int(bits), group_size
        self.symmetric, self.g_idx = bool(symmetric), bool(g_idx)

    def group(self, k: int) -> int:
        return k if self.group_size is None else self.group_size

    def specs(self, k: int, n: int, groups_k: int | None = None) -> dict[str, TensorSpec]:
        groups = -(-(groups_k or k) // self.group(k))
        out = {"weight_packed": TensorSpec((n, packed_len(k, self.bits)), ("I32",),
                                           torch.int32, 0),
               "weight_scale": TensorSpec((n, groups), SCALE_DTYPES, torch.float32, 0),
               "weight_shape": TensorSpec((2,), INDEX_DTYPES, torch.int64, 0)}
        if not self.symmetric:
            out["weight_zero_point"] = TensorSpec((packed_len(n, self.bits), groups),
                                                  ("I32",), torch.int32, 0)
        if self.g_idx:
            out["weight_g_idx"] = TensorSpec((k,), INDEX_DTYPES, torch.int64, 0)
        return out

    def out_features(self, shapes) -> int:
        return shapes["weight_packed"][0]

    def tp_dims(self, kind: str) -> tuple:
        per = per_word(self.bits)
        return {"weight_packed": ((0, 1), (1, per)), "weight_scale": ((0, 1), (1, GROUP)),
                "weight_zero_point": ((0, per), (1, GROUP)),
                "weight_shape": ((0, SHAPE), (0, SHAPE)),
                "weight_g_idx": (None, (0, G_IDX))}[kind]

    def tp_group_size(self) -> int | None:
        return self.group_size

    def keeps_groups_on_row_split(self) -> bool:
        return self.g_idx and self.group_size is not None

    def whole_words(self, n: int) -> bool:
        return self.symmetric or n * self.bits % 32 == 0

    def convert(self, t, k, shards, where, groups_k=None) -> QuantizedWeight:
        n, bits = sum(shards), self.bits
        shapes = t["weight_shape"].reshape(len(shards), 2).tolist()
        want = [[s, k] for s in shards]
        if shapes != want:
            raise ValueError(f"{where}: weight_shape says {shapes}, the layer's matrices "
                             f"are {want}")
        codes = unpack_int32(t["weight_packed"], bits, 1, k)
        groups = -(-(groups_k or k) // self.group(k))
        if self.symmetric:
            zeros = torch.full((n, groups), 1 << (bits - 1), dtype=torch.uint8,
                               device=codes.device)
        else:
            zeros = unpack_int32(t["weight_zero_point"], bits, 0, n)
        if groups_k is not None:  # a row-parallel share: global g_idx, every group
            g_idx = split_shards(t["weight_g_idx"], len(shards), "weight_g_idx", where)
            return row_share_form(codes, t["weight_scale"].float().contiguous(), zeros,
                                  g_idx, bits, self.group(k), where)
        perm = None
        if "weight_g_idx" in t:
            g_idx = split_shards(t["weight_g_idx"], len(shards), "weight_g_idx", where)
            perm = act_order_perm(g_idx, self.group(k), where)
        if perm is not None:
            codes = codes.index_select(1, perm)
        return QuantizedWeight(codes.contiguous(), t["weight_scale"].float().contiguous(),
                               zeros, bits, self.group(k), perm)

    def describe(self) -> str:
        kind = "channel" if self.group_size is None else f"group {self.group_size}"
        sym = "symmetric" if self.symmetric else "asymmetric"
        return f"compressed-tensors W{self.bits}A16, {kind}, {sym}"


class CompressedTensorsLinearMethod(IntLinearMethod):
    """A Linear loaded from compressed-tensors' pack-quantized tensors."""
