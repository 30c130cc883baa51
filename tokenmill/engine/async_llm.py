"""AsyncLLM: one LLMEngine stepped by one background thread, streamed to asyncio callers.

The engine thread is the only code that touches the engine. Callers hand it
commands (add a request, abort one) through a locked list that it drains
before every step; it sleeps on a condition variable while there is nothing
to do. Each request's outputs go back to the caller's event loop with
`loop.call_soon_threadsafe` into that request's `asyncio.Queue`.

`add_request()` does the slow part of adding a request (tokenizing, checking
the parameters, compiling a grammar, with a time limit) on a small thread
pool, off the event loop and off the engine thread; it raises the engine's
ParamError (bad prompt, bad parameters, duplicate id) before anything runs, and
EngineOverloadedError when `max_num_waiting` requests already wait. A consumer
that stops iterating (closed, cancelled, client gone) aborts its request, so
its KV blocks are freed.

Engine death is loud: every open stream raises EngineDeadError, new requests
are refused, `is_healthy()` turns False and the death callbacks run (the server
exits). A step that makes no progress for `step_timeout` seconds counts as
death (a watchdog thread checks).
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

from tokenmill import faults
from tokenmill.engine.llm_engine import EngineArgs, LLMEngine, PreparedRequest
from tokenmill.errors import EngineDeadError, EngineOverloadedError, ParamError
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "EngineOverloadedError", "EngineStats"]

# Threads that tokenize prompts, render chat templates and check parameters.
PREPARE_WORKERS = 2


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
    draft_resumes_total: int = 0
    steps_total: int = 0
    # Prefix caching and the external KV tier (tokenmill.kv_connector.setup.kv_cache_stats).
    prefix_cache_queries_total: int = 0  # prompt tokens looked up
    prefix_cache_hits_total: int = 0  # of those, found in the cache
    num_cached_blocks: int = 0  # blocks holding a cached prefix (in use or evictable)
    # Per external store name: hit_blocks, hit_tokens, bytes_loaded, blocks_stored,
    # bytes_stored, load_failures, store_failures (cumulative).
    external_kv: dict = field(default_factory=dict)
    # Requests the engine failed (finish_reason "error"), by reason: nan_logits,
    # token_out_of_vocab, fault, step_fault, grammar, output.
    requests_errored_total: dict = field(default_factory=dict)
    requests_aborted_total: int = 0
    # Speculative decoding (tokenmill.spec_decode.metrics.SpecDecodingStats.as_dict);
    # empty when off.
    spec_decoding: dict = field(default_factory=dict)


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


# Commands the caller threads queue for the engine thread (AsyncLLM._pending).
@dataclass(frozen=True)
class _AddRequest:
    """Add a prepared request; `future` gets its id once it is in (or why not)."""
    request_id: str
    prepared: PreparedRequest
    stream: _Stream
    future: concurrent.futures.Future


@dataclass(frozen=True)
class _AbortRequest:
    request_id: str


class AsyncLLM:
    def __init__(self, engine: LLMEngine, log_stats_interval: float | None = 5.0,
                 observer=None, *, max_num_waiting: int | None = None,
                 step_timeout: float | None = None):
        """`observer`, if given, is called on the engine thread with
        (kind, seconds) for kind in "ttft", "itl" (one per new token after the
        first; a step that adds k tokens gives k equal intervals) and "e2e".
        `max_num_waiting`: requests (completions) allowed to wait for the engine
        before add_request refuses more (None: no limit). `step_timeout`: seconds
        one engine step may take before the engine counts as dead (None: no limit)."""
        self.observer = observer
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.log_stats_interval = log_stats_interval
        self.max_num_waiting = max_num_waiting
        self.step_timeout = step_timeout
        self.stats = EngineStats()
        self._cond = threading.Condition()
        self._pending: list[_AddRequest | _AbortRequest] = []
        self._stopped = False
        self._dead: BaseException | None = None
        self._death_callbacks: list = []
        self._streams: dict[str, _Stream] = {}  # engine thread (and _die) only
        self._num_admitting = 0  # accepted by add_request, not yet in the scheduler
        self._step_started: float | None = None  # monotonic time of the step in progress
        self._prepare_pool = concurrent.futures.ThreadPoolExecutor(
            PREPARE_WORKERS, thread_name_prefix="tokenmill-prepare")
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()
        if step_timeout:
            threading.Thread(target=self._watchdog, name="tokenmill-watchdog",
                             daemon=True).start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs) -> "AsyncLLM":
        return cls(LLMEngine(args), **kwargs)

    # ---- caller side ---------------------------------------------------------
    def _submit(self, cmd: _AddRequest | _AbortRequest) -> None:
        with self._cond:
            if self._stopped or self._dead is not None:
                raise EngineDeadError("the engine is not running")
            self._pending.append(cmd)
            self._cond.notify()
        wakeup = getattr(self.engine.engine_core, "wakeup", None)
        if wakeup is not None:  # an engine core in another process: stop waiting on it
            wakeup()

    async def run_blocking(self, fn, *args, **kwargs):
        """Run slow host work (tokenizing, rendering a chat template) on the prepare
        pool: off the event loop and off the engine thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._prepare_pool,
                                          lambda: fn(*args, **kwargs))

    def _admit(self, params: SamplingParams | None) -> int:
        """Admission control: refuse (503 + Retry-After) when too many requests wait."""
        if self._stopped or self._dead is not None:
            raise EngineDeadError("the engine is not running")
        n = params.n if isinstance(params, SamplingParams) else 1
        # An n past the engine's cap is a bad request (prepare_request's 400 naming n), not
        # a full queue: count at most the cap, or n=10**9 would be a 503 "retry later".
        n = min(n, self.engine.limits.max_n)
        limit = self.max_num_waiting
        # The scheduler's queue length, read live (an int read is safe from any thread).
        waiting = self.engine.engine_core.num_waiting
        if limit is not None and self._num_admitting + waiting + n > limit:
            raise EngineOverloadedError(f"the server is overloaded: {limit} requests are "
                                        f"already waiting; retry later", retry_after=1.0)
        self._num_admitting += n
        return n

    async def _prepare(self, prompt, params) -> PreparedRequest:
        """Tokenize and check on the pool; wait for a grammar to compile, up to the
        limit (a grammar that does not compile in time is a bad request: it is never
        run unconstrained)."""
        engine = self.engine
        prepared = await self.run_blocking(engine.prepare_request, prompt, params)
        sop = getattr(prepared.params, "structured_outputs", None)  # (PoolingParams: none)
        if sop is not None:
            timeout = engine.limits.grammar_compile_timeout
            fut = engine.engine_core.structured_output.grammar_future(sop)
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), timeout)
            except asyncio.TimeoutError:
                raise ParamError(sop.field_name(), f"{sop.field_name()}: the grammar did not "
                                                   f"compile within {timeout:g} s") from None
            except Exception as e:  # noqa: BLE001 - the compiler refused it
                raise ParamError(sop.field_name(), f"{sop.field_name()}: the grammar failed "
                                                   f"to compile ({type(e).__name__})") from None
        return prepared

    async def add_request(self, prompt, sampling_params: SamplingParams | None,
                          request_id: str | None = None) -> tuple[str, asyncio.Queue]:
        """Validate and enqueue on the engine thread (PoolingParams for `sampling_params`:
        an embedding request, one EmbeddingRequestOutput when done). Raises ParamError
        (a ValueError) for bad input, EngineOverloadedError when the queue is full,
        EngineDeadError."""
        return (await self.add_requests([prompt], sampling_params, [request_id]))[0]

    async def add_requests(self, prompts: list, sampling_params: SamplingParams | None,
                           request_ids: list[str | None]) -> list[tuple[str, asyncio.Queue]]:
        """add_request for the prompts of one client request, all or none: every prompt
        is admitted and validated before any enters the engine, so a bad or refused one
        runs none of the others (nothing is computed for an answer that is an error).
        If entering fails part way, those already in are aborted."""
        loop = asyncio.get_running_loop()
        request_ids = [rid or uuid.uuid4().hex for rid in request_ids]
        admitted = 0
        try:
            for _ in prompts:
                admitted += self._admit(sampling_params)
            # Their arrival times: TTFT includes tokenizing.
            streams = [_Stream(loop, asyncio.Queue()) for _ in prompts]
            prepared = [await self._prepare(p, sampling_params) for p in prompts]
            added: list[tuple[str, asyncio.Queue]] = []
            try:
                for rid, prep, stream in zip(request_ids, prepared, streams):
                    fut: concurrent.futures.Future = concurrent.futures.Future()
                    self._submit(_AddRequest(rid, prep, stream, fut))
                    try:
                        await asyncio.wrap_future(fut)
                    except asyncio.CancelledError:
                        self.abort(rid)  # queued after the add: frees it if it went in
                        raise
                    # (only once in: an add refused, say for an id in use, is not aborted,
                    # which would abort the other request of that id)
                    added.append((rid, stream.queue))
            except BaseException:
                for rid, _ in added:
                    self.abort(rid)
                raise
        finally:
            self._num_admitting -= admitted
        return added

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative RequestOutputs, one per engine step that advanced this request."""
        request_id, queue = await self.add_request(prompt, sampling_params, request_id)
        async for out in self.stream(request_id, queue):
            yield out

    async def stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """The outputs of a request added with add_request(); leaving early aborts it.
        Raises EngineDeadError if the engine dies meanwhile."""
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
            self._submit(_AbortRequest(request_id))
        except EngineDeadError:
            pass

    def is_healthy(self) -> bool:
        return self._dead is None and not self._stopped and self._thread.is_alive()

    def add_death_callback(self, fn) -> None:
        """fn(exc) is called once, on some engine-side thread, if the engine dies (a
        failed or stuck step; not a clean shutdown)."""
        self._death_callbacks.append(fn)
        if self._dead is not None:
            fn(self._dead)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        wakeup = getattr(self.engine.engine_core, "wakeup", None)
        if wakeup is not None:
            wakeup()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)
        if not self._thread.is_alive():  # else the engine thread still uses it
            self.engine.shutdown()

    # ---- death -----------------------------------------------------------------
    def _die(self, err: EngineDeadError) -> None:
        """Mark the engine dead (once): fail every open stream and pending add, run
        the death callbacks. Called by the engine thread or the watchdog."""
        with self._cond:
            if self._dead is not None:
                return
            self._dead = err
            cmds, self._pending = self._pending, []
        self._fail_adds(cmds, err)
        for stream in list(self._streams.values()):
            stream.put(err)
        for fn in list(self._death_callbacks):
            try:
                fn(err)
            except Exception:  # noqa: BLE001 - one callback must not stop the others
                logger.exception("engine death callback failed")

    def _watchdog(self) -> None:
        """A step that makes no progress for step_timeout seconds is a dead engine."""
        timeout = self.step_timeout
        while self._dead is None and not self._stopped:
            time.sleep(min(1.0, timeout / 4))
            started = self._step_started
            stalled = time.monotonic() - started if started is not None else 0.0
            silent_for = getattr(self.engine.engine_core, "silent_for", None)
            if silent_for is not None:  # a core in another process: its last message
                stalled = max(stalled, silent_for())
            if stalled > timeout:
                logger.error("an engine step made no progress for %g s: the engine is dead",
                             timeout)
                self._die(EngineDeadError(f"the engine stalled: a step made no progress "
                                          f"for {timeout:g} s"))
                return

    # ---- engine thread -------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        idle_refresh_s = getattr(engine.engine_core, "idle_refresh_s", None)
        last_log = time.monotonic()
        last_counts = (0, 0)
        try:
            while True:
                with self._cond:
                    while (not self._pending and not self._stopped
                           and not engine.has_unfinished_requests()):
                        self._refresh_stats()
                        # A core in another process changes while this one waits
                        # (an abort lands, a replica dies): look again now and then.
                        self._cond.wait(idle_refresh_s)
                        # throughput in the stats line is over busy time only
                        last_log = time.monotonic()
                        last_counts = (self.stats.prompt_tokens_total,
                                       self.stats.generation_tokens_total)
                    cmds, self._pending = self._pending, []
                    stopped = self._stopped
                self._handle(cmds)
                if stopped or self._dead is not None:
                    break
                if not engine.has_unfinished_requests():
                    continue
                if faults.ARMED:
                    self._inject_step_loop_fault()
                self._step_started = time.monotonic()
                outputs = engine.step()
                self._step_started = None
                if self._dead is not None:  # the watchdog gave up on this step
                    break
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
                        if out.error is None:
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
                    if s.spec_decoding:
                        sd = s.spec_decoding
                        logger.info("speculative decoding: mean acceptance length %.2f, "
                                    "accepted %d of %d draft tokens, per position %s",
                                    sd["mean_acceptance_length"], sd["num_accepted_tokens"],
                                    sd["num_draft_tokens"], sd["accepted_per_position"])
                    last_log, last_counts = now, (s.prompt_tokens_total, s.generation_tokens_total)
        except BaseException:  # noqa: BLE001 - report to every waiter, then stop
            logger.exception("engine thread failed")
            # The message goes to clients: no repr of the exception (the log has it).
            self._die(EngineDeadError("the engine failed; see the server log"))
        finally:
            with self._cond:
                cmds, self._pending = self._pending, []
            err = EngineDeadError("the engine was shut down")
            self._fail_adds(cmds, err)
            for stream in self._streams.values():
                stream.put(self._dead or err)
            self._streams.clear()
            if self._stopped and self._dead is None and self.engine.has_unfinished_requests():
                self.engine.abort_request(self.engine.unfinished_request_ids())

    def _inject_step_loop_fault(self) -> None:
        for rid, state in self.engine.output_processor.requests.items():
            if faults.fires("step_loop", rid, state.prompt_token_ids):
                raise faults.InjectedFault(f"the step loop, with {rid}")

    @staticmethod
    def _fail_adds(cmds: list[_AddRequest | _AbortRequest], err: BaseException) -> None:
        """Commands that will never run: their adds' callers get `err`."""
        for cmd in cmds:
            if isinstance(cmd, _AddRequest) and not cmd.future.done():
                cmd.future.set_exception(err)

    def _handle(self, cmds: list[_AddRequest | _AbortRequest]) -> None:
        for cmd in cmds:
            if isinstance(cmd, _AddRequest):
                rid, prepared, stream, fut = cmd.request_id, cmd.prepared, cmd.stream, cmd.future
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    self.engine.add_request(rid, None, prepared=prepared)
                except Exception as e:  # noqa: BLE001 - the caller re-raises it
                    fut.set_exception(e)
                    continue
                self._streams[rid] = stream
                self.stats.prompt_tokens_total += len(prepared.prompt_token_ids)
                fut.set_result(rid)
            elif isinstance(cmd, _AbortRequest):
                rid = cmd.request_id
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
        core = self.engine.engine_core.stats()
        s.num_running = core.num_running
        s.num_waiting = core.num_waiting
        s.num_preemptions_total = core.num_preemptions
        s.draft_resumes_total = core.num_draft_resumes
        s.steps_total = core.num_steps
        s.kv_cache_usage = core.kv_cache_usage
        s.num_used_blocks = core.num_used_blocks
        s.prefix_cache_queries_total = core.prefix_cache_queries
        s.prefix_cache_hits_total = core.prefix_cache_hits
        s.num_cached_blocks = core.num_cached_blocks
        s.requests_errored_total = dict(core.num_errors)
        s.requests_aborted_total = core.num_aborted
        if core.spec_decoding is not None:
            s.spec_decoding = core.spec_decoding
        if core.external_kv is not None:
            s.external_kv = core.external_kv
