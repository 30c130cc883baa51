"""Per-layer KV cache specifications and the cache configuration built from them.

The runner allocates every cache buffer from these specs (never from HF-config
arithmetic), so a spec with a padded page is honoured byte for byte.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Element sizes by dtype name; the scheduler side stays free of torch.
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1,
               "float8_e4m3fn": 1}

# --kv-cache-dtype (vLLM's values): "auto" keeps K/V in the model's dtype; "fp8" (=
# "fp8_e4m3") stores them as float8_e4m3fn, one byte an element, so a page of the same
# bytes holds twice a bf16 cache's tokens (four times an fp32 one's).
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
FP8_KV_DTYPE = "float8_e4m3fn"


def check_kv_cache_dtype(value) -> str:
    """The --kv-cache-dtype value, checked (a ValueError naming the field)."""
    if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {value!r}")
    return value


def kv_cache_dtype_name(kv_cache_dtype: str, model_dtype: str) -> str:
    """The dtype name the attention specs carry: the model's for "auto"."""
    return KV_CACHE_DTYPES[check_kv_cache_dtype(kv_cache_dtype)] or model_dtype


def dtype_size(dtype: str) -> int:
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise ValueError(f"unsupported KV cache dtype {dtype!r}") from None


class _PagedSpec:
    """K and V pages of `block_size` tokens: the byte arithmetic every attention spec shares."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    page_size_padded: int | None

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

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The shape of one layer's cache view: K at [:, 0], V at [:, 1]."""
        return (num_blocks, 2, self.block_size, self.num_kv_heads, self.head_size)


