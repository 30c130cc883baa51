"""Hybrid prefix caching bookkeeping without a model: which boundaries get a state
snapshot, the snapshot slots' LRU and pins, snapshots leaving with their block, hits
only where a snapshot exists, prompt chunks ending at block boundaries ("align")."""
from __future__ import annotations

import pytest

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, MambaSpec
from tokenmill.core.kv_cache_utils import request_block_hashes
from tokenmill.core.request import Request
from tokenmill.core.state_snapshots import StateSnapshotCache
from tokenmill.sampling_params import SamplingParams

BS = 4


def make_req(rid, tokens, **sp):
    return Request(rid, tokens, SamplingParams(max_tokens=8, **sp))


def make_mgr(num_blocks=40, num_snapshots=8, interval=8):
    cfg = KVCacheConfig(num_blocks, [
        KVCacheGroup(["attn"], FullAttentionSpec(BS, 1, 8, "float32")),
        KVCacheGroup(["gdn"], MambaSpec(((4, 3), (2, 4, 4)), ("float32", "float32")))],
        num_state_slots=4, num_state_snapshots=num_snapshots)
    return KVCacheManager(cfg, enable_caching=True, state_snapshot_interval=interval)


def admit(mgr, req, num_new=None):
    """Admission as the scheduler does it: lookup, allocate, count computed."""
    hit, num_hit = mgr.get_computed_blocks(req)
    n = req.num_tokens - num_hit if num_new is None else num_new
    n = mgr.align_chunk(req, num_hit, n)
    assert mgr.allocate_slots(req, n, hit, num_hit) is not None
    req.num_computed_tokens += num_hit + n
    return num_hit, n


def test_due_boundaries():
    s = StateSnapshotCache(4, block_size=4, interval=8)
    # Every 8th token, and the last boundary before the last token (18 tokens: 16).
    assert s.due_boundaries(0, 18, 18) == [8, 16]
    assert s.due_boundaries(0, 12, 18) == [8, 12]  # the chunk's end, a block boundary
    assert s.due_boundaries(0, 10, 18) == [8]  # (10 is not one)
    assert s.due_boundaries(16, 18, 18) == []  # past the last boundary: nothing
    assert s.due_boundaries(0, 17, 17) == [8, 16]  # 16 is the last one before token 16
    assert s.due_boundaries(0, 16, 17) == [8, 16]
    assert s.due_boundaries(8, 9, 30) == []  # a decode-sized chunk inside a block
    # Where the cached blocks end past the resumed snapshot (a shared prefix's end):
    assert s.due_boundaries(8, 30, 30, match_end=12) == [12, 16, 24, 28]
    assert s.due_boundaries(8, 30, 30, match_end=16) == [16, 24, 28]  # (due anyway)
    assert s.due_boundaries(12, 30, 30, match_end=12) == [16, 24, 28]  # not in (12, 30]
    assert s.due_boundaries(0, 18, 18, match_end=20) == [8, 16]  # never past the last
    assert s.due_boundaries(0, 18, 30, match_end=14) == [8, 16]  # not a block boundary
    with pytest.raises(ValueError, match="multiple of the block size"):
        StateSnapshotCache(4, block_size=4, interval=6)
    with pytest.raises(ValueError, match="num_state_snapshots"):
        StateSnapshotCache(0, block_size=4, interval=8)


def test_slots_lru_pins_and_drop():
    s = StateSnapshotCache(2, block_size=4, interval=4)
    a, b = s.take("a"), s.take("b")
    assert {a, b} == {0, 1}
    assert s.take("c") is None  # both pinned by this schedule call
    s.schedule_done()
    s.get("a")  # used: "b" is now the least recently used
    c = s.take("c")
    assert c == b and not s.has("b") and s.has("a") and s.num_evicted == 1
    s.drop("a")
    assert s.num_used == 1 and not s.has("a")
    s.reset()
    assert s.num_used == 0 and sorted(s._free) == [0, 1]


