"""GET /stats: what the web dashboard shows, as JSON. The same engine counters and gauges
as /metrics, latency percentiles over the last minute, and the engine's configuration.
Counters are cumulative: a client takes rates from two polls and their `uptime_s`."""
from __future__ import annotations

import dataclasses
import re
import time

from fastapi import APIRouter

from tokenmill.entrypoints.openai.context import Ctx

router = APIRouter()

_STARTED = time.monotonic()


@router.get("/stats")
async def stats(ctx: Ctx):
    s = ctx.async_llm.stats
    recent = ctx.metrics.recent
    return {
        "model": ctx.model_name,
        "uptime_s": time.monotonic() - _STARTED,
        "healthy": ctx.async_llm.is_healthy(),
        "requests": {"running": s.num_running, "waiting": s.num_waiting,
                     "finished_total": s.requests_finished_total,
                     "aborted_total": s.requests_aborted_total,
                     "errored_total": sum((s.requests_errored_total or {}).values()),
                     "preemptions_total": s.num_preemptions_total},
        "kv_cache": {"usage": s.kv_cache_usage, "used_blocks": s.num_used_blocks,
                     "cached_blocks": s.num_cached_blocks},
        "tokens": {"prompt_total": s.prompt_tokens_total,
                   "generation_total": s.generation_tokens_total},
        "prefix_cache": {"queries_total": s.prefix_cache_queries_total,
                         "hits_total": s.prefix_cache_hits_total},
        "spec_decoding": s.spec_decoding or None,
        "latency": {"window_s": recent.window_s, **recent.percentiles()},
        "config": engine_config(ctx),
        "replicas": _replicas(ctx),
    }


def _replicas(ctx) -> list[dict] | None:
    """Per engine process (data parallelism): alive, pid, requests routed and open."""
    engine = getattr(ctx.async_llm, "engine", None)
    replica_stats = getattr(getattr(engine, "engine_core", None), "replica_stats", None)
    return replica_stats() if replica_stats is not None else None


def engine_config(ctx) -> dict:
    """The settings the engine runs with, as it resolved them (auto choices decided)."""
    out = {"model": ctx.model_name, "max_model_len": ctx.max_model_len}
    engine = getattr(ctx.async_llm, "engine", None)
    if not hasattr(engine, "engine_core"):  # a stand-in engine (tests): the basics only
        return out
    mc, sc, core = engine.model_config, engine.scheduler_config, engine.engine_core
    spec = engine.args.speculative_config
    connector = engine.args.kv_connector
    out.update(
        model_path=mc.path,
        dtype=str(mc.dtype).removeprefix("torch."),
        device=str(mc.device),
        kernels=engine.platform.describe(),
        platform=engine.platform.as_dict(),
        block_size=engine.cache_config.block_size,
        num_kv_blocks=core.num_kv_blocks,
        max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        chunked_prefill=sc.enable_chunked_prefill,
        prefix_caching=core.enable_prefix_caching,
        engine_process=engine.args.engine_process or engine.args.data_parallel_size > 1,
        data_parallel_size=engine.args.data_parallel_size,
        async_scheduling=bool(core.async_scheduling),
        speculative=dataclasses.asdict(spec) if spec is not None else None,
        kv_stores=([_redact(store) for store in connector.stores]
                   if connector is not None else None),
    )
    return out


def _redact(store: str) -> str:
    """A store spec without the password a redis:// URL may carry."""
    return re.sub(r"(://)[^/@]*@", r"\1***@", store)
