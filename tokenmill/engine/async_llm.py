"""AsyncLLM: one LLMEngine stepped by one background thread, streamed to asyncio callers.

The engine thread is the only code that touches the engine. Callers hand it
commands (add a request, abort one) through a locked list that it drains
before every step; it sleeps on a condition variable while there is nothing
to do. Each request's outputs go back to the caller's event loop with
`loop.call_soon_threadsafe` into that request's `asyncio.Queue`.

`generate()` raises the engine's ValueError (bad prompt, bad parameters,
duplicate id) before anything runs; a consumer that stops iterating (closed,
cancelled, client gone) aborts its request, so its KV blocks are freed.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tokenmill.engine.llm_engine import EngineArgs, LLMEngine
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread failed or was shut down; the request cannot complete."""


@dataclass
class EngineStats:
    """A snapshot the engine thread refreshes after every step (read from any thread)."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_used_blocks: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_finished_total: int = 0
    num_preemptions_total: int = 0
    steps_total: int = 0
    # Prefix caching and the external KV tier (tokenmill.kv_connector.setup.kv_cache_stats).
    prefix_cache_queries_total: int = 0  # prompt tokens looked up
    prefix_cache_hits_total: int = 0  # of those, found in the cache
    num_cached_blocks: int = 0  # blocks holding a cached prefix (in use or evictable)
    # Per external store name: hit_blocks, hit_tokens, bytes_loaded, blocks_stored,
    # bytes_stored, load_failures, store_failures (cumulative).
    external_kv: dict = field(default_factory=dict)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival_time: float = field(default_factory=time.monotonic)
    last_token_time: float | None = None

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass


class AsyncLLM:
    def __init__(self, engine: LLMEngine, log_stats_interval: float | None = 5.0,
                 observer=None):
        """`observer`, if given, is called on the engine thread with
        (kind, seconds) for kind in "ttft", "itl" (one per new token after the
        first; a step that adds k tokens gives k equal intervals) and "e2e"."""
        self.observer = observer
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.log_stats_interval = log_stats_interval
        self.stats = EngineStats()
        self._cond = threading.Condition()
        self._pending: list[tuple] = []
        self._stopped = False
        self._dead: BaseException | None = None
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs) -> "AsyncLLM":
        return cls(LLMEngine(args), **kwargs)

    # ---- caller side ---------------------------------------------------------
    def _submit(self, cmd: tuple) -> None:
        with self._cond:
            if self._stopped or self._dead is not None:
                raise EngineDeadError("the engine is not running")
            self._pending.append(cmd)
            self._cond.notify()

    async def add_request(self, prompt, sampling_params: SamplingParams | None,
                          request_id: str | None = None) -> tuple[str, asyncio.Queue]:
        """Validate and enqueue on the engine thread; ValueError is raised here."""
        loop = asyncio.get_running_loop()
        request_id = request_id or uuid.uuid4().hex
        stream = _Stream(loop, asyncio.Queue())
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("add", request_id, prompt, sampling_params, stream, fut))
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add: frees it if it went in
            raise
        return request_id, stream.queue

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative RequestOutputs, one per engine step that advanced this request."""
        request_id, queue = await self.add_request(prompt, sampling_params, request_id)
        async for out in self.stream(request_id, queue):
            yield out

    async def stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """The outputs of a request added with add_request(); leaving early aborts it."""
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; unknown or finished ids are ignored)."""
        try:
            self._submit(("abort", request_id))
        except EngineDeadError:
            pass

    def is_healthy(self) -> bool:
        return self._dead is None and not self._stopped and self._thread.is_alive()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---- engine thread -------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        last_log = time.monotonic()
        last_counts = (0, 0)
        try:
            while True:
                with self._cond:
                    while (not self._pending and not self._stopped
                           and not engine.has_unfinished_requests()):
                        self._refresh_stats()
                        self._cond.wait()
                        # throughput in the stats line is over busy time only
                        last_log = time.monotonic()
                        last_counts = (self.stats.prompt_tokens_total,
                                       self.stats.generation_tokens_total)
                    cmds, self._pending = self._pending, []
                    stopped = self._stopped
                self._handle(cmds)
                if stopped:
                    break
                if not engine.has_unfinished_requests():
                    continue
                outputs = engine.step()
                self.stats.steps_total += 1
                new_tokens = engine.step_num_new_tokens
                self.stats.generation_tokens_total += sum(new_tokens.values())
                # Timings follow the tokens, whatever output kind a request streams.
                finished_ids = {out.request_id for out in outputs if out.finished}
                for rid, k in new_tokens.items():
                    stream = self._streams.get(rid)
                    if stream is not None:
                        self._observe(stream, k, rid in finished_ids)
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
                        self.stats.requests_finished_total += 1
                    if stream is not None:
                        stream.put(out)
                self._refresh_stats()
                now = time.monotonic()
                if self.log_stats_interval and now - last_log >= self.log_stats_interval:
                    s = self.stats
                    dt = now - last_log
                    logger.info(
                        "running: %d reqs, waiting: %d reqs, KV cache usage: %.1f%%, "
                        "prompt throughput: %.1f tok/s, generation throughput: %.1f tok/s",
                        s.num_running, s.num_waiting, 100 * s.kv_cache_usage,
                        (s.prompt_tokens_total - last_counts[0]) / dt,
                        (s.generation_tokens_total - last_counts[1]) / dt)
                    last_log, last_counts = now, (s.prompt_tokens_total, s.generation_tokens_total)
        except BaseException as e:  # noqa: BLE001 - report to every waiter, then stop
            logger.exception("engine thread failed")
            self._dead = e
            err = EngineDeadError(f"engine failed: {e!r}")
            for stream in self._streams.values():
                stream.put(err)
            self._streams.clear()
        finally:
            with self._cond:
                cmds, self._pending = self._pending, []
            err = EngineDeadError("the engine was shut down")
            for cmd in cmds:
                if cmd[0] == "add" and not cmd[5].done():
                    cmd[5].set_exception(err)
            for stream in self._streams.values():
                stream.put(err)
            self._streams.clear()
            if self._stopped and self.engine.has_unfinished_requests():
                self.engine.abort_request(self.engine.unfinished_request_ids())

    def _handle(self, cmds: list[tuple]) -> None:
        for cmd in cmds:
            if cmd[0] == "add":
                _, rid, prompt, params, stream, fut = cmd
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    processed = self.engine.process_prompt(prompt)
                    self.engine.add_request(rid, prompt, params, processed=processed)
                except Exception as e:  # noqa: BLE001 - the caller re-raises it
                    fut.set_exception(e)
                    continue
                self._streams[rid] = stream
                self.stats.prompt_tokens_total += len(processed[1])
                fut.set_result(rid)
            elif cmd[0] == "abort":
                rid = cmd[1]
                self._streams.pop(rid, None)
                self.engine.abort_request([rid])

    def _observe(self, stream: _Stream, new_tokens: int, finished: bool) -> None:
        if self.observer is None:
            return
        now = time.monotonic()
        try:
            if new_tokens > 0:
                if stream.last_token_time is None:
                    self.observer("ttft", now - stream.arrival_time)
                    new_tokens -= 1
                else:
                    gap = (now - stream.last_token_time) / new_tokens
                    for _ in range(new_tokens):
                        self.observer("itl", gap)
                stream.last_token_time = now
            if finished:
                self.observer("e2e", now - stream.arrival_time)
        except Exception:  # noqa: BLE001 - metrics must never break the engine
            logger.exception("metrics observer failed")

    def _refresh_stats(self) -> None:
        s = self.stats
        sched = self.engine.engine_core.scheduler
        s.num_running = sched.num_running
        s.num_waiting = sched.num_waiting
        s.num_preemptions_total = sched.num_preemptions
        kv = sched.kv_cache_manager
        s.kv_cache_usage = kv.usage
        s.num_used_blocks = kv.num_used_blocks
        s.prefix_cache_queries_total = kv.prefix_cache_stats.queries
        s.prefix_cache_hits_total = kv.prefix_cache_stats.hits
        s.num_cached_blocks = kv.pool.num_cached_blocks
        connector = getattr(self.engine.engine_core, "kv_connector", None)
        if connector is not None:
            s.external_kv = connector.stats.snapshot()["stores"]
