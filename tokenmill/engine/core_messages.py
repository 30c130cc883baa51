"""What the front end and an engine core say to each other, as msgpack frames.

An engine core in its own process (tokenmill.engine.core_proc) takes requests and
commands on one ZeroMQ socket and answers on another. Every frame pair is
(kind, payload): the kind a short ASCII tag, the payload msgpack (core/serial.py)
of the type `INPUT_TYPES` / `OUTPUT_TYPES` name for that kind.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.core.sched_output import MultiModalFeature
from tokenmill.core.scheduler import EngineCoreOutput
from tokenmill.pooling.params import PoolingParams
from tokenmill.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    """A request as it crosses to the engine core: everything Request() takes."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float  # time.monotonic(): one clock for every process of the machine
    share_prompt_with: str | None = None
    cache_salt: str | None = None
    mm_features: list[MultiModalFeature] | None = None
    pooling_params: PoolingParams | None = None  # an embedding request


@dataclass
class CoreStats:
    """The engine core's gauges and counters after a step (cumulative counters)."""
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    num_draft_resumes: int = 0  # requests suspended by load, recomputed to draft
    num_steps: int = 0
    kv_cache_usage: float = 0.0
    num_used_blocks: int = 0
    num_kv_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_cached_blocks: int = 0
    num_errors: dict[str, int] = field(default_factory=dict)
    num_aborted: int = 0
    spec_decoding: dict | None = None  # SpecDecodingStats.as_dict()
    external_kv: dict | None = None  # per store name: the connector's counters


@dataclass
class CoreInfo:
    """What an engine core decided when it started (sent once, before any output)."""
    num_kv_blocks: int
    kv_bytes_per_block: int
    async_scheduling: bool
    enable_prefix_caching: bool
    platform: str  # CpuPlatform.describe()
    pid: int


@dataclass
class CoreOutputs:
    """One step's outputs, with the stats after it."""
    outputs: list[EngineCoreOutput]
    stats: CoreStats


@dataclass
class AbortCommand:
    request_ids: list[str]


@dataclass
class FinishCommand:
    request_ids: list[str]
    status: str  # a RequestStatus value
    stop_reason: int | str | None = None


@dataclass
class RequestFailure:
    """Why the front end fails a request (EngineCore.fail_requests takes it as the
    (reason, message) pair the scheduler uses)."""
    reason: str  # e.g. "output": a key of CoreStats.num_errors
    message: str


@dataclass
class FailCommand:
    failures: dict[str, RequestFailure]  # request id -> why
    emit: bool = True


@dataclass
class UtilityCall:
    """A method of EngineCore called by name (kv_cache_stats, ...); the answer comes
    back as a UtilityResult with the same call_id."""
    call_id: int
    method: str
    args: list[Any] = field(default_factory=list)


@dataclass
class UtilityResult:
    call_id: int
    result: Any = None
    error: str | None = None


@dataclass
class CoreDead:
    """The core failed (to start, or in its loop) and exits."""
    error_type: str  # the exception's class name
    message: str


# Front end -> core.
INPUT_TYPES = {b"add": EngineCoreRequest, b"abort": AbortCommand, b"finish": FinishCommand,
               b"fail": FailCommand, b"call": UtilityCall, b"shutdown": None}
# Core -> front end.
OUTPUT_TYPES = {b"ready": CoreInfo, b"out": CoreOutputs, b"call": UtilityResult,
                b"dead": CoreDead}
# The methods a UtilityCall may name.
UTILITY_METHODS = frozenset({"kv_cache_stats"})


def merge_stats(parts: list[CoreStats]) -> CoreStats:
    """The stats of data-parallel replicas as one engine's: counts add up, the KV
    usage is over all replicas' blocks."""
    if len(parts) == 1:
        return parts[0]
    out = CoreStats()
    for s in parts:
        for name in ("num_running", "num_waiting", "num_preemptions", "num_draft_resumes",
                     "num_steps",
                     "num_used_blocks",
                     "num_kv_blocks", "prefix_cache_queries", "prefix_cache_hits",
                     "num_cached_blocks", "num_aborted"):
            setattr(out, name, getattr(out, name) + getattr(s, name))
        for reason, n in s.num_errors.items():
            out.num_errors[reason] = out.num_errors.get(reason, 0) + n
        if s.spec_decoding:
            out.spec_decoding = _merge_spec(out.spec_decoding, s.spec_decoding)
        if s.external_kv:
            out.external_kv = out.external_kv or {}
            for store, counters in s.external_kv.items():
                acc = out.external_kv.setdefault(store, dict.fromkeys(counters, 0))
                for k, v in counters.items():
                    acc[k] = acc.get(k, 0) + v
    if out.num_kv_blocks:
        out.kv_cache_usage = out.num_used_blocks / out.num_kv_blocks
    return out


def _merge_spec(a: dict | None, b: dict) -> dict:
    if a is None:
        return dict(b, accepted_per_position=list(b["accepted_per_position"]))
    for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        a[k] += b[k]
    a["accepted_per_position"] = [x + y for x, y in zip(a["accepted_per_position"],
                                                        b["accepted_per_position"])]
    a["mean_acceptance_length"] = round(
        1 + a["num_accepted_tokens"] / a["num_drafts"], 4) if a["num_drafts"] else 0.0
    a["acceptance_rate"] = round(
        a["num_accepted_tokens"] / a["num_draft_tokens"], 4) if a["num_draft_tokens"] else 0.0
    return a
