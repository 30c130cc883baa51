"""Per-layer FP8 KV cache scales read from a checkpoint.

FP8 checkpoints (quant_method fp8 with a calibrated KV cache, compressed-tensors with a
`kv_cache_scheme`) carry one float per attention layer for its keys and one for its
values: the fp8 cache stores K / k_scale and V / v_scale, and attention multiplies
them back. They are published under several names:

    model.layers.N.self_attn.k_scale / v_scale           (llm-compressor, ModelOpt)
    model.layers.N.self_attn.kv_scale                    (one scale for both: older AutoFP8)
    model.layers.N.self_attn.attn.k_scale / v_scale      (vLLM's own module path)
    model.layers.N.self_attn.k_proj.output_scale / v_proj.output_scale
                                                         (older compressed-tensors)

`KVScales.take` recognises them while the loader walks the checkpoint and keeps their
values; `apply` sets them on each layer's PagedAttention (`k_scale`, `v_scale`). They
only matter to an fp8 cache: the runner resets them to 1.0 at bind for any other cache
(worker/runner_kv_cache.py), as vLLM does, and says so once.
"""
from __future__ import annotations

import logging
import math

import torch
from torch import nn

from tokenmill.models.checkpoint_io import materialize

logger = logging.getLogger(__name__)

# Checkpoint name tail -> which scale(s) it gives; the module before it is the
# attention module (or its PagedAttention child).
_SUFFIXES = {
    "k_proj.output_scale": ("k",),
    "v_proj.output_scale": ("v",),
    "k_scale": ("k",),
    "v_scale": ("v",),
    "kv_scale": ("k", "v"),
}


def kv_scale_name(name: str) -> tuple[str, tuple[str, ...]] | None:
    """A checkpoint tensor name (after the model's map_checkpoint) -> (the module path it
    belongs to, without "model.", and the scales it gives), or None when it is no KV
    cache scale."""
    for suffix, kinds in _SUFFIXES.items():
        if name.endswith("." + suffix):
            module = name[:-len(suffix) - 1].removeprefix("model.")
            # "k_scale" alone could be anything's; a KV scale sits on an attention module.
            if "attn" in module.rsplit(".", 1)[-1] or suffix.endswith("output_scale"):
                return module, kinds
    return None


def scale_value(name: str, tensor: torch.Tensor) -> float:
    """One per-tensor scale as a float (exactly its fp32 value), or a ValueError naming
    the tensor: several values (per-head / per-channel KV scales are not implemented),
    or not a finite positive number."""
    tensor = materialize(tensor)
    if tensor.numel() != 1:
        raise ValueError(f"KV cache scale {name}: shape {tuple(tensor.shape)}; only one "
                         f"scale per layer (per-tensor) is implemented")
    if not tensor.is_floating_point():
        raise ValueError(f"KV cache scale {name}: dtype {tensor.dtype} is not a float")
    value = float(tensor.detach().reshape(()).to(torch.float32))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"KV cache scale {name} is {value}: it must be a finite positive "
                         f"number")
    return value


class KVScales:
    """The KV cache scales of one checkpoint, collected while it loads."""

    def __init__(self):
        # attention module path -> {"k": (value, tensor name), "v": ...}
        self.found: dict[str, dict[str, tuple[float, str]]] = {}

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Keep `tensor` if it is a KV cache scale (checked); False for any other."""
        hit = kv_scale_name(name)
        if hit is None:
            return False
        module, kinds = hit
        value = scale_value(name, tensor)
        entry = self.found.setdefault(module, {})
        for kind in kinds:
            if kind in entry and entry[kind][0] != value:
                raise ValueError(f"KV cache scale {name} ({value}) disagrees with "
                                 f"{entry[kind][1]} ({entry[kind][0]}) for the same layer")
            entry[kind] = (value, name)
        return True

    def apply(self, model: nn.Module, where: str) -> int:
        """Set each scale on its layer's PagedAttention; -> the number of layers given
        scales. A scale whose module holds no paged attention layer is an error naming it."""
        from tokenmill.models.layers.attention import PagedAttention
        modules = dict(model.named_modules())
        for path, entry in self.found.items():
            module = modules.get(path)
            targets = ([module] if isinstance(module, PagedAttention) else
                       [m for m in module.children() if isinstance(m, PagedAttention)]
                       if module is not None else [])
            if len(targets) != 1:
                name = next(iter(entry.values()))[1]
                raise ValueError(f"{where}: KV cache scale {name} belongs to no paged "
                                 f"attention layer of {type(model).__name__} (module "
                                 f"{path!r}); refusing rather than running without it")
            layer = targets[0]
            if "k" in entry:
                layer.k_scale = entry["k"][0]
            if "v" in entry:
                layer.v_scale = entry["v"][0]
        if self.found:
            logger.info("%s: per-layer KV cache scales for %d attention layers (used with "
                        "--kv-cache-dtype fp8)", where, len(self.found))
        return len(self.found)
