"""The Linear layer: y = x W^T + b, computed by the layer's method, split over ranks by
the role the model gives it.

The weights and the GEMM belong to the layer's `method` (layers/linear_methods/): at
construction an unquantized one registers `weight` [N, K] and `bias` for the
checkpoint to fill; after loading, the platform gives the layer the method that runs
(packed kernels for decode-sized inputs, oneDNN's prepacked GEMM, a widened fp32
GEMM, PyTorch's) and `set_method` lets it repack the weights once. `forward` is one
call of the method.

Tensor parallelism (models/tensor_parallel.py) reads the role the model declares
where it builds the layer, as Megatron's layer kinds:

- "replicated" (default): every rank holds the whole layer;
- "column": the output rows split over the ranks (each rank its heads, its share of
  the intermediate size); `output_sizes` names the packed segments of a fused
  projection (gate | up, ...), each split in place, one checkpoint shard each;
- "row": the input columns split, each rank a partial sum of the output, all-reduced
  (by the layer, unless a block around it reduces once for all of its parts); the
  bias is added by one rank;
- `QKVParallel(...)`: a packed q | k | v projection split by heads, K / V heads
  replicated where the model has fewer than ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.models.layers.linear_methods import (ALL_ROWS, LinearMethod,
                                                    UnquantizedLinearMethod, widen_gemms)

__all__ = ["ALL_ROWS", "Linear", "QKVParallel", "TP_ROLES", "widen_gemms"]

TP_ROLES = ("replicated", "column", "row")


@dataclass(frozen=True)
class QKVParallel:
    """The tensor-parallel role of a packed q | k | v projection (this rank's sizes)."""
    q_rows: int  # q rows (a gated attention's q_proj: q and gate rows per head)
    k_rows: int  # 0: the layer has no K rows (Gemma 4's KV-shared layers)
    v_rows: int  # 0: no V rows (k = v, or KV-shared)
    head_dim: int
    layer_idx: int | None = None  # models whose layers differ in KV head count


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 tp: str | QKVParallel = "replicated",
                 output_sizes: tuple[int | tuple[int, ...], ...] | None = None,
                 method: LinearMethod | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        if not (tp in TP_ROLES or isinstance(tp, QKVParallel)):
            raise ValueError(f"tp must be one of {TP_ROLES} or a QKVParallel, got {tp!r}")
        self.in_features, self.out_features = in_features, out_features
        self.tp, self.output_sizes = tp, output_sizes
        self.method = method if method is not None else UnquantizedLinearMethod()
        self.method.create_weights(self, in_features, out_features, bias, dtype)

    def use_method(self, method: LinearMethod, dtype: torch.dtype | None = None) -> None:
        """Before loading: keep the weights as `method` registers them (a quantized
        checkpoint's layout: models/quantized_layers.py) instead of the unquantized
        [N, K] the layer was built with."""
        self.method = method
        method.create_weights(self, self.in_features, self.out_features,
                              self.bias is not None, dtype)

    def set_method(self, method: LinearMethod) -> None:
        """Run through `method` from now on (the platform's choice, after loading): it
        turns the loaded weights into its kernel's layout first."""
        method.process_weights_after_loading(self)
        self.method = method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def dense_weight(self) -> torch.Tensor:
        """The [N, K] weights, from whichever copy the method keeps."""
        return self.method.dense_weight(self)

    # ---- tensor parallelism -------------------------------------------------------
    @property
    def tp_reduces(self) -> bool:
        """Its output is a partial sum over the ranks (row-parallel)."""
        return self.tp == "row"

    def tp_plan(self, tp) -> dict:
        """(parameter name, checkpoint shard) -> this rank's slice, from the role; a
        quantized method maps the weight's slices onto its own tensors (`tp_rules`)."""
        if self.tp == "column":
            rules = tp.column(self.out_features, self.output_sizes)
        elif self.tp == "row":
            rules = tp.row(self.in_features)
        elif isinstance(self.tp, QKVParallel):
            rules = tp.qkv(self.tp)
        else:
            return {}
        own = getattr(self.method, "tp_rules", None)
        return rules if own is None else own(rules)

    def extra_repr(self) -> str:
        role = "" if self.tp == "replicated" else f", tp={self.tp}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, method={self.method.describe()}{role}")
