"""Prefix caching bookkeeping without a model: block hashes, the block pool's LRU of
cached free blocks, KVCacheManager hits and accounting, the external tier's entry
format and stores."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenmill.core.block_pool import BlockPool
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup
from tokenmill.core.kv_cache_utils import (ROOT_HASH, hash_block, hash_token_blocks,
                                           request_block_hashes)
from tokenmill.core.request import Request
from tokenmill.kv_connector.config import KVConnectorConfig, KVGeometry, parse_store_spec
from tokenmill.kv_connector.stores import (CPUStore, DiskStore, EntryError, decode_entry,
                                           encode_entry)
from tokenmill.sampling_params import SamplingParams

BS = 4


def make_req(rid, tokens, salt=None, **sp):
    return Request(rid, tokens, SamplingParams(max_tokens=8, **sp), cache_salt=salt)


def make_mgr(num_blocks=20, groups=1, caching=True, draft_reads_next_token=False):
    spec = FullAttentionSpec(BS, 1, 8, "float32")
    cfg = KVCacheConfig(num_blocks, [KVCacheGroup([f"l{i}"], spec) for i in range(groups)])
    return KVCacheManager(cfg, enable_caching=caching,
                          draft_reads_next_token=draft_reads_next_token)


# ---- hashes -----------------------------------------------------------------------------

def test_block_hash_is_a_chain_over_full_blocks():
    toks = list(range(10))
    hs = hash_token_blocks(toks, BS)
    assert len(hs) == 2 and all(len(h) == 32 for h in hs)
    assert hs[0] == hash_block(None, toks[:4]) and hs[1] == hash_block(hs[0], toks[4:8])
    # Same block, different prefix: different hash (it names the whole prefix).
    other = hash_token_blocks([99] + toks[1:], BS)
    assert other[0] != hs[0] and other[1] != hs[1]
    # A salt changes every block's hash (through the chain).
    salted = hash_token_blocks(toks, BS, ("s",))
    assert salted[0] != hs[0] and salted[1] != hs[1]
    assert hash_token_blocks(toks, BS, ("t",))[0] != salted[0]
    assert hash_block(None, [1, 2]) != hash_block(ROOT_HASH[:16] + ROOT_HASH[16:], [2, 1])


def test_block_hash_is_stable_across_processes():
    """No per-process salt (Python's hash() would differ between runs)."""
    code = ("from tokenmill.core.kv_cache_utils import hash_token_blocks;"
            "print(hash_token_blocks(list(range(12)), 4, ('salt',))[-1].hex())")
    env = dict(os.environ, PYTHONHASHSEED="123")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True).stdout.strip()
    assert out == hash_token_blocks(list(range(12)), 4, ("salt",))[-1].hex()


def test_request_hashes_follow_outputs_and_salt():
    req = make_req("a", list(range(6)), salt="x")
    assert len(request_block_hashes(req, BS)) == 1
    req.output_token_ids += [6, 7, 8]
    hs = request_block_hashes(req, BS)
    assert hs == hash_token_blocks(list(range(9)), BS, ("x",))


# ---- block pool --------------------------------------------------------------------------

def test_pool_keeps_cached_blocks_until_needed_lru():
    pool = BlockPool(6, enable_caching=True)  # 5 usable
    a = pool.allocate(3)
    for i, b in enumerate(a):
        assert pool.cache_block(b, ("k", i))
    b_plain = pool.allocate(1)
    pool.free(a)
    pool.free(b_plain)
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == 5
    assert pool.num_cached_blocks == 3 and pool.num_evictable_cached_blocks == 3
    # The uncached block and the never-used one go first, then the sequence tail.
    got = pool.allocate(2)
    assert set(got) == {b_plain[0], 5} and pool.num_cached_blocks == 3
    got2 = pool.allocate(1)
    assert got2 == [a[2]] and pool.get_cached_block(("k", 2)) is None  # tail evicted first
    assert pool.get_cached_block(("k", 0)) == a[0] and pool.num_evictions == 1
    # touch takes a free cached block out of the queue: it can no longer be evicted.
    pool.touch([a[0]])
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) == [a[1]]
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    assert pool.get_cached_block(("k", 0)) == a[0]
    pool.free([a[0]])
    assert pool.num_evictable_cached_blocks == 1


