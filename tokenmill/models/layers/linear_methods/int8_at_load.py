"""int8 weights made at load from an unquantized checkpoint (`--quantization int8`,
vLLM's flag): per-channel symmetric int8, one fp32 scale per output row, activations
unquantized (W8A16). Quantizing is the whole format: the checkpoint is a plain one.

- `Int8AtLoadLinearMethod`: a dense Linear. The loader fills the layer's float
  `weight` as for any unquantized model; `to_quantized` turns it into the canonical
  `QuantizedWeight` (`quantize_int8_per_channel`: code = round(w / s) + 128, zero
  128, s = max|w[n]| / 127) and the base class drops the float weight, so the
  [N, K] float matrix is read once and never stays resident. From there it is any
  integer format's layer: the reference GEMM, or the native kernel the platform
  hands it (`for_platform`).
- `Int8AtLoadFusedMoEMethod`: an MoE block's stacked experts, each expert's gate_up
  and down matrices quantized the same way, kept stacked: `gate_up_proj` uint8
  [E, 2I, H] + `gate_up_proj_scale` fp32 [E, 2I, 1], `down_proj` [E, H, I] +
  `down_proj_scale` [E, H, 1]; each expert that receives tokens is dequantized
  transiently for its GEMMs (as fp8's experts), `expert_weight` gives expert e's
  matrix as a `QuantizedWeight` view (no copy) for a kernel that takes that form.
  With the platform's native CPU kernels (`for_platform`) each expert is packed once
  for `linear_quant` instead (quantized_cpu.PackedQuantizedExperts) and the stacked
  codes dropped. On CUDA (`with_triton`) they are stacked into
  ops/triton_quant_moe.py's layout for its grouped GEMMs instead, likewise the only copy.

Used by models/quantize_at_load.py after the weights are loaded.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.models.layers.linear_methods.base import FusedMoEMethod
from tokenmill.models.layers.linear_methods.fused_moe import fused_experts
from tokenmill.models.layers.linear_methods.quantized_cpu import (PackedQuantizedExperts,
                                                                   drop_stacked_experts)
from tokenmill.models.layers.linear_methods.quantized_linear import QuantizedLinearMethod
from tokenmill.models.layers.linear_methods.quantized_weight import (
    QuantizedWeight, quantize_int8_per_channel)
from tokenmill.models.layers.linear_methods.triton_experts import TritonExpertsMixin

INT8_ZERO = 128  # the code that stands for 0.0 (the canonical form's codes are unsigned)


class Int8AtLoadLinearMethod(QuantizedLinearMethod):
    """A dense Linear's per-channel int8 weights, quantized from its loaded float
    weight. `dtype`: the model's (the bias's, dense_weight's)."""
    CHECKPOINT_TENSORS = ("weight",)

    def __init__(self, dtype: torch.dtype | None = None,
                 row_amax: torch.Tensor | None = None):
        self.dtype = dtype or torch.get_default_dtype()
        # [N, 1] max |w| of each whole row, where this layer holds a share of the row
        # (row-parallel): quantized against it, as the unsplit layer would be.
        self.row_amax = row_amax

    def create_weights(self, layer, in_features, out_features, bias, dtype=None):
        # The checkpoint's plain float weight, quantized after loading.
        self._register_bias(layer, out_features, bias, dtype)
        layer.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=self.dtype),
                                    requires_grad=False)

    def to_quantized(self, layer) -> QuantizedWeight:
        qw = quantize_int8_per_channel(layer.weight.detach(), self.row_amax)
        self.row_amax = None
        return qw

    def describe(self) -> str:
        return f"{type(self).__name__}(int8 per-channel{self.describe_kernel()})"


