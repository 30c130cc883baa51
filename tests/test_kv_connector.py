"""The external KV tier (CPU memory, disk, Redis) on a tiny fp32 model.

Outputs are identical with each store to an engine without one; hits are
counted per store; a second engine process gets hits from disk and from Redis;
an entry that cannot be loaded whole (corrupted, torn, deleted, written for
another model or geometry) is recomputed and counted; another geometry or model
never gets hits; Redis down at start-up or mid-run degrades to recompute with a
warning. The Redis tests run a real redis-server (tests/redis_server.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import build_checkpoint, make_llm, runner_of, scheduler_of
from redis_server import RedisServer, free_port, redis_server, require_redis_server  # noqa: F401
from test_prefix_caching import BS, NEW, assert_idle, greedy, shared_prefix_prompts
from tokenmill.core.kv_cache_utils import hash_token_blocks
from tokenmill.kv_connector.config import KVGeometry
from tokenmill.kv_connector.stores import HEADER, decode_entry, encode_entry

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KW = dict(block_size=BS, max_model_len=160)
PREFIX_BLOCKS = 100 // BS


@pytest.fixture(scope="module")
def prompts(llama_tiny):
    return shared_prefix_prompts(llama_tiny.vocab_size, seed=11)


@pytest.fixture(scope="module")
def baseline(llama_tiny, prompts):
    out = greedy(make_llm(llama_tiny.path, enable_prefix_caching=False, **KW), prompts)
    for p, got in list(zip(prompts, out))[:2]:
        assert got == llama_tiny.reference(p, NEW)
    return out


def ext(llm) -> dict:
    return llm.llm_engine.engine_core.kv_cache_stats()["external"]


def connector_of(llm):
    return llm.llm_engine.engine_core.kv_connector


def reset_local_cache(llm) -> None:
    scheduler_of(llm).kv_cache_manager.reset_prefix_cache()


def store_spec(kind, tmp_path, server=None) -> str:
    if kind == "cpu":
        return "cpu"
    if kind == "disk":
        return f"disk:{tmp_path / 'kv'}"
    server.client().flushall()
    return server.url


# ---- each store: identical outputs, hits counted ------------------------------------------

@pytest.mark.parametrize("local_cache", [True, False], ids=["local-on", "local-off"])
@pytest.mark.parametrize("kind", ["cpu", "disk", "redis"])
def test_each_store_identical_outputs_with_hits(request, llama_tiny, prompts, baseline, tmp_path,
                                                kind, local_cache):
    server = request.getfixturevalue("redis_server") if kind == "redis" else None
    llm = make_llm(llama_tiny.path, kv_connector=[store_spec(kind, tmp_path, server)],
                   enable_prefix_caching=local_cache, **KW)
    conn = connector_of(llm)
    assert conn.store_names == [kind]
    assert greedy(llm, prompts) == baseline
    first = ext(llm)
    assert first["blocks_stored"] >= PREFIX_BLOCKS and first["store_failures"] == 0
    reset_local_cache(llm)  # served by the external store now, not the local cache
    assert greedy(llm, prompts) == baseline
    s = ext(llm)
    hits = s["stores"][kind]["hit_tokens"] - first["stores"][kind]["hit_tokens"]
    assert hits >= PREFIX_BLOCKS * BS
    if not local_cache:  # every request loads its whole prefix from the store
        assert hits >= len(prompts[:-1]) * PREFIX_BLOCKS * BS
    assert s["bytes_loaded"] == s["hit_blocks"] * conn.geometry.payload_bytes
    assert s["load_failures"] == 0
    # Blocks are stored once: the second run found them all.
    assert s["blocks_stored"] == first["blocks_stored"]
    assert_idle(llm)


# ---- a second engine process --------------------------------------------------------------

CHILD = textwrap.dedent("""
    import json, sys
    import torch
    torch.set_num_threads(1)
    from tokenmill import LLM, SamplingParams
    args = json.loads(sys.argv[1])
    llm = LLM(args["model"], dtype="float32", device="cpu", max_model_len=160,
              block_size=args["block_size"], kv_connector=args["kv"])
    sp = SamplingParams(temperature=0.0, max_tokens=args["new"], ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]], sp,
                        use_tqdm=False)
    stats = llm.llm_engine.engine_core.kv_cache_stats()
    print("RESULT " + json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                                  "external": stats["external"]}))
