"""Store calls with a deadline: a store that hangs costs the engine one deadline.

Each (store, purpose) pair - the scheduler half's existence lookups, the worker
half's reads - gets its own daemon thread (`StoreCaller`). `call(fn, timeout)`
runs `fn` there and waits at most `timeout` seconds; past it the caller gets
StoreUnavailable and goes on (a lookup answers as a miss, a read is a load
failure), while `fn` is left to finish on the thread (a Redis call ends at its
socket timeout). Until it has, further calls are refused at once (StoreUnavailable,
"busy") instead of queueing behind it, so a store that stopped answering stalls
no later step. A store that cannot block (the in-process CPU store) is called
directly. No torch here.
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.kv_connector.stores import StoreUnavailable


@dataclass(frozen=True)
class _Call:
    """A call handed to a StoreCaller's thread: run `fn`, settle `future` with it."""
    fn: Callable[[], object]
    future: concurrent.futures.Future


class StoreCaller:
    def __init__(self, name: str, blocking: bool = True):
        self.name = name
        self.blocking = blocking  # False: call in the caller's thread (it cannot hang)
        self._lock = threading.Lock()
        self._busy = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # _Call; None: stop
        self._thread: threading.Thread | None = None
        self.num_timeouts = 0

    @property
    def busy(self) -> bool:
        """A call is still running on the thread (maybe one its caller gave up on)."""
        return self._busy

    def submit(self, fn) -> concurrent.futures.Future:
        """Run `fn` on the thread: its future. Raises StoreUnavailable while an earlier
        call still runs."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.blocking:
            try:
                fut.set_result(fn())
            except Exception as e:  # noqa: BLE001 - handed to whoever waits
                fut.set_exception(e)
            return fut
        with self._lock:
            if self._busy:
                raise StoreUnavailable(f"{self.name}: still busy with an earlier call")
            self._busy = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name=self.name)
                self._thread.start()
        self._queue.put(_Call(fn, fut))
        return fut

    def call(self, fn, timeout: float):
        """`fn()`, or StoreUnavailable when it raised that, is refused (busy) or has not
        returned within `timeout` seconds."""
        fut = self.submit(fn)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            self.num_timeouts += 1
            raise StoreUnavailable(f"{self.name}: no answer within {timeout:g} s") from None

    def close(self) -> None:
        """Stop the thread once its current call (if any) returns."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut = item.future
            try:
                result, error = item.fn(), None
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                result, error = None, e
            with self._lock:  # free before the waiter wakes: its next call is accepted
                self._busy = False
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)
