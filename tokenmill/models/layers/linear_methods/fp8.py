"""FP8 weights with block scales, as DeepSeek-V3 and the Qwen `-FP8` checkpoints publish
them: `weight` float8_e4m3fn [N, K] and `weight_scale_inv` fp32 [ceil(N/bn), ceil(K/bk)],
one scale per [bn, bk] block (the last row / column of blocks may be partial). The
weight the checkpoint stands for is W = weight.float() * scale, each scale broadcast
over its block (despite the name, `weight_scale_inv` multiplies: it is the inverse of
the quantizer's scale).

Per-channel and per-tensor scales (checkpoints without weight_block_size, and the fp8
made at load by `--quantization fp8`) are one-row blocks spanning the row,
`per_channel_block`: `weight_scale_inv` [N, 1], broadcast over the row when
dequantizing (no [N, K] scale tensor is built), described as "per-channel".

W8A16: the activations are not quantized. The checkpoints' `activation_scheme:
dynamic` asks for per-token-group e4m3 activations on hardware with fp8 GEMMs; here
the activations stay in the model's dtype, so the result is that of the dequantized
weights (more accurate than the checkpoint's own runtime, and what HF transformers
computes when it dequantizes). The memory saving is the point: the resident weight is
the 1-byte e4m3 tensor.

The kernels, chosen by the platform (`for_platform`, as the integer formats'):

- on the CPU, the native kernels (tokenmill/kernels/cpu_quant_linear.cpp, the integer
  formats' W8A16 kernel with e4m3 codes): after loading, the e4m3 weight and its
  block scales are packed once (quantized_cpu.py `PackedQuantizedWeight.e4m3`: a
  byte a weight, the scales expanded to one per column and bk group) and the packed
  copy is the only one kept (`weight` and `weight_scale_inv` stay as meta tensors:
  shapes and dtypes readable). Inputs of up to `max_rows` rows take `linear_quant`
  (the codes widened in registers, fp32 math), larger ones dequantized tiles of
  weight rows and the library GEMM in the compute dtype;
- on CUDA, the Triton FP8 GEMM (`with_triton`: ops/triton_quant_linear.py); MoE
  experts through its grouped form (ops/triton_quant_moe.py `Fp8ExpertsTriton`:
  no host sync on the expert groups, so decode steps can be captured in a CUDA
  graph);
- otherwise (no kernels) `apply` dequantizes per call, in tiles of whole block rows of
  W (ROW_TILE_ELEMENTS elements at most, ~16 MiB in fp32), each multiplied and
  dropped before the next: a dequantized copy of the whole matrix is never kept, nor
  built at once for a large layer. The cost is one dequantization of W per forward
  call, cheap beside the GEMM for prefill, dominant for one-token decode.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.layers.linear_methods.base import FusedMoEMethod, LinearMethod
from tokenmill.models.layers.linear_methods.fused_moe import fused_experts
from tokenmill.models.layers.linear_methods.quantized_cpu import PackedQuantizedWeight
from tokenmill.models.layers.linear_methods.triton_experts import TritonExpertsMixin

FP8_DTYPE = torch.float8_e4m3fn
# Elements of W dequantized at once (rounded down to whole block rows, at least one).
ROW_TILE_ELEMENTS = 1 << 22


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def per_channel_block(*in_features: int) -> tuple[int, int]:
    """The block of per-channel scales (one per output row): one row by at least the
    widest input (every K it covers is one column of blocks), so the block methods
    serve per-channel and per-tensor checkpoints and the fp8 made at load."""
    return (1, max(in_features))


def describe_block(block_size: tuple[int, int], in_features: int | None,
                   compute_dtype) -> str:
    """"[bn, bk]", or "per-channel" for one-row blocks that span every input column."""
    bn, bk = block_size
    wide = "" if compute_dtype is None else f", in {compute_dtype}"
    per_channel = bn == 1 and in_features is not None and bk >= in_features
    return ("per-channel" if per_channel else f"[{bn}, {bk}]") + wide


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor,
                         block_size: tuple[int, int],
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [n, K] e4m3 (whole block rows, the last may be partial), scale_inv
    [ceil(n/bn), ceil(K/bk)] -> W [n, K] in `dtype` (computed in fp32, then rounded)."""
    bn, bk = block_size
    n, k = weight.shape
    scale = scale_inv.float()
    if bn > 1:
        scale = scale.repeat_interleave(bn, 0)[:n]
    if scale.shape[1] > 1:  # one scale column spans the row (bk >= K): broadcast it
        scale = scale.repeat_interleave(bk, 1)[:, :k]
    w = weight.float()  # a new fp32 tensor (e4m3 -> fp32 is exact): scaled in place
    return w.mul_(scale).to(dtype)


