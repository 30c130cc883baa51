"""/metrics in the Prometheus text format, from AsyncLLM's stats and latency observations;
the latest observations are also kept raw for /stats's percentiles."""
from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenmill.engine.async_llm import AsyncLLM

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# Why the server turned a request away: 400, 401, 404, 413, 503 (queue full), 503 (engine dead).
REJECT_REASONS = ("invalid", "unauthorized", "not_found", "too_large", "overloaded",
                  "engine_dead")


class _StatsCollector:
    def __init__(self, async_llm: AsyncLLM, model_name: str):
        self.async_llm, self.labels = async_llm, {"model_name": model_name}

    def collect(self):
        s = self.async_llm.stats
        for name, help_, value in (
                ("tokenmill:num_requests_running", "Requests in the running batch.", s.num_running),
                ("tokenmill:num_requests_waiting", "Requests waiting to be scheduled.",
                 s.num_waiting),
                ("tokenmill:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).",
                 s.kv_cache_usage),
                ("tokenmill:kv_cache_used_blocks", "KV cache blocks in use.", s.num_used_blocks)):
            g = GaugeMetricFamily(name, help_, labels=list(self.labels))
            g.add_metric(list(self.labels.values()), value)
            yield g
        for name, help_, value in (
                ("tokenmill:prompt_tokens", "Prompt tokens admitted.", s.prompt_tokens_total),
                ("tokenmill:generation_tokens", "Tokens generated.", s.generation_tokens_total),
                ("tokenmill:request_success", "Requests finished (not aborted).",
                 s.requests_finished_total),
                ("tokenmill:num_preemptions", "Preemptions by recompute.",
                 s.num_preemptions_total),
                ("tokenmill:spec_decode_resumed_requests",
                 "Requests suspended from drafting by load, recomputed to draft once the "
                 "batch drained.", s.draft_resumes_total),
                ("tokenmill:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 s.prefix_cache_queries_total),
                ("tokenmill:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                 s.prefix_cache_hits_total)):
            c = CounterMetricFamily(name, help_, labels=list(self.labels))
            c.add_metric(list(self.labels.values()), value)
            yield c
        # Requests the engine failed alone (finish_reason "error"), by reason, and aborts.
        labels = list(self.labels) + ["reason"]
        c = CounterMetricFamily("tokenmill:request_errors",
                                "Requests the engine finished with an error.", labels=labels)
        for reason, count in sorted((getattr(s, "requests_errored_total", None) or {}).items()):
            c.add_metric(list(self.labels.values()) + [str(reason)], count)
        yield c
        c = CounterMetricFamily("tokenmill:requests_aborted",
                                "Requests aborted (client gone, stream closed, shutdown).",
                                labels=list(self.labels))
        c.add_metric(list(self.labels.values()), getattr(s, "requests_aborted_total", 0))
        yield c
        g = GaugeMetricFamily("tokenmill:prefix_cache_blocks",
                              "KV blocks holding a cached prefix (in use or evictable).",
                              labels=list(self.labels))
        g.add_metric(list(self.labels.values()), s.num_cached_blocks)
        yield g
        yield from self._external_kv(s.external_kv)
        yield from self._spec_decoding(getattr(s, "spec_decoding", None) or {})

    def _spec_decoding(self, sd: dict):
        """Speculative decoding counters (vLLM's names); nothing when it is off."""
        if not sd:
            return
        values = list(self.labels.values())
        for key, name, help_ in (
                ("num_drafts", "spec_decode_num_drafts", "Verifications of a request's drafts."),
                ("num_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens verified."),
                ("num_accepted_tokens", "spec_decode_num_accepted_tokens",
                 "Draft tokens accepted.")):
            c = CounterMetricFamily(f"tokenmill:{name}", help_, labels=list(self.labels))
            c.add_metric(values, sd[key])
            yield c
        c = CounterMetricFamily("tokenmill:spec_decode_num_accepted_tokens_per_pos",
                                "Verifications whose draft at this position was accepted.",
                                labels=list(self.labels) + ["position"])
        for pos, count in enumerate(sd["accepted_per_position"]):
            c.add_metric(values + [str(pos)], count)
        yield c

    def _external_kv(self, per_store: dict):
        """The external KV tier's counters, one series per store."""
        labels = list(self.labels) + ["store"]
        for key, name, help_ in (
                ("hit_tokens", "external_kv_hit_tokens", "Prompt tokens loaded from the store."),
                ("hit_blocks", "external_kv_hit_blocks", "KV blocks loaded from the store."),
                ("bytes_loaded", "external_kv_loaded_bytes", "KV bytes loaded from the store."),
                ("bytes_stored", "external_kv_stored_bytes", "KV bytes written to the store."),
                ("load_failures", "external_kv_load_failures",
                 "Entries listed but not loadable (evicted, torn, corrupted, foreign): "
                 "recomputed."),
                ("store_failures", "external_kv_store_failures",
                 "Blocks not written (store unreachable).")):
            c = CounterMetricFamily(f"tokenmill:{name}", help_, labels=labels)
            for store, counters in per_store.items():
                c.add_metric(list(self.labels.values()) + [store], counters.get(key, 0))
            yield c


class RecentLatencies:
    """The latency observations of the last `window_s` seconds, for exact percentiles: the
    histograms' buckets are too coarse for a live chart. At most `cap` per kind are kept
    (memory, and the sort per read), so under a heavy load the ITL window is shorter."""

    def __init__(self, kinds=("ttft", "itl", "e2e"), window_s: float = 60.0, cap: int = 20000,
                 clock=time.monotonic):
        self.window_s, self.clock = window_s, clock
        self._obs = {k: deque(maxlen=cap) for k in kinds}
        self._lock = threading.Lock()  # appended on the engine thread, read on the loop

    def add(self, kind: str, seconds: float) -> None:
        with self._lock:
            self._obs[kind].append((self.clock(), seconds))

    def percentiles(self, qs=(50, 90, 99)) -> dict:
        """{kind: {"count": n, "p50": s, ...}} over the window (None without observations)."""
        since = self.clock() - self.window_s
        with self._lock:
            recent = {k: [v for t, v in obs if t >= since] for k, obs in self._obs.items()}
        out = {}
        for kind, values in recent.items():
            values.sort()
            out[kind] = {"count": len(values)}
            for q in qs:  # nearest rank
                out[kind][f"p{q}"] = (values[max(0, -(-q * len(values) // 100) - 1)]
                                      if values else None)
        return out


class ServerMetrics:
    def __init__(self, async_llm: AsyncLLM, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(async_llm, model_name))
        kw = dict(labelnames=["model_name"], registry=self.registry, buckets=_LATENCY_BUCKETS)
        self._hist = {
            "ttft": Histogram("tokenmill:time_to_first_token_seconds",
                              "Time to first token.", **kw).labels(model_name),
            "itl": Histogram("tokenmill:inter_token_latency_seconds",
                             "Time between output tokens.", **kw).labels(model_name),
            "e2e": Histogram("tokenmill:e2e_request_latency_seconds",
                             "Arrival to last token.", **kw).labels(model_name),
        }
        self._rejected = Counter("tokenmill:requests_rejected",
                                 "Requests the server turned away, by reason.",
                                 labelnames=["model_name", "reason"], registry=self.registry)
        for reason in REJECT_REASONS:  # every series from the start, at 0
            self._rejected.labels(model_name, reason)
        self.model_name = model_name
        self.recent = RecentLatencies(tuple(self._hist))
        async_llm.observer = self.observe

    def rejected(self, reason: str) -> None:
        """Count a request the server turned away (REJECT_REASONS)."""
        self._rejected.labels(self.model_name, reason).inc()

    def observe(self, kind: str, seconds: float) -> None:
        self._hist[kind].observe(seconds)
        self.recent.add(kind, seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
