"""An EngineCore in its own process: a busy loop fed by ZeroMQ, msgpack frames.

The front end (tokenmill.engine.core_client) binds two sockets: a PUSH per core
for requests and commands, and one PULL that every core's outputs arrive on.
The core connects to both, builds its EngineCore, says "ready", then loops:

    take every waiting input (block only while it has nothing to run)
    step, and send the step's outputs with the stats after it

One message per step, also when no request produced a token (a prompt chunk):
the front end reads the messages as the core's heartbeat. A core that fails
sends "dead" with the reason and exits; a core whose front end went away exits.
"""
from __future__ import annotations

import logging
import os
import signal
import sys

from tokenmill.core import serial
from tokenmill.engine.core_messages import (INPUT_TYPES, UTILITY_METHODS, CoreDead, CoreOutputs,
                                            EngineCoreRequest, UtilityCall, UtilityResult)

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000  # how often an idle core checks that its front end is alive


def die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies (no orphans that
    hold memory and cores). Elsewhere the idle loop notices the new parent pid."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def pin_cpus(cpus: list[int] | None, num_threads: int | None) -> None:
    """Before torch starts its thread pool: this core's CPUs and intra-op threads."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    if num_threads:
        import torch
        torch.set_num_threads(num_threads)


def run_engine_core(args, input_addr: str, output_addr: str, replica: int,
                    cpus: list[int] | None = None, num_threads: int | None = None,
                    watch_parent: bool = True) -> None:
    """The core process's main (also a Ray actor's): returns when told to shut down,
    or when the front end is gone; exits the loop on a fatal error after saying so."""
    import zmq
    parent = os.getppid()
    if watch_parent:
        die_with_parent()
    pin_cpus(cpus, num_threads)
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 5000)
    out.connect(output_addr)
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    tag = str(replica).encode()

    def send(kind: bytes, payload) -> None:
        out.send_multipart([tag, kind, serial.encode(payload)], copy=False)

    try:
        from tokenmill.engine.engine_args import build_engine_core
        core = build_engine_core(args)
    except BaseException as e:  # noqa: BLE001 - the front end raises it
        logger.exception("engine core %d failed to start", replica)
        send(b"dead", CoreDead(type(e).__name__, str(e)))
        inp.close(linger=0)  # an open socket would hold ctx.term() until we are killed
        out.close()
        ctx.term()
        return
    send(b"ready", core.info())
    loop = _CoreLoop(core, inp, send)
    try:
        loop.run(lambda: watch_parent and os.getppid() != parent)
    except BaseException as e:  # noqa: BLE001 - say why, then go
        logger.exception("engine core %d died", replica)
        send(b"dead", CoreDead(type(e).__name__, str(e) or type(e).__name__))
    finally:
        try:
            core.shutdown()
        except Exception:  # noqa: BLE001 - already on the way out
            logger.exception("engine core %d: shutdown failed", replica)
        inp.close(linger=0)
        out.close()
        ctx.term()


class _CoreLoop:
    def __init__(self, core, inp, send):
        import zmq
        self.zmq = zmq
        self.core, self.inp, self.send = core, inp, send
        self.poller = zmq.Poller()
        self.poller.register(inp, zmq.POLLIN)
        self.decoders = {kind: serial.decoder(t) for kind, t in INPUT_TYPES.items()}
        self.stopping = False

    def run(self, parent_gone) -> None:
        core = self.core
        while not self.stopping:
            busy = core.has_unfinished_requests()
            if not self.poller.poll(0 if busy else IDLE_POLL_MS) and not busy:
                if parent_gone():
                    logger.warning("the front end is gone: the engine core exits")
                    return
                continue
            self._take_inputs()
            if self.stopping:
                return
            if core.has_unfinished_requests():
                outputs = core.step()
                self.send(b"out", CoreOutputs(outputs, core.stats()))
            else:  # an abort emptied it: no step will say so, the stats must
                self.send(b"out", CoreOutputs([], core.stats()))

    def _take_inputs(self) -> None:
        zmq = self.zmq
        while True:
            try:
                kind, payload = self.inp.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(kind, self.decoders[kind](payload))
            if self.stopping:
                return

    def _handle(self, kind: bytes, msg) -> None:
        core = self.core
        if kind == b"add":
            self._add(msg)
        elif kind == b"abort":
            core.abort_requests(msg.request_ids)
        elif kind == b"finish":
            from tokenmill.core.request import RequestStatus
            core.finish_requests(msg.request_ids, RequestStatus(msg.status), msg.stop_reason)
        elif kind == b"fail":  # (named on the wire; EngineCore takes the scheduler's pairs)
            core.fail_requests({rid: (f.reason, f.message) for rid, f in msg.failures.items()},
                               msg.emit)
        elif kind == b"call":
            self._call(msg)
        elif kind == b"shutdown":
            self.stopping = True

    def _add(self, msg: EngineCoreRequest) -> None:
        from tokenmill.core.request import Request
        from tokenmill.core.scheduler import EngineCoreOutput
        try:
            self.core.add_request(Request(
                msg.request_id, msg.prompt_token_ids, msg.sampling_params,
                frozenset(msg.eos_token_ids), msg.arrival_time, msg.share_prompt_with,
                msg.cache_salt, msg.mm_features, msg.pooling_params))
        except Exception as e:  # noqa: BLE001 - this request fails, the core goes on
            logger.exception("request %s: the engine core refused it", msg.request_id)
            self.send(b"out", CoreOutputs(
                [EngineCoreOutput(msg.request_id, [], "error",
                                  error=f"the engine core refused this request ({e})")],
                self.core.stats()))

    def _call(self, msg: UtilityCall) -> None:
        if msg.method not in UTILITY_METHODS:
            self.send(b"call", UtilityResult(msg.call_id, error=f"no method {msg.method!r}"))
            return
        try:
            result = getattr(self.core, msg.method)(*msg.args)
        except Exception as e:  # noqa: BLE001 - the caller raises it
            self.send(b"call", UtilityResult(msg.call_id, error=f"{type(e).__name__}: {e}"))
            return
        self.send(b"call", UtilityResult(msg.call_id, result))

