"""Prefix caching on hybrid models (Gated DeltaNet + full attention), fp32.

The recurrent state is snapshotted at block boundaries of prompts and restored on a
hit (core/state_snapshots.py). Every run here must give HF's greedy tokens with
logprobs within 1e-4 (logprob_check) and the same tokens as the uncached engine:

  (a) a batch sharing a prefix, twice on one engine: the first run's later requests
      hit snapshots written in the same step, the second run hits every prompt's last
      boundary (one prompt then computes a single token);
  (b) chunked prefill with odd budgets (under one block, and 13 tokens): chunks that
      stop inside a prompt end at block boundaries when the budget allows;
  (c) forced preemption, with async scheduling too;
  (d) aborts mid-prefill and mid-decode;
and afterwards nothing is held: no KV block, no state slot, and every snapshot
belongs to a block still in the prefix cache.
"""
from __future__ import annotations

import logging
import random

import pytest

from conftest import make_llm, runner_of, scheduler_of
from test_hf_parity import assert_same_tokens_and_logprobs, record_schedules, run_greedy_logprobs
from test_hybrid_parity import HYBRID_SPECS, HybridModel, build_hybrid
from tokenmill import SamplingParams

MODELS = ["qwen3_5", "qwen3_next"]
BS = 8
INTERVAL = 16  # a snapshot every two blocks, besides chunk ends and prompt ends
MAX_LEN = 96


def shared_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    prefix = [rng.randrange(1, vocab) for _ in range(45)]
    prompts = [prefix + [rng.randrange(1, vocab) for _ in range(rng.randint(2, 20))]
               for _ in range(4)]
    prompts.append(prefix[:41])  # 5 blocks + 1: a second run computes one token
    prompts.append(prefix[:35] + [rng.randrange(1, vocab) for _ in range(9)])  # diverges at 35
    prompts.append([rng.randrange(1, vocab) for _ in range(30)])  # shares nothing
    return prompts


def hybrid_llm(tm, **kw):
    kw.setdefault("max_model_len", MAX_LEN)
    return make_llm(tm.path, block_size=BS, state_snapshot_interval=INTERVAL, **kw)


def stats(llm) -> dict:
    return llm.llm_engine.engine_core.kv_cache_stats()


def assert_nothing_leaked(llm):
    kvm = scheduler_of(llm).kv_cache_manager
    assert kvm.num_used_blocks == 0 and kvm.req_to_blocks == {} and kvm._match_end == {}
    slots = runner_of(llm).state_slots
    assert not slots.slot_of and slots.num_free == slots.num_slots
    snaps = kvm.snapshots
    assert snaps is not None
    # Each snapshot is tied to a block the prefix cache still holds, slots distinct.
    assert all(key in kvm.pool.cached for key in snaps.slot_of)
    used = list(snaps.slot_of.values())
    assert len(set(used)) == len(used) and len(used) + len(snaps._free) == snaps.num_snapshots


def check_against_hf_and_off(tm, prompts, comps, off):
    assert [c.token_ids for c in comps] == [c.token_ids for c in off]
    assert_same_tokens_and_logprobs(tm, prompts, comps, ref=[tm.reference(p) for p in prompts])


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
    cache: dict[str, HybridModel] = {}

    def get(name: str) -> HybridModel:
        if name not in cache:
            arch, overrides = HYBRID_SPECS[name]
            path = str(tmp_path_factory.mktemp(name))
            cache[name] = HybridModel(name, path, arch, build_hybrid(path, arch, overrides))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def uncached(hybrid_model):
    cache = {}

    def get(name):
        if name not in cache:
            tm = hybrid_model(name)
            llm = hybrid_llm(tm, enable_prefix_caching=False)
            assert scheduler_of(llm).kv_cache_manager.snapshots is None
            cache[name] = run_greedy_logprobs(llm, shared_prompts(tm.vocab_size))
        return cache[name]

    return get


# ---- (a) ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_shared_prefix_batch_twice(hybrid_model, uncached, name):
    tm = hybrid_model(name)
    prompts = shared_prompts(tm.vocab_size)
    off = uncached(name)
    llm = hybrid_llm(tm)  # prefix caching on by default, hybrids included
    assert scheduler_of(llm).kv_cache_manager.enable_caching
    seen = record_schedules(llm)
    first = run_greedy_logprobs(llm, prompts)
    check_against_hf_and_off(tm, prompts, first, off)
    hits_first = stats(llm)["prefix_cache_hits"]
    # Admitted in the step that computes the prefix, later requests resume from a
    # snapshot that step writes (the GDN layers run the writer's row first).
    assert any(set(so.state_restores.values())
               & {s for w in so.state_snapshots.values() for _, s in w} for so in seen)
    assert hits_first > 0
    assert_nothing_leaked(llm)

    seen.clear()
    second = run_greedy_logprobs(llm, prompts)
    check_against_hf_and_off(tm, prompts, second, off)
    st = stats(llm)
    assert st["prefix_cache_hits"] - hits_first >= 40 * 4 + 40
    restored = {rid for so in seen for rid in so.state_restores}
    assert len(restored) == len(prompts)  # each ran before: all of them resume
    # The 41-token prompt resumed after 40 tokens: a one-token row (with the decodes).
    assert any(so.num_scheduled_tokens.get(rid) == 1 and rid in so.state_restores
               for so in seen for rid in so.state_restores)
    assert_nothing_leaked(llm)