def test_hit_needs_a_snapshot_and_restores_it():
    mgr = make_mgr()
    tokens = list(range(1, 20))  # 19 tokens: 4 full blocks
    a = make_req("a", tokens)
    admit(mgr, a)
    restores, writes = mgr.take_state_ops()
    assert restores == {} and [b for b, _ in writes["a"]] == [8, 16]
    slots = dict(writes["a"])
    # The same prompt again: its longest cached prefix with a snapshot is 16 tokens.
    b = make_req("b", tokens)
    num_hit, n = admit(mgr, b)
    assert num_hit == 16 and n == 3
    restores, writes = mgr.take_state_ops()
    assert restores == {"b": slots[16]} and writes == {}
    assert mgr.prefix_cache_stats.hits == 16
    # A prompt sharing 12 tokens: blocks 0..2 are cached, but only 8 has a snapshot.
    c = make_req("c", tokens[:12] + [99] * 7)
    num_hit, _ = admit(mgr, c)
    assert num_hit == 8
    assert mgr.take_state_ops()[0] == {"c": slots[8]}


def test_snapshot_leaves_with_its_block():
    mgr = make_mgr(num_blocks=8)  # 7 usable blocks
    tokens = list(range(1, 20))
    a = make_req("a", tokens)
    admit(mgr, a)
    mgr.take_state_ops()
    assert mgr.snapshots.num_used == 2
    mgr.free(a)
    # Another request takes every free block: the cached ones are evicted, and their
    # snapshots with them.
    b = make_req("b", [7] * 27)
    admit(mgr, b)
    mgr.take_state_ops()
    keys = set(mgr.pool.cached)
    assert all(k in keys for k in mgr.snapshots.slot_of)
    h = request_block_hashes(a, BS)
    assert not mgr.snapshots.has((0, h[1])) and not mgr.snapshots.has((0, h[3]))
    assert mgr.get_computed_blocks(make_req("c", tokens)) == ([[], []], 0)
    mgr.free(b)
    mgr.reset_prefix_cache()
    assert mgr.snapshots.num_used == 0


def test_chunks_end_at_block_boundaries():
    mgr = make_mgr()
    req = make_req("a", list(range(1, 30)))
    # A chunk cut by the budget inside the prompt ends at a block boundary ...
    assert mgr.align_chunk(req, 0, 11) == 8
    assert mgr.align_chunk(req, 3, 11) == 9  # (to 12)
    # ... unless that leaves nothing (a budget under one block), or the chunk reaches
    # the end of the known tokens.
    assert mgr.align_chunk(req, 5, 2) == 2
    assert mgr.align_chunk(req, 20, 9) == 9
    # Caching off, or no recurrent state: chunks untouched.
    plain = KVCacheManager(KVCacheConfig(10, [KVCacheGroup(["attn"], FullAttentionSpec(
        BS, 1, 8, "float32"))]), enable_caching=True)
    assert plain.snapshots is None and plain.align_chunk(req, 0, 11) == 11


def test_same_call_snapshot_not_handed_to_a_one_token_row():
    """A snapshot written by the schedule call under way may be restored by a prompt
    row (it runs after the writer in every layer), not by a one-token row (that runs
    with the decode rows, first)."""
    mgr = make_mgr()
    tokens = list(range(1, 18))  # 17 tokens: last boundary 16
    admit(mgr, make_req("a", tokens))
    one = make_req("b", tokens)  # a hit at 16 would leave one token
    assert mgr.get_computed_blocks(one)[1] == 8
    longer = make_req("c", tokens[:16] + [5, 6, 7])
    assert mgr.get_computed_blocks(longer)[1] == 16
    mgr.take_state_ops()
    assert mgr.get_computed_blocks(one)[1] == 16  # the next call: written by then


