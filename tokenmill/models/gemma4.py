"""Gemma 4 text model (Gemma4ForCausalLM, transformers' Gemma4TextConfig).

Against Gemma 3 (gemma3.py): global layers have their own head_dim (and may have their
own KV head count: `per_layer_config`), so local and global layers are KV cache groups
of different page layouts (each layer's spec at its own head_dim; the groups share KV
buffers at the larger page, tokenmill/core/kv_cache_spec.py); global layers rotate with
"proportional" rope (the first partial_rotary_factor of each half rotated, the rest
left as is); the norms multiply by `weight` (not 1 + weight), V is RMS-normalised
without a scale, scores are not scaled (q/k norms do it), and every layer's output is
multiplied by its `layer_scalar`.

k = v attention (`attention_k_eq_v`, global layers only): no v_proj; V is the k_proj
output before the K norm and rope, RMS-normalised like any V. MoE blocks
(`enable_moe_block`): every layer keeps its dense MLP and adds routed experts beside
it (Gemma4Router + FusedMoE). Per-layer inputs (`hidden_size_per_layer_input`, the
small E2B / E4B models): each token gets a [num_layers, P] table (PerLayerInputs) and
layer i adds a gated residual branch from its slice after the MLP. KV sharing
(`num_kv_shared_layers`, the small models too): the last layers compute queries only
and attend over the K/V of the last earlier layer of their kind; they have no KV cache
of their own (PagedAttention.kv_sharing_target: the runner binds them to their
source's cache and KV group).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.models.gemma3 import FULL, SLIDING, Gemma3ForCausalLM, GeluTanhMLP
from tokenmill.models.layers.attention import PagedAttention
from tokenmill.models.layers.gemma_decode_layers import Gemma4DecodeLayers
from tokenmill.models.layers.linear import Linear, QKVParallel
from tokenmill.models.layers.moe import FusedMoE
from tokenmill.models.layers.rotary import RotaryEmbedding, cos_sin_table
from tokenmill.models.weight_names import text_model_name

logger = logging.getLogger(__name__)


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
        # "vision": image tokens attend both ways, text stays causal; a text-only model
        # sees no image token, so only "all" (no causal mask at all) changes anything.
        bidirectional = cfg.get("use_bidirectional_attention")
        if bidirectional not in (None, "vision"):
            raise ValueError(f"Gemma 4 with use_bidirectional_attention={bidirectional!r} "
                             "(bidirectional attention over text) is not supported")
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
        if "per_layer_config" not in cfg:
            # A config.json written before per_layer_config names the global layers'
            # shape directly (HF derives the same overrides from these fields; the KV
            # heads only with k = v).
            glob = {"head_dim": cfg.get("global_head_dim", 512)}
            if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads"):
                glob["num_key_value_heads"] = cfg["num_global_key_value_heads"]
            overrides = {i: glob for i, t in enumerate(self.layer_types) if t == FULL}
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
        self.kv_source = self._kv_sources(int(cfg.get("num_kv_shared_layers") or 0))
        self.use_double_wide_mlp = bool(cfg.get("use_double_wide_mlp", False))
        # k = v: the global layers' V is their K projection (HF: sliding layers never).
        self.attention_k_eq_v = bool(cfg.get("attention_k_eq_v", False))
        # Per-layer inputs: a [num_layers, hidden_size_per_layer_input] slice per token.
        self.per_layer_size = int(cfg.get("hidden_size_per_layer_input") or 0)
        if self.per_layer_size:
            self.per_layer_vocab = cfg.get("vocab_size_per_layer_input", 262144)
            if not isinstance(self.per_layer_vocab, int) or self.per_layer_vocab < self.vocab_size:
                raise ValueError(f"vocab_size_per_layer_input {self.per_layer_vocab!r} must be an "
                                 f"int covering vocab_size {self.vocab_size}")
        self.enable_moe_block = bool(cfg.get("enable_moe_block", False))
        if self.enable_moe_block:
            for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
                if not isinstance(cfg.get(key), int) or cfg[key] < 1:
                    raise ValueError(f"enable_moe_block needs a positive int {key}, "
                                     f"got {cfg.get(key)!r}")
            self.num_experts = cfg["num_experts"]
            self.top_k_experts = cfg["top_k_experts"]
            self.moe_intermediate_size = cfg["moe_intermediate_size"]
            if self.top_k_experts > self.num_experts:
                raise ValueError(f"top_k_experts {self.top_k_experts} exceeds num_experts "
                                 f"{self.num_experts}")

    def _kv_sources(self, num_shared: int) -> list[int | None]:
        """Layer i's KV source: None (its own K/V and cache), or for the last
        `num_kv_shared_layers` layers the last layer of the same kind before them (HF's
        kv_sharing_modes: "reuse" layers read the "store" layer of their kind)."""
        n = self.num_layers
        if not 0 <= num_shared < n:
            raise ValueError(f"num_kv_shared_layers {num_shared} must be in [0, "
                             f"num_hidden_layers {n})")
        first = n - num_shared
        sources: list[int | None] = [None] * n
        for i in range(first, n):
            kind = self.layer_types[i]
            src = next((j for j in range(first - 1, -1, -1) if self.layer_types[j] == kind),
                       None)
            if src is None:
                raise ValueError(f"num_kv_shared_layers {num_shared}: shared layer {i} "
                                 f"({kind}) has no earlier {kind} layer to read K/V from")
            sources[i] = src
        return sources

    def k_eq_v(self, i: int) -> bool:
        return self.attention_k_eq_v and self.layer_types[i] == FULL

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
        cos, sin = cos_sin_table(emb)
        rotary.cos_cache.copy_(cos)
        rotary.sin_cache.copy_(sin)
    return rotary


class Gemma4Attention(nn.Module):
    def __init__(self, c: Gemma4Config, i: int):
        super().__init__()
        kind = c.layer_types[i]
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.kv_heads[i], c.head_dims[i]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.layer_idx = i
        # A KV-shared layer computes queries only and reads layer `kv_source`'s K/V (this
        # step's from `shared_kv`, earlier ones from its cache: the runner binds it there).
        self.kv_source = c.kv_source[i]
        self.stores_kv = i in c.kv_source
        # k = v: no V rows; shared: no K or V rows (map_checkpoint packs empty shards).
        self.k_eq_v = c.k_eq_v(i)
        self.k_size = 0 if self.kv_source is not None else self.kv_size
        self.v_size = 0 if self.k_eq_v else self.k_size
        # Split at this layer's own head shape and KV head count (layer_idx).
        self.qkv_proj = Linear(c.hidden_size, self.q_size + self.k_size + self.v_size,
                               bias=c.attention_bias,
                               tp=QKVParallel(self.q_size, self.k_size, self.v_size,
                                              self.head_dim, layer_idx=i))
        self.o_proj = Linear(self.q_size, c.hidden_size, bias=c.attention_bias, tp="row")
        self.q_norm = Gemma4RMSNorm(self.head_dim, c.rms_norm_eps)
        if self.kv_source is None:
            self.k_norm = Gemma4RMSNorm(self.head_dim, c.rms_norm_eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, c.rms_norm_eps, with_scale=False)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, 1.0,
                                   sliding_window=c.sliding_window if kind == SLIDING else None,
                                   kv_sharing_target=self.kv_source)

    def forward(self, x, cos, sin, rotary: RotaryEmbedding, meta: AttentionMetadata,
                shared_kv: dict):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.k_size, self.v_size], dim=-1)
        q = rotary.apply(self.q_norm(q.reshape(t, self.num_heads, self.head_dim)), cos, sin)
        if self.kv_source is not None:
            k, v = shared_kv[self.kv_source]
        else:
            if self.k_eq_v:
                v = k  # (normalised as V, before the K norm and rope)
            v = self.v_norm(v.reshape(t, self.num_kv_heads, self.head_dim))
            k = rotary.apply(self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)),
                             cos, sin)
            if self.stores_kv:
                shared_kv[self.layer_idx] = (k, v)
        return self.o_proj(self.attn(q, k, v, meta))


class Gemma4Router(nn.Module):
    """HF's Gemma4TextRouter: RMS-normalised input (no weight) x scale / sqrt(hidden),
    a linear map to expert scores, softmax in fp32, top-k renormalised to sum to 1, then
    each chosen weight times its expert's `per_expert_scale`."""

    def __init__(self, c: Gemma4Config):
        super().__init__()
        self.top_k = c.top_k_experts
        self.root_size = c.hidden_size ** -0.5
        self.norm = Gemma4RMSNorm(c.hidden_size, c.rms_norm_eps, with_scale=False)
        self.proj = Linear(c.hidden_size, c.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(c.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(c.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(x) * self.scale * self.root_size
        probs = torch.softmax(self.proj(h), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * self.per_expert_scale[ids]).to(x.dtype), ids


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, c: Gemma4Config, i: int):
        super().__init__()
        self.kind = c.layer_types[i]
        eps = c.rms_norm_eps
        self.input_layernorm = Gemma4RMSNorm(c.hidden_size, eps)
        self.self_attn = Gemma4Attention(c, i)
        self.post_attention_layernorm = Gemma4RMSNorm(c.hidden_size, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(c.hidden_size, eps)
        # use_double_wide_mlp: the KV-shared layers' MLPs are twice as wide.
        wide = c.use_double_wide_mlp and c.kv_source[i] is not None
        self.mlp = GeluTanhMLP(c.hidden_size, c.intermediate_size * (2 if wide else 1))
        self.post_feedforward_layernorm = Gemma4RMSNorm(c.hidden_size, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))  # (a buffer in HF: in the checkpoint)
        self.enable_moe_block = c.enable_moe_block
        if self.enable_moe_block:
            # Routed experts beside the dense MLP, both from the attention block's output
            # (HF's names: router, experts, the *_1 / *_2 norms).
            self.router = Gemma4Router(c)
            self.experts = FusedMoE(c.num_experts, c.hidden_size, c.moe_intermediate_size,
                                    activation="gelu_tanh")
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(c.hidden_size, eps)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(c.hidden_size, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(c.hidden_size, eps)
        self.per_layer_input_gate = None
        if c.per_layer_size:
            # This layer's per-layer input gates a residual branch after the MLP.
            self.per_layer_input_gate = Linear(c.hidden_size, c.per_layer_size, bias=False)
            self.per_layer_projection = Linear(c.per_layer_size, c.hidden_size, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(c.hidden_size, eps)

    def forward(self, x, cos, sin, rotary, meta, shared_kv: dict, per_layer_input=None):
        h = self.self_attn(self.input_layernorm(x), cos, sin, rotary, meta, shared_kv)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.enable_moe_block:
            weights, ids = self.router(x)
            routed = self.experts(self.pre_feedforward_layernorm_2(x), weights, ids)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(h)
        if self.per_layer_input_gate is not None:
            g = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar


class PerLayerInputs(nn.Module):
    """Each token's per-layer inputs [T, num_layers, P] (HF's PLE): its own row of the
    packed embedding `embed_tokens_per_layer` (x sqrt(P)), plus a projection of its
    scaled token embedding (x hidden^-0.5, RMS-normalised per layer), the sum scaled
    by 2^-0.5. A function of the row's token id alone: chunked prefill and decode rows
    compute theirs from the step's input_ids."""

    def __init__(self, c: Gemma4Config):
        super().__init__()
        self.num_layers, self.size = c.num_layers, c.per_layer_size
        self.embed_tokens_per_layer = nn.Embedding(c.per_layer_vocab, c.num_layers * self.size)
        self.embed_scale = self.size ** 0.5
        self.per_layer_model_projection = Linear(c.hidden_size, c.num_layers * self.size,
                                                 bias=False)
        self.projection_scale = c.hidden_size ** -0.5
        self.per_layer_projection_norm = Gemma4RMSNorm(self.size, c.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[0]
        tok = self.embed_tokens_per_layer(input_ids)
        # HF multiplies by the scale cast to the weights' dtype (as the main embedding).
        tok = tok * torch.tensor(self.embed_scale, dtype=tok.dtype)
        proj = self.per_layer_model_projection(embeds) * self.projection_scale
        proj = self.per_layer_projection_norm(proj.view(t, self.num_layers, self.size))
        return (proj + tok.view(t, self.num_layers, self.size)) * 2.0 ** -0.5


class Gemma4ForCausalLM(Gemma3ForCausalLM):
    """Gemma 3's model (logits) over Gemma 4's layers, norm, rope tables and per-layer
    inputs."""

    # ---- tensor parallelism: the global layers' own KV head counts ----------------
    @classmethod
    def tp_layer_kv_heads(cls, hf_config: dict) -> list[int] | None:
        """Each layer's KV head count where layers differ (the global layers' own:
        per_layer_config, or num_global_key_value_heads); None: one count for all."""
        if not (hf_config.get("per_layer_config") or hf_config.get("global_head_dim")):
            return None
        return Gemma4Config(hf_config).kv_heads

    @classmethod
    def tp_rank_config(cls, c: dict, size: int) -> None:
        """A rank's config (models/tensor_parallel.py rank_config): the global layers'
        KV heads split, or replicated when fewer than ranks; head_dim is per head."""
        if c.get("num_global_key_value_heads"):
            c["num_global_key_value_heads"] = max(1, c["num_global_key_value_heads"] // size)
        if c.get("per_layer_config"):
            c["per_layer_config"] = {
                k: dict(v, num_key_value_heads=max(1, v["num_key_value_heads"] // size))
                if v.get("num_key_value_heads") else v
                for k, v in c["per_layer_config"].items()}

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
        # (checkpoint names model.embed_tokens_per_layer etc.: map_checkpoint)
        self.per_layer = PerLayerInputs(c) if c.per_layer_size else None
        self._add_head(c)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        per_layer = self.per_layer(input_ids, x) if self.per_layer is not None else None
        cos_sin = {kind: rot.cos_sin(positions, x.dtype) for kind, rot in self.rotary.items()}
        if (self.decode_layers is not None and not self.aux_layer_ids
                and self.decode_layers.applies(x, meta)):
            # The same operations as the layers below, called from C++ (one whole-model
            # call: with a drafter's taps the layers run one by one).
            return self.norm(self.decode_layers(x, cos_sin, meta, per_layer))
        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # this step's K/V by layer

        def step(i, h):
            layer = self.layers[i]
            cos, sin = cos_sin[layer.kind]
            return layer(h, cos, sin, self.rotary[layer.kind], meta, shared_kv,
                         per_layer[:, i] if per_layer is not None else None)
        return self.run_layers(x, step, self.norm)

    PER_LAYER_NAMES = ("embed_tokens_per_layer.", "per_layer_model_projection.",
                       "per_layer_projection_norm.")

    def map_checkpoint(self, name: str, tensor: torch.Tensor):
        """The per-layer input tables live in `per_layer`. Layers without some of q/k/v
        get empty shards, so the packed qkv_proj completes with their rows only: a k = v
        layer's v_proj (after its k_proj); a KV-shared layer's k_proj and v_proj (after
        its q_proj; the ones a checkpoint may still carry are dropped, with their
        norms)."""
        if name.startswith(tuple("model." + n for n in self.PER_LAYER_NAMES)):
            name = "model.per_layer." + name[len("model."):]
        i = int(name.split("layers.")[1].split(".")[0]) if ".layers." in name else None
        shared = i is not None and self.config.kv_source[i] is not None
        proj = name.rsplit(".", 2)[-2] if ".self_attn." in name else None
        if shared and proj in ("k_proj", "v_proj", "k_norm", "v_norm"):
            return
        yield name, tensor
        if proj == "q_proj" and shared:
            yield name.replace("q_proj", "k_proj"), tensor[:0]
            yield name.replace("q_proj", "v_proj"), tensor[:0]
        elif proj == "k_proj" and self.config.k_eq_v(i):
            yield name.replace("k_proj", "v_proj"), tensor[:0]

    def set_decode_layers(self, ops, max_rows: int) -> None:
        """The CPU platform's decision, at load: a dense model's decode steps run every
        layer in one native call (Gemma4DecodeLayers); MoE models keep their layers."""
        loop = None
        if ops is not None and hasattr(ops, "gemma4_decode_layers"):
            loop = Gemma4DecodeLayers(self, ops, max_rows)
        self.decode_layers = loop if loop is not None and loop.supported else None


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The text model of a Gemma 4 vision(-audio)-language checkpoint, as the hub ships
    every Gemma 4 (images and audio are not supported): model.language_model.* is
    loaded, the towers and their embedders are skipped. As HF does, an image / video /
    audio placeholder id in a prompt is embedded as the pad token."""

    TOWERS = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.",
              "model.embed_audio.")

    def __init__(self, hf_config: dict):
        super().__init__(hf_config)
        self.pad_token_id = hf_config.get("pad_token_id")
        ids = [hf_config.get(k) for k in ("image_token_id", "video_token_id", "audio_token_id")]
        ids = [i for i in ids if isinstance(i, int) and 0 <= i < self.config.vocab_size]
        self.register_buffer("placeholder_ids", torch.tensor(ids, dtype=torch.long),
                             persistent=False)
        logger.info("Gemma 4 vision-language checkpoint: loading the text model only "
                    "(the vision / audio towers' weights are skipped)")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if self.pad_token_id is not None and self.placeholder_ids.numel():
            input_ids = torch.where(torch.isin(input_ids, self.placeholder_ids),
                                    self.pad_token_id, input_ids)
        return super().forward(input_ids, positions, meta)

    def map_checkpoint(self, name: str, tensor: torch.Tensor):
        if name.startswith(self.TOWERS):
            return
        yield from super().map_checkpoint(text_model_name(name), tensor)
