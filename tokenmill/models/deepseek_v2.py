"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention and DeepSeek MoE.

Attention (layers/mla.py): q from q_proj, or through the low-rank q_a_proj ->
q_a_layernorm -> q_b_proj when q_lora_rank is set; kv_a_proj_with_mqa gives the
compressed kv (kv_lora_rank, normed by kv_a_layernorm) and one shared k_pe
(qk_rope_head_dim); rope on the rope parts only (decoupled); kv_b_proj expands
the compressed kv into each head's k_nope and v. The KV cache keeps the latent
[compressed kv | k_pe] per token (MLAAttentionSpec). The softmax scale is
qk_head_dim^-0.5 times mscale(factor, mscale_all_dim)^2 under yarn.

DeepSeek lays each rope part out as interleaved pairs (x0, x1), (x2, x3), ...
(V2 always; V3 unless rope_interleave is false). Only dot products of the roped
parts are used, so the loader permutes the rope rows of q_proj / q_b_proj and
kv_a_proj_with_mqa into the half-split order once (`map_checkpoint`) and the
ordinary neox rotary applies: the same scores as the interleaved rotation.

MLP: layers before first_k_dense_replace (and those off moe_layer_freq) are
dense; the others route each token to num_experts_per_tok of n_routed_experts
experts plus n_shared_experts always-on ones (one MLP of n_shared x
moe_intermediate_size). Routing (layers/moe.py grouped_topk): V3 sigmoid scores
with e_score_correction_bias choosing among the topk_group best of n_group
groups, weights renormalised when norm_topk_prob; V2 softmax, "greedy" or
"group_limited_greedy" (groups by their best expert). Both scale the weights by
routed_scaling_factor.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.mla import PagedMLAAttention
from tokenmill.models.layers.mlp import GatedMLP
from tokenmill.models.layers.moe import FusedMoE, grouped_topk
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding, rope_parameters_from_config
from tokenmill.models.layers.taps import HiddenStateTaps, PreNormBlock
from tokenmill.models.checkpoint_io import materialize

V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class DeepseekConfig:
    """The fields a DeepSeek-V2 / V3 decoder needs, read from an HF config dict."""

    def __init__(self, cfg: dict, *, v3: bool):
        self.v3 = v3
        self.vocab_size = cfg["vocab_size"]
        self.hidden_size = cfg["hidden_size"]
        self.intermediate_size = cfg["intermediate_size"]
        self.num_layers = cfg["num_hidden_layers"]
        self.num_heads = cfg["num_attention_heads"]
        self.q_lora_rank = cfg.get("q_lora_rank")
        self.kv_lora_rank = cfg["kv_lora_rank"]
        self.qk_nope_head_dim = cfg["qk_nope_head_dim"]
        self.qk_rope_head_dim = cfg["qk_rope_head_dim"]
        self.v_head_dim = cfg["v_head_dim"]
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"config {name} must be a positive int, got {v!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"config qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        self.rms_norm_eps = cfg.get("rms_norm_eps", 1e-6)
        self.max_position_embeddings = cfg.get("max_position_embeddings", 4096)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.attention_bias = bool(cfg.get("attention_bias", False))
        self.mlp_bias = bool(cfg.get("mlp_bias", False))
        self.hidden_act = cfg.get("hidden_act", "silu")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (only silu)")
        self.rope_params = rope_parameters_from_config(cfg)
        self.rope_interleave = bool(cfg.get("rope_interleave", True)) if v3 else True
        self.softmax_scale = self.qk_head_dim ** -0.5
        m_all = self.rope_params.get("mscale_all_dim")
        if self.rope_params["rope_type"] != "default" and m_all:
            m = _yarn_mscale(self.rope_params["factor"], m_all)
            self.softmax_scale *= m * m
        # MoE
        self.n_routed_experts = int(cfg.get("n_routed_experts") or 0)
        self.num_experts_per_tok = int(cfg.get("num_experts_per_tok") or 0)
        self.moe_intermediate_size = cfg.get("moe_intermediate_size") or self.intermediate_size
        self.n_shared_experts = int(cfg.get("n_shared_experts") or 0)
        self.routed_scaling_factor = float(cfg.get("routed_scaling_factor", 1.0))
        self.norm_topk_prob = bool(cfg.get("norm_topk_prob", False))
        self.first_k_dense_replace = int(cfg.get("first_k_dense_replace") or 0)
        self.moe_layer_freq = int(cfg.get("moe_layer_freq") or 1)
        self.scoring = "sigmoid" if v3 else "softmax"
        self.topk_method = "noaux_tc" if v3 else (cfg.get("topk_method") or "greedy")
        if not v3 and self.topk_method not in V2_TOPK_METHODS:
            raise ValueError(f"config topk_method {self.topk_method!r} is not supported "
                             f"(supported: {', '.join(V2_TOPK_METHODS)})")
        grouped = v3 or self.topk_method == "group_limited_greedy"
        self.n_group = int(cfg.get("n_group") or 1) if grouped else 1
        self.topk_group = int(cfg.get("topk_group") or self.n_group) if grouped else 1
        if self.n_routed_experts:
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ValueError(f"config num_experts_per_tok {self.num_experts_per_tok} must "
                                 f"be in [1, n_routed_experts {self.n_routed_experts}]")
            if self.n_routed_experts % self.n_group:
                raise ValueError(f"config n_group {self.n_group} must divide n_routed_experts "
                                 f"{self.n_routed_experts}")
            if not 0 < self.topk_group <= self.n_group:
                raise ValueError(f"config topk_group {self.topk_group} must be in [1, n_group "
                                 f"{self.n_group}]")
            if v3 and self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
                raise ValueError("config n_group: DeepSeek-V3 scores a group by its two best "
                                 "experts, so each group needs at least 2")

    def is_sparse(self, layer_idx: int) -> bool:
        return (self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace
                and layer_idx % self.moe_layer_freq == 0)


