"""The scheduler's encoder cache bookkeeping (tokenmill/core/encoder_cache_manager.py):
entries held while referenced, unreferenced ones kept while there is room and
evicted oldest-release first, every eviction reported to the runner once."""
from __future__ import annotations

from tokenmill.core.encoder_cache_manager import EncoderCacheManager


def test_referenced_entries_are_never_evicted():
    c = EncoderCacheManager(capacity=10)
    c.allocate("a", 6, "r1")
    assert c.has("a") and c.used == 6
    assert c.can_allocate(4) and not c.can_allocate(5)  # "a" is held by r1
    c.allocate("b", 4, "r2")
    assert not c.can_allocate(1) and c.take_freed() == []


def test_released_entries_stay_until_room_is_needed():
    c = EncoderCacheManager(capacity=10)
    c.allocate("a", 4, "r1")
    c.allocate("b", 4, "r2")
    c.release("r1", ["a"])
    c.release("r2", ["b"])
    assert c.has("a") and c.has("b")  # still cached: a repeated image is a hit
    c.add_ref("a", "r3")  # a hit takes it back from the unreferenced list
    assert c.can_allocate(6) and not c.can_allocate(7)
    c.allocate("c", 6, "r4")  # evicts "b" only
    assert c.take_freed() == ["b"] and c.take_freed() == []
    assert c.has("a") and c.has("c") and not c.has("b") and c.used == 10


def test_eviction_order_and_shared_references():
    c = EncoderCacheManager(capacity=9)
    for h in "abc":
        c.allocate(h, 3, "r")
    c.add_ref("b", "s")  # two requests read "b"
    c.release("r", ["c", "a", "b"])  # released in this order; "b" is still s's
    c.allocate("d", 6, "t")
    assert c.take_freed() == ["c", "a"] and c.has("b")
    c.release("s", ["b"])
    c.reset()  # after a failed step: everything goes, and the runner is told
    assert sorted(c.take_freed()) == ["b", "d"] and c.used == 0 and not c.has("d")
