"""Qwen3-MoE: the Qwen3 decoder (q/k RMSNorm) with sparse MoE MLPs.

Layer l is sparse when it is not in `mlp_only_layers`, `num_experts` > 0 and
(l + 1) % `decoder_sparse_step` == 0; the other layers keep a dense MLP of
`intermediate_size`. A sparse layer routes each token to `num_experts_per_tok`
of `num_experts` experts of size `moe_intermediate_size` (softmax in fp32,
top-k, renormalised when `norm_topk_prob`), see layers/moe.py.
"""
from __future__ import annotations

from torch import nn

from tokenmill.models.layers.moe import SparseMoeBlock
from tokenmill.models.llama import DecoderConfig, Qwen3ForCausalLM


class MoeDecoderConfig(DecoderConfig):
    def __init__(self, cfg: dict, **kw):
        super().__init__(cfg, **kw)
        # transformers 5 writes num_local_experts; hub checkpoints say num_experts.
        self.num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
        self.num_experts_per_tok = int(cfg.get("num_experts_per_tok", 1))
        self.moe_intermediate_size = cfg.get("moe_intermediate_size") or self.intermediate_size
        self.norm_topk_prob = bool(cfg.get("norm_topk_prob", False))
        self.decoder_sparse_step = int(cfg.get("decoder_sparse_step", 1) or 1)
        self.mlp_only_layers = set(cfg.get("mlp_only_layers") or [])

    def is_sparse(self, layer_idx: int) -> bool:
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    config_class = MoeDecoderConfig
    # Per-expert checkpoint tensors "...experts.{e}.{name}.weight" -> (stacked parameter
    # "...experts.{target}", shard along its dim 1); see loader.py.
    expert_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                      "down_proj": ("down_proj", 0)}

    def make_mlp(self, c: MoeDecoderConfig, layer_idx: int) -> nn.Module:
        if not c.is_sparse(layer_idx):
            return super().make_mlp(c, layer_idx)
        return SparseMoeBlock(c.hidden_size, c.num_experts, c.num_experts_per_tok,
                              c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob)
