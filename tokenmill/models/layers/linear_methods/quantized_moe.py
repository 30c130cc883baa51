"""MoE experts stored in an integer format (GPTQ, AWQ, compressed-tensors), per expert
as published ("...experts.{e}.{gate_proj,up_proj,down_proj}.qweight", ...).

The loader stacks each per-expert tensor into `{target}_{kind}` [E, ...] (gate and
up concatenated along the tensor's `shard_dim`, as a packed Linear's shards), which
this method registers; after loading each expert becomes two canonical
`QuantizedWeight`s (gate | up [2I, H], down [H, I]), the stacked tensors are
dropped, and `gate_up_proj` / `down_proj` stay as meta tensors of the model's dtype
(their shapes and dtype readable, their data not). `fused_experts` runs over the
experts that received tokens, each dequantized transiently for its GEMM (as fp8's
DequantizedExperts): no dequantized copy of all experts exists at once.

On the CPU with the native kernels (`for_platform`), each expert is packed once for
`linear_quant` instead (PackedQuantizedWeight: the quad layout where the platform asks
for it), the canonical codes dropped: an expert's slice of up to `max_rows` rows (every
decode step's) reads its packed codes once, the larger slices dequantize tiles of it
for the library GEMM. Decode no longer dequantizes every touched expert every step.

On CUDA with Triton (`with_triton`, the CUDA platform's choice), the experts are
stacked once into ops/triton_quant_moe.py's device layout (the canonical copies
dropped) and run its grouped GEMMs: no host sync on the expert groups, so a decode
step can be captured in a CUDA graph.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from tokenmill.models.layers.linear_methods.base import FusedMoEMethod
from tokenmill.models.layers.linear_methods.fused_moe import fused_experts
from tokenmill.models.layers.linear_methods.int_layout import (IntLayout, int_tp_rules,
                                                               make_params)
from tokenmill.models.layers.linear_methods.quantized_cpu import PackedQuantizedExperts
from tokenmill.models.layers.linear_methods.quantized_weight import QuantizedWeight
from tokenmill.models.layers.linear_methods.triton_experts import TritonExpertsMixin


class QuantizedExperts:
    """Per-expert QuantizedWeights read as the stacked matrices `fused_experts`
    indexes: `[e]` is expert e's W [N, K] in `dtype`, dequantized on the spot."""

    def __init__(self, weights: list[QuantizedWeight], dtype: torch.dtype):
        self.weights, self.dtype = weights, dtype
        n, k = weights[0].shape
        self.shape = (len(weights), n, k)

    def __getitem__(self, e: int) -> torch.Tensor:
        return self.weights[e].dequantize(self.dtype)


