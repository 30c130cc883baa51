"""What an integer-quantized checkpoint format holds per matrix, and the linear method
that loads it: one `IntLayout` per format (gptq.py, awq.py, compressed_tensors.py)
says which tensors a [N, K] matrix is stored as (kind -> shape, dtypes) and turns
them into the canonical `QuantizedWeight`; `IntLinearMethod` registers them on a
`Linear` for the loader and converts them after loading (QuantizedLinearMethod);
the MoE experts' method (quantized_moe.py) stacks the same tensors per expert.

Packed layers (q | k | v -> qkv_proj, gate | up -> gate_up_proj): the loader
concatenates the shards' tensors along each parameter's `shard_dim` (GPTQ and AWQ
keep the output dim last, compressed-tensors first), so a layer's parameters are
the concatenation of its shards' checkpoint tensors. Per-shard metadata that does
not concatenate (g_idx over the shared input, compressed-tensors' weight_shape) is
stacked along dim 0 and checked shard by shard.

Act order under tensor parallelism: a row-parallel rank's share of a matrix whose
layout has a g_idx keeps the scales / zero points of every group of the whole K
(`groups_k`) and its columns' global group ids; `convert` lays them out padded
(act_order_share.py), so groups scattered over the ranks load exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.models.layers.linear_methods.quantized_linear import QuantizedLinearMethod
from tokenmill.models.layers.linear_methods.quantized_weight import QuantizedWeight

# Every tensor kind an integer format stores per matrix (the loader stacks experts' by it).
INT_TENSOR_KINDS = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale",
                    "weight_zero_point", "weight_shape", "weight_g_idx")
# Safetensors dtype names -> torch dtypes a layout accepts.
SCALE_DTYPES = ("F16", "BF16", "F32")
INDEX_DTYPES = ("I32", "I64")


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor of a matrix: its shape, the safetensors dtypes the
    checkpoint may store it in, the parameter's dtype (scales widen to fp32 exactly,
    indices to int64) and the dim the loader concatenates packed shards along."""
    shape: tuple[int, ...]
    header_dtypes: tuple[str, ...]
    dtype: torch.dtype
    shard_dim: int = 0


class IntLayout:
    """A format's tensors for one matrix [n, k] (a shard of a packed layer)."""
    name = "integer"
    marker = "qweight"  # the tensor kind whose presence says a module is quantized
    KINDS: tuple[str, ...] = ()  # every kind the format may store (optional ones too)

    def specs(self, k: int, n: int, groups_k: int | None = None) -> dict[str, TensorSpec]:
        """Kind -> spec of the tensors this layout reads for a [n, k] matrix;
        `groups_k`: the input columns its scales / zero points cover (a row-parallel
        act-order share's whole K; None: k)."""
        raise NotImplementedError

    def out_features(self, shapes: dict[str, tuple[int, ...]]) -> int:
        """N of a checkpoint matrix, from its tensors' shapes (kind -> shape)."""
        raise NotImplementedError

    def whole_words(self, n: int) -> bool:
        """Whether a shard of n rows ends on a word boundary of every tensor packed
        along the output dim (else its words cannot be concatenated with the next)."""
        return True

    def convert(self, t: dict[str, torch.Tensor], k: int, shards: tuple[int, ...],
                where: str, groups_k: int | None = None) -> QuantizedWeight:
        """The canonical form of the concatenated tensors of `shards` (rows each);
        `groups_k`: as in `specs` (the columns' g_idx then global, every group's scales
        and zero points present)."""
        raise NotImplementedError

    def keeps_groups_on_row_split(self) -> bool:
        """Whether a row-parallel share keeps every group's scales / zero points with
        its columns' global g_idx (a layout with g_idx and groups), instead of cutting
        them by groups (which needs each rank's columns to be whole groups)."""
        return False

    def describe(self) -> str:
        return self.name

    # ---- tensor parallelism --------------------------------------------------------
    # Which dim of each tensor kind follows the weight's output rows and input
    # columns, and in what unit (one entry per codes word, block of rows, group):
    # kind -> ((dim, unit) or None, (dim, unit) or None); unit GROUP: the group size
    # (a kind with one group per row then stays whole), G_IDX: act-order's g_idx
    # (cut and renumbered), SHAPE: compressed-tensors' stored (N, K).
    def tp_dims(self, kind: str) -> tuple:
        raise NotImplementedError

    def tp_group_size(self) -> int | None:
        """The group size, None for one group per row (-1, strategy "channel")."""
        raise NotImplementedError


GROUP, G_IDX, SHAPE = "group", "g_idx", "shape"