def test_pool_duplicate_key_stays_uncached():
    pool = BlockPool(4, enable_caching=True)
    x, y = pool.allocate(2)
    assert pool.cache_block(x, "k") and not pool.cache_block(y, "k")
    assert pool.get_cached_block("k") == x
    assert pool.reset_prefix_cache() == 1 and pool.get_cached_block("k") is None


# ---- manager -----------------------------------------------------------------------------

def test_manager_hits_cap_and_accounting():
    mgr = make_mgr()
    a = make_req("a", list(range(13)))  # 3 full blocks + 1 token
    hit, n = mgr.get_computed_blocks(a)
    assert n == 0
    assert mgr.allocate_slots(a, 13, hit, n) is not None
    assert mgr.num_cached_blocks_total == 3  # registered when scheduled
    a.num_computed_tokens = 13
    # Same prompt: 3 cached blocks. A prompt of exactly 3 blocks: the last token is
    # always computed, so only 2 blocks hit.
    b = make_req("b", list(range(13)))
    hit, n = mgr.get_computed_blocks(b)
    assert n == 12 and hit[0] == mgr.get_block_ids("a")[0][:3]
    c = make_req("c", list(range(12)))
    assert mgr.get_computed_blocks(c)[1] == 8
    # Another salt: nothing.
    assert mgr.get_computed_blocks(make_req("d", list(range(13)), salt="s"))[1] == 0
    # Prompt logprobs: no lookup.
    assert mgr.get_computed_blocks(make_req("e", list(range(13)), prompt_logprobs=1))[1] == 0
    used = mgr.num_used_blocks
    assert mgr.allocate_slots(b, 1, hit, n) == [[mgr.get_block_ids("b")[0][3]]]
    assert mgr.num_used_blocks == used + 1  # shared blocks are not counted twice
    assert mgr.prefix_cache_stats.hits == 12 and mgr.prefix_cache_stats.queries == 26
    mgr.free(a)
    mgr.free(b)
    assert mgr.num_used_blocks == 0 and mgr.num_cached_blocks_total == 3
    # Freed, still cached: a later request takes them back out of the free queue.
    d = make_req("f", list(range(13)))
    hit, n = mgr.get_computed_blocks(d)
    assert n == 12
    free_before = mgr.pool.num_free_blocks
    mgr.allocate_slots(d, 1, hit, n)
    assert mgr.pool.num_free_blocks == free_before - 4
    mgr.free(d)
    assert mgr.num_used_blocks == 0