def test_snapshot_slots_are_pinned_within_a_call():
    mgr = make_mgr(num_snapshots=2, interval=4)
    admit(mgr, make_req("a", list(range(1, 14))))  # due: 4, 8, 12: only two slots
    restores, writes = mgr.take_state_ops()
    assert [b for b, _ in writes["a"]] == [4, 8]
    assert sorted(s for _, s in writes["a"]) == [0, 1]


def test_state_ops_cross_the_contract():
    """The step's restores and snapshot writes travel in the SchedulerOutput message."""
    from tokenmill.core import serial
    from tokenmill.core.sched_output import CachedRequestData, SchedulerOutput
    so = SchedulerOutput([], CachedRequestData(), {"a": 12}, 12, state_restores={"a": 3},
                         state_snapshots={"a": [(8, 1), (16, 2)]})
    back = serial.decode(serial.encode(so), SchedulerOutput)
    assert back.state_restores == {"a": 3}
    assert back.state_snapshots == {"a": [(8, 1), (16, 2)]}


def test_can_take_only_with_a_free_or_unpinned_slot():
    c = StateSnapshotCache(2, BS, 8)
    assert c.can_take()
    c.take("a")
    c.take("b")
    assert not c.can_take()  # both pinned within the schedule call
    c.schedule_done()
    assert c.can_take()  # an unpinned one can be evicted


def test_external_hit_takes_a_slot_to_load_and_restores_from_it():
    """An external hit (no local snapshot): allocate_slots takes a slot for the tier's
    snapshot, the request restores from it, and while it loads nobody else may use it;
    a failed load drops it."""
    from tokenmill.core.sched_output import KVLoad

    mgr = make_mgr()
    req = make_req("a", list(range(1, 20)))
    assert mgr.external_restore_ok(req, 8)
    blocks = mgr.allocate_slots(req, 11, [[], []], 0, num_external_tokens=8)
    assert blocks is not None
    slot = mgr.take_state_load("a")
    assert slot is not None
    hashes = request_block_hashes(req, BS)
    assert mgr.local_snapshot_slot(hashes[1]) == slot
    assert mgr.local_snapshot_slot(hashes[1], pin=True) is None  # loading: loader only
    restores, _ = mgr.take_state_ops()
    assert restores == {"a": slot}
    other = make_req("b", list(range(1, 20)))
    assert not mgr._snapshot_usable(other, hashes, 2)  # in flight
    ids = mgr.req_to_blocks["a"][0]
    mgr.state_loads_done([KVLoad("a", 0, ids[:2], hashes[:2], [[0], [0]], slot,
                                 hashes[1], [0])], {ids[1]})
    assert not mgr.snapshots.has((0, hashes[1]))


def test_scheduler_never_gives_a_one_token_chunk_a_snapshot_written_now():
    """A hit on a snapshot the same schedule call writes, with one token of budget left:
    that one-token chunk would run with the decode rows, before the row writing the
    snapshot. The request waits for the next step (then the snapshot is written)."""
    from tokenmill.core.scheduler import Scheduler, SchedulerConfig
    cfg = KVCacheConfig(40, [
        KVCacheGroup(["attn"], FullAttentionSpec(BS, 1, 8, "float32")),
        KVCacheGroup(["gdn"], MambaSpec(((4, 3), (2, 4, 4)), ("float32", "float32")))],
        num_state_slots=4, num_state_snapshots=8)
    sched = Scheduler(SchedulerConfig(4, 17, 64, True, True, state_snapshot_interval=8), cfg)
    tokens = list(range(1, 17))
    sched.add_request(make_req("a", tokens))
    sched.add_request(make_req("b", tokens + [5, 6, 7]))  # hits 12: a's last snapshot
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 16} and not so.state_restores
    so2 = sched.schedule()  # (async: a's step in flight) the snapshot is written by now
    assert so2.num_scheduled_tokens["b"] == 19 - 12 and "b" in so2.state_restores
