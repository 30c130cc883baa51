"""The external KV tier on hybrid models (Gated DeltaNet + full attention), fp32.

The tier carries the recurrent-state snapshots beside the full-attention layers'
blocks (kv_connector: a snapshot entry per block boundary that has one, written
after its block). Engine A fills a real Redis; a fresh engine B (empty local
cache, same checkpoint) gets the shared-prefix batch and must resume from the
tier's snapshots: same tokens as the uncached run and as HF, logprobs within 1e-4
of HF's, external hits and loaded snapshots counted. A snapshot deleted,
corrupted or of the wrong size in Redis makes its prefix a miss (same output, a
warning, nothing leaked); preemption with the tier on changes nothing.
"""
from __future__ import annotations

import logging

import pytest

from conftest import scheduler_of
from redis_server import redis_server  # noqa: F401 - the fixture
from test_hf_parity import record_schedules, run_greedy_logprobs
from test_hybrid_prefix_caching import (BS, MODELS, assert_nothing_leaked, check_against_hf_and_off,
                                        hybrid_llm, hybrid_model, shared_prompts,  # noqa: F401
                                        uncached)
from tokenmill import SamplingParams
from tokenmill.core.kv_cache_utils import hash_token_blocks
from tokenmill.kv_connector.stores import HEADER, encode_entry


def ext(llm) -> dict:
    return llm.llm_engine.engine_core.kv_cache_stats()["external"]


def tier_llm(tm, server, **kw):
    return hybrid_llm(tm, kv_connector={"stores": [server.url], "load_timeout_s": 10.0}, **kw)


def fill_tier(tm, server, off) -> dict:
    """Engine A: the batch once, cold (Redis emptied first), its blocks and snapshots
    stored. -> A's external counters."""
    server.client().flushall()
    prompts = shared_prompts(tm.vocab_size)
    a = tier_llm(tm, server)
    check_against_hf_and_off(tm, prompts, run_greedy_logprobs(a, prompts), off)
    s = ext(a)
    assert s["hit_tokens"] == 0 and s["blocks_stored"] > 0 and s["snapshots_stored"] > 0
    assert s["store_failures"] == 0
    conn = a.llm_engine.engine_core.kv_connector
    return s, conn


def state_keys(server) -> list[bytes]:
    return sorted(server.client().keys("tokenmill:kv:*-state"))


def restored_from_tier(seen) -> set[str]:
    """Requests admitted with external tokens whose state restore came with them."""
    out = set()
    for so in seen:
        meta = so.kv_connector_metadata
        for load in (meta.loads if meta is not None else ()):
            if load.state_slot is not None:
                assert so.state_restores.get(load.req_id) == load.state_slot
                out.add(load.req_id)
    return out


@pytest.mark.parametrize("name", MODELS)
def test_fresh_engine_resumes_from_the_tiers_snapshots(hybrid_model, uncached, redis_server,
                                                       name):
    tm = hybrid_model(name)
    prompts = shared_prompts(tm.vocab_size)
    off = uncached(name)
    a_stats, conn = fill_tier(tm, redis_server, off)
    assert conn.state_geometry is not None
    keys = state_keys(redis_server)
    assert len(keys) == a_stats["snapshots_stored"]
    # Every snapshot's block is in Redis too (written with or before it).
    c = redis_server.client()
    assert all(c.exists(k[:-len(b"-state")]) for k in keys)

    b = tier_llm(tm, redis_server)
    seen = record_schedules(b)
    check_against_hf_and_off(tm, prompts, run_greedy_logprobs(b, prompts), off)
    s = ext(b)
    assert s["hit_tokens"] > 0 and s["snapshots_loaded"] > 0
    assert s["load_failures"] == 0
    loaded = restored_from_tier(seen)
    assert len(loaded) == s["snapshots_loaded"] > 0
    assert_nothing_leaked(b)
    # B stored nothing new: A had stored every block and snapshot B computed again,
    # except those of boundaries only B's schedule snapshotted.
    assert s["blocks_stored"] == 0


