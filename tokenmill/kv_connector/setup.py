"""Wiring for EngineCore: whether prefix caching is on, the connector's two halves,
and the KV cache statistics (engine stats, /metrics)."""
from __future__ import annotations

import logging

from tokenmill.core.kv_cache_spec import KVCacheConfig
from tokenmill.kv_connector.config import (KVConnectorConfig, KVGeometry, StateGeometry,
                                           model_fingerprint)
from tokenmill.models.layers.rotary import LONGROPE_USE_LONG

logger = logging.getLogger(__name__)

NO_SNAPSHOTS_REASON = (
    "it has recurrent-state (Gated DeltaNet) layers and prefix caching is off: a hit "
    "resumes from a state snapshot, which only prefix caching takes")

MULTI_GROUP_REASON = (
    "its layers form {n} KV cache groups (full and sliding-window layers, or layers of "
    "different head sizes); an entry holds one block of every layer of a single group, "
    "so the tier runs only models whose attention layers are all alike (full attention, "
    "or all sliding with one window, e.g. Mistral)")


def _num_block_groups(config: KVCacheConfig) -> int:
    return sum(1 for g in config.groups if g.is_attention)


def resolve_prefix_caching(flag: bool | None, kv_cache_config: KVCacheConfig) -> bool:
    """None: on. Hybrids too: their recurrent state is snapshotted at block boundaries
    (core/state_snapshots.py), which needs the config's snapshot slots."""
    on = True if flag is None else bool(flag)
    if on and kv_cache_config.state_group_id is not None and \
            not kv_cache_config.num_state_snapshots:
        raise ValueError("prefix caching of a hybrid model needs state snapshot slots "
                         "(num_state_snapshots) in its KV cache config")
    return on


def make_kv_connector(config: KVConnectorConfig | None, model_config,
                      kv_cache_config: KVCacheConfig, gemm_dtype=None):
    """The external tier's KVConnector (its stores, shared by both halves), or None: off,
    or this model's KV cache cannot use it. The scheduler and the runner build their
    halves from it (Scheduler(connector=...), ModelRunner.initialize_kv_cache).
    `gemm_dtype`: the dtype the GEMMs were widened to (None: the model's), part of the
    model identity."""
    if config is None:
        return None
    if kv_cache_config.state_group_id is not None and not kv_cache_config.num_state_snapshots:
        logger.warning("the external KV tier is turned off for this model: %s",
                       NO_SNAPSHOTS_REASON)
        return None
    if _num_block_groups(kv_cache_config) != 1:
        logger.warning("the external KV tier is turned off for this model: %s",
                       MULTI_GROUP_REASON.format(n=_num_block_groups(kv_cache_config)))
        return None
    from tokenmill.kv_connector.connector import KVConnector

    geometry = KVGeometry.from_kv_cache_config(kv_cache_config)
    model_id = config.model_id
    if model_id is None:
        # The LongRoPE factor set changes every key: caches of the two do not mix.
        longrope = model_config.hf_config.get(LONGROPE_USE_LONG)
        model_id = model_fingerprint(model_config.path,
                                     f"dtype={model_config.dtype};gemm={gemm_dtype}"
                                     + ("" if longrope is None else f";longrope_long={longrope}"))
    # Hybrids: the tier carries the recurrent-state snapshots too (None: attention only).
    return KVConnector(config, model_id, geometry,
                       state_geometry=StateGeometry.from_kv_cache_config(kv_cache_config))


def kv_cache_stats(scheduler, connector=None) -> dict:
    """Prefix-cache and external-tier counters (cumulative) and cache gauges."""
    kvm = scheduler.kv_cache_manager
    pc = kvm.prefix_cache_stats
    out = {
        "prefix_caching": kvm.enable_caching,
        "prefix_cache_queries": pc.queries,  # tokens looked up at admission
        "prefix_cache_hits": pc.hits,  # of those, tokens found cached
        "prefix_cache_requests": pc.requests,
        "prefix_cache_hit_requests": pc.hit_requests,
        "num_used_blocks": kvm.num_used_blocks,
        "num_cached_blocks": kvm.pool.num_cached_blocks,
        "num_evictable_cached_blocks": kvm.pool.num_evictable_cached_blocks,
        "num_cache_evictions": kvm.pool.num_evictions,
        "external": None,
    }
    if connector is not None:
        out["external"] = connector.stats.snapshot()
    return out
