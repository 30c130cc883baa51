"""The experts of an MoE block as grouped GEMMs, and the methods `FusedMoE` computes
through.

`fused_experts` sorts the (token, slot) pairs of a batch by expert, so the tokens
routed to one expert form one contiguous slice; each expert that received tokens
then runs one GEMM per weight matrix over its slice (a loop over experts with work,
never over tokens), the weighted results are added back to their tokens with one
`index_add_`. Weights: `gate_up_proj` [E, 2*I, H] (gate rows, then up rows, per
expert), `down_proj` [E, H, I].

Methods (one per FusedMoE, chosen by the platform at load):

- `UnquantizedFusedMoEMethod`: the grouped GEMMs in the model's dtype, or widened
  (`compute_dtype`: fp32 copies of bf16 experts where bf16 is emulated, the
  results rounded to the activations' dtype after each GEMM, as a widened Linear);
- `SyncFreeFusedMoEMethod` (CUDA): the expert groups never reach the host: the
  sorted pairs go through `torch._grouped_mm` with the groups' end offsets (bf16
  on compute capability 9.0+), else through a batched matmul over each pair's
  gathered expert weights in chunks of bounded size. No per-expert `.tolist()`, so
  the step can run under async scheduling without a stall and be captured in a
  CUDA graph;
- `PackedBf16FusedMoEMethod` (CPU, bf16 models): an expert's slice of up to
  `max_rows` rows runs `linear_bf16` over the expert's packed weights, as a packed
  `Linear` does; with ALL_ROWS every slice does and the packed weights are the only
  copy (no fp32 copy of the experts).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.layers.linear_methods.base import ALL_ROWS, FusedMoEMethod

ACTIVATIONS = ("silu", "gelu_tanh")


def act_and_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up over [..., 2*I] rows (gate columns first): SiLU (Qwen, DeepSeek) or
    tanh-approximated GELU (Gemma 4's experts)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  compute_dtype: torch.dtype | None = None,
                  packed: "PackedExperts | None" = None,
                  sync_free: bool = False, activation: str = "silu") -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for every token t.

    x [T, H]; w13 [E, 2*I, H] (gate rows then up rows); w2 [E, H, I] (or, without
    `packed` / `sync_free`, anything with `.shape` whose `[e]` is expert e's matrix in
    `compute_dtype`: fp8's per-expert dequantization); `activation` of
    the gate (ACTIVATIONS). The GEMMs
    run in `compute_dtype` (the weights' dtype) when given; their results are
    rounded to x's dtype after each GEMM, as a widened `Linear` does. With
    `packed`, an expert's slice of up to packed.max_rows rows takes the packed
    bf16 kernel instead (fp32 math, the result rounded to x's dtype likewise).
    """
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    gemm_dtype = compute_dtype or x.dtype
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # pair p = token * top_k + slot, by expert
    token_idx = order // top_k
    if sync_free:
        # (bincount on CUDA reads the largest id on the host: an index_add instead)
        counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device).index_add_(
            0, flat_ids, torch.ones_like(flat_ids))
        xs = x[token_idx].to(gemm_dtype)
        gate_up = _sync_free_mm(xs, w13, counts, flat_ids[order]).to(x.dtype)
        act = act_and_mul(gate_up, activation).to(gemm_dtype)
        down = _sync_free_mm(act, w2, counts, flat_ids[order]).to(x.dtype)
        down = down * topk_weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, token_idx, down)
    counts = torch.bincount(flat_ids, minlength=num_experts)
    ends = torch.cumsum(counts, 0)
    hit = torch.nonzero(counts).flatten()
    # (expert, start, end) of every expert that received tokens: one host sync per layer.
    groups = [(e, end - n, end) for e, n, end in
              zip(hit.tolist(), counts[hit].tolist(), ends[hit].tolist())]

    n13, n2 = w13.shape[1], w2.shape[1]
    xs = x[token_idx]  # [T*k, H], grouped by expert
    if packed is None:
        gate_up = _grouped_mm(xs.to(gemm_dtype), w13, groups).to(x.dtype)
    else:
        gate_up = packed.grouped(xs, packed.w13, n13, groups, w13, gemm_dtype)
    act = act_and_mul(gate_up, activation)
    if packed is None:
        down = _grouped_mm(act.to(gemm_dtype), w2, groups).to(x.dtype)
    else:
        down = packed.grouped(act, packed.w2, n2, groups, w2, gemm_dtype)
    down = down * topk_weights.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros_like(x).index_add_(0, token_idx, down)


# Bytes of gathered expert weights one batched matmul of the sync-free fallback reads.
GATHER_BYTES = 256 << 20


@functools.cache
def _has_grouped_mm(device: torch.device) -> bool:
    """torch._grouped_mm (bf16, offsets) runs on CUDA devices of compute capability 9.0+."""
    return (device.type == "cuda" and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(device) >= (9, 0))


