"""All decoder layers of a Gemma 3 (or dense Gemma 4) model in one native call, for
decode steps.

The Gemma counterpart of decode_layers.py (kernels/cpu_gemma_decode_layers.cpp):
the same kernel calls as the Python layers of tokenmill/models/gemma3.py make
with the native kernels, so the residual stream is bit-identical to theirs.
Gemma's layers are several KV cache groups (local layers slide, global ones do
not, and the groups are cut to one layer's size), so each layer reads its own
group's slot mapping and decode block table, its kind's rope table and its own
window; the loop gets them per step as lists (`tables`, `ropes`) plus, per layer,
indices into them (`layer_info`: group, rope kind, window).
"""
from __future__ import annotations

import torch

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.models.layers.decode_layers import _bias, _packed, packed_dtype


class GemmaDecodeLayers:
    def __init__(self, model, ops, max_rows: int):
        self.model = model
        self.ops = ops
        self.max_rows = max_rows
        self.num_calls = 0  # decode steps it ran (the tests' proof of the path taken)
        c = model.config
        self.kinds = list(model.rotary.keys())
        self.dims = [c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size,
                     c.intermediate_size]
        self.eps = c.rms_norm_eps
        first = model.layers[0].self_attn
        self.scale = first.attn.scale
        self.softcap = first.attn.logit_softcap or 0.0
        self.dtype = torch.float32 if packed_dtype(first.qkv_proj) == torch.float32 \
            else torch.bfloat16
        self.supported = all(self._layer_supported(layer) for layer in model.layers)
        self._weights: list[torch.Tensor] | None = None
        self._bound = None  # the first layer's KV cache the tensors were gathered for
        self._group_ids: list[int] = []
        self._info: list[int] = []

    def _layer_supported(self, layer) -> bool:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        return (all(packed_dtype(lin) == self.dtype for lin in linears)
                and mlp.gate_up_proj.bias is None and mlp.down_proj.bias is None
                and attn.head_dim == self.dims[2] and attn.attn.scale == self.scale
                and (attn.attn.logit_softcap or 0.0) == self.softcap)

    def applies(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A decode-only step on CPU whose rows the packed linears take."""
        return (not meta.prefills and meta.state is None
                and meta.num_decodes == x.shape[0] and x.dtype == self.dtype
                and x.shape[0] <= self.max_rows and self._bind())

    def _bind(self) -> bool:
        """Gather the layer tensors (again after the runner binds new KV caches); False
        when a layer has no cache in the activations' dtype."""
        layers = self.model.layers
        attn0 = layers[0].self_attn.attn
        if self._bound is attn0.kv_cache and self._weights is not None:
            return True
        self._weights, self._bound = None, attn0.kv_cache
        caches = [layer.self_attn.attn.kv_cache for layer in layers]
        if any(c is None or c.dtype != self.dtype for c in caches):
            return False
        groups = [layer.self_attn.attn.kv_group for layer in layers]
        self._group_ids = sorted({g for g in groups if g is not None}) or [None]
        info, out = [], []
        for layer, g in zip(layers, groups):
            info += self._layer_info(layer, self._group_ids.index(g))
            out += self._layer_tensors(layer)
        self._info, self._weights = info, out
        return True

    def _layer_info(self, layer, group: int) -> list[int]:
        return [group, self.kinds.index(layer.kind), layer.self_attn.attn.sliding_window or 0]

    def _layer_tensors(self, layer) -> list[torch.Tensor]:
        attn, mlp = layer.self_attn, layer.mlp
        return [layer.input_layernorm.folded_weight(),
                _packed(attn.qkv_proj), _bias(attn.qkv_proj, torch.empty(0)),
                attn.q_norm.folded_weight(), attn.k_norm.folded_weight(),
                attn.attn.kv_cache,
                _packed(attn.o_proj), _bias(attn.o_proj, torch.empty(0)),
                layer.post_attention_layernorm.folded_weight(),
                layer.pre_feedforward_layernorm.folded_weight(),
                _packed(mlp.gate_up_proj), _packed(mlp.down_proj),
                layer.post_feedforward_layernorm.folded_weight()]

    def _tables(self, meta: AttentionMetadata) -> list[torch.Tensor]:
        tables = []
        for gid in self._group_ids:
            m = meta.for_group(gid)
            tables += [m.slot_block, m.slot_offset, m.decode_block_table, m.decode_seq_lens]
        return tables

    def __call__(self, x: torch.Tensor, cos_sin: dict, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden]: the residual stream, updated in place through every layer."""
        ropes = [t for kind in self.kinds for t in cos_sin[kind]]
        self.num_calls += 1
        return self.ops.gemma_decode_layers(x, self._weights, self._info, self.dims, self.eps,
                                            self.scale, self.softcap, ropes,
                                            self._tables(meta))


class Gemma4DecodeLayers(GemmaDecodeLayers):
    """The same for a dense Gemma 4 (kernels/cpu_gemma4_decode_layers.cpp): per layer its
    own head_dim, KV heads and MLP width, k = v, KV sharing (the layer's cache is its
    source's, bound by the runner; no write), its per-layer input branch and
    layer_scalar. Gemma 4's norms and rope are ATen ops there, as in the Python layers.
    MoE layers are not in the loop: such a model is not `supported`."""

    def __init__(self, model, ops, max_rows: int):
        self.model = model
        self.ops = ops
        self.max_rows = max_rows
        self.num_calls = 0
        c = model.config
        self.kinds = list(model.rotary.keys())
        self.num_heads = c.num_heads
        self.eps = c.rms_norm_eps
        self.dtype = torch.float32 if packed_dtype(model.layers[0].self_attn.qkv_proj) \
            == torch.float32 else torch.bfloat16
        self.supported = all(self._layer_supported(layer) for layer in model.layers)
        self._weights, self._bound = None, None
        self._group_ids, self._info = [], []

    def _layer_supported(self, layer) -> bool:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        if layer.per_layer_input_gate is not None:
            linears += [layer.per_layer_input_gate, layer.per_layer_projection]
        return (not layer.enable_moe_block
                and all(packed_dtype(lin) == self.dtype for lin in linears)
                and all(lin.bias is None for lin in linears[2:])
                and attn.attn.scale == 1.0 and attn.attn.logit_softcap is None)

    def _layer_info(self, layer, group: int) -> list[int]:
        attn = layer.self_attn
        return super()._layer_info(layer, group) + [
            attn.num_kv_heads, attn.head_dim, layer.mlp.intermediate_size, int(attn.k_eq_v),
            int(attn.kv_source is not None), int(layer.per_layer_input_gate is not None)]

    def _layer_tensors(self, layer) -> list[torch.Tensor]:
        attn, mlp, none = layer.self_attn, layer.mlp, torch.empty(0)
        ple = layer.per_layer_input_gate is not None
        return [layer.input_layernorm.weight,
                _packed(attn.qkv_proj), _bias(attn.qkv_proj, none),
                attn.q_norm.weight,
                attn.k_norm.weight if attn.kv_source is None else none,
                attn.attn.kv_cache,
                _packed(attn.o_proj), _bias(attn.o_proj, none),
                layer.post_attention_layernorm.weight,
                layer.pre_feedforward_layernorm.weight,
                _packed(mlp.gate_up_proj), _packed(mlp.down_proj),
                layer.post_feedforward_layernorm.weight,
                _packed(layer.per_layer_input_gate) if ple else none,
                _packed(layer.per_layer_projection) if ple else none,
                layer.post_per_layer_input_norm.weight if ple else none,
                layer.layer_scalar]

    def __call__(self, x: torch.Tensor, cos_sin: dict, meta: AttentionMetadata,
                 per_layer: torch.Tensor | None = None) -> torch.Tensor:
        ropes = [t for kind in self.kinds for t in cos_sin[kind]]
        self.num_calls += 1
        return self.ops.gemma4_decode_layers(
            x, self._weights, self._info, self.num_heads, self.eps,
            per_layer if per_layer is not None else torch.empty(0), ropes,
            self._tables(meta))