class TopkRouter(nn.Module):
    """The router: fp32 logits over the experts (the weight kept in fp32, as HF keeps it),
    then DeepSeek's grouped top-k."""

    def __init__(self, c: DeepseekConfig):
        super().__init__()
        self.c = c
        e = c.n_routed_experts
        self.weight = nn.Parameter(torch.empty(e, c.hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False)
            if c.v3 else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.c
        logits = torch.nn.functional.linear(x.float(), self.weight)
        return grouped_topk(logits, c.num_experts_per_tok, scoring=c.scoring,
                            num_groups=c.n_group, topk_groups=c.topk_group,
                            correction_bias=self.e_score_correction_bias,
                            renormalize=c.norm_topk_prob, scaling=c.routed_scaling_factor)


class DeepseekMoE(nn.Module):
    """Routed experts (stacked, layers/moe.py) plus the shared experts, always on.
    Tensor parallel: their partial sums added first, all-reduced once, here."""

    tp_reduces = True

    def __init__(self, c: DeepseekConfig):
        super().__init__()
        self.gate = TopkRouter(c)
        self.experts = FusedMoE(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size)
        self.shared_experts = (GatedMLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts,
                                        bias=c.mlp_bias)
                               if c.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights.to(x.dtype), ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class MLAttention(nn.Module):
    def __init__(self, c: DeepseekConfig):
        super().__init__()
        self.c = c
        h, qk = c.num_heads, c.qk_head_dim
        if c.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, h * qk, bias=False, tp="column")
        else:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, 1e-6)  # HF: the default eps
            self.q_b_proj = Linear(c.q_lora_rank, h * qk, bias=False, tp="column")
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim,
                                         bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim),
                                bias=False, tp="column")
        self.o_proj = Linear(h * c.v_head_dim, c.hidden_size, bias=c.attention_bias, tp="row")
        self.attn = PagedMLAAttention(h, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                                      c.kv_lora_rank, c.softmax_scale)

    def _q(self, x: torch.Tensor) -> torch.Tensor:
        if self.c.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def _latent(self, x, cos, sin, rotary: RotaryEmbedding) -> torch.Tensor:
        """[T, kv_lora_rank + rope]: the normed compressed kv, then the roped k_pe."""
        r = self.c.kv_lora_rank
        kv_a = self.kv_a_proj_with_mqa(x)
        k_pe = rotary.apply(kv_a[:, None, r:], cos, sin)[:, 0]
        return torch.cat([self.kv_a_layernorm(kv_a[:, :r].contiguous()), k_pe], dim=-1)

    def forward(self, x, cos, sin, rotary: RotaryEmbedding, meta: AttentionMetadata):
        t, c = x.shape[0], self.c
        q = self._q(x).view(t, c.num_heads, c.qk_head_dim)
        q[..., c.qk_nope_head_dim:] = rotary.apply(q[..., c.qk_nope_head_dim:], cos, sin)
        latent = self._latent(x, cos, sin, rotary)
        return self.o_proj(self.attn(q, latent, self.kv_b_proj, meta))


