"""The interfaces every GEMM layer computes through: `LinearMethod` (a `Linear`) and
`FusedMoEMethod` (the stacked experts of an MoE block).

A method owns how a layer's weights are kept and multiplied:

- `create_weights` registers the parameters the checkpoint fills (an unquantized
  method: `weight` [N, K] and `bias` [N]; a quantized one would add its scales);
- `process_weights_after_loading` turns them, once, into what the kernel reads
  (packed, prepacked, widened) and drops copies no longer needed;
- `apply` computes the layer's output: the layer's `forward` is this one call;
- `dense_weight` gives the [N, K] weights back for code that needs them as a matrix
  (the greedy head's int8 screen, MLA's absorbed weights, tests).

A method object belongs to one layer: it holds the kernel state it made (the packed
copy, its row limit, the method that takes the other inputs) next to its policy.
The layers get an unquantized method at construction; the platform
(`Platform.linear_method` / `moe_method`, tokenmill/platforms/interface.py) chooses
the method that runs, once, after loading. A method may still pick its kernel by
the input's row count (packed kernels for decode-sized inputs, a GEMM above): that
is the method's own kernel policy, not a choice of method.
"""
from __future__ import annotations

import torch

# max_rows of a packed method that takes every input (it keeps no other copy).
ALL_ROWS = 1 << 62


class LinearMethod:
    # The native packed layout `packed_weight` is in (torch.bfloat16: linear_bf16's,
    # torch.float32: linear_f32's), for the native decode-layer loops and the greedy
    # head, which read it directly; None: no packed copy.
    packed_dtype: torch.dtype | None = None
    packed_weight: torch.Tensor | None = None
    max_rows = 0  # inputs of up to this many rows take the packed kernel

    def create_weights(self, layer, in_features: int, out_features: int, bias: bool,
                       dtype: torch.dtype | None = None) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer) -> None:
        """Once, after the checkpoint filled the weights."""

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dense_weight(self, layer) -> torch.Tensor:
        """The [N, K] weights, from whichever copy this method keeps."""
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__


class FusedMoEMethod:
    """The experts' GEMMs: x [T, H] routed to `topk_ids` [T, k] with `topk_weights`
    -> sum over the k slots of weight * expert(x), [T, H]."""

    def create_weights(self, layer, num_experts: int, hidden_size: int,
                       intermediate_size: int, dtype: torch.dtype | None = None) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer) -> None:
        """Once, after the checkpoint filled the weights."""

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__
