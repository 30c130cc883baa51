"""The linear method of integer-quantized layers (GPTQ, AWQ, compressed-tensors, int8
made at load): one base that every such format subclasses with its checkpoint layout.

A format's subclass says what its checkpoint holds and how to read it:

- `create_weights` registers the checkpoint's tensors (packed words, scales, zero
  points, g_idx) under the checkpoint's names, for the loader to fill;
- `to_quantized(layer)` turns them into the canonical `QuantizedWeight`
  (quantized_weight.py) once, after loading;
- `CHECKPOINT_TENSORS`: the names it registered, dropped from the layer once converted.

The base does the rest the same way for every format: after loading it converts,
checks and keeps the canonical form (`self.qweight`), leaves `layer.weight` as a
meta tensor [N, K] in the model's dtype (its shape and dtype stay readable, any use
of its data fails loudly) and multiplies through `reference_linear`: tiles of rows
dequantized and multiplied one at a time, never a dequantized copy of the matrix.

The platform (`Platform.linear_method`) hands a quantized method its kernels through
`for_platform`: the native CPU module, the dtype its GEMMs compute in where the
platform widens, and the row count up to which the packed kernel takes an input.
With the kernels, the canonical form is packed once into their layout
(quantized_cpu.py `PackedQuantizedWeight`) and the packed copy is the only one kept:
inputs of up to `max_rows` rows take `linear_quant`, larger ones dequantized tiles.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from tokenmill.models.layers.linear_methods.base import LinearMethod
from tokenmill.models.layers.linear_methods.quantized_cpu import PackedQuantizedWeight
from tokenmill.models.layers.linear_methods.quantized_weight import (QuantizedWeight,
                                                                     reference_linear)


class QuantizedLinearMethod(LinearMethod):
    CHECKPOINT_TENSORS: tuple[str, ...] = ()
    ops = None           # the native kernels module (for_platform), or None
    max_rows = 0         # inputs of up to this many rows take the native kernel
    compute_dtype: torch.dtype | None = None  # the GEMMs' dtype (None: the input's)
    qweight: QuantizedWeight | None = None
    packed: PackedQuantizedWeight | None = None  # with the native kernels: the only copy
    triton = False       # the CUDA path's Triton GEMM (for_platform)
    # > 0: pack 4- / 8-bit codes in the quad layout (integer dot products on 15-bit
    # activations; bf16 models where the kernels have it) for up to this many rows
    quad_max_rows = 0
    gpu = None           # ops/triton_quant_linear.IntWeightTriton: then the only copy

    # ---- what a format implements --------------------------------------------------
    def create_weights(self, layer, in_features, out_features, bias, dtype=None):
        raise NotImplementedError

    def to_quantized(self, layer) -> QuantizedWeight:
        raise NotImplementedError

    # ---- the same for every format -------------------------------------------------
    def _register_bias(self, layer, out_features: int, bias: bool, dtype) -> None:
        """The model's dtype (the bias's, dense_weight's) and the bias parameter."""
        self.dtype = dtype or torch.get_default_dtype()
        layer.register_parameter(
            "bias", nn.Parameter(torch.zeros(out_features, dtype=self.dtype),
                                 requires_grad=False) if bias else None)

    def for_platform(self, ops, compute_dtype: torch.dtype | None,
                     max_rows: int, triton: bool = False,
                     quad_max_rows: int = 0) -> "QuantizedLinearMethod":
        """This method (checkpoint tensors untouched) with the platform's kernels: the
        native CPU module, or (`triton`) the Triton GEMM on a GPU. `quad_max_rows` > 0:
        the quad layout where the weight's shape allows it, with that row limit."""
        method = copy.copy(self)
        method.ops, method.compute_dtype, method.max_rows = ops, compute_dtype, max_rows
        method.triton, method.quad_max_rows = triton, quad_max_rows
        return method

    def process_weights_after_loading(self, layer) -> None:
        if self.qweight is None and self.packed is None and self.gpu is None:
            self._convert(layer)
        if self.triton and self.gpu is None:
            from tokenmill.ops.triton_quant_linear import IntWeightTriton
            self.gpu = IntWeightTriton(self.qweight, self.qweight.codes.device)
            self.qweight = None
            return
        if (self.packed is None and self.ops is not None
                and hasattr(self.ops, "linear_quant")):
            self.packed = PackedQuantizedWeight(self.ops, self.qweight,
                                                quad=self.quad_max_rows > 0)
            if self.packed.quad:
                self.max_rows = self.quad_max_rows
            self.qweight = None  # no uint8 codes copy stays beside the packed one

    def _convert(self, layer) -> None:
        """The checkpoint's tensors -> the canonical form (once), checked."""
        where = f"quantized layer [{layer.out_features}, {layer.in_features}]"
        qw = self.to_quantized(layer).check(where)
        if qw.shape != (layer.out_features, layer.in_features):
            raise ValueError(f"{where}: the checkpoint's tensors give a "
                             f"{list(qw.shape)} matrix")
        for name in self.CHECKPOINT_TENSORS:
            if name in layer._parameters:
                del layer._parameters[name]
            elif hasattr(layer, name):
                delattr(layer, name)
        layer.weight = nn.Parameter(
            torch.empty(layer.out_features, layer.in_features, dtype=self.dtype,
                        device="meta"), requires_grad=False)
        self.qweight = qw

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if self.gpu is not None:
            return self.gpu.linear(x, layer.bias, self.compute_dtype)
        if self.packed is not None:
            return self.packed.linear(x, layer.bias, self.max_rows, self.compute_dtype)
        return reference_linear(self.qweight, x, layer.bias, self.compute_dtype)

    def dense_weight(self, layer) -> torch.Tensor:
        if self.gpu is not None:
            return self.gpu.dequantize(self.dtype)
        if self.packed is not None:
            return self.packed.dequantize(self.dtype)
        return self.qweight.dequantize(self.dtype)

    @property
    def weight_form(self):
        """The weights as this method keeps them now (the Triton layout, the native
        packed one, or the canonical QuantizedWeight; each has bits, group_size, perm),
        None before conversion."""
        return next((q for q in (self.gpu, self.packed, self.qweight) if q is not None), None)

    def describe(self) -> str:
        qw = self.weight_form
        shape = "" if qw is None else (f"{qw.bits}-bit, group {qw.group_size}"
                                       f"{', act-order' if qw.perm is not None else ''}"
                                       f"{_padding(qw)}")
        return f"{type(self).__name__}({shape}{self.describe_kernel()})"

    def describe_kernel(self) -> str:
        """", Triton" / ", native up to N rows" / "" and the widened dtype, for the log."""
        quad = (" (integer dot products, 15-bit activations)"
                if self.packed is not None and self.packed.quad else "")
        native = (", Triton" if self.gpu is not None else
                  f", native up to {self.max_rows} rows{quad}" if self.packed is not None
                  else "")
        wide = "" if self.compute_dtype is None else f", in {self.compute_dtype}"
        return native + wide


def _padding(qw) -> str:
    """", padded K -> K' columns" for a row-parallel act-order share (act_order_share.py)."""
    width = qw.perm.numel() if qw.perm is not None else 0
    k = getattr(qw, "in_features", None) or width
    return f", padded {k} -> {width} columns" if width != k else ""
