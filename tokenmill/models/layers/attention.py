"""Paged attention layers: the model's view of one attention layer's KV cache.

The cache of one layer is a [num_blocks, 2, block_size, num_kv_heads, head_size]
view (K at index 0, V at 1) over bytes the runner allocated from the layer's spec.
Rows come decode-first (the runner reorders the batch). The runner binds, in
`initialize_kv_cache`, the cache, the KV cache group and the implementation
(`impl`, made by the group's attention backend: tokenmill/attention/), which writes
the K/V and attends; the layer only routes to it.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.backend import AttentionImpl
from tokenmill.attention.metadata import AttentionMetadata


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None,
                 kv_sharing_target: int | None = None):
        """`sliding_window`: keys in (p - w, p] only (None: full attention);
        `logit_softcap`: scores become cap * tanh(scores / cap) (Gemma 2/3);
        `kv_sharing_target`: the index (in the model's attention_layers()) of the layer
        whose KV cache this one reads and never writes (Gemma 4's KV-shared layers: the
        K/V passed in are that layer's of this step); it gets no cache of its own."""
        super().__init__()
        self.kv_sharing_target = kv_sharing_target
        # A drafter's windowed layer whose cache keeps every position (full-attention
        # spec, the target's group): the window masks its reads only.
        self.cache_all_positions = False
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        # The checkpoint's per-layer FP8 KV cache scales (models/kv_scales.py): an fp8
        # cache holds K / k_scale and V / v_scale. 1.0 when it has none.
        self.k_scale: float = 1.0
        self.v_scale: float = 1.0
        # Bound by the runner: the cache, its KV cache group, the backend's implementation.
        self.kv_cache: torch.Tensor | None = None
        self.kv_group: int | None = None
        self.impl: AttentionImpl | None = None

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """k/v [T, Hkv, D] into the paged cache at the step's slots."""
        self.impl.write_kv(k, v, self.kv_cache, meta.for_group(self.kv_group))

    def read_decodes(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Decode queries only, over what the cache holds (nothing written): q [N, H, D]
        with H any multiple of the KV heads (the grouped query heads of kv head h are
        h * H / Hkv ...) -> [N, H, D]. A DFlash block's rows all read the same keys, so
        they attend as one query of (k + 1) x the heads: the context is read once."""
        meta = meta.for_group(self.kv_group)
        if meta.prefills or meta.num_decodes != q.shape[0]:
            raise ValueError("read_decodes takes a decode-only metadata, one row per query")
        return self.impl.forward(q, None, None, self.kv_cache, meta)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]."""
        meta = meta.for_group(self.kv_group)
        if self.kv_sharing_target is None:  # (a sharing layer's source wrote them)
            self.impl.write_kv(k, v, self.kv_cache, meta)
        return self.impl.forward(q, k, v, self.kv_cache, meta).view(q.shape[0], -1)
