"""The disk KV store's byte budget: LRU eviction by access, restart, stale temp files."""
from __future__ import annotations

import os
import threading
import time

import pytest

from tokenmill.engine.arg_utils import kv_cache_kwargs
from tokenmill.entrypoints.cli import build_parser
from tokenmill.kv_connector.config import DEFAULT_DISK_BYTES, KVConnectorConfig
from tokenmill.kv_connector.stores import DiskStore, StoreUnavailable, make_store

NS = "model-L1"


def key(name: str) -> str:
    """A hex key like a block hash (the first two digits pick the folder)."""
    return name.encode().hex().ljust(64, "0")


def disk_bytes(root) -> int:
    """What the entries really take on disk (temp files excluded)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root)
               for f in fs if f.endswith(".kvb"))


def test_budget_holds_after_many_puts(tmp_path):
    s = DiskStore(NS, str(tmp_path), max_bytes=1000)
    for i in range(50):
        s.put_many([(key(f"k{i}"), b"x" * 90)])
        assert disk_bytes(tmp_path) <= 1000
    assert s.num_bytes == disk_bytes(tmp_path) == 11 * 90 and len(s) == 11
    assert s.num_evictions == 39
    # The newest survive.
    assert s.contains_many([key("k49"), key("k39"), key("k38")]) == [True, True, False]


def test_least_recently_read_is_evicted_first(tmp_path):
    s = DiskStore(NS, str(tmp_path), max_bytes=300)
    a, b, c, d = (key(n) for n in "abcd")
    s.put_many([(a, b"a" * 100), (b, b"b" * 100), (c, b"c" * 100)])
    assert s.get_many([a]) == [b"a" * 100]  # a is now the most recent
    s.put_many([(d, b"d" * 100)])
    assert s.contains_many([a, b, c, d]) == [True, False, True, True]
    assert disk_bytes(tmp_path) == 300


def test_overwrite_counts_once(tmp_path):
    s = DiskStore(NS, str(tmp_path), max_bytes=300)
    for _ in range(5):
        s.put_many([(key("a"), b"x" * 100)])
    assert s.num_bytes == 100 and len(s) == 1 and s.num_evictions == 0


def test_entry_bigger_than_budget_is_not_stored(tmp_path):
    s = DiskStore(NS, str(tmp_path), max_bytes=100)
    s.put_many([(key("a"), b"a" * 100)])
    with pytest.raises(StoreUnavailable, match="larger than the budget"):
        s.put_many([(key("big"), b"x" * 101), (key("b"), b"b" * 50)])
    assert s.contains_many([key("big"), key("a"), key("b")]) == [False, False, True]
    assert s.num_too_big == 1 and disk_bytes(tmp_path) == 50


def test_restart_rebuilds_index_in_access_order(tmp_path):
    s = DiskStore(NS, str(tmp_path), max_bytes=300)
    a, b, c, d = (key(n) for n in "abcd")
    now = time.time()
    for i, k in enumerate((a, b, c)):
        s.put_many([(k, b"v" * 100)])
        os.utime(s.path(k), (now - 100 + i, now - 100 + i))  # a oldest, c newest
    s.get_many([a])  # a read last: touched on disk as well as in the index
    del s
    s2 = DiskStore(NS, str(tmp_path), max_bytes=300)
    assert len(s2) == 3 and s2.num_bytes == 300
    s2.put_many([(d, b"d" * 100)])
    assert s2.contains_many([a, b, c, d]) == [True, False, True, True]
    assert disk_bytes(tmp_path) == 300


def test_restart_with_a_smaller_budget_evicts_the_oldest(tmp_path):
    s = DiskStore(NS, str(tmp_path), max_bytes=1000)
    now = time.time()
    keys = [key(f"k{i}") for i in range(10)]
    for i, k in enumerate(keys):
        s.put_many([(k, b"v" * 100)])
        os.utime(s.path(k), (now - 100 + i, now - 100 + i))
    s2 = DiskStore(NS, str(tmp_path), max_bytes=350)
    assert s2.num_bytes == disk_bytes(tmp_path) == 300
    assert s2.contains_many(keys) == [False] * 7 + [True] * 3


def test_vanished_file_is_dropped_from_the_index(tmp_path):
    s = DiskStore(NS, str(tmp_path), max_bytes=300)
    s.put_many([(key("a"), b"a" * 100), (key("b"), b"b" * 100)])
    os.unlink(s.path(key("a")))  # another process evicted it
    assert s.get_many([key("a"), key("b")]) == [None, b"b" * 100]
    assert s.num_bytes == 100 and len(s) == 1


def test_entry_of_another_process_is_counted_once_read(tmp_path):
    s = DiskStore(NS, str(tmp_path), max_bytes=300)
    other = DiskStore(NS, str(tmp_path), max_bytes=300)
    s.put_many([(key("a"), b"a" * 100), (key("b"), b"b" * 100)])
    other.put_many([(key("o"), b"o" * 100)])
    assert s.get_many([key("o")]) == [b"o" * 100]
    assert s.num_bytes == 300
    s.put_many([(key("c"), b"c" * 100)])  # evicts a, the least recent
    assert s.contains_many([key("a"), key("b"), key("o"), key("c")]) == [False, True, True, True]


def test_stale_temp_files_removed_at_start(tmp_path):
    s = DiskStore(NS, str(tmp_path), max_bytes=1000)
    s.put_many([(key("a"), b"a" * 100)])
    folder = os.path.dirname(s.path(key("a")))
    stale, fresh = (os.path.join(folder, f".{key('a')[:16]}.{n}.tmp") for n in ("old", "new"))
    for p in (stale, fresh):
        with open(p, "wb") as f:
            f.write(b"half an entry")
    old = time.time() - 2 * DiskStore.STALE_TMP_S
    os.utime(stale, (old, old))
    s2 = DiskStore(NS, str(tmp_path), max_bytes=1000)
    assert not os.path.exists(stale)
    assert os.path.exists(fresh)  # maybe another process' write in progress
    assert len(s2) == 1 and s2.num_bytes == 100  # temp files are not entries


def test_concurrent_puts_keep_the_budget(tmp_path):
    s = DiskStore(NS, str(tmp_path), max_bytes=2000)
    errors = []

    def writer(t):
        try:
            for i in range(60):
                s.put_many([(key(f"t{t}-{i % 25}"), bytes([t]) * (50 + i % 7 * 10))])
                s.get_many([key(f"t{(t + 1) % 4}-{i % 25}")])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert disk_bytes(tmp_path) <= 2000
    assert s.num_bytes == disk_bytes(tmp_path)
    assert not [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".tmp")]


def test_disk_bytes_config_and_flag(tmp_path):
    assert KVConnectorConfig().disk_bytes == DEFAULT_DISK_BYTES == 10 << 30
    cfg = KVConnectorConfig.from_any({"stores": [f"disk:{tmp_path}"], "disk_bytes": 4096})
    assert make_store(cfg.stores[0], NS, cfg).max_bytes == 4096
    for bad in (0, -1, 1.5, True, "10"):
        with pytest.raises(ValueError, match="disk_bytes"):
            KVConnectorConfig.from_any({"stores": ["cpu"], "disk_bytes": bad})
    args = build_parser().parse_args(["generate", "--prompt", "x", "--kv-store",
                                      f"disk:{tmp_path}", "--kv-disk-bytes", "12345"])
    assert kv_cache_kwargs(args)["kv_connector"]["disk_bytes"] == 12345