def test_a_hit_ends_at_the_last_block_with_a_snapshot(hybrid_model, uncached, redis_server):
    """Only the snapshots after blocks 1 and 3 of the shared prefix (tokens 16 and 32)
    are left in Redis: B's tier hits end there, never at a block without one."""
    tm = hybrid_model("qwen3_5")
    prompts = shared_prompts(tm.vocab_size)
    off = uncached("qwen3_5")
    fill_tier(tm, redis_server, off)
    prefix = hash_token_blocks(prompts[0], BS)
    keep = {prefix[1], prefix[3]}
    c = redis_server.client()
    for k in state_keys(redis_server):
        if bytes.fromhex(k.decode().rsplit(":", 1)[1][:-len("-state")]) not in keep:
            c.delete(k)
    assert len(state_keys(redis_server)) == 2
    b = tier_llm(tm, redis_server)
    seen = record_schedules(b)
    check_against_hf_and_off(tm, prompts, run_greedy_logprobs(b, prompts), off)
    loads = [ld for so in seen if so.kv_connector_metadata is not None
             for ld in so.kv_connector_metadata.loads]
    assert loads and all(ld.state_hash in keep and ld.state_hash == ld.block_hashes[-1]
                         for ld in loads if ld.state_slot is not None)
    s = ext(b)
    assert 0 < s["snapshots_loaded"] and s["load_failures"] == 0
    assert s["hit_blocks"] <= 4 * s["snapshots_loaded"]  # no hit past block 3
    assert_nothing_leaked(b)


DAMAGES = ["deleted", "corrupted", "wrong_size"]


def damage_states(server, conn, damage: str) -> int:
    c = server.client()
    keys = state_keys(server)
    for k in keys:
        if damage == "deleted":
            c.delete(k)
        elif damage == "corrupted":
            b = bytearray(c.get(k))
            b[HEADER.size + 17] ^= 0x20
            c.set(k, bytes(b))
        else:  # a whole entry, right namespace, of another state size
            data = c.get(k)
            block_hash = HEADER.unpack_from(data)[3]
            payload = data[HEADER.size:]
            c.set(k, encode_entry(conn.state_ns_digest, block_hash, payload[:-4]))
    return len(keys)


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_snapshot_is_a_miss(hybrid_model, uncached, redis_server, caplog, damage):
    tm = hybrid_model("qwen3_5")
    prompts = shared_prompts(tm.vocab_size)
    off = uncached("qwen3_5")
    _, conn = fill_tier(tm, redis_server, off)
    assert damage_states(redis_server, conn, damage) > 0
    b = tier_llm(tm, redis_server)
    with caplog.at_level(logging.WARNING, logger="tokenmill.kv_connector.worker"):
        check_against_hf_and_off(tm, prompts, run_greedy_logprobs(b, prompts), off)
    s = ext(b)
    assert s["snapshots_loaded"] == 0
    if damage == "deleted":
        # No snapshot: the blocks alone are no hit (the lookup stops there).
        assert s["hit_tokens"] == 0 and s["load_failures"] == 0
    else:
        assert s["load_failures"] > 0
        assert "state snapshot" in caplog.text and "not loaded" in caplog.text
    assert_nothing_leaked(b)
    # Again on B: the failed snapshots are misses now, its own cache serves.
    check_against_hf_and_off(tm, prompts, run_greedy_logprobs(b, prompts), off)
    assert ext(b)["snapshots_loaded"] == 0
    assert_nothing_leaked(b)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_with_the_tier(hybrid_model, uncached, redis_server, async_scheduling):
    tm = hybrid_model("qwen3_next")
    prompts = shared_prompts(tm.vocab_size)
    off = uncached("qwen3_next")
    fill_tier(tm, redis_server, off)
    # 23 usable blocks of 8 tokens: the 7 sequences need ~40.
    b = tier_llm(tm, redis_server, num_kv_blocks=24, max_num_batched_tokens=32,
                 async_scheduling=async_scheduling)
    for _ in range(2):
        check_against_hf_and_off(tm, prompts, run_greedy_logprobs(b, prompts), off)
    assert scheduler_of(b).num_preemptions > 0
    s = ext(b)
    assert s["hit_tokens"] > 0 and s["snapshots_loaded"] > 0 and s["load_failures"] == 0
    assert_nothing_leaked(b)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_aborts_with_the_tier_leave_nothing_held(hybrid_model, uncached, redis_server,
                                                 async_scheduling):
    """Aborts right after admission (its tier load in the step, or in flight with async
    scheduling) and mid-decode; the others' tokens stay the uncached run's."""
    tm = hybrid_model("qwen3_5")
    prompts = shared_prompts(tm.vocab_size)
    off = uncached("qwen3_5")
    fill_tier(tm, redis_server, off)
    b = tier_llm(tm, redis_server, max_num_batched_tokens=24,
                 async_scheduling=async_scheduling)
    engine = b.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=len(off[0].token_ids), ignore_eos=True)
    for i, p in enumerate(prompts[:5]):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    engine.step()
    engine.abort_request(["r3"])  # admitted with a tier hit in that step
    for _ in range(6):
        engine.step()
    engine.abort_request(["r0"])  # decoding by now
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    engine.step()  # the runner drops the aborted requests' state on the next step
    for i in (1, 2, 4):
        assert done[f"r{i}"] == off[i].token_ids, i
    assert ext(b)["snapshots_loaded"] > 0
    assert_nothing_leaked(b)
