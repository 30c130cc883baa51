"""Hybrid decoders: Qwen3.5, Qwen3.5-MoE and Qwen3-Next.

Layers follow `layer_types`: "linear_attention" layers mix tokens with Gated
DeltaNet (a recurrent state per sequence), "full_attention" layers with gated
softmax attention over the paged KV cache (q/k RMSNorm, partial rotary, the
output scaled by sigmoid of a per-head gate that q_proj also produces). The
MLP is dense or a sparse MoE block with a gated shared expert. Every RMSNorm
outside the DeltaNet is zero-centred: it scales by (1 + weight).

Checkpoints: Qwen3.5 stores the DeltaNet input projections as in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a; Qwen3-Next as in_proj_qkvz and in_proj_ba,
grouped per key head. `map_checkpoint` rewrites the latter into the former,
which are then packed into one `in_proj`. A Qwen3.5 ...ForConditionalGeneration
checkpoint keeps the text model under model.language_model (its vision tower:
qwen3_5_vl.py).
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.config import flatten_text_config
from tokenmill.models.layers.attention import PagedAttention
from tokenmill.models.layers.gated_deltanet import GatedDeltaNet
from tokenmill.models.layers.hybrid_decode_layers import HybridDecodeLayers
from tokenmill.models.layers.linear import Linear, QKVParallel
from tokenmill.models.layers.mlp import GatedMLP
from tokenmill.models.layers.moe import SparseMoeBlock
from tokenmill.models.layers.rotary import RotaryEmbedding
from tokenmill.models.layers.taps import HiddenStateTaps, PreNormBlock
from tokenmill.models.llama import DecoderConfig
from tokenmill.models.weight_names import text_model_name


class HybridConfig(DecoderConfig):
    def __init__(self, cfg: dict):
        super().__init__(cfg, qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=True)
        n = self.num_layers
        types = cfg.get("layer_types")
        if not types:
            interval = cfg.get("full_attention_interval", 4)
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                     for i in range(n)]
        if len(types) != n or set(types) - {"full_attention", "linear_attention"}:
            raise ValueError(f"layer_types must list full_attention / linear_attention for "
                             f"each of the {n} layers, got {types}")
        self.layer_types = list(types)
        self.linear_num_key_heads = cfg["linear_num_key_heads"]
        self.linear_num_value_heads = cfg["linear_num_value_heads"]
        self.linear_key_head_dim = cfg["linear_key_head_dim"]
        self.linear_value_head_dim = cfg["linear_value_head_dim"]
        self.linear_conv_kernel_dim = cfg.get("linear_conv_kernel_dim", 4)
        self.num_experts = cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0
        self.num_experts_per_tok = cfg.get("num_experts_per_tok", 0)
        self.moe_intermediate_size = cfg.get("moe_intermediate_size", 0)
        self.shared_expert_intermediate_size = cfg.get("shared_expert_intermediate_size", 0)
        self.norm_topk_prob = bool(cfg.get("norm_topk_prob", True))
        self.decoder_sparse_step = cfg.get("decoder_sparse_step", 1) or 1
        self.mlp_only_layers = list(cfg.get("mlp_only_layers") or [])

    def is_sparse(self, layer_idx: int) -> bool:
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


class ZeroCenteredRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in fp32 and rounded once; the native kernel
    (`set_norm_kernels`) in one pass a row, strided rows too. fp32 models take it too
    (`native_fp32_norm`): the PyTorch form is seven ops, each a pass over the rows."""

    native_fp32_norm = True

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self._ops = None

    def set_norm_kernels(self, ops) -> None:
        self._ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self._ops is not None and x.dtype == self.weight.dtype and x.dim() in (2, 3)
                and x.stride(-1) == 1):
            return self._ops.rms_norm_zero_centered(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def add_forward(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual += x (in place: the residual stream), then the norm of it; with the
        native kernel one pass, the same roundings."""
        if (self._ops is not None and residual.dtype == x.dtype == self.weight.dtype
                and residual.dim() == 2 and residual.is_contiguous() and x.dim() == 2
                and x.stride(-1) == 1):
            return self._ops.add_rms_norm_zero_centered_(residual, x, self.weight, self.eps)
        return self(residual.add_(x))


class GatedAttention(nn.Module):
    """Softmax attention whose output is scaled by sigmoid(gate), gate from q_proj."""

    def __init__(self, c: HybridConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        # q_proj yields, per head, head_dim query features then head_dim gate features.
        self.qkv_proj = Linear(c.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=c.qkv_bias,
                               tp=QKVParallel(2 * self.q_size, self.kv_size, self.kv_size,
                                              c.head_dim))
        self.o_proj = Linear(self.q_size, c.hidden_size, bias=c.qkv_bias, tp="row")
        self.q_norm = ZeroCenteredRMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(c.head_dim, c.rms_norm_eps)
        self.attn = PagedAttention(c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim ** -0.5)

    def write_kv(self, x, cos, sin, rotary: RotaryEmbedding, meta: AttentionMetadata) -> None:
        """Only the K/V forward would write for these rows (an MTP drafter's cache)."""
        t = x.shape[0]
        _, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
        self.attn.write_kv(rotary.apply(k, cos, sin), v.view(t, self.num_kv_heads, self.head_dim),
                           meta)

    def forward(self, x, cos, sin, rotary: RotaryEmbedding, meta: AttentionMetadata):
        t = x.shape[0]
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary.apply(q, cos, sin), rotary.apply(k, cos, sin)
        # (the gate by heads, as q_proj left it: reshaping it to [t, q_size] was a copy)
        out = self.attn(q, k, v, meta).view(t, self.num_heads, self.head_dim) * torch.sigmoid(gate)
        return self.o_proj(out.view(t, self.q_size))


class HybridDecoderLayer(PreNormBlock, nn.Module):
    def __init__(self, c: HybridConfig, layer_idx: int, shared_expert_gate: bool):
        super().__init__()
        self.is_linear = c.layer_types[layer_idx] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(
                c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads,
                c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim,
                c.rms_norm_eps)
        else:
            self.self_attn = GatedAttention(c)
        if c.is_sparse(layer_idx):
            self.mlp = SparseMoeBlock(
                c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                norm_topk_prob=c.norm_topk_prob,
                shared_expert_intermediate_size=c.shared_expert_intermediate_size,
                shared_expert_gate=shared_expert_gate)
        else:
            self.mlp = GatedMLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)

    def mix(self, normed, cos, sin, rotary, meta):
        if self.is_linear:
            return self.linear_attn(normed, meta)
        return self.self_attn(normed, cos, sin, rotary, meta)


class Qwen3NextForCausalLM(HiddenStateTaps, nn.Module):
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
        "in_proj_qkv": ("in_proj", 0), "in_proj_z": ("in_proj", 1),
        "in_proj_b": ("in_proj", 2), "in_proj_a": ("in_proj", 3),
    }
    expert_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                      "down_proj": ("down_proj", 0)}
    # Qwen3.5-MoE always renormalises the top-k weights; Qwen3-Next reads norm_topk_prob.
    force_norm_topk = False
    text_prefixes = ("model.",)
    # compute_logits is exactly lm_head(hidden): the runner's greedy head may stand in.
    plain_lm_head = True

    def __init__(self, hf_config: dict):
        super().__init__()
        c = self.config = HybridConfig(flatten_text_config(hf_config))
        if self.force_norm_topk:
            c.norm_topk_prob = True
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(HybridDecoderLayer(c, i, shared_expert_gate=True)
                                    for i in range(c.num_layers))
        self.norm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = RotaryEmbedding(c.head_dim, c.rotary_dim, c.max_position_embeddings,
                                      c.rope_params)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # The native loop over every layer of a decode step (set_decode_layers), or None.
        self.decode_layers: HybridDecodeLayers | None = None

    def set_decode_layers(self, ops, max_rows: int) -> None:
        """The platform's decision, at load (after the weights are packed): `ops` with
        `hybrid_decode_layers` turns the native loop on where every layer would take its
        native kernels; None turns it off."""
        loop = None
        if ops is not None and hasattr(ops, "hybrid_decode_layers"):
            loop = HybridDecodeLayers(self, ops, max_rows)
        self.decode_layers = loop if loop is not None and loop.supported else None

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers if not layer.is_linear]

    def state_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.layers if layer.is_linear]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None
                ) -> torch.Tensor:
        """`inputs_embeds`: the step's input embeddings when not just the tokens'
        (image rows in place); positions [T], or M-RoPE's [3, T]."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        loop = self.decode_layers
        if loop is not None and not self.aux_layer_ids and loop.applies(x, meta):
            return self.norm(loop(x, cos, sin, meta))

        def deferred(i, h, pending):
            return self.layers[i].forward_deferred(h, pending, cos, sin, self.rotary, meta)

        return self.run_layers(x, lambda i, h: self.layers[i](h, cos, sin, self.rotary, meta),
                               self.norm, deferred=(deferred, self.norm.add_forward))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # ---- checkpoint names ----------------------------------------------------------
    def map_checkpoint(self, name: str, tensor: torch.Tensor):
        """Yield (name, tensor) pairs in the layout the loader packs."""
        if name.startswith(("mtp.", "model.visual.", "visual.", "model.mtp.")):
            return  # the vision tower and the MTP head are not part of the text model
        name = text_model_name(name)
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            yield from self._split_qkvz(name, tensor)
        elif name.endswith("linear_attn.in_proj_ba.weight"):
            yield from self._split_ba(name, tensor)
        else:
            yield name, tensor

    def _split_qkvz(self, name, w):
        """Qwen3-Next groups rows per key head: [q_h, k_h, v_h (rep heads), z_h (rep heads)]."""
        c = self.config
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        rep = c.linear_num_value_heads // c.linear_num_key_heads
        # The key heads counted from the tensor (a tensor-parallel rank's config has its
        # share of the heads only; the checkpoint has all of them).
        g = w.view(-1, 2 * dk + 2 * rep * dv, w.shape[-1])
        q, k, v, z = g.split([dk, dk, rep * dv, rep * dv], dim=1)
        flat = [x.reshape(-1, w.shape[-1]) for x in (q, k, v, z)]
        base = name[:-len("in_proj_qkvz.weight")]
        yield base + "in_proj_qkv.weight", torch.cat(flat[:3], dim=0)
        yield base + "in_proj_z.weight", flat[3]

    def _split_ba(self, name, w):
        c = self.config
        rep = c.linear_num_value_heads // c.linear_num_key_heads
        b, a = w.view(-1, 2 * rep, w.shape[-1]).split([rep, rep], dim=1)
        base = name[:-len("in_proj_ba.weight")]
        yield base + "in_proj_b.weight", b.reshape(-1, w.shape[-1])
        yield base + "in_proj_a.weight", a.reshape(-1, w.shape[-1])


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    pass


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    force_norm_topk = True
