"""All decoder layers of a Llama-family model in one native call, for decode steps.

At batch 1 a decode step runs about a dozen native kernels per layer; reaching
each through nn.Module calls costs about as much time as the kernels. Where
every layer would take the native path anyway (bf16 activations with packed bf16
linears and native norms, or fp32 activations with packed fp32 linears and
PyTorch's fp32 rms_norm; any linear may instead be quantized with the native
`linear_quant` kernel: GPTQ / AWQ / compressed-tensors integers, FP8, --quantization
int8 / fp8; native
attention and KV writes), `kernels/cpu_decode_layers.cpp`
makes the same kernel calls in the same order from C++: the output is
bit-identical to the Python layers, which stay the model's definition (and run
every other step: prefill, fp32, MoE, or no native kernels).

Whether a model gets one is the CPU platform's decision (tokenmill/platforms/cpu.py,
engine argument `decode_layers`): it builds it at load, after packing the weights.
"""
from __future__ import annotations

import torch

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.models.layers.mlp import GatedMLP


class DecodeLayers:
    """The layer tensors of one LlamaForCausalLM, in cpu_decode_layers.cpp's order."""

    def __init__(self, model, ops, max_rows: int):
        """`ops`: the kernels module with `decode_layers`; steps of up to `max_rows` rows
        (the packed linears' limit; quantized linears' own native limit may be lower)
        take it."""
        self.model = model
        self.ops = ops
        self._weights: list[torch.Tensor] | None = None
        self._checked_cache, self._cache_dtype = None, None
        self._kv_scales: list[float] = []  # (k_scale, v_scale) per layer, or [] (all 1.0)
        # Looked up once: nn.Module attribute access costs a few microseconds a step.
        self._first_attn = model.layers[0].self_attn.attn
        self.num_layers = len(model.layers)
        c = model.config
        self.dims = [c.num_heads, c.num_kv_heads, c.head_dim, model.rotary.rotary_dim,
                     c.hidden_size, c.intermediate_size]
        # Each layer's sliding window (None: full attention), the kernel's 7th dim.
        self.windows = [layer.self_attn.attn.sliding_window for layer in model.layers]
        # Runs of consecutive layers in one KV cache group: (start, end, group, window),
        # one native call each (a model with one group: a single run). Built at bind.
        self._runs: list[tuple[int, int, int | None, int | None]] = []
        self.eps = c.rms_norm_eps
        self.scale = c.head_dim ** -0.5
        # The activations' dtype the loop serves (the norms' weights are the model's):
        # bf16 (packed bf16 linears) or fp32 (packed fp32 linears).
        self.dtype = model.layers[0].input_layernorm.weight.dtype
        self.supported = (self.dtype in (torch.bfloat16, torch.float32)
                          and all(self._layer_supported(layer, self.dtype)
                                  for layer in model.layers))
        # Rows the loop takes: no more than any of its linears' native kernels do.
        self.max_rows = min([max_rows] + [
            lin.method.max_rows for layer in model.layers for lin in _linears(layer)
            if lin is not None and _native_quantized(lin) is not None])

    @staticmethod
    def _layer_supported(layer, dtype: torch.dtype) -> bool:
        attn, mlp = layer.self_attn, layer.mlp
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if attn.q_norm is not None:
            norms += [attn.q_norm, attn.k_norm]
        return (type(mlp) is GatedMLP
                and all(lin is not None and (packed_dtype(lin) == dtype
                                             or _native_quantized(lin) is not None)
                        for lin in _linears(layer))
                and all(n.weight.dtype == dtype and n.eps == layer.input_layernorm.eps
                        for n in norms))

    def applies(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A decode-only step on CPU where every layer would take its native path (the
        platform builds the loop only where the layers' attention is the CPU native
        backend, whose kernels the loop calls itself)."""
        return (not meta.prefills and meta.state is None
                and meta.num_decodes == x.shape[0]
                and x.dtype == self.dtype and x.shape[0] <= self.max_rows
                and self._caches_ok(x.dtype))

    def _caches_ok(self, dtype: torch.dtype) -> bool:
        """Every layer has a KV cache in the activations' dtype, or every one an fp8
        (float8_e4m3fn) cache, which the loop's kv_cache_write / paged_decode convert as
        the Python layers' calls do (checked once per binding: every step after it costs
        one identity test)."""
        first = self._first_attn.kv_cache
        if self._checked_cache is not first:
            self._checked_cache, self._cache_dtype = first, None
            self._weights = None  # new caches: gather the layer tensors again
            caches = [layer.self_attn.attn.kv_cache for layer in self.model.layers]
            if all(c is not None for c in caches) and len({c.dtype for c in caches}) == 1:
                self._cache_dtype = first.dtype
            self._runs = []
            for i, layer in enumerate(self.model.layers):
                key = (layer.self_attn.attn.kv_group, self.windows[i])
                if self._runs and self._runs[-1][2:] == key:
                    self._runs[-1] = (self._runs[-1][0], i + 1) + key
                else:
                    self._runs.append((i, i + 1) + key)
        return self._cache_dtype in (dtype, torch.float8_e4m3fn)

    def weights(self) -> tuple[list[torch.Tensor], list[int]]:
        """The layers' tensors and their linears' (bits, group size) (`quant`), in
        cpu_decode_layers.cpp's order, and (in `_kv_scales`) their fp8 caches' scales.
        Gathered once; again after the runner binds new KV caches (see _caches_ok)."""
        if self._weights is None:
            none = torch.empty(0)
            out, quant = [], []
            for layer in self.model.layers:
                attn = layer.self_attn
                qkv, o, gate_up, down = (_linear_slots(lin, none) for lin in _linears(layer))
                out += [layer.input_layernorm.weight, *qkv[0],
                        attn.q_norm.weight if attn.q_norm is not None else none,
                        attn.k_norm.weight if attn.k_norm is not None else none,
                        attn.attn.kv_cache, *o[0],
                        layer.post_attention_layernorm.weight, *gate_up[0], *down[0]]
                quant += [*qkv[1], *o[1], *gate_up[1], *down[1]]
            # Each layer's fp8 cache scales, as its bound implementation uses them.
            scales = [float(s) for layer in self.model.layers
                      for s in (layer.self_attn.attn.impl.k_scale,
                                layer.self_attn.attn.impl.v_scale)]
            self._kv_scales = [] if all(s == 1.0 for s in scales) else scales
            self._weights = out, quant
        return self._weights

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 meta: AttentionMetadata, start: int = 0, end: int | None = None,
                 taps: torch.Tensor | None = None, tap_ids: tuple[int, ...] = ()
                 ) -> torch.Tensor:
        """x [T, hidden]: the residual stream, updated in place through layers
        [start, end) (default: all). `taps` [T, len(tap_ids) * hidden]: column block j
        gets the stream entering layer tap_ids[j] (a drafter's taps, models/layers/
        taps.py; ids outside [start, end) are left alone). Layers of several KV cache
        groups (Qwen2 sliding above max_window_layers): one call per run of
        consecutive layers in one group, with its tables."""
        weights, quant = self.weights()
        scales = self._kv_scales
        num_layers = self.num_layers
        per_layer = len(weights) // num_layers
        quant_per_layer = len(quant) // num_layers
        end = num_layers if end is None else end
        tap_kw = {}  # (a step without taps passes none: the kernel's defaults)
        for r0, r1, group, window in self._runs:
            lo, hi = max(r0, start), min(r1, end)
            if lo >= hi:
                continue
            m = meta.for_group(group)
            dims = self.dims if window is None else self.dims + [window]
            if taps is not None:
                tap_kw = dict(taps=taps, tap_layers=[i - lo if lo <= i < hi else -1
                                                     for i in tap_ids])
            x = self.ops.decode_layers(
                x, weights[lo * per_layer:hi * per_layer], dims,
                quant[lo * quant_per_layer:hi * quant_per_layer], self.eps, self.scale, cos,
                sin, m.slot_block, m.slot_offset, m.decode_block_table, m.decode_seq_lens,
                scales[2 * lo:2 * hi], **tap_kw)
        return x


def packed_dtype(linear) -> torch.dtype | None:
    """The native packed layout a Linear's method keeps (layers/linear_methods/
    cpu_packed.py: bf16 or fp32), or None."""
    return linear.method.packed_dtype


def _linears(layer) -> tuple:
    """A decoder layer's four linears (None where its MLP has no such one)."""
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None),
            getattr(mlp, "down_proj", None))


def _native_quantized(linear):
    """The packed quantized weights (quantized_cpu.PackedQuantizedWeight) a linear's
    method multiplies with `linear_quant` at decode sizes, or None: no native kernel, or
    one that would not run in fp32 (the method's widened dtype)."""
    method = linear.method
    packed = getattr(method, "packed", None)
    if packed is None or getattr(method, "max_rows", 0) <= 0:
        return None
    return packed if method.compute_dtype in (None, torch.float32) else None


def _linear_slots(linear, none: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
    """One linear's LINEAR_SLOTS tensors (weight, scales, zeros, perm, bias) and its
    (kind, group size): linear_quant's `bits` (4, 8 or ops.QUANT_E4M3), 0 for a packed
    float linear."""
    bias = _bias(linear, none)
    q = _native_quantized(linear)
    if q is None:
        return [_packed(linear), none, none, none, bias], [0, 0]
    perm = q.perm if q.perm is not None else none
    return [q.codes, q.scales, q.zeros, perm, bias], [q.kind, q.group_size]


def _packed(linear) -> torch.Tensor:
    return linear.method.packed_weight


def _bias(linear, none: torch.Tensor) -> torch.Tensor:
    return linear.bias if linear.bias is not None else none
