"""All decoder layers of a Qwen3.5 / Qwen3-Next model in one native call, for decode
steps.

The hybrid counterpart of decode_layers.py (kernels/cpu_hybrid_decode_layers.cpp): the
calls the Python layers of tokenmill/models/qwen3_next.py make with the native kernels
(Gated DeltaNet's conv and delta rule over the whole step in place on the rows' state
slots, gated attention over the paged KV cache, the zero-centred norms with the
residual adds folded in), in the same order, so the residual stream is bit-identical
to theirs. A one-row step of the bench model made ~110 calls through nn.Module code.

It serves decode-only steps without a prefix-cache state snapshot: rows that each run
one token in place on their own state slot (`StateMetadata.query_start_loc`), or a
speculative step's verifying rows (`decode_steps`: token j of every row from its read
slot to its write slot, j = 0, 1, ...); bf16 with packed bf16 linears or fp32 with
packed fp32 linears (any linear may be natively quantized instead), the norms native;
MoE layers are not in the loop (such a model is not `supported`). Every other step runs the Python layers, which
stay the model's definition.
"""
from __future__ import annotations

import torch

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.models.layers.decode_layers import _linear_slots, _native_quantized, packed_dtype
from tokenmill.models.layers.gated_deltanet import NATIVE_CONV_MAX_KERNEL
from tokenmill.models.layers.mlp import GatedMLP


