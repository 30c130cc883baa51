"""Store calls bounded in time (tokenmill/kv_connector/calls.py): a call that has not
returned by its deadline is given up on, and while it still runs the store's next calls
are refused at once instead of queueing behind it."""
from __future__ import annotations

import threading
import time

import pytest

from tokenmill.kv_connector.calls import StoreCaller
from tokenmill.kv_connector.stores import StoreUnavailable


def test_a_call_past_its_deadline_is_given_up_and_the_store_refused_meanwhile():
    caller = StoreCaller("t")
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="no answer within 0.1 s"):
        caller.call(lambda: release.wait(30), 0.1)
    assert time.monotonic() - t0 < 5 and caller.busy and caller.num_timeouts == 1
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="busy"):
        caller.call(lambda: 1, 10)
    assert time.monotonic() - t0 < 1  # refused at once, not queued
    release.set()
    deadline = time.monotonic() + 5
    while caller.busy:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert caller.call(lambda: 2, 5) == 2
    caller.close()


def test_errors_pass_through_and_a_nonblocking_store_is_called_inline():
    caller = StoreCaller("t")
    with pytest.raises(StoreUnavailable, match="down"):
        caller.call(lambda: (_ for _ in ()).throw(StoreUnavailable("down")), 5)
    assert caller.call(lambda: 3, 5) == 3  # not left busy by the error
    caller.close()
    inline = StoreCaller("cpu", blocking=False)
    assert inline.call(threading.current_thread, 5) is threading.current_thread()
    assert inline._thread is None


def test_lookup_and_load_deadlines_are_validated():
    from tokenmill.kv_connector.config import KVConnectorConfig
    cfg = KVConnectorConfig.from_any({"stores": ["cpu"], "lookup_timeout_s": 0.05,
                                      "load_timeout_s": 3})
    assert (cfg.lookup_timeout_s, cfg.load_timeout_s) == (0.05, 3)
    assert KVConnectorConfig().lookup_timeout_s == 0.1 and KVConnectorConfig().load_timeout_s == 2
    for name in ("lookup_timeout_s", "load_timeout_s"):
        for bad in (0, -1, True, "1", float("nan")):
            with pytest.raises(ValueError, match=name):
                KVConnectorConfig.from_any({"stores": ["cpu"], name: bad})