def quantize_experts_int8(w: torch.Tensor, amax: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked experts w [E, N, K] -> (uint8 codes [E, N, K], fp32 scales [E, N, 1]),
    each expert's rows as `quantize_int8_per_channel` quantizes a matrix; one expert
    at a time, so the fp32 transient is one expert's. `amax` [E, N, 1]: the whole
    rows' max |w| (a tensor-parallel rank holding a share of each row)."""
    codes = torch.empty(w.shape, dtype=torch.uint8, device=w.device)
    scales = torch.empty(*w.shape[:2], 1, dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        qw = quantize_int8_per_channel(w[e], None if amax is None else amax[e])
        codes[e], scales[e] = qw.codes, qw.scales
    return codes, scales


def dequantize_int8_rows(codes: torch.Tensor, scales: torch.Tensor,
                         dtype: torch.dtype) -> torch.Tensor:
    """codes [N, K] uint8 (zero 128), scales [N, 1] -> W [N, K] (fp32 math, then cast),
    the same numbers as `QuantizedWeight.dequantize`."""
    return ((codes.to(torch.int32) - INT8_ZERO).to(torch.float32) * scales).to(dtype)


class _DequantizedInt8Experts:
    """Stacked int8 experts read as `fused_experts`' stacked matrices: `[e]` is expert
    e's dequantized matrix (a transient in `dtype`)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
        self.codes, self.scales, self.dtype = codes, scales, dtype
        self.shape = codes.shape

    def __getitem__(self, e: int) -> torch.Tensor:
        return dequantize_int8_rows(self.codes[e], self.scales[e], self.dtype)


class Int8AtLoadFusedMoEMethod(TritonExpertsMixin, FusedMoEMethod):
    """The experts' grouped GEMMs over per-channel int8 experts made at load (module
    docstring). `compute_dtype`: the GEMMs' dtype where the platform widens; None:
    the activations'."""

    def __init__(self, compute_dtype: torch.dtype | None = None):
        self.compute_dtype = compute_dtype
        # The platform's native kernels (for_platform): packed when the layer sets it.
        self.ops, self.max_rows, self.quad_max_rows = None, 0, 0
        self.packed: PackedQuantizedExperts | None = None

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size, dtype=None):
        raise ValueError("int8 experts are made from loaded float experts "
                         "(quantize_fused_moe), not loaded from a checkpoint")

    @staticmethod
    def quantize_fused_moe(layer, row_amax=None) -> "Int8AtLoadFusedMoEMethod":
        """Replace `layer`'s loaded float experts by their int8 codes and scales (the
        float stacks dropped) and run through this method from now on. `row_amax`:
        name -> [E, N, 1] whole rows' max |w| for a stack holding a share of each row
        (tensor parallelism's down_proj)."""
        method = Int8AtLoadFusedMoEMethod()
        for name in ("gate_up_proj", "down_proj"):
            codes, scales = quantize_experts_int8(getattr(layer, name).detach(),
                                                  (row_amax or {}).get(name))
            setattr(layer, name, nn.Parameter(codes, requires_grad=False))
            setattr(layer, name + "_scale", nn.Parameter(scales, requires_grad=False))
        layer.method = method
        return method

    def with_compute_dtype(self, dtype: torch.dtype | None) -> "Int8AtLoadFusedMoEMethod":
        method = Int8AtLoadFusedMoEMethod(dtype)
        method.ops, method.max_rows, method.quad_max_rows = (self.ops, self.max_rows,
                                                             self.quad_max_rows)
        method.triton, method.gpu = self.triton, self.gpu
        if self.packed is not None:
            method.packed = self.packed.with_compute_dtype(dtype)
        return method

    def for_platform(self, ops, compute_dtype: torch.dtype | None, max_rows: int,
                     quad_max_rows: int = 0) -> "Int8AtLoadFusedMoEMethod":
        """This method with the native CPU kernels `ops` for expert slices of up to
        `max_rows` rows (`quad_max_rows` > 0: the quad layout with that limit)."""
        method = self.with_compute_dtype(compute_dtype)
        method.ops, method.max_rows, method.quad_max_rows = ops, max_rows, quad_max_rows
        return method

    def process_weights_after_loading(self, layer) -> None:
        if self.triton and self.gpu is None:
            from tokenmill.ops.triton_quant_moe import IntExpertsTriton
            experts = range(layer.gate_up_proj.shape[0])
            self.gpu = tuple(
                IntExpertsTriton([self.expert_weight(layer, name, e) for e in experts],
                                 getattr(layer, name).device)
                for name in ("gate_up_proj", "down_proj"))
            drop_stacked_experts(layer, "_scale")
            return
        if (self.packed is not None or self.ops is None or self.max_rows <= 0
                or not hasattr(self.ops, "linear_quant")):
            return
        experts = range(layer.gate_up_proj.shape[0])
        self.packed = PackedQuantizedExperts.from_quantized(
            self.ops, [self.expert_weight(layer, "gate_up_proj", e) for e in experts],
            [self.expert_weight(layer, "down_proj", e) for e in experts], self.max_rows,
            self.quad_max_rows, self.compute_dtype)
        drop_stacked_experts(layer, "_scale")

    def nbytes(self) -> int:
        """Resident bytes of the Triton layout or the packed experts (0 before: the
        stacked codes are the layer's own parameters then)."""
        if self.gpu is not None:
            return self.triton_nbytes()
        return 0 if self.packed is None else self.packed.nbytes()

    @staticmethod
    def expert_weight(layer, name: str, e: int) -> QuantizedWeight:
        """Expert e's `name` ("gate_up_proj" / "down_proj") in the canonical form."""
        codes, scales = getattr(layer, name)[e], getattr(layer, name + "_scale")[e]
        zeros = torch.full_like(scales, INT8_ZERO, dtype=torch.uint8)
        return QuantizedWeight(codes, scales, zeros, 8, codes.shape[1])

    def apply(self, layer, x, topk_weights, topk_ids):
        if self.gpu is not None:
            return self.apply_triton(layer, x, topk_weights, topk_ids)
        dtype = self.compute_dtype or x.dtype
        if self.packed is not None:
            return fused_experts(x, layer.gate_up_proj, layer.down_proj, topk_weights,
                                 topk_ids, dtype, self.packed, activation=layer.activation)
        w13 = _DequantizedInt8Experts(layer.gate_up_proj, layer.gate_up_proj_scale, dtype)
        w2 = _DequantizedInt8Experts(layer.down_proj, layer.down_proj_scale, dtype)
        return fused_experts(x, w13, w2, topk_weights, topk_ids, dtype,
                             activation=layer.activation)

    def describe(self) -> str:
        wide = "" if self.compute_dtype is None else f", in {self.compute_dtype}"
        native = "" if self.packed is None else self.packed.describe()
        if self.gpu is not None:
            native = self.TRITON_DESCRIPTION
        return f"{type(self).__name__}(int8 per-channel{native}{wide})"