@dataclass(frozen=True)
class FullAttentionSpec(_PagedSpec):
    """One full-attention layer: every position of the sequence stays in the cache."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    page_size_padded: int | None = None


@dataclass(frozen=True)
class SlidingWindowSpec(_PagedSpec):
    """One sliding-window layer: a query at position p attends keys in (p - window, p]
    (HF's mask: `window` positions, its own included). Blocks that fall entirely before
    the window of a request's next token are given back to the pool while it runs."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    sliding_window: int
    page_size_padded: int | None = None

    def __post_init__(self):
        if not isinstance(self.sliding_window, int) or self.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive int, got {self.sliding_window!r}")

    def first_needed_block(self, num_computed: int) -> int:
        """The first block the next token (at position `num_computed`) reads: every
        block before it lies entirely outside its window."""
        return max(0, num_computed - self.sliding_window + 1) // self.block_size


@dataclass(frozen=True)
class MLAAttentionSpec(_PagedSpec):
    """One multi-head latent attention layer (DeepSeek-V2 / V3): every head's K and V
    are recomputed from one latent per token, [normed compressed kv (kv_lora_rank) |
    roped k_pe (rope_dim)], so a page holds one `head_size` = kv_lora_rank + rope_dim
    wide row per token and no V: half the K+V factor of a one-head page. Full
    attention otherwise (grouped with, and handled as, full-attention layers)."""

    block_size: int
    kv_lora_rank: int
    rope_dim: int
    dtype: str
    page_size_padded: int | None = None

    def __post_init__(self):
        for name in ("kv_lora_rank", "rope_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")

    @property
    def num_kv_heads(self) -> int:
        return 1

    @property
    def head_size(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def real_page_size_bytes(self) -> int:
        # One latent row per token: [block_size, kv_lora_rank + rope_dim], no V.
        return self.block_size * self.head_size * dtype_size(self.dtype)

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.head_size)


AttentionSpec = FullAttentionSpec | SlidingWindowSpec | MLAAttentionSpec


@dataclass(frozen=True)
class MambaSpec:
    """One recurrent layer (Gated DeltaNet): a fixed-size state per live sequence.

    `shapes` / `dtypes` list the state tensors of one sequence, in order (for
    GDN: the conv state [kernel - 1, conv_dim], then the SSM state
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


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MLAAttentionSpec | MambaSpec


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table (same spec, same block ids)."""

    layer_names: list[str]
    spec: KVCacheSpec
    # A draft model's group (speculative decoding): never the target's attention group.
    is_draft: bool = False

    @property
    def is_attention(self) -> bool:
        return isinstance(self.spec, (FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec))

    @property
    def sliding_window(self) -> int | None:
        return self.spec.sliding_window if isinstance(self.spec, SlidingWindowSpec) else None


@dataclass
class KVCacheConfig:
    num_blocks: int
    groups: list[KVCacheGroup] = field(default_factory=list)
    # State slots of each MambaSpec layer (one per live sequence); 0 without such layers.
    num_state_slots: int = 0
    # Snapshot slots after them (hybrid prefix caching: core/state_snapshots.py); 0: none.
    num_state_snapshots: int = 0

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

    @property
    def attention_group_ids(self) -> list[int]:
        return [i for i, g in enumerate(self.groups) if g.is_attention]

    def buffer_page_sizes(self) -> list[int]:
        """Page bytes of each KV buffer. Layer j of every attention group views buffer j:
        a block id belongs to one group, so the groups' layers never touch the same
        page, and a buffer's page is the largest of the specs that view it (each
        layer views the first `real_page_size_bytes` of a page)."""
        pages: list[int] = []
        for g in self.groups:
            if not g.is_attention:
                continue
            for j in range(len(g.layer_names)):
                if j == len(pages):
                    pages.append(0)
                pages[j] = max(pages[j], g.spec.page_size_bytes)
        return pages

    def bytes_per_block(self) -> int:
        """Bytes one block id costs: one page of every KV buffer."""
        return sum(self.buffer_page_sizes())

    def state_bytes(self) -> int:
        """Bytes of every recurrent layer's state slots and snapshot slots."""
        return self.state_slot_bytes() * (self.num_state_slots + self.num_state_snapshots)

    def state_slot_bytes(self) -> int:
        """Bytes of one state slot: every recurrent layer's state."""
        return sum(len(g.layer_names) * g.spec.page_size_bytes
                   for g in self.groups if not g.is_attention)


# The runner names a draft model's attention layers "draft.<i>.attn".
DRAFT_LAYER_PREFIX = "draft."


def group_layer_specs(specs: dict[str, KVCacheSpec]) -> list[KVCacheGroup]:
    """KV cache groups from per-layer specs: layers with equal specs share a group (one
    block table). Full-attention groups come first (the first is the target's
    `attention_group_id`), then sliding-window groups, then the recurrent state.

    Attention groups are cut into groups of at most as many layers as the smallest
    one has, so every group views the same KV buffers (layer j of a group views
    buffer j, KVCacheConfig.buffer_page_sizes): a block id costs one page per buffer
    whatever group holds it. E.g. 1 full + 5 sliding layers make six groups of one
    layer (one buffer), not two groups whose full-attention blocks would leave five
    sliding layers' pages unused.
    """
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        by_spec.setdefault(spec, []).append(name)
    # MLA layers keep every position too: full attention over their latent pages.
    full = [(s, n) for s, n in by_spec.items()
            if isinstance(s, (FullAttentionSpec, MLAAttentionSpec))]
    sliding = [(s, n) for s, n in by_spec.items() if isinstance(s, SlidingWindowSpec)]
    state = [(s, n) for s, n in by_spec.items() if isinstance(s, MambaSpec)]
    if len(state) > 1:
        raise ValueError("recurrent layers with different state shapes are not supported")
    attention = full + sliding
    groups = []
    if attention:
        size = min(len(names) for _, names in attention)
        for spec, names in attention:
            # A group of a draft model's layers alone (its spec differs from every
            # target layer's) is never the target's attention group.
            draft = all(n.startswith(DRAFT_LAYER_PREFIX) for n in names)
            groups += [KVCacheGroup(names[i:i + size], spec, is_draft=draft)
                       for i in range(0, len(names), size)]
    groups += [KVCacheGroup(names, spec) for spec, names in state]
    return groups