class QuantizedFusedMoEMethod(TritonExpertsMixin, FusedMoEMethod):
    """The experts' grouped GEMMs over integer-quantized weights in `layout`'s format
    (W4A16 / W8A16: activations unquantized). `compute_dtype`: the GEMMs' dtype where
    the platform widens; None: the activations'. `down_groups_k`: a tensor-parallel
    rank's act-order share of down_proj's input (the whole intermediate size, whose
    groups' scales / zero points it keeps: IntLayout.specs), None otherwise."""

    TARGETS = ("gate_up_proj", "down_proj")

    def __init__(self, layout: IntLayout, compute_dtype: torch.dtype | None = None,
                 down_groups_k: int | None = None):
        self.layout, self.compute_dtype = layout, compute_dtype
        self.down_groups_k = down_groups_k
        self.w13: list[QuantizedWeight] | None = None
        self.w2: list[QuantizedWeight] | None = None
        # The platform's native kernels (for_platform): packed at conversion.
        self.ops, self.max_rows, self.quad_max_rows = None, 0, 0
        self.packed: PackedQuantizedExperts | None = None

    def _matrices(self, hidden: int, inter: int):
        """(target, K, checkpoint matrices' rows, groups_k) of each stacked projection."""
        return (("gate_up_proj", hidden, (inter, inter), None),
                ("down_proj", inter, (hidden,), self.down_groups_k))

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size, dtype=None):
        self.dtype = dtype or torch.get_default_dtype()
        self.kinds = {}
        for target, k, shards, groups_k in self._matrices(hidden_size, intermediate_size):
            layer._parameters.pop(target, None)  # the unquantized stack it was built with
            params = make_params(self.layout, k, shards, experts=num_experts,
                                 groups_k=groups_k)
            self.kinds[target] = tuple(params)
            for kind, p in params.items():
                layer.register_parameter(f"{target}_{kind}", p)

    def tp_rules(self, rules: dict) -> dict:
        """Tensor parallelism: each expert's gate / up rows and down columns as its
        stored tensors' slices (int_tp_rules); the stacked forms are not loaded."""
        per_expert = {key: rule for key, rule in rules.items() if key[1] is not None}
        return int_tp_rules(self.layout, per_expert,
                            {t: tuple(f"{t}_{kind}" for kind in self.kinds[t])
                             for t in self.TARGETS})

    def process_weights_after_loading(self, layer) -> None:
        if self.w13 is None and self.packed is None and self.gpu is None:
            self._convert(layer)  # (once: the loader's call)
        if self.triton and self.gpu is None:
            from tokenmill.ops.triton_quant_moe import IntExpertsTriton
            device = self.w13[0].codes.device
            self.gpu = (IntExpertsTriton(self.w13, device), IntExpertsTriton(self.w2, device))
            self.w13 = self.w2 = None  # the stacked device copy is the only one kept
            return
        if (self.packed is None and self.ops is not None and self.max_rows > 0
                and hasattr(self.ops, "linear_quant")):
            self.packed = PackedQuantizedExperts.from_quantized(
                self.ops, self.w13, self.w2, self.max_rows, self.quad_max_rows,
                self.compute_dtype)
            self.w13 = self.w2 = None  # the packed codes are the only copy kept

    def _convert(self, layer) -> None:
        e_count, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
        converted = {}
        for target, k, shards, groups_k in self._matrices(h, i):
            experts = []
            for e in range(e_count):
                where = f"{self.layout.name} expert {e} {target} [{sum(shards)}, {k}]"
                t = {kind: getattr(layer, f"{target}_{kind}")[e].detach()
                     for kind in self.kinds[target]}
                qw = self.layout.convert(t, k, shards, where, groups_k).check(where)
                if qw.shape != (sum(shards), k):
                    raise ValueError(f"{where}: the checkpoint's tensors give a "
                                     f"{list(qw.shape)} matrix")
                experts.append(qw)
            converted[target] = experts
            for kind in self.kinds[target]:
                del layer._parameters[f"{target}_{kind}"]
            shape = (e_count, sum(shards), k)
            layer.register_parameter(target, nn.Parameter(
                torch.empty(shape, dtype=self.dtype, device="meta"), requires_grad=False))
        self.w13, self.w2 = converted["gate_up_proj"], converted["down_proj"]

    def with_compute_dtype(self, dtype: torch.dtype | None) -> "QuantizedFusedMoEMethod":
        """The same method (converted experts shared) with its GEMMs in `dtype`."""
        method = copy.copy(self)
        method.compute_dtype = dtype
        if self.packed is not None:
            method.packed = self.packed.with_compute_dtype(dtype)
        return method

    def for_platform(self, ops, compute_dtype: torch.dtype | None, max_rows: int,
                     quad_max_rows: int = 0) -> "QuantizedFusedMoEMethod":
        """This method with the native CPU kernels `ops` for expert slices of up to
        `max_rows` rows (`quad_max_rows` > 0: the quad layout with that limit) and the
        GEMMs of the larger ones in `compute_dtype`; packed when the layer sets it."""
        method = self.with_compute_dtype(compute_dtype)
        method.ops, method.max_rows, method.quad_max_rows = ops, max_rows, quad_max_rows
        return method

    def apply(self, layer, x, topk_weights, topk_ids):
        if self.gpu is not None:
            return self.apply_triton(layer, x, topk_weights, topk_ids)
        dtype = self.compute_dtype or x.dtype
        if self.packed is not None:
            return fused_experts(x, layer.gate_up_proj, layer.down_proj, topk_weights,
                                 topk_ids, dtype, self.packed, activation=layer.activation)
        return fused_experts(x, QuantizedExperts(self.w13, dtype),
                             QuantizedExperts(self.w2, dtype), topk_weights, topk_ids,
                             dtype, activation=layer.activation)

    def nbytes(self) -> int:
        """Resident bytes of the experts' weights (the Triton layout, packed, or the
        canonical codes)."""
        if self.gpu is not None:
            return self.triton_nbytes()
        if self.packed is not None:
            return self.packed.nbytes()
        return sum(qw.nbytes() for qw in (self.w13 or []) + (self.w2 or []))

    def describe(self) -> str:
        wide = "" if self.compute_dtype is None else f", in {self.compute_dtype}"
        native = "" if self.packed is None else self.packed.describe()
        if self.gpu is not None:
            native = self.TRITON_DESCRIPTION
        return f"{type(self).__name__}({self.layout.describe()}{native}{wide})"