""")


def run_child(tmp_path, model, kv, prompts) -> dict:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    arg = json.dumps({"model": model, "kv": kv, "prompts": prompts, "new": NEW,
                      "block_size": BS})
    res = subprocess.run([sys.executable, str(script), arg], capture_output=True, text=True,
                         cwd=REPO, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_second_process_gets_external_hits(request, llama_tiny, prompts, baseline, tmp_path,
                                           kind):
    server = request.getfixturevalue("redis_server") if kind == "redis" else None
    spec = store_spec(kind, tmp_path, server)
    first = run_child(tmp_path, llama_tiny.path, [spec], prompts)
    assert first["tokens"] == baseline
    assert first["external"]["hit_tokens"] == 0  # nothing stored yet
    assert first["external"]["blocks_stored"] >= PREFIX_BLOCKS
    # The first process has exited; a new one finds its KV in the store.
    second = run_child(tmp_path, llama_tiny.path, [spec], prompts)
    assert second["tokens"] == baseline
    st = second["external"]["stores"][kind]
    assert st["hit_tokens"] >= PREFIX_BLOCKS * BS and st["load_failures"] == 0
    assert second["external"]["blocks_stored"] == 0  # everything was there


# ---- entries that cannot be loaded whole --------------------------------------------------

def entry_path(llm, prompt, block: int) -> str:
    conn = connector_of(llm)
    key = hash_token_blocks(prompt, BS)[block].hex()
    return conn.stores[0].path(key)


@pytest.mark.parametrize("damage", ["corrupted", "torn", "deleted", "foreign"])
def test_damaged_entry_is_recomputed_and_counted(llama_tiny, prompts, baseline, tmp_path,
                                                 damage, caplog):
    spec = f"disk:{tmp_path / 'kv'}"
    writer = make_llm(llama_tiny.path, kv_connector=[spec], **KW)
    assert greedy(writer, prompts) == baseline
    conn = connector_of(writer)
    path = entry_path(writer, prompts[0], 5)  # the middle of the shared prefix
    data = open(path, "rb").read()
    if damage == "corrupted":
        b = bytearray(data)
        b[HEADER.size + 100] ^= 0x40
        open(path, "wb").write(bytes(b))
    elif damage == "torn":
        open(path, "wb").write(data[:len(data) // 2])
    elif damage == "deleted":
        os.unlink(path)
    else:  # KV of another model / geometry planted under this key
        payload = decode_entry(data, conn.ns_digest, hash_token_blocks(prompts[0], BS)[5],
                               conn.geometry.payload_bytes)
        open(path, "wb").write(encode_entry(b"another-model-x", hash_token_blocks(
            prompts[0], BS)[5], payload))
    reader = make_llm(llama_tiny.path, kv_connector=[spec], **KW)
    with caplog.at_level(logging.WARNING, logger="tokenmill.kv_connector"):
        assert greedy(reader, [prompts[0]]) == baseline[:1]
    s = ext(reader)
    assert s["load_failures"] == 1
    assert s["hit_blocks"] == 5  # blocks 0-4 loaded, block 5 onwards recomputed
    if damage != "deleted":
        assert "not loaded" in caplog.text
    # The recomputed block was written again, whole.
    fixed = open(path, "rb").read()
    decode_entry(fixed, conn.ns_digest, hash_token_blocks(prompts[0], BS)[5],
                 conn.geometry.payload_bytes)
    # All prompts, in a fresh engine: identical, and the tier is whole again.
    again = make_llm(llama_tiny.path, kv_connector=[spec], **KW)
    assert greedy(again, prompts) == baseline
    assert ext(again)["load_failures"] == 0
    assert_idle(reader)


# ---- geometry and model identity ----------------------------------------------------------

def test_other_geometry_or_model_never_loads(llama_tiny, tiny_model_factory, prompts,
                                             baseline, tmp_path):
    spec = f"disk:{tmp_path / 'kv'}"
    writer = make_llm(llama_tiny.path, kv_connector=[spec], **KW)
    assert greedy(writer, prompts) == baseline
    ns = connector_of(writer).namespace
    # Another block size, another dtype: other keys, no hits.
    for kw in (dict(block_size=16), dict(dtype="bfloat16")):
        other = make_llm(llama_tiny.path, kv_connector=[spec], **{**KW, **kw})
        assert connector_of(other).namespace != ns
        out = greedy(other, prompts[:2])
        assert ext(other)["hit_tokens"] == 0 and ext(other)["load_failures"] == 0
        if "block_size" in kw:
            assert out == [llama_tiny.reference(p, NEW) for p in prompts[:2]]
    # The same architecture and config with other weights: another model identity.
    twin_path = str(tmp_path / "twin")
    twin_hf = build_checkpoint(twin_path, "llama", dict(tie_word_embeddings=True), seed=5)
    twin = make_llm(twin_path, kv_connector=[spec], **KW)
    assert connector_of(twin).geometry == connector_of(writer).geometry
    assert connector_of(twin).model_id != connector_of(writer).model_id
    from conftest import hf_greedy
    assert greedy(twin, prompts[:1]) == [hf_greedy(twin_hf, prompts[0], NEW)]
    assert ext(twin)["hit_tokens"] == 0
    # A model id given explicitly replaces the fingerprint.
    named = make_llm(llama_tiny.path, kv_connector={"stores": [spec], "model_id": "tiny-1"},
                     **KW)
    assert connector_of(named).namespace.startswith("tiny-1-L2-H2-")


def test_worker_refuses_a_cache_of_another_geometry(llama_tiny):
    from tokenmill.kv_connector.config import KVConnectorConfig
    from tokenmill.kv_connector.connector import KVConnector
    from tokenmill.kv_connector.worker import KVConnectorWorker
    llm = make_llm(llama_tiny.path, **KW)
    core = llm.llm_engine.engine_core
    names = core.kv_cache_config.groups[0].layer_names
    real = KVGeometry.from_kv_cache_config(core.kv_cache_config)
    for wrong in (KVGeometry(real.num_layers, real.num_kv_heads, real.head_size, "bfloat16",
                             real.block_size),
                  KVGeometry(real.num_layers, real.num_kv_heads, real.head_size, real.dtype, 16),
                  KVGeometry(real.num_layers + 1, real.num_kv_heads, real.head_size, real.dtype,
                             real.block_size)):
        conn = KVConnector(KVConnectorConfig(["cpu"]), "m", wrong)
        with pytest.raises(ValueError, match="refusing"):
            KVConnectorWorker(conn, core.runner.kv_caches, names)


# ---- sliding-window models ----------------------------------------------------------------

@pytest.fixture(scope="module")
def swa_model(tiny_model_factory):
    return tiny_model_factory("mistral_swa")  # every layer slides, window 12 (< 2 blocks)


@pytest.fixture(scope="module")
def swa_prompts(swa_model):
    return shared_prefix_prompts(swa_model.vocab_size, seed=12)


@pytest.fixture(scope="module")
def swa_baseline(swa_model, swa_prompts):
    out = greedy(make_llm(swa_model.path, enable_prefix_caching=False, **KW), swa_prompts)
    for p, got in list(zip(swa_prompts, out))[:2]:
        assert got == swa_model.reference(p, NEW)
    return out


def swa_loads(llm) -> list:
    """Every KVLoad the scheduler half hands out, recorded."""
    sched = scheduler_of(llm).connector
    seen, build = [], sched.build_connector_meta

    def spy(so, scheduler):
        meta = build(so, scheduler)
        if meta is not None:
            seen.extend(meta.loads)
        return meta
    sched.build_connector_meta = spy
    return seen


@pytest.mark.parametrize("local_cache", [True, False], ids=["local-on", "local-off"])
def test_sliding_window_model_hits_only_its_window(swa_model, swa_prompts, swa_baseline,
                                                   local_cache):
    llm = make_llm(swa_model.path, kv_connector=["cpu"], enable_prefix_caching=local_cache,
                   **KW)
    conn = connector_of(llm)
    assert conn.geometry.sliding_window == 12 and conn.namespace.endswith("-B8-W12")
    assert greedy(llm, swa_prompts) == swa_baseline
    first = ext(llm)
    # Every prompt block is stored whole, the ones the window left behind too.
    assert first["blocks_stored"] >= PREFIX_BLOCKS and first["store_failures"] == 0
    reset_local_cache(llm)
    loads = swa_loads(llm)
    assert greedy(llm, swa_prompts) == swa_baseline
    s = ext(llm)
    assert s["load_failures"] == 0 and s["hit_blocks"] > first["hit_blocks"]
    assert loads
    spec = scheduler_of(llm).kv_cache_manager.sliding[0]
    for load in loads:
        # Only the blocks inside the window of the hit's end: ceil(12 / 8) + 1 at most.
        end = load.first_block + len(load.block_ids)
        assert load.first_block == max(spec.first_needed_block(end * BS), load.first_block)
        assert 1 <= len(load.block_ids) <= 3
        assert load.first_block >= spec.first_needed_block(end * BS)
    # The hits reach past the shared prefix (the same prompts again: every full prompt
    # block), loading only the window's blocks of each.
    assert max(load.first_block + len(load.block_ids) for load in loads) > PREFIX_BLOCKS
    assert s["hit_blocks"] - first["hit_blocks"] == sum(len(ld.block_ids) for ld in loads)
    assert_idle(llm)


def test_sliding_window_failed_load_starts_over(swa_model, swa_prompts, swa_baseline, tmp_path,
                                                caplog):
    spec = f"disk:{tmp_path / 'kv'}"
    prefix, want = swa_prompts[-2], swa_baseline[-2]  # the shared prefix alone: 100 tokens
    writer = make_llm(swa_model.path, kv_connector=[spec], **KW)
    assert greedy(writer, [prefix]) == [want]
    reader = make_llm(swa_model.path, kv_connector=[spec], **KW)
    # The hit ends at block 12 and loads blocks 10 and 11 (window 12); damage block 11:
    # the recomputation from there would read block 9, which the hit skipped.
    path = entry_path(reader, prefix, 11)
    b = bytearray(open(path, "rb").read())
    b[HEADER.size + 100] ^= 0x40
    open(path, "wb").write(bytes(b))
    loads = swa_loads(reader)
    with caplog.at_level(logging.WARNING, logger="tokenmill.kv_connector"):
        assert greedy(reader, [prefix]) == [want]
    assert [(ld.first_block, len(ld.block_ids)) for ld in loads][:1] == [(10, 2)]
    s = ext(reader)
    assert s["load_failures"] == 1 and "not loaded" in caplog.text
    assert scheduler_of(reader).num_preemptions >= 1  # started over, from token 0
    assert_idle(reader)


def test_several_kv_groups_turn_the_tier_off_with_the_reason(tiny_model_factory, caplog):
    gemma = tiny_model_factory("gemma3")  # local and global layers: several groups
    with caplog.at_level(logging.WARNING, logger="tokenmill.kv_connector"):
        llm = make_llm(gemma.path, kv_connector=["cpu"], **KW)
    assert connector_of(llm) is None
    assert "KV cache groups" in caplog.text and "turned off" in caplog.text


# ---- Redis failures -----------------------------------------------------------------------

def test_redis_down_at_startup_recomputes(llama_tiny, prompts, baseline, caplog):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="tokenmill.kv_connector"):
        llm = make_llm(llama_tiny.path, kv_connector={"stores": [url], "redis_timeout_s": 0.5},
                       **KW)
    assert "unreachable" in caplog.text
    assert greedy(llm, prompts) == baseline
    s = ext(llm)
    assert s["hit_tokens"] == 0 and s["store_failures"] > 0
    assert_idle(llm)


def test_redis_down_mid_run_recomputes_then_recovers(llama_tiny, prompts, baseline, tmp_path,
                                                     caplog):
    server = RedisServer(require_redis_server(), str(tmp_path / "redis")).start()
    try:
        llm = make_llm(llama_tiny.path, kv_connector={
            "stores": [server.url], "redis_timeout_s": 0.5, "redis_retry_s": 0.2}, **KW)
        assert greedy(llm, prompts) == baseline
        stored = ext(llm)["blocks_stored"]
        assert stored >= PREFIX_BLOCKS
        server.stop()
        reset_local_cache(llm)
        with caplog.at_level(logging.WARNING, logger="tokenmill.kv_connector"):
            assert greedy(llm, prompts) == baseline
        assert "unreachable" in caplog.text
        s = ext(llm)
        assert s["hit_tokens"] == 0 and s["blocks_stored"] == stored
        # Back (empty: no persistence): after the retry interval, blocks are stored again.
        server.start()
        time.sleep(0.3)
        reset_local_cache(llm)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tokenmill.kv_connector"):
            assert greedy(llm, prompts) == baseline
        assert "answers again" in caplog.text
        assert ext(llm)["blocks_stored"] > stored
        assert_idle(llm)
    finally:
        server.stop()


# ---- metrics ------------------------------------------------------------------------------

def test_engine_stats_and_prometheus(llama_tiny, prompts):
    from tokenmill.engine.async_llm import AsyncLLM
    from tokenmill.entrypoints.openai.metrics import ServerMetrics
    from tokenmill.sampling_params import SamplingParams
    llm = make_llm(llama_tiny.path, kv_connector=["cpu"], **KW)
    greedy(llm, prompts[:2])
    reset_local_cache(llm)
    a = AsyncLLM(llm.llm_engine, log_stats_interval=None)
    try:
        metrics = ServerMetrics(a, "tiny")
        sp = SamplingParams(temperature=0, max_tokens=4)

        async def main():
            for i, p in enumerate(prompts[:2]):
                async for _ in a.generate({"prompt_token_ids": p}, sp, f"m{i}"):
                    pass
        asyncio.run(main())
        deadline = time.monotonic() + 10
        while a.stats.num_running or a.stats.num_waiting:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        a._refresh_stats()
        s = a.stats
        assert s.prefix_cache_queries_total > 0 and s.prefix_cache_hits_total > 0
        assert s.external_kv["cpu"]["hit_tokens"] >= PREFIX_BLOCKS * BS
        text = metrics.render().decode()
        for name in ("tokenmill:prefix_cache_queries_total", "tokenmill:prefix_cache_hits_total",
                     "tokenmill:prefix_cache_blocks",
                     'tokenmill:external_kv_hit_tokens_total{model_name="tiny",store="cpu"}',
                     "tokenmill:external_kv_loaded_bytes_total",
                     "tokenmill:external_kv_stored_bytes_total",
                     "tokenmill:external_kv_load_failures_total"):
            assert name in text, name
    finally:
        a.shutdown()


# ---- stores off the step's critical path ---------------------------------------------------

def test_a_stuck_store_stalls_no_step(llama_tiny, prompts, baseline, monkeypatch):
    """The blocks a step completes are copied to host memory on the step and written by
    the writer thread: a store that hangs delays no request (generate() returns while it
    hangs), its queue is bounded (a full queue drops blocks as store failures instead of
    waiting), and once the store answers again the queued blocks land."""
    import threading

    from tokenmill.kv_connector import worker as worker_mod
    from tokenmill.kv_connector.stores import CPUStore
    monkeypatch.setattr(worker_mod, "MAX_PENDING_STORES", 2)
    release, entered, writers = threading.Event(), threading.Event(), set()
    real_put = CPUStore.put_many

    def stuck_put(self, items):
        writers.add(threading.current_thread().name)
        entered.set()
        release.wait(60)
        return real_put(self, items)
    monkeypatch.setattr(CPUStore, "put_many", stuck_put)
    llm = make_llm(llama_tiny.path, kv_connector=["cpu"], **KW)
    done = {}
    run = threading.Thread(target=lambda: done.setdefault("out", greedy(llm, prompts)))
    run.start()
    run.join(30)
    stuck = not release.is_set()
    release.set()
    assert stuck and not run.is_alive(), "generate() waited for a hanging store"
    assert done["out"] == baseline
    assert writers == {"tokenmill-kv-store"}  # never the engine's thread
    worker = runner_of(llm).kv_connector
    assert worker.flush(10)
    stored = ext(llm)["blocks_stored"]
    assert stored > 0 and ext(llm)["store_failures"] == 0
    # The queue is bounded: with the store hanging, one batch in the writer and two
    # queued, the next step's blocks are dropped (store failures), not waited for.
    release.clear()
    entered.clear()
    from tokenmill.core.sched_output import KVConnectorMetadata, KVStoreBlock
    for i in range(4):
        worker.save_kv(KVConnectorMetadata(stores=[KVStoreBlock("r", 1, bytes([i]) * 32, (0,))]))
        if i == 0:
            assert entered.wait(10)  # the writer holds the first batch, in the store
    assert ext(llm)["store_failures"] == 1
    release.set()
    assert worker.flush(10) and ext(llm)["blocks_stored"] == stored + 3
    llm.llm_engine.engine_core.shutdown()


# ---- loads on the worker side: an entry that changes between lookup and load ---------------

def damage_entry(store, key: str, damage: str) -> None:
    """Break a CPU store's entry in place: evicted, torn or corrupted."""
    data = store._data[key]
    if damage == "evicted":
        store.drop(key)
    elif damage == "torn":
        store._data[key] = data[:len(data) // 2]
    else:
        b = bytearray(data)
        b[HEADER.size + 100] ^= 0x40
        store._data[key] = bytes(b)


def spy_rollbacks(llm) -> list[tuple[object, dict]]:
    """Each step with failed loads: its connector metadata and the requests rolled back
    (request id -> tokens that keep their KV)."""
    conn_sched = scheduler_of(llm).connector
    seen, inner = [], conn_sched.loads_failed

    def loads_failed(meta, invalid, redo):
        seen.append((meta, dict(redo)))
        return inner(meta, invalid, redo)
    conn_sched.loads_failed = loads_failed
    return seen


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("damage", ["evicted", "torn", "corrupted"])
def test_entry_damaged_between_lookup_and_load(llama_tiny, prompts, baseline, damage,
                                               async_scheduling, caplog):
    """The lookup found the entry; by the time the worker reads it, it is gone or broken.
    The block is never used: the requests that loaded it sample nothing that step and
    recompute from it; the others keep their loads. Outputs stay HF-equal greedy, the
    failure is counted, no block leaks, and the recomputed block is stored again whole."""
    llm = make_llm(llama_tiny.path, kv_connector=["cpu"], async_scheduling=async_scheduling,
                   **KW)
    assert greedy(llm, prompts) == baseline
    conn = connector_of(llm)
    store = conn.stores[0]
    h5 = hash_token_blocks(prompts[0], BS)[5]
    other = [7] + prompts[1][1:]  # another prefix: its own blocks, loaded on the next run
    assert greedy(llm, [other]) == [llama_tiny.reference(other, NEW)]
    reset_local_cache(llm)
    before = ext(llm)
    broke = []
    real_get = store.get_many

    def get_many(keys):  # the worker's read: the entry changes just before it
        if h5.hex() in keys and not broke:
            damage_entry(store, h5.hex(), damage)
            broke.append(1)
        return real_get(keys)
    store.get_many = get_many
    rollbacks = spy_rollbacks(llm)
    with caplog.at_level(logging.WARNING, logger="tokenmill.kv_connector"):
        out = greedy(llm, prompts + [other])
    assert broke, "the damaged entry was never read"
    assert out == baseline + [llama_tiny.reference(other, NEW)]
    assert out[0] == llama_tiny.reference(prompts[0], NEW)
    s = ext(llm)
    assert s["load_failures"] - before["load_failures"] >= 1
    assert "not loaded" in caplog.text
    # Rolled back to the damaged block's start: the requests that loaded it (and any that
    # hit it in the same step), no other.
    rolled = {rid: n for _, redo in rollbacks for rid, n in redo.items()}
    assert rolled and set(rolled.values()) == {5 * BS}
    for meta, redo in rollbacks:
        for load in meta.loads:
            if h5 in load.block_hashes:
                assert load.req_id in redo
            elif load.first_block <= 5:  # another prefix
                assert load.req_id not in redo
    # The other prefix loaded whole.
    assert s["hit_blocks"] - before["hit_blocks"] >= (len(other) - 1) // BS
    assert s["bytes_loaded"] == s["hit_blocks"] * conn.geometry.payload_bytes
    # The recomputed block was written again, whole, and loads on the next run.
    decode_entry(store._data[h5.hex()], conn.ns_digest, h5, conn.geometry.payload_bytes)
    assert_idle(llm)
    reset_local_cache(llm)
    again = ext(llm)
    assert greedy(llm, prompts[:1]) == baseline[:1]
    assert ext(llm)["load_failures"] == again["load_failures"]
    assert ext(llm)["hit_blocks"] - again["hit_blocks"] >= PREFIX_BLOCKS
    assert_idle(llm)
    llm.llm_engine.engine_core.shutdown()


def test_a_failed_entry_is_read_from_the_next_store(llama_tiny, prompts, baseline, tmp_path):
    """The CPU store's entry breaks after the lookup; the disk store holds the block too:
    the worker reads it there, and nothing is recomputed (one failure, of the CPU store),
    and the block is written back to the CPU store."""
    llm = make_llm(llama_tiny.path, kv_connector=["cpu", f"disk:{tmp_path / 'kv'}"], **KW)
    assert greedy(llm, prompts[:1]) == baseline[:1]
    cpu = connector_of(llm).stores[0]
    h5 = hash_token_blocks(prompts[0], BS)[5].hex()
    reset_local_cache(llm)
    before = ext(llm)
    real_get, broke = cpu.get_many, []

    def get_many(keys):
        if h5 in keys and not broke:
            damage_entry(cpu, h5, "corrupted")
            broke.append(1)
        return real_get(keys)
    cpu.get_many = get_many
    rollbacks = spy_rollbacks(llm)
    assert greedy(llm, prompts[:1]) == baseline[:1]
    s = ext(llm)
    assert broke and rollbacks == []
    assert s["stores"]["cpu"]["load_failures"] == before["stores"]["cpu"]["load_failures"] + 1
    assert s["stores"]["disk"]["hit_blocks"] - before["stores"]["disk"]["hit_blocks"] == 1
    assert s["hit_blocks"] - before["hit_blocks"] >= PREFIX_BLOCKS
    assert runner_of(llm).kv_connector.flush(10)
    conn = connector_of(llm)
    decode_entry(cpu._data[h5], conn.ns_digest, bytes.fromhex(h5), conn.geometry.payload_bytes)
    assert_idle(llm)


def test_lookup_and_load_never_carry_kv_bytes(llama_tiny, prompts):
    """The connector's part of every SchedulerOutput is ids and hashes: no payload."""
    llm = make_llm(llama_tiny.path, kv_connector=["cpu"], **KW)
    greedy(llm, prompts[:2])
    reset_local_cache(llm)
    runner = runner_of(llm)
    metas, execute = [], runner.execute_model

    def execute_model(so):
        if so.kv_connector_metadata is not None:
            metas.append(so.kv_connector_metadata)
        return execute(so)
    runner.execute_model = execute_model
    greedy(llm, prompts[:2])
    loads = [load for m in metas for load in m.loads]
    assert loads
    for load in loads:
        assert len(load.block_ids) == len(load.block_hashes) == len(load.store_ids)
        assert all(isinstance(b, int) for b in load.block_ids)
        assert all(isinstance(h, bytes) and len(h) == 32 for h in load.block_hashes)
        assert all(ids == [0] for ids in load.store_ids)


# ---- a Redis that stops answering -----------------------------------------------------------

class HangingProxy:
    """A TCP proxy in front of a real redis-server that, once `hang_on` is set, holds
    every client request containing that command (never forwarded, never answered)
    until release()."""

    def __init__(self, target_port: int):
        import socket
        import threading
        self.target_port = target_port
        self.hang_on: bytes | None = None
        self.num_held = 0
        self._release = threading.Event()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        self._conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self):
        import socket
        import threading
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            self._conns += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False),
                             daemon=True).start()

    def _pump(self, src, dst, requests: bool):
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            if requests and self.hang_on is not None and self.hang_on in data.upper():
                self.num_held += 1
                self._release.wait()
            try:
                dst.sendall(data)
            except OSError:
                return

    def release(self):
        self.hang_on = None
        self._release.set()

    def close(self):
        self.release()
        self._sock.close()
        for c in self._conns:
            c.close()


