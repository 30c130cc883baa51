"""What the external KV tier is (the stores) and whose KV it holds (model identity,
KV geometry). Nothing here imports torch."""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field, fields

from tokenmill.core.kv_cache_spec import (FullAttentionSpec, KVCacheConfig, MambaSpec,
                                          MLAAttentionSpec, SlidingWindowSpec, dtype_size)

DEFAULT_CPU_BYTES = 1 << 30
DEFAULT_DISK_BYTES = 10 << 30


def parse_store_spec(spec: str) -> tuple[str, str]:
    """'cpu' | 'disk:PATH' | 'redis://host:port/db' (or rediss://, unix://) -> (kind, arg)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"kv_connector: a store is 'cpu', 'disk:PATH' or a redis:// URL, "
                         f"got {spec!r}")
    if spec == "cpu":
        return "cpu", ""
    if spec.startswith("disk:"):
        path = spec[len("disk:"):]
        if not path:
            raise ValueError("kv_connector: 'disk:' needs a directory, e.g. disk:/var/cache/kv")
        return "disk", os.path.expanduser(path)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return "redis", spec
    raise ValueError(f"kv_connector: unknown store {spec!r} (use 'cpu', 'disk:PATH' or a "
                     f"redis://host:port/db URL)")


@dataclass
class KVConnectorConfig:
    """The external KV tier: stores searched in order (put the fastest first) and
    written through. `model_id` names the weights (default: a fingerprint of the
    checkpoint's files) so KV of one model is never loaded into another."""

    stores: list[str] = field(default_factory=lambda: ["cpu"])
    cpu_bytes: int = DEFAULT_CPU_BYTES  # LRU byte budget of the in-process store
    # LRU byte budget of each disk store, per namespace (model + KV geometry) directory
    disk_bytes: int = DEFAULT_DISK_BYTES
    model_id: str | None = None
    redis_timeout_s: float = 2.0  # connect and socket timeout
    redis_retry_s: float = 5.0  # after a Redis error, how long to recompute before retrying
    redis_ttl_s: int | None = None  # expiry of Redis entries (None: Redis' own eviction)
    # The scheduler's existence lookup waits this long for a store; a store that has not
    # answered by then answers as a miss (the step goes on; its blocks are computed).
    lookup_timeout_s: float = 0.1
    # The worker's reads of a step's loads wait this long (from the start of the step;
    # the step waits with them); a block not read and verified by then is a load
    # failure: it is recomputed. Raise it for long prompts over a slow link.
    load_timeout_s: float = 2.0

    @classmethod
    def from_any(cls, value) -> "KVConnectorConfig | None":
        """None, a KVConnectorConfig, a dict of its fields, a store spec or a list of them."""
        if value is None or isinstance(value, cls):
            cfg = value
        elif isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"kv_connector: unknown field(s) {', '.join(unknown)}; "
                                 f"known: {', '.join(sorted(known))}")
            cfg = cls(**value)
        elif isinstance(value, str):
            cfg = cls(stores=[s for s in value.split(",") if s])
        elif isinstance(value, (list, tuple)):
            cfg = cls(stores=list(value))
        else:
            raise ValueError(f"kv_connector must be a KVConnectorConfig, dict, store spec or "
                             f"list of store specs, got {type(value).__name__}")
        if cfg is not None:
            cfg.validate()
        return cfg

    def validate(self) -> None:
        if not isinstance(self.stores, (list, tuple)) or not self.stores:
            raise ValueError("kv_connector: stores must be a non-empty list")
        kinds = [parse_store_spec(s)[0] for s in self.stores]
        if kinds.count("cpu") > 1:
            raise ValueError("kv_connector: 'cpu' store given twice")
        for name in ("cpu_bytes", "disk_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"kv_connector: {name} must be a positive int, got {v!r}")
        if self.model_id is not None and (not isinstance(self.model_id, str) or not
                                          self.model_id.replace("-", "").replace("_", "")
                                          .replace(".", "").isalnum()):
            raise ValueError(f"kv_connector: model_id must be letters, digits, '-', '_' or '.', "
                             f"got {self.model_id!r}")
        for name in ("redis_timeout_s", "redis_retry_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"kv_connector: {name} must be a number >= 0, got {v!r}")
        for name in ("lookup_timeout_s", "load_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"kv_connector: {name} must be a number > 0, got {v!r}")


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one block's KV across the model: what an entry must match."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    # The cache's element type: the model's, or float8_e4m3fn (--kv-cache-dtype fp8). In
    # the key (`tag`), so an fp8 engine never reads a bf16 engine's blocks nor the
    # reverse; an entry is the cache's bytes (1 per element in fp8).
    dtype: str
    block_size: int
    # MLA (DeepSeek): one latent row per token, no separate V (MLAAttentionSpec).
    latent: bool = False
    # The layers' sliding window (tokens), None for full attention. A block's KV is
    # stored whole either way; the window says which blocks a hit must load.
    sliding_window: int | None = None

    @classmethod
    def from_kv_cache_config(cls, config: KVCacheConfig) -> "KVGeometry":
        """The geometry of the one attention group (make_kv_connector refuses others)."""
        group = config.groups[config.attention_group_id]
        spec = group.spec
        assert isinstance(spec, (FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec))
        window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        return cls(len(group.layer_names), spec.num_kv_heads, spec.head_size, spec.dtype,
                   spec.block_size, latent=isinstance(spec, MLAAttentionSpec),
                   sliding_window=window)

    @property
    def layer_block_shape(self) -> tuple[int, ...]:
        """One block of one layer's cache view (the spec's cache_shape past dim 0)."""
        if self.latent:
            return (self.block_size, self.head_size)
        return (2, self.block_size, self.num_kv_heads, self.head_size)

    def first_needed_block(self, num_tokens: int) -> int:
        """The first block the token at position `num_tokens` reads (0: full attention)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_tokens - self.sliding_window + 1) // self.block_size

    @property
    def layer_bytes(self) -> int:
        """K and V (MLA: the latent rows) of one block in one layer."""
        n = dtype_size(self.dtype)
        for d in self.layer_block_shape:
            n *= d
        return n

    @property
    def payload_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def tag(self) -> str:
        window = "" if self.sliding_window is None else f"-W{self.sliding_window}"
        return (f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_size}-{self.dtype}"
                f"-B{self.block_size}{window}" + ("-MLA" if self.latent else ""))


@dataclass(frozen=True)
class StateGeometry:
    """The shape of one recurrent-state snapshot (hybrid models): every Gated DeltaNet
    layer's state tensors for one sequence (conv state, then SSM state), in layer
    order. What a snapshot entry must match."""

    num_layers: int
    shapes: tuple[tuple[int, ...], ...]  # one layer's tensors
    dtypes: tuple[str, ...]

    @classmethod
    def from_kv_cache_config(cls, config: KVCacheConfig) -> "StateGeometry | None":
        gid = config.state_group_id
        if gid is None:
            return None
        group = config.groups[gid]
        spec = group.spec
        assert isinstance(spec, MambaSpec)
        return cls(len(group.layer_names), tuple(tuple(s) for s in spec.shapes),
                   tuple(spec.dtypes))

    @property
    def layer_bytes(self) -> int:
        total = 0
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            n = dtype_size(dtype)
            for d in shape:
                n *= d
            total += n
        return total

    @property
    def payload_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def tag(self) -> str:
        tensors = "-".join("x".join(map(str, s)) + f"{d}" for s, d in zip(self.shapes, self.dtypes))
        return f"S{self.num_layers}-{tensors}"


def state_key(block_hash: bytes) -> str:
    """The store key of the state snapshot taken after the block `block_hash` (the
    block's own key is its hex)."""
    return block_hash.hex() + "-state"


def model_fingerprint(path: str, extra: str = "", sample_bytes: int = 64 << 10,
                      samples_per_file: int = 16) -> str:
    """16 hex digits naming a checkpoint: config.json and the weight files (names,
    sizes, and their bytes: whole files up to 1 MiB, else evenly spaced samples),
    plus `extra` (the compute dtypes). Two random initialisations of one config
    differ; one folder read twice, or copied, does not."""
    h = hashlib.sha256(b"tokenmill-model-v1\0" + extra.encode())
    cfg = os.path.join(path, "config.json")
    if os.path.exists(cfg):
        with open(cfg, "rb") as f:
            h.update(f.read())
    names = sorted(n for n in os.listdir(path)
                   if n.endswith((".safetensors", ".bin", ".pt", ".gguf")))
    for name in names:
        full = os.path.join(path, name)
        size = os.path.getsize(full)
        h.update(f"\0{name}\0{size}\0".encode())
        with open(full, "rb") as f:
            if size <= samples_per_file * sample_bytes:
                h.update(f.read())
            else:
                step = (size - sample_bytes) // (samples_per_file - 1)
                for i in range(samples_per_file):
                    f.seek(i * step)
                    h.update(f.read(sample_bytes))
    return h.hexdigest()[:16]


def kv_namespace(model_id: str, geometry: KVGeometry) -> str:
    """Every key carries this: the model identity and the KV geometry."""
    return f"{model_id}-{geometry.tag}"


def namespace_digest(namespace: str) -> bytes:
    """16 bytes written into every entry's header and checked on load."""
    return hashlib.sha256(namespace.encode()).digest()[:16]