def int_tp_rules(layout: IntLayout, rules: dict, kinds: dict[str, tuple[str, ...]]) -> dict:
    """A tensor-parallel plan (parameter, shard) -> slice of a weight [N, K], turned
    into the slices of the format's tensors that store it (`kinds`: the weight's
    parameter name -> the tensor parameters it is stored as, in the order of
    layout.KINDS). A split that would cut a packed word or a group is refused by name
    (Split.regrid). A layout that `keeps_groups_on_row_split`: on a split of the input
    columns its group tensors stay whole and its g_idx is cut with the columns, global
    group ids kept (any act order loads; act_order_share.py)."""
    out = {key: rule for key, rule in rules.items() if key[0] not in kinds}
    group = layout.tp_group_size()
    for (name, shard), rule in rules.items():
        if name not in kinds or not hasattr(rule, "regrid"):
            continue
        side = "output rows" if rule.dim == 0 else "input columns"
        for param in kinds[name]:
            kind = max((k for k in layout.KINDS if param == k or param.endswith("_" + k)),
                       key=len)
            dim_unit = layout.tp_dims(kind)[rule.dim]
            if dim_unit is None:
                continue  # every rank the whole (g_idx of a column split)
            dim, unit = dim_unit
            what = f"{layout.describe()} {param} ({side})"
            whole_groups = rule.dim == 1 and layout.keeps_groups_on_row_split()
            if unit == SHAPE:
                out[(param, shard)] = rule.local_shape(rule.dim)
            elif unit == G_IDX:  # the same columns, along g_idx's dim, global ids kept
                out[(param, shard)] = rule.regrid(dim, 1, what)
            elif unit == GROUP:
                # (one group per row, or every group kept: the tensor stays whole)
                if group is not None and not whole_groups:
                    out[(param, shard)] = rule.regrid(dim, group, f"{what}: groups of "
                                                                  f"{group} columns")
            else:
                out[(param, shard)] = rule.regrid(dim, unit, f"{what}: {unit} per word"
                                                  if unit > 1 else what)
    return out


def packed_specs(layout: IntLayout, k: int, shards: tuple[int, ...],
                 groups_k: int | None = None) -> dict[str, TensorSpec]:
    """Specs of a packed layer's parameters: its shards' concatenated along shard_dim."""
    per = [layout.specs(k, n, groups_k) for n in shards]
    out = {}
    for kind, spec in per[0].items():
        d = spec.shard_dim
        size = sum(p[kind].shape[d] for p in per)
        shape = spec.shape[:d] + (size,) + spec.shape[d + 1:]
        out[kind] = TensorSpec(shape, spec.header_dtypes, spec.dtype, d)
    return out


def make_params(layout: IntLayout, k: int, shards: tuple[int, ...],
                experts: int | None = None,
                groups_k: int | None = None) -> dict[str, nn.Parameter]:
    """The parameters the loader fills (zeros until it does), each marked with its
    `shard_dim`; `experts`: stacked along a leading expert dim; `groups_k`: as in
    IntLayout.specs."""
    params = {}
    for kind, spec in packed_specs(layout, k, shards, groups_k).items():
        shape = spec.shape if experts is None else (experts, *spec.shape)
        p = nn.Parameter(torch.zeros(shape, dtype=spec.dtype), requires_grad=False)
        p.shard_dim = spec.shard_dim
        params[kind] = p
    return params


def split_shards(t: torch.Tensor, shards: int, name: str, where: str) -> torch.Tensor:
    """Per-shard metadata stacked along dim 0 -> its one value, checked the same in
    every shard (a packed layer's shards share their input)."""
    parts = t.reshape(shards, -1)
    if not all(torch.equal(parts[0], p) for p in parts[1:]):
        raise ValueError(f"{where}: the shards of the packed layer have different {name}: "
                         f"one act-order permutation per layer is implemented")
    return parts[0]


class IntLinearMethod(QuantizedLinearMethod):
    """A Linear whose weight is stored in `layout`'s tensors, `shards` rows per
    checkpoint matrix packed into it (one entry: not packed); `groups_k`: a
    row-parallel rank's act-order share of a matrix of that many input columns
    (IntLayout.specs), None otherwise."""

    def __init__(self, layout: IntLayout, shards: tuple[int, ...],
                 groups_k: int | None = None):
        self.layout, self.shards = layout, tuple(int(n) for n in shards)
        self.groups_k = groups_k

    def create_weights(self, layer, in_features, out_features, bias, dtype=None):
        if sum(self.shards) != out_features:
            raise ValueError(f"{self.layout.name} layer [{out_features}, {in_features}]: its "
                             f"checkpoint matrices have {list(self.shards)} rows")
        self._register_bias(layer, out_features, bias, dtype)
        layer._parameters.pop("weight", None)  # the unquantized [N, K] it was built with
        params = make_params(self.layout, in_features, self.shards, groups_k=self.groups_k)
        self.CHECKPOINT_TENSORS = tuple(params)
        for kind, p in params.items():
            layer.register_parameter(kind, p)

    def tp_rules(self, rules: dict) -> dict:
        """Tensor parallelism: the weight's slices as its stored tensors' (int_tp_rules)."""
        return int_tp_rules(self.layout, rules, {"weight": self.CHECKPOINT_TENSORS})

    def to_quantized(self, layer) -> QuantizedWeight:
        t = {kind: getattr(layer, kind).detach() for kind in self.CHECKPOINT_TENSORS}
        where = f"{self.layout.name} layer [{layer.out_features}, {layer.in_features}]"
        return self.layout.convert(t, layer.in_features, self.shards, where, self.groups_k)

    def describe(self) -> str:
        return f"{self.layout.describe()}: {super().describe()}"
