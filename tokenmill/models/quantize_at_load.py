"""Quantization at load (`--quantization int8|fp8`, vLLM's flag): an unquantized
(bf16 / fp16 / fp32) checkpoint's weights quantized once, after loading, so the
resident weights are the quantized ones.

- "int8": per-channel symmetric int8 weights (one fp32 scale per output row),
  `Int8AtLoadLinearMethod` / `Int8AtLoadFusedMoEMethod` (layers/linear_methods/
  int8_at_load.py);
- "fp8": per-channel e4m3 weights (scale = max|w[n]| / 448 per output row), through
  the block-scaled fp8 methods with one-row blocks spanning the row
  (`per_channel_block`): the layout of per-channel fp8 checkpoints, so one path
  serves both. Per-channel rather than [128, 128] blocks: e4m3 is a floating format
  (3 mantissa bits whatever the magnitude), so a finer scale buys little accuracy,
  while one scale per row is what an int8 / fp8 GEMV kernel applies once per output
  and needs no shape condition (a [128, 128] block would want N and K multiples of
  128 for fused shards and experts).

Activations stay in the model's dtype (W8A16), so the result is exactly that of the
dequantized weights. Quantized: every dense `Linear` but the lm_head, a weight tied to
another module (the embedding) and an MoE router; every `FusedMoE`'s experts. The
embeddings, norms and convolutions stay as loaded.

`resolve_quantization` checks the flag against the checkpoint (models/quantization.py
reads its quantization_config) before anything is loaded; `quantize_model` runs in
models/loader.py `load_model` after `load_weights`, before the platform chooses the
kernels (`prepare_model`).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.linear_methods.fp8 import (FP8_DTYPE, Fp8BlockFusedMoEMethod,
                                                        Fp8BlockLinearMethod,
                                                        per_channel_block)
from tokenmill.models.layers.linear_methods.int8_at_load import (Int8AtLoadFusedMoEMethod,
                                                                 Int8AtLoadLinearMethod)
from tokenmill.models.layers.moe import FusedMoE
from tokenmill.models.quantization import QUANTIZE_AT_LOAD as AT_LOAD
from tokenmill.models.quantization import quantization_method

logger = logging.getLogger(__name__)

FP8_MAX = 448.0  # the largest finite e4m3 value


def resolve_quantization(quantization: str | None, hf_config: dict,
                         where: str) -> str | None:
    """The method to quantize with at load (`quantization` against the checkpoint), or
    None: not asked, or the checkpoint is quantized with that method already (as vLLM,
    naming the checkpoint's own method is fine). Raises ValueError naming both for a
    quantized checkpoint and another method, and an unknown method by name."""
    if quantization is None:
        return None
    if not isinstance(quantization, str) or not quantization:
        raise ValueError(f"quantization must be a method name or None, got {quantization!r}")
    asked = quantization.lower()
    found = quantization_method(hf_config, where)
    if found is not None:
        key, method = found
        if method.lower() == asked:
            return None
        raise ValueError(f"{where} is quantized with {method!r} ({key}) but quantization "
                         f"{quantization!r} was asked for: a quantized checkpoint runs in "
                         f"its own format (pass quantization={method!r} or none)")
    if asked not in AT_LOAD:
        raise ValueError(f"quantization {quantization!r} is not a method tokenmill applies to "
                         f"an unquantized checkpoint (it quantizes at load with: "
                         f"{', '.join(AT_LOAD)}; other methods load from checkpoints "
                         f"quantized with them)")
    return asked


def _skipped_linears(model: nn.Module) -> set[int]:
    """ids of the Linears left as loaded: the lm_head, weights held by more than one
    module (tied to the embedding), MoE routers (a block's `gate` / `shared_expert_gate`
    beside its `FusedMoE`, a router module's projection)."""
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    skip = set()
    for name, module in model.named_modules():
        children = dict(module.named_children())
        is_moe_block = any(isinstance(c, FusedMoE) for c in children.values())
        is_router = "router" in type(module).__name__.lower()
        for leaf, child in children.items():
            if not isinstance(child, Linear):
                continue
            tied = uses.get(id(getattr(child, "weight", None)), 0) > 1
            if (leaf == "lm_head" or tied or is_router
                    or (is_moe_block and leaf in ("gate", "shared_expert_gate"))):
                skip.add(id(child))
    return skip


def row_amax(w: torch.Tensor, tp_group=None) -> torch.Tensor:
    """[..., N, 1] fp32 max |w| of each row of w [..., N, K]; with `tp_group`, over the
    whole row that the ranks' shares make up (a row-parallel layer)."""
    amax = w.detach().abs().amax(dim=-1, keepdim=True).float()
    return amax if tp_group is None else tp_group.all_reduce_max(amax)


def fp8_per_channel(w: torch.Tensor,
                    amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], fp32 scale [N, 1]): scale = max|w[n]| /
    448 (a zero row: 1), w8 = w / scale, rounded to nearest. `amax` [N, 1]: the whole
    rows' max |w| where w is a share of each row (row_amax)."""
    wf = w.detach().float()
    if amax is None:
        amax = wf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # (w itself untouched)
    return q, scale


def _quantize_linear_fp8(layer: Linear, amax: torch.Tensor | None = None) -> None:
    w, bias = layer.weight.detach(), layer.bias
    q, scale = fp8_per_channel(w, amax)
    del w
    # The fp8 method registers its e4m3 weight and scales (and a zero bias: the
    # loaded one is put back), on the device the weights were loaded to.
    with torch.device(q.device):
        layer.use_method(Fp8BlockLinearMethod(per_channel_block(layer.in_features),
                                              per_channel=True),
                         layer.weight.dtype)
    layer.bias = bias
    with torch.no_grad():
        layer.weight.copy_(q)
        layer.weight_scale_inv.copy_(scale)


def _quantize_experts_fp8(layer: FusedMoE, amax: dict[str, torch.Tensor]) -> None:
    loaded = {name: getattr(layer, name).detach() for name in ("gate_up_proj", "down_proj")}
    with torch.device(loaded["gate_up_proj"].device):
        layer.use_method(Fp8BlockFusedMoEMethod(per_channel_block(layer.hidden_size,
                                                                  layer.intermediate_size),
                                                per_channel=True),
                         loaded["gate_up_proj"].dtype)
    with torch.no_grad():
        for name, w in loaded.items():
            for e in range(w.shape[0]):  # one expert at a time: a small fp32 transient
                q, scale = fp8_per_channel(w[e], amax[name][e] if name in amax else None)
                getattr(layer, name)[e].copy_(q)
                getattr(layer, name + "_scale_inv")[e].copy_(scale)


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (each tensor once, meta tensors not
    counted) plus what the GEMM layers' methods keep beside them: their tensors (packed
    copies, oneDNN-prepacked ones at their element count: oneDNN may pad a little) and
    their weight objects with an `nbytes()` (the integer formats' canonical or
    kernel-packed form), a fallback method's too."""
    seen, total = set(), 0

    def add(t) -> int:
        if id(t) in seen or t.device.type == "meta" or t.layout not in (torch.strided,
                                                                         torch._mkldnn):
            return 0
        seen.add(id(t))
        return t.numel() * t.element_size()

    for t in list(model.parameters()) + list(model.buffers()):
        total += add(t)
    methods = [getattr(m, "method", None) for m in model.modules()]
    while methods:
        method = methods.pop()
        for v in vars(method).values() if method is not None else ():
            if isinstance(v, torch.Tensor):
                total += add(v)
            elif callable(getattr(v, "nbytes", None)) and id(v) not in seen:
                seen.add(id(v))
                total += v.nbytes()
            elif hasattr(v, "apply") and hasattr(v, "describe"):  # a fallback method
                methods.append(v)
    return total