class HybridDecodeLayers:
    """The layer tensors of one Qwen3NextForCausalLM, in cpu_hybrid_decode_layers.cpp's
    order."""

    def __init__(self, model, ops, max_rows: int):
        self.model = model
        self.ops = ops
        self.num_calls = 0  # decode steps it ran (the tests' proof of the path taken)
        c = model.config
        layers = model.layers
        self.dims = [c.num_heads, c.num_kv_heads, c.head_dim, model.rotary.rotary_dim,
                     c.hidden_size, c.intermediate_size, c.linear_num_key_heads,
                     c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim]
        self.kinds = [int(layer.is_linear) for layer in layers]
        self.eps = c.rms_norm_eps
        self.scale = c.head_dim ** -0.5
        self.q_scale = c.linear_key_head_dim ** -0.5
        self.dtype = layers[0].input_layernorm.weight.dtype
        self._attn = [layer.self_attn.attn for layer in layers if not layer.is_linear]
        self._mixers = [layer.linear_attn for layer in layers if layer.is_linear]
        self.supported = (self.dtype in (torch.bfloat16, torch.float32)
                          and len({a.kv_group for a in self._attn}) <= 1
                          and all(self._layer_supported(layer) for layer in layers))
        # Rows the loop takes: no more than any of its linears' native kernels do.
        self.max_rows = min([max_rows] + [
            lin.method.max_rows for layer in layers for lin in _linears(layer)
            if _native_quantized(lin) is not None]) if self.supported else 0
        self._weights: tuple[list[torch.Tensor], list[int], list[float]] | None = None
        self._bound: tuple | None = None  # the caches and states the tensors were gathered for

    def _layer_supported(self, layer) -> bool:
        dtype = self.dtype
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if layer.is_linear:
            la = layer.linear_attn
            norms.append(la.norm)
            mixer_ok = (la._native is not None and la._native.conv is not None
                        and la.conv_kernel <= NATIVE_CONV_MAX_KERNEL
                        and la.conv1d.weight.dtype == dtype)
        else:
            attn = layer.self_attn
            norms += [attn.q_norm, attn.k_norm]
            mixer_ok = (attn.attn.sliding_window is None and not attn.attn.logit_softcap
                        and attn.attn.scale == self.scale)
        return (mixer_ok and type(layer.mlp) is GatedMLP
                and all(packed_dtype(lin) == dtype or _native_quantized(lin) is not None
                        for lin in _linears(layer))
                and all(n.weight.dtype == dtype and n.eps == self.eps
                        and n._ops is not None for n in norms))  # (the loop's kernels)

    def applies(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A decode-only step on CPU with every layer's native kernels: rows that each run
        one token in place on their state slot, or a speculative step's rows (one token and
        its drafts each, `StateMetadata.decode_steps`); no state snapshot this step."""
        sm = meta.state
        if (meta.prefills or meta.num_decodes != x.shape[0] or sm is None or sm.prefills
                or sm.decode_snapshots):
            return False
        whole = (sm.decode_steps is not None or (sm.query_start_loc is not None
                 and sm.query_start_loc.numel() == x.shape[0] + 1))
        return (whole and x.dtype == self.dtype and x.shape[0] <= self.max_rows
                and self._bind())

    def _bind(self) -> bool:
        """Gather the layer tensors (again after the runner binds new KV caches or state
        caches); False when a cache or state is not one the loop's kernels take in place
        (the Python layers then fall back to PyTorch for it, and so must the step)."""
        key = (tuple(a.kv_cache for a in self._attn[:1]),
               tuple(m.state for m in self._mixers[:1]))
        if self._bound is not None and all(
                a is b for a, b in zip(key[0] + key[1], self._bound[0] + self._bound[1])):
            return self._weights is not None
        self._bound, self._weights = key, None
        caches = [a.kv_cache for a in self._attn]
        if any(c is None for c in caches) or len({c.dtype for c in caches}) > 1:
            return False
        if caches and caches[0].dtype not in (self.dtype, torch.float8_e4m3fn):
            return False
        for m in self._mixers:
            if m.state is None or m.state[0].dtype != self.dtype \
                    or m.state[1].dtype != torch.float32:
                return False
        self._weights = self._gather()
        return True

    def _gather(self) -> tuple[list[torch.Tensor], list[int], list[float]]:
        none = torch.empty(0)
        out, quant, scales = [], [], []
        for layer in self.model.layers:
            if layer.is_linear:
                la = layer.linear_attn
                mix_in, mix_out = _linear_slots(la.in_proj, none), _linear_slots(la.out_proj, none)
                extra = [la.conv1d.weight[:, 0, :], la.A_log, la.dt_bias, la.norm.weight,
                         *la.state]
                scales += [1.0, 1.0]
            else:
                attn = layer.self_attn
                mix_in, mix_out = (_linear_slots(attn.qkv_proj, none),
                                   _linear_slots(attn.o_proj, none))
                extra = [attn.q_norm.weight, attn.k_norm.weight, attn.attn.kv_cache,
                         none, none, none]
                scales += [float(attn.attn.impl.k_scale), float(attn.attn.impl.v_scale)]
            mlp = layer.mlp
            gate_up, down = _linear_slots(mlp.gate_up_proj, none), _linear_slots(mlp.down_proj, none)
            out += [layer.input_layernorm.weight, *mix_in[0], *extra, *mix_out[0],
                    layer.post_attention_layernorm.weight, *gate_up[0], *down[0]]
            quant += [*mix_in[1], *mix_out[1], *gate_up[1], *down[1]]
        return out, quant, [] if all(s == 1.0 for s in scales) else scales

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden]: the residual stream, updated in place through every layer."""
        weights, quant, scales = self._weights
        m = meta.for_group(self._attn[0].kv_group) if self._attn else meta
        sm = meta.state
        none = torch.empty(0)
        self.num_calls += 1
        return self.ops.hybrid_decode_layers(
            x, weights, self.kinds, self.dims, quant, self.eps, self.scale, self.q_scale,
            cos, sin, m.slot_block, m.slot_offset,
            *((m.decode_block_table, m.decode_seq_lens) if self._attn else (none, none)),
            *((none, none) if sm.query_start_loc is None
              else (sm.query_start_loc, sm.state_indices)),
            scales, [t for step in sm.decode_steps or () for t in step])


def _linears(layer) -> tuple:
    """A hybrid layer's four linears: its token mixer's in and out projections, the MLP's."""
    mix = layer.linear_attn if layer.is_linear else layer.self_attn
    ins, outs = ((mix.in_proj, mix.out_proj) if layer.is_linear
                 else (mix.qkv_proj, mix.o_proj))
    return ins, outs, layer.mlp.gate_up_proj, layer.mlp.down_proj
