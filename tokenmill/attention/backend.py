"""The attention backend interface: what the platform chooses per KV cache spec.

A backend names one set of attention kernels. It says which KV cache specs it takes
(`supports`), makes the metadata builder of a group of such layers (`make_builder`)
and each layer's implementation (`make_impl`), once, when the runner binds the KV
caches. `Platform.attention_backend(spec)` (tokenmill/platforms/interface.py) is
where the choice is made; nothing else looks at which kernels exist.

Two kinds of implementation, by the cache they read:
- `AttentionImpl`, paged K/V ([num_blocks, 2, block_size, Hkv, D]): `write_kv` puts a
  step's K/V at its slots, `forward` attends (decode rows, then prompt chunks);
- `MLAImpl`, MLA's latent rows ([num_blocks, block_size, kv_lora_rank + rope_dim]):
  `write_kv` puts the latents at their slots, `decode` runs the absorbed decode's
  attention in the latent space (the layer does the projections around it and the
  prompt chunks' expanded form, layers/mla.py).
"""
from __future__ import annotations

import torch

from tokenmill.attention.builder import AttentionMetadataBuilder
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.core.kv_cache_spec import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec


# float8_e4m3fn's largest finite value: K/V beyond it (after their layer's scale) are
# stored as +-448 (saturated), never as NaN (--kv-cache-dtype fp8).
FP8_MAX = 448.0


def to_cache_dtype(x: torch.Tensor, cache: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x as the cache stores it: unchanged, or for a float8_e4m3fn cache x / scale (in
    fp32; `scale` the layer's k_scale or v_scale, 1.0 without one) rounded to nearest
    even after saturating at +-448 (what the native and Triton writes store)."""
    if cache.dtype == torch.float8_e4m3fn and x.dtype != cache.dtype:
        if scale != 1.0:
            x = x.float() / scale
        return x.clamp(-FP8_MAX, FP8_MAX).to(cache.dtype)
    return x


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Values read from a cache (gathered blocks) in `dtype`: a float8_e4m3fn cache's
    codes times the layer's scale, in fp32 then rounded to `dtype`."""
    if scale != 1.0 and x.dtype == torch.float8_e4m3fn:
        return (x.float() * scale).to(dtype)
    return x.to(dtype)


def as_cached(x: torch.Tensor, cache: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x as attention reads it back from the cache, in x's dtype: through fp8 and back
    for a float8_e4m3fn cache (so a prompt's own K/V are the values every later read
    sees, whether it runs in one chunk or several, or hits the prefix cache)."""
    if cache.dtype == torch.float8_e4m3fn and x.dtype != cache.dtype:
        return from_cache(to_cache_dtype(x, cache, scale), x.dtype, scale)
    return x


def is_paged_kv(spec) -> bool:
    """A spec of K and V pages (full or sliding-window attention)."""
    return isinstance(spec, (FullAttentionSpec, SlidingWindowSpec))


def is_mla(spec) -> bool:
    return isinstance(spec, MLAAttentionSpec)


class AttentionImpl:
    """One paged-attention layer's kernels; its shape copied from the layer at bind."""

    def __init__(self, layer):
        self.num_heads, self.num_kv_heads = layer.num_heads, layer.num_kv_heads
        self.head_size = layer.head_size
        self.scale = layer.scale
        self.sliding_window: int | None = layer.sliding_window
        self.logit_softcap: float | None = layer.logit_softcap
        # An fp8 cache holds K / k_scale and V / v_scale (the checkpoint's per-layer
        # scales); 1.0 for any other cache (the runner resets them at bind).
        self.k_scale: float = getattr(layer, "k_scale", 1.0)
        self.v_scale: float = getattr(layer, "v_scale", 1.0)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """k/v [T, Hkv, D] into the paged cache at the step's slots."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D] (decode rows first), k/v [T, Hkv, D] (written already) ->
        [T, Hq, D]."""
        raise NotImplementedError


class MLAImpl:
    """One MLA layer's latent-cache kernels."""

    def __init__(self, layer):
        self.kv_lora_rank = layer.kv_lora_rank
        self.head_size = layer.head_size  # kv_lora_rank + rope_dim
        self.scale = layer.scale

    def write_kv(self, latent: torch.Tensor, cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """latent [T, kv_lora_rank + rope_dim] into the cache at the step's slots."""
        cache[meta.slot_block, meta.slot_offset] = latent

    def decode(self, qa: torch.Tensor, cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """qa [nd, H, kv_lora_rank + rope_dim] (q_nope absorbed, then q_pe) attends over
        each decode row's latent rows -> [nd, H, kv_lora_rank]."""
        raise NotImplementedError


class AttentionBackend:
    name = ""
    impl_class: type = AttentionImpl
    builder_class: type[AttentionMetadataBuilder] = AttentionMetadataBuilder
    # Whether a captured CUDA graph may replay its decode steps: its kernels read only
    # the static metadata buffers (worker/cuda_graph.py) and size nothing on the host.
    cuda_graphs = False

    def supports(self, spec) -> bool:
        """Whether its kernels take the layers of this KV cache spec."""
        raise NotImplementedError

    def make_builder(self, device: torch.device) -> AttentionMetadataBuilder:
        return self.builder_class(device)

    def make_impl(self, layer):
        return self.impl_class(layer)

    def __repr__(self) -> str:
        return f"<attention backend {self.name}>"
