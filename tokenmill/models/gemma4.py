"""Gemma 4 text model (Gemma4ForCausalLM, transformers' Gemma4TextConfig), the subset
without per-layer input embeddings, KV sharing, MoE blocks or k = v attention (each is
refused by name).

Against Gemma 3 (gemma3.py): global layers have their own head_dim (and may have their
own KV head count: `per_layer_config`), so local and global layers are KV cache groups
of different page layouts (each layer's spec at its own head_dim; the groups share KV
buffers at the larger page, tokenmill/core/kv_cache_spec.py); global layers rotate with
"proportional" rope (the first partial_rotary_factor of each half rotated, the rest
left as is); the norms multiply by `weight` (not 1 + weight), V is RMS-normalised
without a scale, scores are not scaled (q/k norms do it), and every layer's output is
multiplied by its `layer_scalar`.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.models.gemma3 import FULL, SLIDING, Gemma3ForCausalLM, GeluTanhMLP
from tokenmill.models.layers.attention import AttentionMetadata, PagedAttention
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.rotary import RotaryEmbedding


class Gemma4RMSNorm(nn.Module):
    """x * (mean(x^2) + eps)^-0.5 [* weight], in fp32, rounded once (HF's formula)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            xf = xf * self.weight.float()
        return xf.to(x.dtype)


class Gemma4Config:
    def __init__(self, cfg: dict):
        for key, what in (("hidden_size_per_layer_input", "per-layer input embeddings"),
                          ("num_kv_shared_layers", "KV sharing across layers"),
                          ("enable_moe_block", "MoE blocks"),
                          ("attention_k_eq_v", "k = v attention"),
                          ("use_bidirectional_attention", "bidirectional attention")):
            if cfg.get(key):
                raise ValueError(f"Gemma 4 with {key}={cfg[key]!r} ({what}) is not supported")
        self.vocab_size = cfg["vocab_size"]
        self.hidden_size = cfg["hidden_size"]
        self.intermediate_size = cfg["intermediate_size"]
        self.num_layers = cfg["num_hidden_layers"]
        self.num_heads = cfg["num_attention_heads"]
        self.rms_norm_eps = cfg.get("rms_norm_eps", 1e-6)
        self.max_position_embeddings = cfg.get("max_position_embeddings", 131072)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", True))
        self.attention_bias = bool(cfg.get("attention_bias", False))
        self.final_logit_softcapping = cfg.get("final_logit_softcapping")
        act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
        self.sliding_window = cfg.get("sliding_window")
        types = cfg.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL
                                           for i in range(self.num_layers)]
        if len(types) != self.num_layers or set(types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must name {self.num_layers} layers as "
                             f"{SLIDING!r} or {FULL!r}, got {types!r}")
        self.layer_types = list(types)
        # Per-layer overrides (global layers: their head_dim, maybe their KV heads).
        overrides = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
        head_dim = cfg.get("head_dim") or 256
        kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dims = [overrides.get(i, {}).get("head_dim", head_dim)
                          for i in range(self.num_layers)]
        self.kv_heads = [overrides.get(i, {}).get("num_key_value_heads", kv_heads)
                         for i in range(self.num_layers)]
        for kind in (SLIDING, FULL):  # one rope table per kind: one head_dim per kind
            dims = {self.head_dims[i] for i, t in enumerate(types) if t == kind}
            if len(dims) > 1:
                raise ValueError(f"{kind} layers with different head dims {sorted(dims)}")
        self.rope = cfg.get("rope_parameters") or {}

    def kind_head_dim(self, kind: str) -> int:
        return next((d for d, t in zip(self.head_dims, self.layer_types) if t == kind),
                    self.head_dims[0])


def make_rotary(head_dim: int, max_position: int, params: dict) -> RotaryEmbedding:
    """"default" rope over the whole head, or "proportional": the inverse frequencies of
    the first partial_rotary_factor * head_dim / 2 angles (over head_dim), zero for the
    rest (cos 1, sin 0: those features pass unrotated)."""
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "proportional"):
        raise ValueError(f"Gemma 4 rope_type {rope_type!r} is not supported")
    theta = params.get("rope_theta", 10000.0)
    rotary = RotaryEmbedding(head_dim, head_dim, max_position,
                             {"rope_type": "default", "rope_theta": theta})
    if rope_type == "proportional":
        if params.get("factor", 1.0) != 1.0:
            raise ValueError("proportional rope with a factor is not supported")
        angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.float) / head_dim))
        inv = torch.cat([inv, torch.zeros(head_dim // 2 - angles)])
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        rotary.cos_cache.copy_(emb.cos())
        rotary.sin_cache.copy_(emb.sin())
    return rotary


class Gemma4Attention(nn.Module):
    def __init__(self, c: Gemma4Config, i: int):
        super().__init__()
        kind = c.layer_types[i]
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.kv_heads[i], c.head_dims[i]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias)
        self.o_proj = Linear(self.q_size, c.hidden_size, bias=c.attention_bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = Gemma4RMSNorm(self.head_dim, c.rms_norm_eps)
        self.v_norm = Gemma4RMSNorm(self.head_dim, c.rms_norm_eps, with_scale=False)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, 1.0,
                                   sliding_window=c.sliding_window if kind == SLIDING else None)

    def forward(self, x, cos, sin, rotary: RotaryEmbedding, meta: AttentionMetadata):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = rotary.apply(self.q_norm(q.reshape(t, self.num_heads, self.head_dim)), cos, sin)
        k = rotary.apply(self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)), cos, sin)
        v = self.v_norm(v.reshape(t, self.num_kv_heads, self.head_dim))
        return self.o_proj(self.attn(q, k, v, meta))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, c: Gemma4Config, i: int):
        super().__init__()
        self.kind = c.layer_types[i]
        eps = c.rms_norm_eps
        self.input_layernorm = Gemma4RMSNorm(c.hidden_size, eps)
        self.self_attn = Gemma4Attention(c, i)
        self.post_attention_layernorm = Gemma4RMSNorm(c.hidden_size, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(c.hidden_size, eps)
        self.mlp = GeluTanhMLP(c.hidden_size, c.intermediate_size)
        self.post_feedforward_layernorm = Gemma4RMSNorm(c.hidden_size, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))  # (a buffer in HF: in the checkpoint)

    def forward(self, x, cos, sin, rotary, meta):
        h = self.self_attn(self.input_layernorm(x), cos, sin, rotary, meta)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return (x + self.post_feedforward_layernorm(h)) * self.layer_scalar


class Gemma4ForCausalLM(Gemma3ForCausalLM):
    """Gemma 3's model (forward, logits) over Gemma 4's layers, norm and rope tables."""

    def __init__(self, hf_config: dict):
        nn.Module.__init__(self)
        c = self.config = Gemma4Config(hf_config)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_scale = c.hidden_size ** 0.5
        self.layers = nn.ModuleList(Gemma4DecoderLayer(c, i) for i in range(c.num_layers))
        self.norm = Gemma4RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = nn.ModuleDict({
            kind: make_rotary(c.kind_head_dim(kind), c.max_position_embeddings,
                              c.rope.get(kind) or {"rope_type": "default"})
            for kind in (SLIDING, FULL)})
        self._add_head(c)

    def set_decode_layers(self, ops, max_rows: int) -> None:
        """No native loop yet: per-layer head sizes, the V norm and layer_scalar are not
        in gemma_decode_layers (its layers still call the native kernels one by one)."""
        self.decode_layers = None