def _sync_free_mm(xs: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
                  sorted_ids: torch.Tensor) -> torch.Tensor:
    """out[p] = xs[p] @ w[sorted_ids[p]]^T for pairs sorted by expert, without reading
    the group sizes on the host."""
    if xs.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and _has_grouped_mm(xs.device):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)  # each group's end
        return torch._grouped_mm(xs, w.transpose(-2, -1), offs=offs)
    # Fallback (fp32, or no grouped GEMM): each pair's expert matrix gathered, a
    # bounded number of pairs at a time (the count is the tensor's shape: no sync).
    out = xs.new_empty(xs.shape[0], w.shape[1])
    step = max(1, GATHER_BYTES // (w.shape[1] * w.shape[2] * w.element_size()))
    for lo in range(0, xs.shape[0], step):
        hi = min(lo + step, xs.shape[0])
        torch.bmm(w[sorted_ids[lo:hi]], xs[lo:hi].unsqueeze(-1), out=out[lo:hi].unsqueeze(-1))
    return out


def _grouped_mm(xs: torch.Tensor, w: torch.Tensor, groups) -> torch.Tensor:
    """One GEMM per expert group: out[lo:hi] = xs[lo:hi] @ w[e]^T."""
    out = xs.new_empty(xs.shape[0], w.shape[1])
    for e, lo, hi in groups:
        torch.mm(xs[lo:hi], w[e].t(), out=out[lo:hi])
    return out


class PackedExperts:
    """The experts' bf16 weights in linear_bf16's layout, one packed matrix per expert."""

    def __init__(self, ops, w13: torch.Tensor, w2: torch.Tensor, max_rows: int):
        self.kernel = ops.linear_bf16
        self.w13 = [ops.pack_bf16_weight(w.contiguous()) for w in w13]
        self.w2 = [ops.pack_bf16_weight(w.contiguous()) for w in w2]
        self.max_rows = max_rows
        self.no_bias = torch.empty(0)

    def grouped(self, xs: torch.Tensor, packed: list[torch.Tensor], n: int, groups,
                w: torch.Tensor, gemm_dtype: torch.dtype) -> torch.Tensor:
        """Per group: the packed kernel for up to max_rows rows, else a GEMM in
        gemm_dtype over `w` (only reached when the platform kept the weights);
        either result rounded to xs's dtype."""
        out = xs.new_empty(xs.shape[0], n)
        for e, lo, hi in groups:
            if hi - lo <= self.max_rows:
                out[lo:hi] = self.kernel(xs[lo:hi], packed[e], n, self.no_bias)
            else:
                out[lo:hi] = torch.mm(xs[lo:hi].to(gemm_dtype), w[e].t())
        return out


class UnquantizedFusedMoEMethod(FusedMoEMethod):
    """The grouped GEMMs over the stacked weights; `compute_dtype`: kept and computed
    in it (widened), each GEMM's result rounded to the activations' dtype."""

    sync_free = False

    def __init__(self, compute_dtype: torch.dtype | None = None):
        self.compute_dtype = compute_dtype

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size, dtype=None):
        layer.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size,
                                                      hidden_size, dtype=dtype))
        layer.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size,
                                                   intermediate_size, dtype=dtype))

    def process_weights_after_loading(self, layer) -> None:
        dtype = self.compute_dtype
        if dtype is None or layer.gate_up_proj.dtype == dtype:
            return
        layer.gate_up_proj = nn.Parameter(layer.gate_up_proj.detach().to(dtype),
                                          requires_grad=False)
        layer.down_proj = nn.Parameter(layer.down_proj.detach().to(dtype), requires_grad=False)

    def apply(self, layer, x, topk_weights, topk_ids):
        return fused_experts(x, layer.gate_up_proj, layer.down_proj, topk_weights, topk_ids,
                             self.compute_dtype, None, self.sync_free, layer.activation)


class SyncFreeFusedMoEMethod(UnquantizedFusedMoEMethod):
    """CUDA: the grouped GEMMs without a host sync on the expert groups."""

    sync_free = True


class PackedBf16FusedMoEMethod(UnquantizedFusedMoEMethod):
    """Each expert's bf16 weights packed for `ops.linear_bf16`, which runs every expert
    slice of up to `max_rows` rows; larger slices take a GEMM in `compute_dtype` (the
    weights widened to it) or the weights' own. ALL_ROWS: every slice takes the
    kernel and the stacked weights are dropped."""

    def __init__(self, ops, max_rows: int, compute_dtype: torch.dtype | None = None):
        super().__init__(None if max_rows >= ALL_ROWS else compute_dtype)
        self.ops = ops
        self.max_rows = max_rows
        self.packed: PackedExperts | None = None

    def process_weights_after_loading(self, layer) -> None:
        self.packed = PackedExperts(self.ops, layer.gate_up_proj.detach(),
                                    layer.down_proj.detach(), self.max_rows)
        if self.max_rows >= ALL_ROWS:
            for name in ("gate_up_proj", "down_proj"):  # no other use: meta, same shapes
                setattr(layer, name, nn.Parameter(
                    torch.empty_like(getattr(layer, name), device="meta"), requires_grad=False))
        else:
            super().process_weights_after_loading(layer)

    def apply(self, layer, x, topk_weights, topk_ids):
        packed = self.packed if x.dtype in (torch.bfloat16, torch.float32) else None
        return fused_experts(x, layer.gate_up_proj, layer.down_proj, topk_weights, topk_ids,
                             self.compute_dtype, packed, False, layer.activation)
