"""Gemma 3 text model (Gemma3ForCausalLM, transformers' Gemma3TextConfig).

What sets it apart from the Llama family:
* local and global layers interleaved (`layer_types`, or every `sliding_window_pattern`-th
  layer global): local layers attend over a sliding window and rotate with their own
  rope base (`rope_local_base_freq`, or rope_parameters["sliding_attention"]); each kind
  is its own KV cache group (tokenmill/core/kv_cache_spec.py: group_layer_specs);
* Gemma's RMSNorm, x / rms(x) * (1 + weight) in fp32, on q and k per head too, and
  four norms per layer: after attention and around the MLP;
* the embedding scaled by sqrt(hidden_size) (in the weights' dtype), the lm_head tied
  to it; queries scaled by query_pre_attn_scalar ** -0.5;
* a gelu-tanh gated MLP; attention scores and final logits soft-capped where configured.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.models.layers.attention import PagedAttention
from tokenmill.models.layers.gemma_decode_layers import GemmaDecodeLayers
from tokenmill.models.layers.linear import Linear, QKVParallel
from tokenmill.models.layers.rotary import RotaryEmbedding, rope_parameters_from_config
from tokenmill.models.layers.taps import HiddenStateTaps
from tokenmill.models.weight_names import text_model_name

logger = logging.getLogger(__name__)

SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in fp32, rounded once (HF's Gemma3RMSNorm): PyTorch's
    fp32 rms_norm over the weight with its +1 folded in, bit-identical to HF's formula
    and what the native decode loop calls (`folded_weight`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def folded_weight(self) -> torch.Tensor:
        """1 + weight, in fp32."""
        return 1.0 + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), self.weight.shape, self.folded_weight(), self.eps)
        return y.to(x.dtype)


class Gemma3Config:
    """The fields the decoder needs, read from an HF config dict."""

    def __init__(self, cfg: dict):
        self.vocab_size = cfg["vocab_size"]
        self.hidden_size = cfg["hidden_size"]
        self.intermediate_size = cfg["intermediate_size"]
        self.num_layers = cfg["num_hidden_layers"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = cfg.get("head_dim") or 256
        self.rms_norm_eps = cfg.get("rms_norm_eps", 1e-6)
        self.max_position_embeddings = cfg.get("max_position_embeddings", 131072)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", True))
        self.attention_bias = bool(cfg.get("attention_bias", False))
        self.query_pre_attn_scalar = cfg.get("query_pre_attn_scalar", 256)
        self.final_logit_softcapping = cfg.get("final_logit_softcapping")
        self.attn_logit_softcapping = cfg.get("attn_logit_softcapping")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention (an embedding model) is not supported")
        self.sliding_window = cfg.get("sliding_window")
        types = cfg.get("layer_types")
        if not types:
            pattern = cfg.get("sliding_window_pattern", 6)
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(self.num_layers)]
        if len(types) != self.num_layers or set(types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must name {self.num_layers} layers as "
                             f"{SLIDING!r} or {FULL!r}, got {types!r}")
        if self.sliding_window is None and SLIDING in types:
            raise ValueError("sliding_attention layers need a sliding_window")
        self.layer_types = list(types)
        self.rope = {kind: self._rope_params(cfg, kind) for kind in (SLIDING, FULL)}

    @staticmethod
    def _rope_params(cfg: dict, kind: str) -> dict:
        """transformers 5 writes rope_parameters per layer kind; older configs carry
        rope_theta (global), rope_local_base_freq (local) and rope_scaling (global)."""
        params = cfg.get("rope_parameters")
        if isinstance(params, dict) and kind in params:
            return rope_parameters_from_config({"rope_parameters": params[kind]})
        if kind == SLIDING:
            return rope_parameters_from_config({"rope_theta": cfg.get("rope_local_base_freq",
                                                                      10000.0)})
        return rope_parameters_from_config({"rope_theta": cfg.get("rope_theta", 1e6),
                                            "rope_scaling": cfg.get("rope_scaling")})


class Gemma3Attention(nn.Module):
    def __init__(self, c: Gemma3Config, kind: str):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.kind = kind
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.qkv_proj = Linear(c.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=c.attention_bias,
                               tp=QKVParallel(self.q_size, self.kv_size, self.kv_size,
                                              c.head_dim))
        self.o_proj = Linear(self.q_size, c.hidden_size, bias=c.attention_bias, tp="row")
        self.q_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps)
        self.attn = PagedAttention(c.num_heads, c.num_kv_heads, c.head_dim,
                                   c.query_pre_attn_scalar ** -0.5,
                                   sliding_window=c.sliding_window if kind == SLIDING else None,
                                   logit_softcap=c.attn_logit_softcapping)
        self._no_norm = torch.empty(0)
        self.set_qk_norm_rope(None)

    def set_qk_norm_rope(self, ops) -> None:
        """The platform's decision, at load: the native rotary (`ops.qk_norm_rope` with
        no norm weights, after Gemma's q/k norms are written back into qkv: the calls
        the native decode loop makes) or the PyTorch ops (None)."""
        self._ops = ops
        self._qkv_roped = self._qkv_roped_native if ops is not None else self._qkv_roped_torch

    def _qkv_roped_torch(self, qkv, cos, sin, rotary: RotaryEmbedding):
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim))
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        return rotary.apply(q, cos, sin), rotary.apply(k, cos, sin), v

    def _qkv_roped_native(self, qkv, cos, sin, rotary: RotaryEmbedding):
        # q out, k rotated in place inside qkv.
        t = qkv.shape[0]
        qv = qkv[:, :self.q_size]
        kv = qkv[:, self.q_size:self.q_size + self.kv_size]
        qv.copy_(self.q_norm(qv.reshape(t, self.num_heads, self.head_dim)).view(t, -1))
        kv.copy_(self.k_norm(kv.reshape(t, self.num_kv_heads, self.head_dim)).view(t, -1))
        q = self._ops.qk_norm_rope(qkv, self._no_norm, self._no_norm, cos, sin,
                                   self.num_heads, self.num_kv_heads,
                                   self.head_dim, self.head_dim, 0.0)
        k = kv.view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        return q, k, v

    def forward(self, x, cos, sin, rotary: RotaryEmbedding, meta: AttentionMetadata):
        q, k, v = self._qkv_roped(self.qkv_proj(x), cos, sin, rotary)
        return self.o_proj(self.attn(q, k, v, meta))


class GeluTanhMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up packed in one `gate_up_proj`. The
    activation is the platform's `activation` decision, handed over once at load
    (`set_activation_kernels`): the native gelu_tanh_mul or PyTorch's."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False,
                                   tp="column", output_sizes=(intermediate_size,) * 2)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False, tp="row")
        self.act_and_mul = self._torch_act_and_mul

    def forward(self, x):
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))

    def _torch_act_and_mul(self, gate_up):
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def set_activation_kernels(self, ops) -> None:
        self.act_and_mul = ops.gelu_tanh_mul if ops is not None else self._torch_act_and_mul


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, c: Gemma3Config, kind: str):
        super().__init__()
        self.kind = kind
        self.input_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Gemma3Attention(c, kind)
        self.post_attention_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = GeluTanhMLP(c.hidden_size, c.intermediate_size)
        self.post_feedforward_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, rotary, meta):
        h = self.self_attn(self.input_layernorm(x), cos, sin, rotary, meta)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3ForCausalLM(HiddenStateTaps, nn.Module):
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, hf_config: dict):
        super().__init__()
        c = self.config = Gemma3Config(hf_config)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_scale = c.hidden_size ** 0.5
        self.layers = nn.ModuleList(Gemma3DecoderLayer(c, kind) for kind in c.layer_types)
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        # One rope table per layer kind (local layers have their own base).
        self.rotary = nn.ModuleDict({kind: RotaryEmbedding(c.head_dim, c.head_dim,
                                                           c.max_position_embeddings,
                                                           c.rope[kind])
                                     for kind in (SLIDING, FULL)})
        self._add_head(c)

    def _add_head(self, c) -> None:
        """lm_head (tied or not), and what the runner may do with it."""
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # The runner's greedy head may stand in for lm_head only without soft-capping
        # (tanh is monotonic, but the capped logits are what logprobs report).
        self.plain_lm_head = c.final_logit_softcapping is None
        # The native loop over every layer of a decode step (set_decode_layers), or None.
        self.decode_layers: GemmaDecodeLayers | None = None

    def set_decode_layers(self, ops, max_rows: int) -> None:
        """The CPU platform's decision, at load (after the Linear layers were packed)."""
        loop = None
        if ops is not None and hasattr(ops, "gemma_decode_layers"):
            loop = GemmaDecodeLayers(self, ops, max_rows)
        self.decode_layers = loop if loop is not None and loop.supported else None

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # HF multiplies by the scale cast to the weights' dtype.
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        cos_sin = {kind: rot.cos_sin(positions, x.dtype) for kind, rot in self.rotary.items()}
        if (self.decode_layers is not None and not self.aux_layer_ids
                and self.decode_layers.applies(x, meta)):
            # The same kernels as the layers below, called from C++ (one whole-model call:
            # with a drafter's taps the layers run one by one).
            return self.norm(self.decode_layers(x, cos_sin, meta))

        def step(i, h):
            cos, sin = cos_sin[self.layers[i].kind]
            return self.layers[i](h, cos, sin, self.rotary[self.layers[i].kind], meta)
        return self.run_layers(x, step, self.norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text model of a Gemma 3 vision-language checkpoint (gemma-3-4b/12b/27b): the
    SigLIP tower and the projector are skipped, so prompts are text only. The hub's
    files name the text weights language_model.model.* (transformers 5 in memory:
    model.language_model.*)."""

    skipped_prefixes = ("vision_tower.", "multi_modal_projector.",
                        "model.vision_tower.", "model.multi_modal_projector.")

    def __init__(self, hf_config: dict):
        super().__init__(hf_config)
        logger.info("%s checkpoint: loading the text model only (the vision tower's "
                    "weights are skipped)", type(self).__name__)

    def map_checkpoint(self, name: str, tensor: torch.Tensor):
        if name.startswith(self.skipped_prefixes):
            return
        yield text_model_name(name), tensor
