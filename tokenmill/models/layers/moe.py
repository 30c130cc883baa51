"""Mixture of experts: softmax top-k routing and the experts as grouped GEMMs.

`fused_experts` sorts the (token, slot) pairs of a batch by expert, so the
tokens routed to one expert form one contiguous slice; each expert that
received tokens then runs one GEMM per weight matrix over its slice (a loop
over experts with work, never over tokens), the weighted results are added
back to their tokens with one `index_add_`.

`SparseMoeBlock` is the MoE MLP of Qwen3-MoE (`norm_topk_prob` from the
config, no shared expert), Qwen3-Next (plus a shared expert scaled by
sigmoid(shared_expert_gate(x))) and Qwen3.5-MoE (the same, top-k always
renormalised). Checkpoint names follow HF: `gate` (the router),
`experts.gate_up_proj` [E, 2*I, H] (gate rows, then up rows, per expert),
`experts.down_proj` [E, H, I], `shared_expert.*`, `shared_expert_gate`.

On the CPU the experts of a bf16 model take the packed bf16 kernel the way a
`Linear` does (`FusedMoE.pack_bf16`, called by the CPU platform): an expert's
slice of up to `bf16_max_rows` rows runs `linear_bf16` over the expert's packed
weights. Without native bf16 every slice does and the packed weights are the only
copy (no fp32 copy of the experts).

On CUDA (`FusedMoE.sync_free`, set by the platform) the expert groups never reach
the host: the sorted pairs go through `torch._grouped_mm` with the groups' end
offsets (bf16 on compute capability 9.0+), else through a batched matmul
over each pair's gathered expert weights in chunks of bounded size. No
per-expert `.tolist()`, so the step can run under async scheduling without a
stall and be captured in a CUDA graph.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.layers.linear import ALL_ROWS, Linear
from tokenmill.models.layers.mlp import GatedMLP


def route(router_logits: torch.Tensor, top_k: int,
          renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in fp32, top-k, optionally renormalised to sum to 1.

    Returns (weights [T, k] in the logits' dtype, expert ids [T, k]).
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def grouped_topk(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax",
                 num_groups: int = 1, topk_groups: int = 1,
                 correction_bias: torch.Tensor | None = None, renormalize: bool = False,
                 scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing, in fp32: scores (softmax, or sigmoid for V3), then top-k among
    the experts of the `topk_groups` best of `num_groups` equal expert groups.

    A group's score is its best expert's score (softmax scoring, V2's
    group_limited_greedy) or, with a `correction_bias` (V3), the sum of its two best
    bias-corrected scores. The bias only chooses: the weights are the uncorrected
    scores of the chosen experts, renormalised to sum to 1 when asked, then scaled
    by `scaling` (routed_scaling_factor). Returns (weights [T, k] fp32, ids [T, k]).
    """
    logits = router_logits.float()
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias
    if num_groups > 1:
        t, e = choice.shape
        grouped = choice.view(t, num_groups, e // num_groups)
        group_scores = (grouped.max(dim=-1).values if correction_bias is None
                        else grouped.topk(2, dim=-1).values.sum(dim=-1))
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, torch.topk(group_scores, topk_groups, dim=-1).indices, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(t, e)
        # As DeepSeek: dropped experts score 0 (softmax) or -inf (bias-corrected).
        choice = choice.masked_fill(~keep, 0.0 if correction_bias is None else float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


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

    x [T, H]; w13 [E, 2*I, H] (gate rows then up rows); w2 [E, H, I]; `activation` of
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


class FusedMoE(nn.Module):
    """`num_experts` gated MLPs (SiLU, or `activation` from ACTIVATIONS), their weights
    stacked along a leading expert dim."""

    compute_dtype: torch.dtype | None = None
    packed: PackedExperts | None = None  # set by pack_bf16
    sync_free: bool = False  # CUDA: no host sync on the expert groups (set by the platform)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 activation: str = "silu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"expert activation {activation!r} is not one of {ACTIVATIONS}")
        self.num_experts = num_experts
        self.activation = activation
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size,
                                                     hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def extra_repr(self) -> str:
        e, i2, h = self.gate_up_proj.shape
        return f"num_experts={e}, hidden_size={h}, intermediate_size={i2 // 2}"

    def pack_bf16(self, ops, max_rows: int) -> None:
        """Pack each expert's bf16 weights for `ops.linear_bf16`, which then runs every
        expert slice of up to `max_rows` rows (ALL_ROWS: every slice; widening then
        keeps no fp32 copy, as for a packed-only `Linear`)."""
        self.packed = PackedExperts(ops, self.gate_up_proj.detach(), self.down_proj.detach(),
                                    max_rows)

    @property
    def packed_only(self) -> bool:
        return self.packed is not None and self.packed.max_rows >= ALL_ROWS

    def set_compute_dtype(self, dtype: torch.dtype) -> bool:
        """Keep the expert weights in `dtype` and run their GEMMs there (see layers/linear.py).
        Packed-only experts compute in fp32 in the kernel and drop their bf16 weights
        (meta tensors of the same shapes)."""
        if self.gate_up_proj.dtype == dtype or self.compute_dtype == dtype:
            return False
        if self.packed_only and dtype == torch.float32:
            self.gate_up_proj = nn.Parameter(torch.empty_like(self.gate_up_proj, device="meta"),
                                             requires_grad=False)
            self.down_proj = nn.Parameter(torch.empty_like(self.down_proj, device="meta"),
                                          requires_grad=False)
            self.compute_dtype = dtype
            return True
        self.gate_up_proj = nn.Parameter(self.gate_up_proj.detach().to(dtype), requires_grad=False)
        self.down_proj = nn.Parameter(self.down_proj.detach().to(dtype), requires_grad=False)
        self.compute_dtype = dtype
        return True

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        packed = self.packed if x.dtype in (torch.bfloat16, torch.float32) else None
        return fused_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                             self.compute_dtype, None if self.sync_free else packed,
                             self.sync_free, self.activation)


class SparseMoeBlock(nn.Module):
    """Router + routed experts, plus an optional (optionally gated) shared expert."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 *, norm_topk_prob: bool, shared_expert_intermediate_size: int = 0,
                 shared_expert_gate: bool = False):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, num_experts "
                             f"{num_experts}]")
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size)
        self.shared_expert = (GatedMLP(hidden_size, shared_expert_intermediate_size)
                              if shared_expert_intermediate_size else None)
        self.shared_expert_gate = (Linear(hidden_size, 1, bias=False)
                                   if self.shared_expert is not None and shared_expert_gate
                                   else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.norm_topk_prob)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