class DecoderLayer(PreNormBlock, nn.Module):
    def __init__(self, c: DeepseekConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = MLAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = (DeepseekMoE(c) if c.is_sparse(layer_idx)
                    else GatedMLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias))


class DeepseekV2ForCausalLM(HiddenStateTaps, nn.Module):
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    expert_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                      "down_proj": ("down_proj", 0)}
    plain_lm_head = True
    v3 = False

    def __init__(self, hf_config: dict):
        super().__init__()
        c = self.config = DeepseekConfig(hf_config, v3=self.v3)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = RotaryEmbedding(c.qk_rope_head_dim, c.qk_rope_head_dim,
                                      c.max_position_embeddings, c.rope_params)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def attention_layers(self) -> list[PagedMLAAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def map_checkpoint(self, name: str, tensor: torch.Tensor):
        """Interleaved rope rows -> half-split order (see the module docstring); the MTP
        layers past num_hidden_layers (V3's next-token heads) are not part of this model."""
        parts = name.removeprefix("model.").split(".")
        if (len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit()
                and int(parts[1]) >= self.config.num_layers):
            return
        c = self.config
        if c.rope_interleave and len(parts) > 3 and parts[2] == "self_attn":
            rope = c.qk_rope_head_dim
            perm = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
            if parts[3] in ("q_proj", "q_b_proj", "kv_a_proj_with_mqa"):
                tensor = materialize(tensor)  # read whole below in any case
                if name.endswith("_scale_inv") or tensor.dtype == torch.float8_e4m3fn:
                    # Reordering the rows of block-quantized weights would move rows
                    # across their blocks' scales.
                    raise ValueError(f"tensor {name}: fp8 MLA projections with "
                                     f"interleaved rope rows are not implemented")
                if not name.endswith(".weight"):  # GPTQ / AWQ / compressed-tensors tensors
                    raise ValueError(f"tensor {name}: integer-quantized MLA projections "
                                     f"with interleaved rope rows are not implemented")
            if parts[3] in ("q_proj", "q_b_proj"):
                # Every head of the checkpoint (a tensor-parallel rank's config counts
                # its own only; the rank's slice is taken after this).
                per_head = materialize(tensor).view(-1, c.qk_head_dim, *tensor.shape[1:])
                nope = per_head[:, :c.qk_nope_head_dim]
                tensor = torch.cat([nope, per_head[:, c.qk_nope_head_dim:][:, perm]], dim=1)
                tensor = tensor.reshape(-1, *per_head.shape[2:])
            elif parts[3] == "kv_a_proj_with_mqa":
                r = c.kv_lora_rank
                tensor = torch.cat([tensor[:r], tensor[r:][perm]])
        yield name, tensor

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        def deferred(i, h, pending):
            return self.layers[i].forward_deferred(h, pending, cos, sin, self.rotary, meta)
        return self.run_layers(x, lambda i, h: self.layers[i](h, cos, sin, self.rotary, meta),
                               self.norm, deferred=(deferred, self.norm.add_forward))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    v3 = True