def quantize_model(model: nn.Module, method: str, where: str,
                   tp_group=None) -> tuple[int, int]:
    """Quantize `model`'s loaded weights with `method` ("int8" / "fp8"); returns
    (Linear layers, MoE expert blocks) quantized. One INFO line with the counts and
    the resident weight bytes before and after.

    `tp_group` (tensor parallelism): `model` is this rank's shard. Per-channel scales
    are per output row, so a rank holding whole rows (column-parallel) quantizes them
    as the unsplit model would; a row-parallel layer (and the experts' down_proj)
    holds a share of each row, so its rows' max |w| is taken over the ranks first
    (one all-reduce per such layer, in the same module order on every rank): every
    rank's codes and scales are those of the unsplit model's on its columns."""
    tp = tp_group is not None and tp_group.size > 1
    if method not in AT_LOAD:
        raise ValueError(f"quantization {method!r} is not one applied at load ({AT_LOAD})")
    before = resident_weight_bytes(model)
    skip = _skipped_linears(model)
    linears = experts = 0
    for module in list(model.modules()):
        if isinstance(module, Linear) and id(module) not in skip:
            amax = (row_amax(module.weight, tp_group) if tp and module.tp == "row"
                    else None)
            if method == "int8":
                module.set_method(Int8AtLoadLinearMethod(module.weight.dtype, amax))
            else:
                _quantize_linear_fp8(module, amax)
            linears += 1
        elif isinstance(module, FusedMoE):
            # The experts' down_proj splits its input (intermediate) dim over the ranks.
            amax = {"down_proj": row_amax(module.down_proj, tp_group)} if tp else {}
            if method == "int8":
                Int8AtLoadFusedMoEMethod.quantize_fused_moe(module, amax)
            else:
                _quantize_experts_fp8(module, amax)
            experts += 1
    after = resident_weight_bytes(model)
    logger.info("%s: quantized at load to %s per-channel (activations unquantized): %d Linear "
                "layers, %d MoE expert blocks (the lm_head, embeddings, routers and tied "
                "weights stay); resident weight bytes %d -> %d (%.2fx)", where, method,
                linears, experts, before, after, before / max(after, 1))
    return linears, experts