@pytest.mark.parametrize("groups", [1, 2])
def test_a_next_token_drafter_hit_ends_at_a_confirmed_block(groups):
    """EAGLE-3 / MTP keep K/V made at a block's last position from the token after
    it: a hit's last block counts only where that token is the one its writer had
    (the cached block after it matches, or the token recorded with it, once sampled,
    is the new request's); else the hit ends a block earlier."""
    mgr = make_mgr(groups=groups, draft_reads_next_token=True)
    a = make_req("a", list(range(13)))  # 3 full blocks cached
    mgr.allocate_slots(a, 13, *mgr.get_computed_blocks(a))
    # Diverging right after block 1: block 1's last position read a's token 8.
    b = make_req("b", list(range(8)) + [99, 98, 97, 96, 95])
    assert mgr.get_computed_blocks(b)[1] == 4
    plain = make_mgr(groups=groups)  # without the rule: 8
    a2 = make_req("a2", list(range(13)))
    plain.allocate_slots(a2, 13, *plain.get_computed_blocks(a2))
    assert plain.get_computed_blocks(b)[1] == 8
    # Diverging inside block 3 (token 12 equal): block 2 confirmed by the recorded 12.
    hit, n = mgr.get_computed_blocks(make_req("c", list(range(13)) + [77]))
    assert n == 12 and [len(h) for h in hit] == [3] * groups
    # A prompt of exactly 3 blocks: its last token is always computed (2 blocks hit).
    assert mgr.get_computed_blocks(make_req("d", list(range(12))))[1] == 8
    # The token after a block not sampled yet when the block is registered: recorded
    # with the request's next step, or when it is freed.
    for follow, step in ((6, True), (9, True), (6, False)):
        m = make_mgr(groups=groups, draft_reads_next_token=True)
        g = make_req("g", [5] * 8)  # exactly 2 blocks: the token after block 1 unknown
        m.allocate_slots(g, 8, *m.get_computed_blocks(g))
        g.num_computed_tokens = 8
        h = make_req("h", [5] * 8 + [6, 1, 2])
        assert m.get_computed_blocks(h)[1] == 4
        g.output_token_ids.append(follow)
        if step:
            m.allocate_slots(g, 1)
        else:
            m.free(g)
        assert m.get_computed_blocks(h)[1] == (8 if follow == 6 else 4)


def test_manager_refuses_when_hits_and_new_blocks_do_not_fit():
    mgr = make_mgr(num_blocks=6)  # 5 usable
    a = make_req("a", list(range(12)))
    mgr.allocate_slots(a, 12, *mgr.get_computed_blocks(a))
    mgr.free(a)  # 3 cached, free
    # 3 cached blocks (free: touching takes them out) + 3 new > 5 free
    b = make_req("b", list(range(12)) + list(range(100, 110)))
    hit, n = mgr.get_computed_blocks(b)
    assert n == 12
    assert mgr.allocate_slots(b, len(b.prompt_token_ids) - n, hit, n) is None
    assert mgr.num_used_blocks == 0 and "b" not in mgr.req_to_blocks
    assert mgr.num_cached_blocks_total == 3  # nothing evicted by the failed attempt


def test_manager_two_groups_hit_together():
    mgr = make_mgr(groups=2)
    a = make_req("a", list(range(9)))
    mgr.allocate_slots(a, 9, *mgr.get_computed_blocks(a))
    b = make_req("b", list(range(9)))
    hit, n = mgr.get_computed_blocks(b)
    assert n == 8 and [len(h) for h in hit] == [2, 2]
    assert hit == [ids[:2] for ids in mgr.get_block_ids("a")]


@pytest.mark.parametrize("groups", [1, 2])
def test_decode_steps_inside_held_blocks_register_the_blocks_they_fill(groups):
    """allocate_slots' shortcut for a step inside the blocks a request holds (most decode
    steps) registers each block its tokens fill, as a step that allocates does: a later
    request over the prompt and those outputs hits them."""
    mgr = make_mgr(groups=groups)
    a = make_req("a", list(range(6)))  # 1 full block + 2 tokens
    mgr.allocate_slots(a, 6, *mgr.get_computed_blocks(a))
    a.num_computed_tokens = 6
    held = mgr.get_block_ids("a")
    for tok in (50, 51):  # the second fills block 1: no new block, the block registered
        a.output_token_ids.append(tok)
        assert mgr.allocate_slots(a, 1) == [[] for _ in range(groups)]
        a.num_computed_tokens += 1
    assert mgr.get_block_ids("a") == held
    b = make_req("b", list(range(6)) + [50, 51, 7])
    hit, n = mgr.get_computed_blocks(b)
    assert n == 8 and hit == [ids[:2] for ids in held]
    a.output_token_ids.append(52)  # the next token needs a block: allocated
    new = mgr.allocate_slots(a, 1)
    assert [len(ids) for ids in new] == [1] * groups
    # Lookahead slots count too: room for them or a new block.
    a.num_computed_tokens += 1
    a.output_token_ids.append(53)
    assert mgr.allocate_slots(a, 1, num_lookahead_tokens=2) == [[] for _ in range(groups)]
    a.output_token_ids.append(54)
    a.num_computed_tokens += 1
    assert [len(ids) for ids in mgr.allocate_slots(a, 1, num_lookahead_tokens=2)] == \
        [1] * groups


