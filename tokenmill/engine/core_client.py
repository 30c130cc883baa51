"""The front end's handle on engine cores in other processes (vLLM's MP client shape).

`MPEngineCoreClient` has the surface LLMEngine uses on an in-process EngineCore
(add_request, abort/finish/fail_requests, step, has_unfinished_requests,
has_request, stats, kv_cache_stats, shutdown), so LLMEngine and AsyncLLM work on
either. Behind it, one engine core per data-parallel replica, each a busy loop
in its own process (tokenmill.engine.core_proc) started by a launcher:

* "mp": local processes (multiprocessing, spawn), each pinned to its own share
  of the CPUs with as many intra-op threads;
* "ray": Ray actors, each reserving its CPUs from a running Ray cluster (or a
  local one started on demand).

Requests go to the replica with the fewest unfinished requests (waiting +
running, as this side counts them: adds minus finishes); the completions of an
n > 1 request stay together, since they share their prompt's blocks.

step() returns whatever outputs the cores have sent, waiting for the first up to
a poll interval; `wakeup()` (any thread) cuts that wait short, so the caller can
take in new requests. A replica that dies is dropped from routing and its
requests finish with an error; when none is left the engine is dead.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future

from tokenmill.core import serial
from tokenmill.core.request import Request
from tokenmill.core.scheduler import EngineCoreOutput
from tokenmill.engine.core_messages import (OUTPUT_TYPES, AbortCommand, CoreInfo, CoreStats,
                                            EngineCoreRequest, FailCommand, FinishCommand,
                                            RequestFailure, UtilityCall, merge_stats)
from tokenmill.errors import EngineDeadError

logger = logging.getLogger(__name__)

POLL_S = 0.5  # the longest one step() waits for outputs (liveness is checked between)
# An idle caller looks at the cores this often (stats, a replica that died).
IDLE_REFRESH_S = 0.5
HEALTH_CHECK_S = 0.5  # how often the cores' processes are looked at while messages flow
SEND_CHECK_MS = 1000  # a send that waits this long checks that its core is alive
STARTUP_TIMEOUT_S = 900.0  # loading a large checkpoint on a slow disk
SHUTDOWN_TIMEOUT_S = 10.0


class _Replica:
    """One engine core as the front end sees it."""

    def __init__(self, index: int, socket, handle):
        self.index = index
        self.socket = socket  # PUSH: requests and commands
        self.handle = handle  # the launcher's: is_alive(), stop(), kill()
        self.info: CoreInfo | None = None
        self.stats = CoreStats()
        self.unfinished: set[str] = set()
        self.num_routed = 0  # requests sent here, ever
        self.alive = True
        self.death: str | None = None


class MPEngineCoreClient:
    def __init__(self, args, setup):
        import zmq
        self.args = args
        # The front end's own grammar manager: it checks grammars (and bounds their
        # compile time) before they reach a core, which compiles its own copy.
        self.structured_output = setup.structured_output()
        self.platform = setup.platform
        self.num_replicas = args.data_parallel_size
        self.backend = args.distributed_executor_backend
        from tokenmill.engine.launchers import make_launcher
        self._launcher = make_launcher(self.backend, self.num_replicas)  # (Ray: connects)
        self._ctx = zmq.Context()
        self._ipc_dir = tempfile.mkdtemp(prefix="tokenmill-zmq-")
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out_addr = self._bind(self._out, "out")
        self._lock = threading.Lock()  # whoever holds it reads the output socket
        # Read, not yet taken by step(): one list per core step. step() hands out one at a
        # time, as an in-process core would: a request has one output per list.
        self._outputs: collections.deque[list[EngineCoreOutput]] = collections.deque()
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._replica_of: dict[str, _Replica] = {}
        self._last_message = self._last_health_check = time.monotonic()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._out, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._closed = False
        self._decoders = {kind: serial.decoder(t) for kind, t in OUTPUT_TYPES.items()}
        self.replicas: list[_Replica] = []
        # The processes go with this object, or at exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _cleanup, self._launcher, self._ipc_dir)
        try:
            for i in range(self.num_replicas):
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, SEND_CHECK_MS)
                try:
                    addr = self._bind(sock, f"in{i}")
                    handle = self._launcher.start(i, args, addr, self._out_addr)
                except BaseException:
                    sock.close(linger=0)  # not a replica's yet: shutdown() would miss it
                    raise
                self.replicas.append(_Replica(i, sock, handle))
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        info = self.replicas[0].info
        self.async_scheduling = info.async_scheduling
        self.enable_prefix_caching = info.enable_prefix_caching
        logger.info("engine core%s in %d process%s (%s): %s", "s" if self.num_replicas > 1 else "",
                    self.num_replicas, "es" if self.num_replicas > 1 else "", self.backend,
                    ", ".join(f"pid {r.info.pid}" for r in self.replicas))

    def _bind(self, sock, name: str) -> str:
        if self.backend == "ray":  # an actor may run on another node: TCP on this node's IP
            import ray
            host = ray.util.get_node_ip_address()
            port = sock.bind_to_random_port(f"tcp://{host}")
            return f"tcp://{host}:{port}"
        addr = f"ipc://{self._ipc_dir}/{name}"
        sock.bind(addr)
        return addr

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while any(r.info is None for r in self.replicas):
            self._read(timeout_s=0.5)
            for r in self.replicas:
                if r.info is None and (r.death is not None or not r.handle.is_alive()):
                    r.alive = False  # never started: shutdown() sends it nothing
                    self._raise_start_failure(r)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine cores did not start within "
                                   f"{STARTUP_TIMEOUT_S:g} s")

    @staticmethod
    def _raise_start_failure(r: _Replica):
        if r.death is None:
            raise RuntimeError(f"engine core {r.index} exited while starting "
                               f"(exit code {r.handle.exitcode()}); see the log above")
        kind, _, message = r.death.partition(": ")
        exc = ValueError if kind == "ValueError" else RuntimeError
        raise exc(message if exc is ValueError else r.death)

    # ---- requests and commands ---------------------------------------------------
    def add_request(self, request: Request) -> None:
        replica = self._route(request)
        msg = EngineCoreRequest(request.request_id, request.prompt_token_ids,
                                request.sampling_params, sorted(request.eos_token_ids),
                                request.arrival_time, request.share_prompt_with,
                                request.cache_salt, request.mm_features,
                                request.pooling_params)
        if not self.has_unfinished_requests():
            self._last_message = time.monotonic()  # silence counts from now
        replica.unfinished.add(request.request_id)
        replica.num_routed += 1
        self._replica_of[request.request_id] = replica
        self._send(replica, b"add", msg)

    def _route(self, request: Request) -> _Replica:
        if request.share_prompt_with is not None:
            sibling = self._replica_of.get(request.share_prompt_with)
            if sibling is not None and sibling.alive:
                return sibling
        alive = [r for r in self.replicas if r.alive]
        if not alive:
            raise EngineDeadError("every engine core has died")
        return min(alive, key=lambda r: len(r.unfinished))

    def abort_requests(self, request_ids) -> list[str]:
        return self._forget(request_ids, b"abort", AbortCommand)

    def finish_requests(self, request_ids, status, stop_reason=None) -> list[str]:
        return self._forget(request_ids, b"finish",
                            lambda ids: FinishCommand(ids, status.value, stop_reason))

    def fail_requests(self, failures: dict[str, tuple[str, str]], emit: bool = True) -> list[str]:
        def named(ids) -> dict[str, RequestFailure]:
            return {i: RequestFailure(*failures[i]) for i in ids}

        if emit:  # the core's error output finishes them here
            for replica, ids in self._by_replica(failures).items():
                self._send(replica, b"fail", FailCommand(named(ids), True))
            return list(failures)
        return self._forget(list(failures), b"fail", lambda ids: FailCommand(named(ids), False))

    def _forget(self, request_ids, kind: bytes, payload) -> list[str]:
        """Requests this side has finished: tell their cores, stop tracking them."""
        done = []
        for replica, ids in self._by_replica(request_ids).items():
            for rid in ids:
                replica.unfinished.discard(rid)
                self._replica_of.pop(rid, None)
            if replica.alive:
                self._send(replica, kind, payload(ids))
            done += ids
        return done

    def _by_replica(self, request_ids) -> dict[_Replica, list[str]]:
        out: dict[_Replica, list[str]] = {}
        for rid in request_ids:
            replica = self._replica_of.get(rid)
            if replica is not None:
                out.setdefault(replica, []).append(rid)
        return out

    def _send(self, replica: _Replica, kind: bytes, payload) -> None:
        """Send, waiting while the core is alive but behind (backpressure); a PUSH whose
        core died would block for good, so each wait is short and checks the process."""
        import zmq
        frames = [kind, serial.encode(payload)]
        while replica.alive:
            try:
                replica.socket.send_multipart(frames, copy=False)
                return
            except zmq.Again:
                if not replica.handle.is_alive():
                    with self._lock:
                        replica.death = replica.death or f"exit code {replica.handle.exitcode()}"
                        self._replica_died(replica)
                        replica.alive = False  # also one that died before it was ready

    # ---- outputs ------------------------------------------------------------------
    def wakeup(self) -> None:
        """Cut a waiting step() short (any thread): new work is queued for the caller."""
        try:
            os.write(self._wake_w, b"w")
        except (BlockingIOError, OSError):
            pass  # already signalled (or closed)

    def step(self) -> list[EngineCoreOutput]:
        """The outputs of the oldest core step not yet taken, waiting up to POLL_S for
        one; [] when woken up or when nothing came."""
        with self._lock:
            if not self._outputs:
                self._read(POLL_S)
            return self._outputs.popleft() if self._outputs else []

    def _read(self, timeout_s: float) -> None:
        """Read what the cores sent (waiting up to timeout_s for the first message);
        check the cores' processes when nothing came, and every HEALTH_CHECK_S while
        messages flow. Holder of _lock only."""
        import zmq
        events = dict(self._poller.poll(timeout_s * 1000))
        if self._wake_r in events:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        got = False
        if self._out in events:
            while True:
                try:
                    tag, kind, payload = self._out.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                got = True
                self._on_message(self.replicas[int(tag)], kind, self._decoders[kind](payload))
        now = time.monotonic()
        if got:
            self._last_message = now
        # Also while messages flow: one busy replica must not hide a dead one.
        if not got or now - self._last_health_check > HEALTH_CHECK_S:
            self._last_health_check = now
            self._check_health()

    def _on_message(self, replica: _Replica, kind: bytes, msg) -> None:
        if kind == b"out":
            replica.stats = msg.stats
            outputs = []
            for out in msg.outputs:
                if out.finished:
                    if out.request_id in replica.unfinished:
                        replica.unfinished.discard(out.request_id)
                        self._replica_of.pop(out.request_id, None)
                    elif out.request_id not in self._replica_of:
                        continue  # finished here already (abort, stop string)
                outputs.append(out)
            if outputs:
                self._outputs.append(outputs)
        elif kind == b"ready":
            replica.info = msg
            replica.stats.num_kv_blocks = msg.num_kv_blocks
        elif kind == b"call":
            fut = self._calls.pop(msg.call_id, None)
            if fut is not None:
                if msg.error is not None:
                    fut.set_exception(RuntimeError(msg.error))
                else:
                    fut.set_result(msg.result)
        elif kind == b"dead":
            replica.death = f"{msg.error_type}: {msg.message}"
            self._replica_died(replica)

    def _check_health(self) -> None:
        for r in self.replicas:
            if r.alive and r.info is not None and not r.handle.is_alive():
                r.death = r.death or f"exit code {r.handle.exitcode()}"
                self._replica_died(r)

    def _replica_died(self, replica: _Replica) -> None:
        if not replica.alive or replica.info is None:
            return
        replica.alive = False
        logger.error("engine core %d died (%s); %d request(s) on it fail", replica.index,
                     replica.death, len(replica.unfinished))
        failed = []
        for rid in sorted(replica.unfinished):
            self._replica_of.pop(rid, None)
            failed.append(EngineCoreOutput(
                rid, [], "error", error="the engine replica serving this request died"))
        if failed:
            self._outputs.append(failed)
        replica.unfinished.clear()
        replica.handle.kill()
        for fut in list(self._calls.values()):  # a call may wait on the dead one
            if not fut.done():
                fut.set_exception(EngineDeadError("an engine core died"))
        if not any(r.alive for r in self.replicas):
            raise EngineDeadError(f"the engine core died ({replica.death})")

    idle_refresh_s = IDLE_REFRESH_S

    def silent_for(self) -> float:
        """Seconds since a core last said anything while requests are unfinished (0
        when idle): a stalled step shows here (AsyncLLM's watchdog reads it)."""
        if not self.has_unfinished_requests():
            return 0.0
        return time.monotonic() - self._last_message

    # ---- state --------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        """A request still runs on a core, or a finished one's last output waits in the
        queue for step(). Queued outputs of requests this side has already let go of
        (aborted, finished by a stop string) are stale: they do not count, or a caller
        that aborts everything would still see work until it stepped them away."""
        if self._replica_of:
            return True
        # (a copy: list() of a deque is one C call, so another thread's step() cannot
        # change it mid-iteration)
        return any(out.finished for batch in list(self._outputs) for out in batch)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._replica_of

    @property
    def num_waiting(self) -> int:
        return sum(r.stats.num_waiting for r in self.replicas if r.alive)

    def stats(self) -> CoreStats:
        """The cores' stats as of their last messages (read now, unless step() is
        reading them on another thread)."""
        if self._lock.acquire(blocking=False):
            try:
                self._read(0)
            finally:
                self._lock.release()
        return merge_stats([r.stats for r in self.replicas if r.alive] or [CoreStats()])

    @property
    def num_kv_blocks(self) -> int:
        return sum(r.info.num_kv_blocks for r in self.replicas if r.info is not None)

    def replica_stats(self) -> list[dict]:
        """Per replica: alive, pid, requests routed and unfinished, its last stats."""
        return [{"index": r.index, "alive": r.alive, "pid": r.info.pid if r.info else None,
                 "requests_routed": r.num_routed, "unfinished": len(r.unfinished),
                 "num_running": r.stats.num_running, "num_waiting": r.stats.num_waiting}
                for r in self.replicas]

    def kv_cache_stats(self) -> dict:
        parts = self.call("kv_cache_stats")
        return parts[0] if len(parts) == 1 else _sum_nested(parts)

    def call(self, method: str, *args, timeout_s: float = 60.0) -> list:
        """`method` of every live core's EngineCore; their answers, in replica order."""
        futures = []
        for r in self.replicas:
            if r.alive:
                fut: Future = Future()
                call_id = next(self._call_ids)
                self._calls[call_id] = fut
                self._send(r, b"call", UtilityCall(call_id, method, list(args)))
                futures.append(fut)
        deadline = time.monotonic() + timeout_s
        for fut in futures:
            while not fut.done():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the engine cores did not answer {method} "
                                       f"within {timeout_s:g} s")
                # Whoever reads the socket resolves the futures: the step loop, or us.
                if self._lock.acquire(blocking=False):
                    try:
                        self._read(0.05)
                    finally:
                        self._lock.release()
                else:
                    try:
                        fut.exception(timeout=0.05)
                    except TimeoutError:
                        pass
        return [f.result() for f in futures]

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for r in self.replicas:
            if r.alive:
                try:
                    self._send(r, b"shutdown", None)
                except Exception:  # noqa: BLE001 - it is stopped below either way
                    pass
        self._launcher.stop_all(SHUTDOWN_TIMEOUT_S)
        for r in self.replicas:
            r.socket.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._finalizer()


def _cleanup(launcher, ipc_dir: str) -> None:
    launcher.stop_all(SHUTDOWN_TIMEOUT_S, graceful=False)
    shutil.rmtree(ipc_dir, ignore_errors=True)


def _sum_nested(parts: list):
    """Replicas' counters as one: numbers add up, dicts merge key by key."""
    first = parts[0]
    if isinstance(first, bool) or not isinstance(first, (int, float, dict)):
        return first
    if isinstance(first, dict):
        keys = dict.fromkeys(k for p in parts if isinstance(p, dict) for k in p)
        return {k: _sum_nested([p[k] for p in parts if isinstance(p, dict) and k in p])
                for k in keys}
    return sum(p for p in parts if p is not None)