@pytest.mark.parametrize("name", MODELS)
def test_a_third_request_resumes_where_two_prompts_part(hybrid_model, name):
    """Three prompts share a 40-token prefix (5 blocks, not on the 16-token interval),
    sent one after another. The second resumes at 32 (the interval snapshot) and
    snapshots where its cached blocks end, 40, so the third resumes at 40; every output
    equals the uncached engine's and HF's (fp32, 1e-4)."""
    tm = hybrid_model(name)
    rng = random.Random(11)
    prefix = [rng.randrange(1, tm.vocab_size) for _ in range(40)]
    prompts = [prefix + [rng.randrange(1, tm.vocab_size) for _ in range(n)]
               for n in (10, 15, 12)]  # (none ends its last block at 40)
    off = run_greedy_logprobs(hybrid_llm(tm, enable_prefix_caching=False), prompts)
    llm = hybrid_llm(tm)
    seen = record_schedules(llm)
    comps, hits = [], []
    for p in prompts:
        before = stats(llm)["prefix_cache_hits"]
        comps += run_greedy_logprobs(llm, [p])
        hits.append(stats(llm)["prefix_cache_hits"] - before)
    assert hits == [0, 32, 40]
    # the second request wrote the snapshot at 40 (besides the ones due anyway)
    writes = [b for so in seen for w in so.state_snapshots.values() for b, _ in w]
    assert writes.count(40) == 1
    check_against_hf_and_off(tm, prompts, comps, off)
    assert_nothing_leaked(llm)


# ---- (b) ---------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [5, 13])
def test_chunked_prefill_odd_budgets(hybrid_model, uncached, budget):
    tm = hybrid_model("qwen3_5")
    prompts = shared_prompts(tm.vocab_size)
    llm = hybrid_llm(tm, max_num_batched_tokens=budget)
    seen = record_schedules(llm)
    for _ in range(2):
        check_against_hf_and_off(tm, prompts, run_greedy_logprobs(llm, prompts),
                                 uncached("qwen3_5"))
    assert stats(llm)["prefix_cache_hits"] > 0
    assert any(so.state_restores for so in seen)
    # A prompt chunk that stops short ends at a block boundary unless the budget left
    # for it is under one block.
    prompt_len, computed_at = {}, {}
    short = 0
    for so in seen:
        for nr in so.scheduled_new_reqs:
            prompt_len[nr.req_id] = len(nr.prompt_token_ids)
            computed_at[nr.req_id] = nr.num_computed_tokens
        c = so.scheduled_cached_reqs
        computed_at.update(zip(c.req_ids, c.num_computed_tokens))
        for rid, n in so.num_scheduled_tokens.items():
            start, end = computed_at[rid], computed_at[rid] + n
            if end < prompt_len[rid]:
                short += 1
                assert end % BS == 0 or end // BS * BS <= start, (rid, start, end)
    assert short > 0
    assert_nothing_leaked(llm)


# ---- (c) ---------------------------------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption(hybrid_model, uncached, async_scheduling):
    tm = hybrid_model("qwen3_next")
    prompts = shared_prompts(tm.vocab_size)
    # 23 usable blocks of 8 tokens: the 7 sequences need ~40.
    llm = hybrid_llm(tm, num_kv_blocks=24, max_num_batched_tokens=32,
                     async_scheduling=async_scheduling)
    for _ in range(2):
        check_against_hf_and_off(tm, prompts, run_greedy_logprobs(llm, prompts),
                                 uncached("qwen3_next"))
    assert scheduler_of(llm).num_preemptions > 0
    assert stats(llm)["prefix_cache_hits"] > 0
    assert_nothing_leaked(llm)


# ---- (d) ---------------------------------------------------------------------------------

def test_aborts_leave_nothing_held(hybrid_model):
    tm = hybrid_model("qwen3_5")
    prompts = shared_prompts(tm.vocab_size)
    llm = hybrid_llm(tm, max_num_batched_tokens=24)
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(prompts[:4]):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    engine.step()
    engine.abort_request(["r3"])  # mid-prefill (the budget reached it at most in part)
    for _ in range(8):
        engine.step()
    engine.abort_request(["r0"])  # decoding by now
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # the runner drops the aborted requests' state on the next step
    assert_nothing_leaked(llm)
    kvm = scheduler_of(llm).kv_cache_manager
    assert kvm.snapshots.num_used > 0
    kvm.reset_prefix_cache()
    assert kvm.snapshots.num_used == 0


def test_external_tier_needs_prefix_caching(hybrid_model, caplog):
    """The external KV tier carries a hybrid's state snapshots (test_hybrid_kv_tier.py),
    which only prefix caching takes: with it off the tier stays off, saying why."""
    tm = hybrid_model("qwen3_5")
    llm = hybrid_llm(tm, kv_connector=["cpu"])
    assert llm.llm_engine.engine_core.kv_connector.state_geometry is not None
    with caplog.at_level(logging.WARNING, logger="tokenmill.kv_connector.setup"):
        llm = hybrid_llm(tm, kv_connector=["cpu"], enable_prefix_caching=False)
    assert llm.llm_engine.engine_core.kv_connector is None
    assert "external KV tier is turned off" in caplog.text and "snapshot" in caplog.text