def test_manager_without_caching_keeps_old_behaviour():
    mgr = make_mgr(caching=False)
    a = make_req("a", list(range(12)))
    mgr.allocate_slots(a, 12)
    mgr.free(a)
    assert mgr.num_cached_blocks_total == 0
    assert mgr.get_computed_blocks(make_req("b", list(range(12))))[1] == 0


# ---- entries and stores ------------------------------------------------------------------

NS = b"n" * 16
H = b"h" * 32


def test_entry_roundtrip_and_refusals():
    payload = bytes(range(256)) * 4
    e = encode_entry(NS, H, payload)
    assert bytes(decode_entry(e, NS, H, len(payload))) == payload
    cases = {
        "another model": (e, b"m" * 16, H, len(payload)),
        "another block": (e, NS, b"x" * 32, len(payload)),
        "needs": (e, NS, H, len(payload) * 2),  # another geometry's size
        "torn": (e[:-10], NS, H, len(payload)),
        "header": (e[:20], NS, H, len(payload)),
        "missing": (None, NS, H, len(payload)),
    }
    for reason, args in cases.items():
        with pytest.raises(EntryError, match=reason):
            decode_entry(*args)
    flipped = bytearray(e)
    flipped[-7] ^= 1
    with pytest.raises(EntryError, match="checksum"):
        decode_entry(bytes(flipped), NS, H, len(payload))


def test_cpu_store_lru_byte_budget():
    s = CPUStore("ns", max_bytes=300)
    s.put_many([("a", b"x" * 100), ("b", b"x" * 100), ("c", b"x" * 100)])
    assert s.contains_many(["a"]) == [True]  # refreshes a
    s.put_many([("d", b"x" * 100)])
    assert s.contains_many(["a", "b", "c", "d"]) == [True, False, True, True]
    assert s.num_bytes == 300 and s.num_evictions == 1
    s.put_many([("big", b"x" * 301)])  # over the budget: not kept
    assert s.get_many(["big", "a"]) == [None, b"x" * 100]


def test_disk_store_atomic_files(tmp_path):
    s = DiskStore("model-L1", str(tmp_path))
    key = "ab" + "0" * 62
    s.put_many([(key, b"v1")])
    s.put_many([(key, b"v2")])
    assert s.get_many([key, "cd" + "0" * 62]) == [b"v2", None]
    assert os.path.basename(s.path(key)) == key + ".kvb"
    leftovers = [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".tmp")]
    assert leftovers == []


def test_connector_config_parsing():
    assert parse_store_spec("cpu") == ("cpu", "")
    assert parse_store_spec("disk:/x/y") == ("disk", "/x/y")
    assert parse_store_spec("redis://h:1/0")[0] == "redis"
    for bad in ("", "disk:", "s3://x", "memory"):
        with pytest.raises(ValueError, match="kv_connector"):
            parse_store_spec(bad)
    assert KVConnectorConfig.from_any("cpu,disk:/tmp/x").stores == ["cpu", "disk:/tmp/x"]
    assert KVConnectorConfig.from_any({"stores": ["cpu"], "cpu_bytes": 10}).cpu_bytes == 10
    with pytest.raises(ValueError, match="unknown field"):
        KVConnectorConfig.from_any({"stores": ["cpu"], "cpu_size": 1})
    with pytest.raises(ValueError, match="cpu_bytes"):
        KVConnectorConfig.from_any({"stores": ["cpu"], "cpu_bytes": 0})
    g = KVGeometry(2, 2, 16, "float32", 8)
    assert g.payload_bytes == 2 * 2 * 8 * 2 * 16 * 4 and g.tag == "L2-H2-D16-float32-B8"
