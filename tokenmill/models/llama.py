"""Llama-family decoder: Llama, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm).

Weights are packed where it saves ops: q/k/v in one `qkv_proj`, gate/up in one
`gate_up_proj` (the loader concatenates HF's separate matrices).
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.config import sliding_window
from tokenmill.models.layers.attention import PagedAttention
from tokenmill.models.layers.decode_layers import DecodeLayers
from tokenmill.models.layers.linear import Linear, QKVParallel
from tokenmill.models.layers.mlp import GatedMLP
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding, rope_parameters_from_config
from tokenmill.models.layers.taps import HiddenStateTaps, PreNormBlock


class DecoderConfig:
    """The fields a Llama-family decoder needs, read from an HF config dict."""

    def __init__(self, cfg: dict, *, qkv_bias: bool | None = None, qk_norm: bool = False):
        self.vocab_size = cfg["vocab_size"]
        self.hidden_size = cfg["hidden_size"]
        self.intermediate_size = cfg["intermediate_size"]
        self.num_layers = cfg["num_hidden_layers"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = cfg.get("head_dim") or self.hidden_size // self.num_heads
        self.rms_norm_eps = cfg.get("rms_norm_eps", 1e-6)
        self.max_position_embeddings = cfg.get("max_position_embeddings", 4096)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.qkv_bias = bool(cfg.get("attention_bias", False)) if qkv_bias is None else qkv_bias
        self.o_bias = bool(cfg.get("attention_bias", False))
        self.mlp_bias = bool(cfg.get("mlp_bias", False))
        self.qk_norm = qk_norm
        self.hidden_act = cfg.get("hidden_act", "silu")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (only silu)")
        self.rope_params = rope_parameters_from_config(cfg)
        self.rotary_dim = int(self.head_dim * self.rope_params.get("partial_rotary_factor", 1.0))
        # Each layer's sliding window (None: full attention): every layer's (Mistral,
        # Phi-3), or the "sliding_attention" ones of `layer_types` (Qwen2's upper layers).
        window = sliding_window(cfg)
        types = cfg.get("layer_types")
        self.layer_windows = ([window if t == "sliding_attention" else None for t in types]
                              if window is not None and types else [window] * self.num_layers)


class Attention(nn.Module):
    def __init__(self, c: DecoderConfig, input_size: int | None = None,
                 sliding_window: int | None = None):
        """`input_size`: the width of x (default hidden_size; an EAGLE-3 drafter's
        attention reads [embedding | hidden], twice that); `sliding_window`: this
        layer's window (None: full attention)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.qkv_proj = Linear(input_size or c.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=c.qkv_bias,
                               tp=QKVParallel(self.q_size, self.kv_size, self.kv_size,
                                              c.head_dim))
        self.o_proj = Linear(self.q_size, c.hidden_size, bias=c.o_bias, tp="row")
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.attn = PagedAttention(c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim ** -0.5,
                                   sliding_window=sliding_window)
        self._no_norm = torch.empty(0)
        self.set_qk_norm_rope(None)

    def set_qk_norm_rope(self, ops) -> None:
        """The platform's decision, at load: q/k norm + rotary in one native op
        (`ops.qk_norm_rope`, k rotated in place inside qkv) instead of ~25, or the
        PyTorch ops (None)."""
        self._ops = ops
        self._qkv_roped = self._qkv_roped_native if ops is not None else self._qkv_roped_torch

    def _qkv_roped_torch(self, qkv, cos, sin, rotary: RotaryEmbedding, with_q: bool = True):
        """qkv [T, q + 2 kv] -> q (None unless `with_q`), k normed and rotated, v."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = rotary.apply(k, cos, sin)
        if not with_q:
            return None, k, v
        q = q.view(t, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return rotary.apply(q, cos, sin), k, v

    def _qkv_roped_native(self, qkv, cos, sin, rotary: RotaryEmbedding, with_q: bool = True):
        t = qkv.shape[0]
        norm = self.q_norm is not None
        q = self._ops.qk_norm_rope(
            qkv, self.q_norm.weight if norm else self._no_norm,
            self.k_norm.weight if norm else self._no_norm, cos, sin, self.num_heads,
            self.num_kv_heads, self.head_dim, rotary.rotary_dim,
            self.q_norm.eps if norm else 0.0)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, -1)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, -1)
        return q, k, v

    def write_kv(self, x, cos, sin, rotary: RotaryEmbedding, meta: AttentionMetadata) -> None:
        """Only the K/V that forward would write into the cache for these rows (a
        draft model keeping its cache complete for positions it proposes nothing from)."""
        _, k, v = self._qkv_roped(self.qkv_proj(x), cos, sin, rotary, with_q=False)
        self.attn.write_kv(k, v, meta)

    def forward(self, x, cos, sin, rotary: RotaryEmbedding, meta: AttentionMetadata):
        q, k, v = self._qkv_roped(self.qkv_proj(x), cos, sin, rotary)
        return self.o_proj(self.attn(q, k, v, meta))


class DecoderLayer(PreNormBlock, nn.Module):
    def __init__(self, c: DecoderConfig, mlp: nn.Module, sliding_window: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, sliding_window=sliding_window)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = mlp


class LlamaForCausalLM(HiddenStateTaps, nn.Module):
    # Checkpoint names packed into one parameter: (packed name, shard index).
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    qkv_bias: bool | None = None  # None: from config.attention_bias
    qk_norm = False
    config_class = DecoderConfig
    # compute_logits is exactly lm_head(hidden): the runner's greedy head may stand in.
    plain_lm_head = True
    has_lm_head = True  # False: a checkpoint without one (models/registry.py)

    def __init__(self, hf_config: dict):
        super().__init__()
        c = self.config = self.config_class(hf_config, qkv_bias=self.qkv_bias,
                                            qk_norm=self.qk_norm)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, self.make_mlp(c, i), c.layer_windows[i])
                                    for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = RotaryEmbedding(c.head_dim, c.rotary_dim, c.max_position_embeddings,
                                      c.rope_params)
        # (None for a checkpoint saved without it: an embedding model, models/registry.py)
        self.lm_head = (Linear(c.hidden_size, c.vocab_size, bias=False)
                        if self.has_lm_head else None)
        if c.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight
        # The native loop over every layer of a decode step (set_decode_layers), or None.
        self.decode_layers: DecodeLayers | None = None

    def set_decode_layers(self, ops, max_rows: int) -> None:
        """The CPU platform's decision, at load (after the Linear layers were packed):
        `ops` with `decode_layers` turns the native loop on where every layer would take
        its native path; None turns it off."""
        loop = DecodeLayers(self, ops, max_rows) if ops is not None else None
        self.decode_layers = loop if loop is not None and loop.supported else None

    def make_mlp(self, c: DecoderConfig, layer_idx: int) -> nn.Module:
        """The MLP of layer `layer_idx` (an MoE model overrides this)."""
        return GatedMLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None
                ) -> torch.Tensor:
        """`inputs_embeds`: the step's input embeddings when not just the tokens'
        (a multimodal model's, with image embeddings at the placeholders)."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        # The native loop: the same kernels as the layers, called from C++ (which also
        # takes a drafter's taps; layers/decode_layers.py).
        native = self.decode_layers is not None and self.decode_layers.applies(x, meta)

        def span(start, end, h):
            return self.decode_layers(h, cos, sin, meta, start, end)

        def tapped(h, taps, ids):
            return self.decode_layers(h, cos, sin, meta, taps=taps, tap_ids=ids)

        def deferred(i, h, pending):
            return self.layers[i].forward_deferred(h, pending, cos, sin, self.rotary, meta)
        return self.run_layers(x, lambda i, h: self.layers[i](h, cos, sin, self.rotary, meta),
                               self.norm, span if native else None,
                               tapped if native else None,
                               deferred=(deferred, self.norm.add_forward))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's decoder with a sliding window on every layer where configured."""


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama's decoder as Phi-3 / Phi-4-mini checkpoints store it: q/k/v already fused in
    qkv_proj and gate/up in gate_up_proj (loaded as they are: the same layout as ours),
    partial rotary and a sliding window where configured."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
