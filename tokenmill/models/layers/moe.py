"""Mixture of experts: softmax top-k routing and the experts as grouped GEMMs
(`FusedMoE`; the GEMMs themselves, `fused_experts`, in layers/linear_methods/fused_moe.py).

`SparseMoeBlock` is the MoE MLP of Qwen3-MoE (`norm_topk_prob` from the
config, no shared expert), Qwen3-Next (plus a shared expert scaled by
sigmoid(shared_expert_gate(x))) and Qwen3.5-MoE (the same, top-k always
renormalised). Checkpoint names follow HF: `gate` (the router),
`experts.gate_up_proj` [E, 2*I, H] (gate rows, then up rows, per expert),
`experts.down_proj` [E, H, I], `shared_expert.*`, `shared_expert_gate`.

How the experts' GEMMs run is `FusedMoE`'s method, chosen by the platform at load
(layers/linear_methods/fused_moe.py): PyTorch's grouped GEMMs (in the model's dtype
or widened), the CPU's packed bf16 kernel for small expert slices, or CUDA's grouped
GEMM without a host sync.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.linear_methods.base import FusedMoEMethod
# (the grouped expert GEMMs live with their methods)
from tokenmill.models.layers.linear_methods.fused_moe import (ACTIVATIONS,
                                                              UnquantizedFusedMoEMethod)
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


class FusedMoE(nn.Module):
    """`num_experts` gated MLPs (SiLU, or `activation` from ACTIVATIONS), their weights
    stacked along a leading expert dim; the GEMMs are the method's
    (layers/linear_methods/fused_moe.py), chosen by the platform at load.

    Tensor parallelism splits each expert's intermediate dim (not the experts): every
    rank routes every token the same way and runs every expert that received tokens
    on its slice; the output is a partial sum, reduced here unless a block around
    the experts reduces once for them and its shared expert."""

    tp_reduces = True

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 activation: str = "silu", method: FusedMoEMethod | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"expert activation {activation!r} is not one of {ACTIVATIONS}")
        self.num_experts = num_experts
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation = activation
        self.method = method if method is not None else UnquantizedFusedMoEMethod()
        self.method.create_weights(self, num_experts, hidden_size, intermediate_size, dtype)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, "
                f"method={self.method.describe()}")

    def use_method(self, method: FusedMoEMethod, dtype: torch.dtype | None = None) -> None:
        """Before loading: keep the experts as `method` registers them (a quantized
        checkpoint's layout: models/quantized_layers.py)."""
        self.method = method
        method.create_weights(self, self.num_experts, self.hidden_size,
                              self.intermediate_size, dtype)

    def set_method(self, method: FusedMoEMethod) -> None:
        """Run through `method` from now on (the platform's choice, after loading)."""
        method.process_weights_after_loading(self)
        self.method = method

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, topk_weights, topk_ids)

    def tp_plan(self, tp) -> dict:
        """Each expert's gate and up rows and its down columns: per-expert checkpoint
        tensors ([I, H] / [H, I], shards 0 and 1 of gate_up) and stacked ones."""
        inter = self.intermediate_size * tp.size
        rules = {("gate_up_proj", 0): tp.split(0, inter), ("gate_up_proj", 1): tp.split(0, inter),
                 ("down_proj", 0): tp.split(1, inter),
                 ("gate_up_proj", None): tp.split(1, inter, inter),
                 ("down_proj", None): tp.split(2, inter)}
        # A quantized method maps the per-expert slices onto its own tensors.
        own = getattr(self.method, "tp_rules", None)
        return rules if own is None else own(rules)


class SparseMoeBlock(nn.Module):
    """Router + routed experts, plus an optional (optionally gated) shared expert.
    Tensor parallel: the router replicated, the experts and the shared expert split;
    their partial sums are added first and all-reduced once, here."""

    tp_reduces = True

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
