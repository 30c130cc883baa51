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
class MambaSpec:
    """One recurrent layer (Gated DeltaNet): a fixed-size state per live sequence.

    `shapes` / `dtypes` list the state tensors of one sequence, in order (for
    GDN: the conv state [conv_dim, kernel - 1], then the SSM state
    [num_v_heads, v_head_dim, k_head_dim]). The state does not grow with the
    sequence, so it takes no KV blocks: the runner keeps one slot per live
    request, keyed on the request id.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one sequence's state in this layer."""
        total = 0
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            n = 1
            for d in shape:
                n *= d
            total += n * dtype_size(dtype)
        return total


KVCacheSpec = FullAttentionSpec | MambaSpec


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table (same spec, same block ids)."""

    layer_names: list[str]
    spec: KVCacheSpec
    # A draft model's group (speculative decoding): never the target's attention group.
    is_draft: bool = False

    @property
    def is_attention(self) -> bool:
        return isinstance(self.spec, FullAttentionSpec)


@dataclass
class KVCacheConfig:
    num_blocks: int
    groups: list[KVCacheGroup] = field(default_factory=list)
    # State slots of each MambaSpec layer (one per live sequence); 0 without such layers.
    num_state_slots: int = 0

    @property
    def attention_group_id(self) -> int:
        """The target model's full-attention group: the first one that is not a draft's."""
        for i, g in enumerate(self.groups):
            if g.is_attention and not g.is_draft:
                return i
        raise ValueError("the KV cache config has no full-attention group")

    @property
    def state_group_id(self) -> int | None:
        """The recurrent-state (MambaSpec) group, or None for attention-only models."""
        for i, g in enumerate(self.groups):
            if isinstance(g.spec, MambaSpec):
                return i
        return None

    @property
    def block_size(self) -> int:
        return self.groups[self.attention_group_id].spec.block_size

    def bytes_per_block(self) -> int:
        """Bytes one block id costs across every attention layer of every group."""
        return sum(len(g.layer_names) * g.spec.page_size_bytes
                   for g in self.groups if g.is_attention)

    def state_bytes(self) -> int:
        """Bytes of every recurrent layer's state slots."""
        return sum(len(g.layer_names) * g.spec.page_size_bytes * self.num_state_slots
                   for g in self.groups if not g.is_attention)
