"""The native CPU kernels' packed layouts: decode-sized inputs read weights packed once
for `linear_bf16` / `linear_f32` (tokenmill/kernels); larger inputs go to a fallback
method (oneDNN-prepacked, a widened fp32 copy or the plain GEMM).

`PackedBf16LinearMethod`: a bf16 model's weights packed in bf16 and widened to fp32
in registers - fp32 products and sums, the math of a widened GEMM, over half the
bytes of fp32 weights (a decode step is bound by reading them). Which layers do so,
for how many rows, and what takes the larger inputs is the CPU platform's decision
(tokenmill/platforms/cpu.py: the measured reasons); with `max_rows` ALL_ROWS the
packed copy takes every input and is the only copy kept.

`PackedF32LinearMethod`: an fp32 model's decode-sized inputs take `linear_f32` the same
way - the math of F.linear up to summation order, but streaming the weights at the
memory's pace where a batch-1 F.linear does not; larger inputs keep oneDNN.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.models.layers.linear_methods.base import ALL_ROWS
from tokenmill.models.layers.linear_methods.unquantized import (UnquantizedLinearMethod,
                                                                drop_weight)

_NO_BIAS = torch.empty(0)
_BF16_INPUTS = (torch.float32, torch.bfloat16)


def _packed_linear(kernel, packed: torch.Tensor, layer, x: torch.Tensor,
                   rows: int) -> torch.Tensor:
    # (a 2-D x goes as it is: a reshape to its own shape is an aten call for nothing, on
    # every linear of a step)
    y = kernel(x if x.dim() == 2 else x.reshape(rows, layer.in_features), packed,
               layer.out_features, layer.bias if layer.bias is not None else _NO_BIAS)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], layer.out_features)


def _describe(method) -> str:
    if method.fallback is None:
        return f"{type(method).__name__}(every input)"
    return (f"{type(method).__name__}(up to {method.max_rows} rows, then "
            f"{method.fallback.describe()})")


class PackedBf16LinearMethod(UnquantizedLinearMethod):
    """`ops.linear_bf16` over the bf16 weights packed [N/32, K, 32] for inputs of up to
    `max_rows` rows (fp32 or bf16), `fallback` for the others; no fallback: the packed
    copy is the only one (`max_rows` ALL_ROWS)."""

    packed_dtype = torch.bfloat16

    def __init__(self, ops, max_rows: int, fallback: UnquantizedLinearMethod | None):
        super().__init__()
        if fallback is None and max_rows < ALL_ROWS:
            raise ValueError("a packed layer without a fallback must take every input")
        self.ops = ops
        self.kernel = ops.linear_bf16
        self.max_rows = max_rows
        self.fallback = fallback

    def process_weights_after_loading(self, layer) -> None:
        # Packed from the checkpoint's bf16 weights, before a fallback widens or
        # reorders them.
        self.packed_weight = self.ops.pack_bf16_weight(layer.weight.detach().contiguous())
        if self.fallback is None:
            drop_weight(layer)
        else:
            self.fallback.process_weights_after_loading(layer)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // layer.in_features
        if rows <= self.max_rows and x.dtype in _BF16_INPUTS:
            return _packed_linear(self.kernel, self.packed_weight, layer, x, rows)
        if self.fallback is None:
            raise TypeError(f"a packed-only bf16 layer takes fp32 / bf16 inputs, not {x.dtype}")
        return self.fallback.apply(layer, x)

    def describe(self) -> str:
        return _describe(self)

    def dense_weight(self, layer) -> torch.Tensor:
        """The bf16 weights, unpacked: [N/32, K, 32] whose 32 columns are pairs
        (column i, column 16 + i)."""
        nb, k, cols = self.packed_weight.shape
        w = self.packed_weight.view(nb, k, cols // 2, 2).permute(0, 3, 2, 1)
        return w.reshape(nb * cols, k)[:layer.out_features]


class PackedF32LinearMethod(UnquantizedLinearMethod):
    """`ops.linear_f32` over the fp32 weights packed [N/32, K, 32] for fp32 inputs of up
    to `max_rows` rows, `fallback` (oneDNN-prepacked or plain) for the others."""

    packed_dtype = torch.float32

    def __init__(self, ops, max_rows: int, fallback: UnquantizedLinearMethod):
        super().__init__()
        self.ops = ops
        self.kernel = ops.linear_f32
        self.max_rows = max_rows
        self.fallback = fallback

    def process_weights_after_loading(self, layer) -> None:
        self.packed_weight = self.ops.pack_f32_weight(layer.weight.detach().contiguous())
        self.fallback.process_weights_after_loading(layer)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // layer.in_features
        if rows <= self.max_rows and x.dtype == torch.float32:
            return _packed_linear(self.kernel, self.packed_weight, layer, x, rows)
        return self.fallback.apply(layer, x)

    def describe(self) -> str:
        return _describe(self)

    def dense_weight(self, layer) -> torch.Tensor:
        """The fp32 weights, unpacked: [N/32, K, 32], columns in order."""
        nb, k, cols = self.packed_weight.shape
        return self.packed_weight.permute(0, 2, 1).reshape(nb * cols, k)[:layer.out_features]


class PackedRowsEmbedding(nn.Module):
    """The token embedding of a model whose lm_head is tied to it, read from the
    lm_head's packed bf16 copy (`PackedBf16LinearMethod` with no fallback: the only
    copy), so the [vocab, hidden] matrix is resident once instead of twice (Qwen3
    0.6B-4B, Gemma: the embedding is a fifth to a quarter of the checkpoint).

    Row t of W is column t of the packed layout: block t / 32, and within a k line
    the dword pair slot (t % 32) % 16, half (t % 32) / 16. A lookup reads one 64-byte
    line per k for each token: microseconds a decode step, a few ms for a 2,048-token
    prompt. The rows are the checkpoint's values exactly (packing only moves them)."""

    def __init__(self, method: PackedBf16LinearMethod, num_embeddings: int,
                 embedding_dim: int):
        super().__init__()
        self.method = method
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        # (shape and dtype for code that asks; no data: lookups go through forward)
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim,
                                               dtype=torch.bfloat16, device="meta"),
                                   requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).long()
        lo, hi = torch.aminmax(ids) if ids.numel() else (0, 0)
        if int(lo) < 0 or int(hi) >= self.num_embeddings:  # (padding columns hold zeros)
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        packed = self.method.packed_weight  # [N/32, K, 32]
        nb, k, cols = packed.shape
        lines = packed.view(nb, k, cols // 2, 2)
        col = ids % cols
        rows = lines[ids // cols, :, col % (cols // 2), col // (cols // 2)]  # [T, K]
        return rows.view(*input_ids.shape, k)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of the tied lm_head's packed copy"


def tie_embeddings_to_packed_heads(model, tied: dict[int, object]) -> int:
    """Every nn.Embedding of `model` whose weight was the (tied) weight of a Linear in
    `tied` (id of the weight -> the Linear, taken before its method was set) and whose
    Linear now keeps only a packed bf16 copy becomes a `PackedRowsEmbedding` over that
    copy; -> how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            linear = tied.get(id(getattr(child, "weight", None)))
            if type(child) is not nn.Embedding or linear is None:
                continue
            method = linear.method
            if (not isinstance(method, PackedBf16LinearMethod) or method.fallback is not None
                    or child.weight.dtype != torch.bfloat16
                    or tuple(child.weight.shape) != (linear.out_features, linear.in_features)):
                continue
            setattr(parent, name, PackedRowsEmbedding(method, child.num_embeddings,
                                                      child.embedding_dim))
            replaced += 1
    return replaced
