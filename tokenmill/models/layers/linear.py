"""Linear layers whose GEMM may run in a wider dtype than the activations.

On CPUs without native bf16 (no AVX512-BF16 / AMX), oneDNN emulates bf16
GEMMs at ~26 GFLOP/s while fp32 GEMMs reach ~120 on the same cores. A bf16
weight upcast to fp32 is exact, bf16 x bf16 products are exact in fp32, and
oneDNN's bf16 GEMM accumulates in fp32 too: computing in fp32 and rounding the
result to bf16 is the same math (up to summation order), about 4x faster.

Better still for a bf16 model, the native `linear_bf16` kernel reads the bf16
weights (packed once at load) and widens them in registers - the same math
again, fp32 products and sums, over half the bytes of fp32 weights (a decode
step is bound by reading them). Which layers do so, for how many rows, and
whether an fp32 (or the bf16) copy is kept for larger inputs, is the CPU
platform's decision (tokenmill/platforms/cpu.py); it calls `pack_bf16` once at load.

An fp32 model's decode-sized inputs take `linear_f32` the same way (`pack_f32`): the
same math as F.linear up to summation order, but it streams the weights at the
memory's pace where a batch-1 F.linear does not; larger inputs keep oneDNN.

Those larger inputs (batched decode, prefill) run oneDNN's GEMM on weights reordered
once into its blocked layout (`prepack_onednn`: torch.ops.mkldnn's
_reorder_linear_weight / _linear_pointwise, what PyTorch's own CPU compiler uses for
frozen weights) instead of F.linear on the plain [N, K] weights: 1.3-3x the fp32
GEMM speed and 1.0-1.8x the bf16 one at 9-2048 rows on the machines measured, the
same bf16 results bit for bit, fp32 ones up to summation order. The prepacked copy
replaces `weight`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


# bf16_max_rows of a layer that takes every input through the packed kernel.
ALL_ROWS = 1 << 62


class Linear(nn.Linear):
    compute_dtype: torch.dtype | None = None
    packed_bf16: torch.Tensor | None = None  # the bf16 weights in linear_bf16's layout
    bf16_max_rows = 0  # inputs of up to this many rows take linear_bf16
    _linear_bf16 = None
    packed_f32: torch.Tensor | None = None  # fp32 weights in linear_f32's layout
    f32_max_rows = 0  # fp32 inputs of up to this many rows take linear_f32
    _linear_f32 = None
    onednn_weight: torch.Tensor | None = None  # oneDNN's prepacked weights (prepack_onednn)

    def prepack_onednn(self, keep_weight: bool = False) -> None:
        """Reorder the weights once for oneDNN's GEMM, which then takes every input the
        packed kernels do not; `weight` is dropped (left on the meta device) unless
        `keep_weight` (a weight shared with another module, as a tied embedding: dropping
        it here would free nothing)."""
        w = self.weight.detach()
        self.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
        if not keep_weight:
            self.weight = nn.Parameter(torch.empty_like(w, device="meta"), requires_grad=False)

    def pack_f32(self, ops, max_rows: int) -> None:
        """Pack the fp32 weights for `ops.linear_f32`, which then runs fp32 inputs of up
        to `max_rows` rows; `weight` stays for the larger ones."""
        self.packed_f32 = ops.pack_f32_weight(self.weight.detach().contiguous())
        self._linear_f32 = ops.linear_f32
        self._no_bias = torch.empty(0)
        self.f32_max_rows = max_rows

    def pack_bf16(self, ops, max_rows: int) -> None:
        """Pack the (bf16) weights for `ops.linear_bf16`, which then runs inputs of up to
        `max_rows` rows (ALL_ROWS: every input; widening the GEMM then keeps no fp32 copy)."""
        self.packed_bf16 = ops.pack_bf16_weight(self.weight.detach().contiguous())
        self._linear_bf16 = ops.linear_bf16
        self._no_bias = torch.empty(0)
        self.bf16_max_rows = max_rows

    @property
    def packed_only(self) -> bool:
        """The packed weights serve every input: `weight` holds no data (meta)."""
        return self._linear_bf16 is not None and self.bf16_max_rows >= ALL_ROWS

    def bf16_weight(self) -> torch.Tensor:
        """The [N, K] weights in bf16, unpacked from the packed layout if need be."""
        if self.packed_bf16 is None or not self.weight.is_meta:
            return self.dense_weight().to(torch.bfloat16)
        nb, k, nb_cols = self.packed_bf16.shape  # [N/32, K, 32], pairs (col i, col 16+i)
        w = self.packed_bf16.view(nb, k, nb_cols // 2, 2).permute(0, 3, 2, 1)
        return w.reshape(nb * nb_cols, k)[:self.out_features]

    def dense_weight(self) -> torch.Tensor:
        """The [N, K] weights in the model's dtype, from whichever copy the layer keeps."""
        if not self.weight.is_meta:
            return self.weight.detach()
        if self.packed_f32 is not None:  # [N/32, K, 32], columns in order
            nb, k, cols = self.packed_f32.shape
            return self.packed_f32.permute(0, 2, 1).reshape(nb * cols, k)[:self.out_features]
        if self.packed_bf16 is not None:
            return self.bf16_weight()
        return self.onednn_weight.to_dense()

    def set_compute_dtype(self, dtype: torch.dtype) -> bool:
        """Keep the weights in `dtype` and run the GEMM there; False if they already were.
        A packed-only layer computes in fp32 in the kernel and drops its bf16 `weight`
        (left as a meta tensor of the same shape: any other use of it fails loudly)."""
        if self.weight.dtype == dtype:
            return False
        if self.packed_only and dtype == torch.float32:
            self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"),
                                       requires_grad=False)
            self.compute_dtype = dtype
            return True
        old = self.weight.detach()
        self.weight = nn.Parameter(old.to(dtype), requires_grad=False)
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.detach().to(dtype), requires_grad=False)
        self.compute_dtype = dtype
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self._linear_f32 is not None and x.dtype == torch.float32 \
                and rows <= self.f32_max_rows:
            return self._packed_linear(self._linear_f32, self.packed_f32, x, rows)
        if self._linear_bf16 is not None and x.dtype in (torch.float32, torch.bfloat16) \
                and rows <= self.bf16_max_rows:
            return self._packed_linear(self._linear_bf16, self.packed_bf16, x, rows)
        if self.onednn_weight is not None:
            y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, self.in_features),
                                                   self.onednn_weight, self.bias, "none", [], "")
            return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
        if self.compute_dtype is None:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x.to(self.compute_dtype), self.weight, self.bias).to(x.dtype)

    def _packed_linear(self, kernel, packed: torch.Tensor, x: torch.Tensor,
                       rows: int) -> torch.Tensor:
        y = kernel(x.reshape(rows, self.in_features), packed, self.out_features,
                   self.bias if self.bias is not None else self._no_bias)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)


def widen_gemms(model: nn.Module, dtype: torch.dtype) -> int:
    """Run every GEMM layer of `model` in `dtype`; returns how many were changed.

    A GEMM layer is any module with `set_compute_dtype(dtype) -> bool`: `Linear`,
    and the stacked experts of an MoE block (layers/moe.py `FusedMoE`).
    """
    changed = 0
    for module in model.modules():
        set_compute_dtype = getattr(module, "set_compute_dtype", None)
        if set_compute_dtype is not None and set_compute_dtype(dtype):
            changed += 1
    return changed
