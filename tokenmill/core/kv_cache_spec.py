"""Per-layer KV cache specifications and the cache configuration built from them.

The runner allocates every cache buffer from these specs (never from HF-config
arithmetic), so a spec with a padded page is honoured byte for byte.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Element sizes by dtype name; the scheduler side stays free of torch.
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1}


def dtype_size(dtype: str) -> int:
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise ValueError(f"unsupported KV cache dtype {dtype!r}") from None


@dataclass(frozen=True)
class FullAttentionSpec:
    """One full-attention layer: K and V pages of `block_size` tokens."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    sliding_window: int | None = None
    page_size_padded: int | None = None

    @property
    def real_page_size_bytes(self) -> int:
        # K and V, each [block_size, num_kv_heads, head_size].
        return 2 * self.block_size * self.num_kv_heads * self.head_size * dtype_size(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            if self.page_size_padded < self.real_page_size_bytes:
                raise ValueError("page_size_padded is smaller than the real page size")
            return self.page_size_padded
        return self.real_page_size_bytes


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table (same spec, same block ids)."""

    layer_names: list[str]
    spec: FullAttentionSpec


@dataclass
class KVCacheConfig:
    num_blocks: int
    groups: list[KVCacheGroup] = field(default_factory=list)

    @property
    def block_size(self) -> int:
        return self.groups[0].spec.block_size

    def bytes_per_block(self) -> int:
        """Bytes one block id costs across every layer of every group."""
        return sum(len(g.layer_names) * g.spec.page_size_bytes for g in self.groups)