def block_scale_rules(rules: dict, scales: dict[str, str], block_size: tuple[int, int],
                      per_channel: bool) -> dict:
    """A tensor-parallel plan (parameter, shard) -> slice of the weights, with the slices
    of their block scales (`scales`: weight parameter -> its scales') added: a split of
    rows (dim 0) or input columns (dim 1) takes the same blocks' scales, and must fall
    on a block boundary (refused naming weight_block_size otherwise). Per-channel
    scales (one per row) are cut with the rows and kept whole for a split of the
    columns."""
    out = dict(rules)
    for (name, shard), rule in rules.items():
        if name not in scales or (shard is None and name != "weight"):
            continue  # (experts stored stacked: refused for fp8 before this)
        if not hasattr(rule, "regrid") or (rule.dim == 1 and per_channel):
            continue
        unit = block_size[rule.dim]
        what = (f"fp8 weight_block_size {list(block_size)}: "
                f"{'output rows' if rule.dim == 0 else 'input columns'} in blocks of {unit}")
        out[(scales[name], shard)] = rule.regrid(rule.dim, unit, what)
    return out


class Fp8BlockLinearMethod(LinearMethod):
    """y = x W^T + b over block-scaled e4m3 weights (module docstring). `compute_dtype`:
    the GEMMs' dtype (the platform's widened one where bf16 GEMMs are emulated); None:
    the input's."""

    ops = None      # the native CPU kernels module (for_platform), or None
    max_rows = 0    # inputs of up to this many rows take the native kernel
    packed: PackedQuantizedWeight | None = None  # with the native kernels: the only copy

    def __init__(self, block_size: tuple[int, int],
                 compute_dtype: torch.dtype | None = None, per_channel: bool = False):
        bn, bk = block_size
        self.block_size = (int(bn), int(bk))
        self.compute_dtype = compute_dtype
        # One scale per output row (per-channel / per-tensor checkpoints, fp8 at load):
        # a tensor-parallel split of the input columns leaves every rank the row's scale.
        self.per_channel = per_channel

    in_features: int | None = None  # K (known once create_weights ran)

    def tp_rules(self, rules: dict) -> dict:
        """Tensor parallelism (models/tensor_parallel.py): the block scales cut with the
        weight (`block_scale_rules`)."""
        return block_scale_rules(rules, {"weight": "weight_scale_inv"}, self.block_size,
                                 self.per_channel)

    def create_weights(self, layer, in_features, out_features, bias, dtype=None):
        bn, bk = self.block_size
        # The model's dtype: the bias's, and dense_weight's.
        self.dtype = dtype or torch.get_default_dtype()
        self.in_features = in_features
        layer.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=FP8_DTYPE),
                                    requires_grad=False)
        layer.weight_scale_inv = nn.Parameter(
            torch.ones(cdiv(out_features, bn), cdiv(in_features, bk), dtype=torch.float32),
            requires_grad=False)
        layer.register_parameter(
            "bias", nn.Parameter(torch.zeros(out_features, dtype=self.dtype),
                                 requires_grad=False)
            if bias else None)

    def with_compute_dtype(self, dtype: torch.dtype | None) -> "Fp8BlockLinearMethod":
        """The same method (weights, or their packed form, shared) with its GEMMs in
        `dtype`."""
        method = copy.copy(self)
        method.compute_dtype = dtype
        return method

    def for_platform(self, ops, compute_dtype: torch.dtype | None, max_rows: int,
                     triton: bool = False, quad_max_rows: int = 0) -> "Fp8BlockLinearMethod":
        """This method with the platform's kernels (as QuantizedLinearMethod's): the
        Triton GEMM (`triton`, CUDA), else the native CPU module `ops` for inputs of up
        to `max_rows` rows (None / 0: none) and the GEMMs in `compute_dtype` where the
        platform widens. Nothing to change: this method itself. (`quad_max_rows`: the
        integer kinds' quad layout; e4m3 codes have none.)"""
        if triton:
            return self.with_triton()
        dtype = compute_dtype if compute_dtype is not None else self.compute_dtype
        native = (ops is not None and max_rows > 0
                  and getattr(ops, "QUANT_E4M3", None) is not None)
        if dtype == self.compute_dtype and not native:
            return self
        method = self.with_compute_dtype(dtype)
        if native:
            method.ops, method.max_rows = ops, max_rows
        return method

    use_triton = False
    gpu = None  # ops/triton_quant_linear.Fp8WeightTriton, after loading (with_triton)

    def with_triton(self) -> "Fp8BlockLinearMethod":
        """The same method through the Triton FP8 GEMM (the CUDA path): the e4m3 weights
        read as they are stored, dequantized per tile in registers."""
        method = self.with_compute_dtype(self.compute_dtype)
        method.use_triton = True
        return method

    def process_weights_after_loading(self, layer) -> None:
        if self.use_triton and self.gpu is None:
            from tokenmill.ops.triton_quant_linear import Fp8WeightTriton
            self.gpu = Fp8WeightTriton(layer.weight.detach(),
                                       layer.weight_scale_inv.detach(), self.block_size)
        elif self.ops is not None and self.packed is None and not layer.weight.is_meta:
            self.packed = PackedQuantizedWeight.e4m3(
                self.ops, layer.weight.detach(), layer.weight_scale_inv.detach(),
                self.block_size)
            # The packed copy is the only one: no e4m3 [N, K] stays beside it.
            for name in ("weight", "weight_scale_inv"):
                setattr(layer, name, nn.Parameter(
                    torch.empty_like(getattr(layer, name), device="meta"),
                    requires_grad=False))

    def _tile_rows(self, in_features: int) -> int:
        bn = self.block_size[0]
        return max(1, ROW_TILE_ELEMENTS // max(1, in_features * bn)) * bn

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if self.gpu is not None:
            return self.gpu.linear(x, layer.bias, self.compute_dtype)
        if self.packed is not None:
            return self.packed.linear(x, layer.bias, self.max_rows, self.compute_dtype)
        dtype = self.compute_dtype or x.dtype
        bn = self.block_size[0]
        w, s = layer.weight, layer.weight_scale_inv
        n = w.shape[0]
        xc = x.to(dtype)
        tile = self._tile_rows(w.shape[1])
        if tile >= n:  # one tile: no output buffer to fill
            y = F.linear(xc, dequantize_block_fp8(w, s, self.block_size, dtype))
        else:
            y = xc.new_empty(*x.shape[:-1], n)
            for r0 in range(0, n, tile):
                r1 = min(n, r0 + tile)
                wt = dequantize_block_fp8(w[r0:r1], s[r0 // bn:cdiv(r1, bn)],
                                          self.block_size, dtype)
                y[..., r0:r1] = F.linear(xc, wt)
        if layer.bias is not None:
            y = y + layer.bias.to(dtype)
        return y.to(x.dtype)

    def dense_weight(self, layer) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.dequantize(self.dtype)
        return dequantize_block_fp8(layer.weight.detach(), layer.weight_scale_inv.detach(),
                                    self.block_size, self.dtype)

    def describe(self) -> str:
        kernel = (", Triton" if self.use_triton else
                  f", native up to {self.max_rows} rows" if self.packed is not None else "")
        return (f"{type(self).__name__}("
                f"{describe_block(self.block_size, self.in_features, self.compute_dtype)}"
                f"{kernel})")


class DequantizedExperts:
    """Stacked e4m3 experts [E, N, K] + scales [E, ceil(N/bn), ceil(K/bk)] read as the
    stacked matrices `fused_experts` indexes: `[e]` dequantizes expert e (a transient
    [N, K] in `dtype`), so no dequantized copy of all experts exists at once."""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor,
                 block_size: tuple[int, int], dtype: torch.dtype):
        self.weight, self.scale_inv = weight, scale_inv
        self.block_size, self.dtype = block_size, dtype
        self.shape = weight.shape

    def __getitem__(self, e: int) -> torch.Tensor:
        return dequantize_block_fp8(self.weight[e], self.scale_inv[e], self.block_size,
                                    self.dtype)


class Fp8BlockFusedMoEMethod(TritonExpertsMixin, FusedMoEMethod):
    """The experts' grouped GEMMs over block-scaled e4m3 weights (W8A16, as
    Fp8BlockLinearMethod). `gate_up_proj` [E, 2I, H] stacks gate rows then up rows,
    each whole block rows (I a multiple of bn), so one scale tensor
    [E, 2I/bn, ceil(H/bk)] covers both; `down_proj` [E, H, I]. `compute_dtype`: the
    GEMMs' dtype where the platform widens; None: the activations'."""
    in_features: int | None = None  # max(H, I) once create_weights ran

    def __init__(self, block_size: tuple[int, int],
                 compute_dtype: torch.dtype | None = None, per_channel: bool = False):
        bn, bk = block_size
        self.block_size = (int(bn), int(bk))
        self.compute_dtype = compute_dtype
        self.per_channel = per_channel  # one scale per row (as Fp8BlockLinearMethod's)

    def tp_rules(self, rules: dict) -> dict:
        """Each expert's block scales cut with its gate / up rows and down columns."""
        return block_scale_rules(rules, {t: t + "_scale_inv"
                                         for t in ("gate_up_proj", "down_proj")},
                                 self.block_size, self.per_channel)

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size, dtype=None):
        bn, bk = self.block_size
        if intermediate_size % bn:
            raise ValueError(f"fp8 experts: intermediate size {intermediate_size} is not a "
                             f"multiple of the block's {bn} rows (gate and up scales would "
                             f"share a block row)")
        e, h, i = num_experts, hidden_size, intermediate_size
        self.in_features = max(h, i)

        def param(*shape, dtype):
            init = torch.ones if dtype == torch.float32 else torch.zeros
            return nn.Parameter(init(*shape, dtype=dtype), requires_grad=False)

        layer.gate_up_proj = param(e, 2 * i, h, dtype=FP8_DTYPE)
        layer.gate_up_proj_scale_inv = param(e, 2 * i // bn, cdiv(h, bk), dtype=torch.float32)
        layer.down_proj = param(e, h, i, dtype=FP8_DTYPE)
        layer.down_proj_scale_inv = param(e, cdiv(h, bn), cdiv(i, bk), dtype=torch.float32)

    ops = None     # the native CPU kernels (for_platform): packed when the layer sets it
    max_rows = 0
    packed = None  # quantized_cpu.PackedQuantizedExperts: the experts' only copy then

    def with_compute_dtype(self, dtype: torch.dtype | None) -> "Fp8BlockFusedMoEMethod":
        """The same method (weights untouched) with its GEMMs in `dtype`."""
        method = Fp8BlockFusedMoEMethod(self.block_size, dtype, self.per_channel)
        method.in_features = self.in_features
        method.ops, method.max_rows = self.ops, self.max_rows
        method.triton, method.gpu = self.triton, self.gpu
        if self.packed is not None:
            method.packed = self.packed.with_compute_dtype(dtype)
        return method

    def for_platform(self, ops, compute_dtype: torch.dtype | None, max_rows: int,
                     quad_max_rows: int = 0) -> "Fp8BlockFusedMoEMethod":
        """This method with the native CPU kernels `ops` (the e4m3 kind of
        `linear_quant`, block scales as its groups) for expert slices of up to
        `max_rows` rows. (`quad_max_rows`: the integer kinds' layout; none here.)"""
        method = self.with_compute_dtype(compute_dtype)
        method.ops, method.max_rows = ops, max_rows
        return method

    def process_weights_after_loading(self, layer) -> None:
        from tokenmill.models.layers.linear_methods.quantized_cpu import (
            PackedQuantizedExperts, drop_stacked_experts)
        if self.triton and self.gpu is None:
            from tokenmill.ops.triton_quant_moe import Fp8ExpertsTriton
            self.gpu = tuple(
                Fp8ExpertsTriton(getattr(layer, name).detach(),
                                 getattr(layer, name + "_scale_inv").detach(),
                                 self.block_size, getattr(layer, name).device)
                for name in ("gate_up_proj", "down_proj"))
            drop_stacked_experts(layer, "_scale_inv")  # (the bytes stay: viewed above)
            return
        if (self.packed is not None or self.ops is None or self.max_rows <= 0
                or not hasattr(self.ops, "QUANT_E4M3")):
            return
        self.packed = PackedQuantizedExperts.from_e4m3(
            self.ops, layer.gate_up_proj.detach(), layer.gate_up_proj_scale_inv.detach(),
            layer.down_proj.detach(), layer.down_proj_scale_inv.detach(), self.block_size,
            self.max_rows, self.compute_dtype)
        drop_stacked_experts(layer, "_scale_inv")

    def nbytes(self) -> int:
        """Resident bytes of the Triton layout or the packed experts (0 before: the
        e4m3 stacks are the layer's own parameters then)."""
        if self.gpu is not None:
            return self.triton_nbytes()
        return 0 if self.packed is None else self.packed.nbytes()

    def apply(self, layer, x, topk_weights, topk_ids):
        if self.gpu is not None:
            return self.apply_triton(layer, x, topk_weights, topk_ids)
        dtype = self.compute_dtype or x.dtype
        if self.packed is not None:
            return fused_experts(x, layer.gate_up_proj, layer.down_proj, topk_weights,
                                 topk_ids, dtype, self.packed, activation=layer.activation)
        w13 = DequantizedExperts(layer.gate_up_proj, layer.gate_up_proj_scale_inv,
                                 self.block_size, dtype)
        w2 = DequantizedExperts(layer.down_proj, layer.down_proj_scale_inv,
                                self.block_size, dtype)
        return fused_experts(x, w13, w2, topk_weights, topk_ids, dtype,
                             activation=layer.activation)

    def describe(self) -> str:
        native = "" if self.packed is None else self.packed.describe()
        if self.gpu is not None:
            native = self.TRITON_DESCRIPTION
        return (f"{type(self).__name__}("
                f"{describe_block(self.block_size, self.in_features, self.compute_dtype)}"
                f"{native})")