@pytest.mark.parametrize("hang_on", [b"MGET", b"EXISTS"], ids=["reads", "lookups"])
def test_a_hanging_redis_stalls_no_request(request, llama_tiny, prompts, baseline, hang_on):
    """Redis stops answering (its socket timeout far away): the lookup waits at most
    lookup_timeout_s and answers as a miss, a load waits at most load_timeout_s and is a
    load failure (recomputed); further calls to the stuck store are refused at once
    rather than queued. Every request finishes with HF-equal greedy tokens."""
    import threading
    server = request.getfixturevalue("redis_server")
    server.client().flushall()
    proxy = HangingProxy(server.port)
    llm = None
    try:
        llm = make_llm(llama_tiny.path, kv_connector={
            "stores": [proxy.url], "redis_timeout_s": 120, "lookup_timeout_s": 1.0,
            "load_timeout_s": 1.0}, **KW)
        assert greedy(llm, prompts) == baseline
        assert ext(llm)["blocks_stored"] >= PREFIX_BLOCKS
        reset_local_cache(llm)
        before = ext(llm)
        proxy.hang_on = hang_on
        other = [7] + prompts[1][1:]
        done = {}
        t0 = time.monotonic()
        run = threading.Thread(target=lambda: done.setdefault(
            "out", greedy(llm, prompts + [other])))
        run.start()
        run.join(60)
        elapsed = time.monotonic() - t0
        assert not run.is_alive(), "a request waited for the hanging Redis"
        assert done["out"] == baseline + [llama_tiny.reference(other, NEW)]
        assert proxy.num_held >= 1
        s = ext(llm)
        if hang_on == b"MGET":  # found by the lookup, not read: recomputed and counted
            assert s["load_failures"] > before["load_failures"]
        else:  # nothing found: no load was tried
            assert s["hit_tokens"] == before["hit_tokens"]
            assert s["load_failures"] == before["load_failures"]
        assert elapsed < 45, elapsed  # far below the 120 s socket timeout
        assert_idle(llm)
    finally:
        proxy.close()  # (the held calls are answered: nothing waits at shutdown)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
