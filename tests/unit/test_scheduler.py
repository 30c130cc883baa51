"""Scheduler, KV block accounting and finishing rules.

Most tests drive the Scheduler alone with a fake runner (no torch model);
the workload and finishing tests go through LLMEngine on a tiny model.
"""
from __future__ import annotations

import random

import pytest

from conftest import make_llm, make_prompts, runner_of, scheduler_of
from tokenmill import SamplingParams
from tokenmill.core.block_pool import BlockPool
from tokenmill.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.core.scheduler import Scheduler, SchedulerConfig


def cdiv(a, b):
    return -(-a // b)


def make_sched(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=64,
               chunked=True) -> Scheduler:
    spec = FullAttentionSpec(block_size, 1, 8, "float32")
    cfg = KVCacheConfig(num_blocks, [KVCacheGroup(["layers.0.attn"], spec)])
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, chunked), cfg)


def make_req(rid, n_prompt, max_tokens=8, **sp):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **sp)
    return Request(rid, list(range(1, n_prompt + 1)), params, frozenset({2}))


def fake_step(sched: Scheduler, token: int = 5):
    """schedule() + a runner that samples `token` for every request done with its prompt."""
    so = sched.schedule()
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = sched.requests[rid]
        sampled.append([token] if req.num_computed_tokens >= req.num_tokens else [])
    out = ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)
    return so, sched.update_from_output(so, out)


def check_invariants(sched: Scheduler, so):
    cfg = sched.config
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(so.num_scheduled_tokens) <= cfg.max_num_seqs
    assert len(sched.running) <= cfg.max_num_seqs
    assert all(n > 0 for n in so.num_scheduled_tokens.values())
    mgr = sched.kv_cache_manager
    held = 0
    for rid, groups in mgr.req_to_blocks.items():
        req = sched.requests[rid]
        assert len(groups[0]) >= cdiv(req.num_computed_tokens, mgr.block_size)
        assert 0 not in groups[0]
        held += len(groups[0])
    assert held == mgr.num_used_blocks
    # No block id is held twice.
    all_ids = [b for g in mgr.req_to_blocks.values() for b in g[0]]
    assert len(all_ids) == len(set(all_ids))


# ---- block pool -------------------------------------------------------------------------

def test_block_pool_never_hands_out_the_null_block():
    pool = BlockPool(9)
    assert pool.num_usable_blocks == 8 and pool.num_free_blocks == 8
    got = pool.allocate(8)
    assert sorted(got) == list(range(1, 9))
    assert BlockPool.NULL_BLOCK == 0 and 0 not in got
    assert pool.num_used_blocks == 8 and pool.usage() == 1.0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free(got)
    assert pool.num_used_blocks == 0
    # Freeing the null block is a no-op: it never enters the free list.
    pool.free([0])
    assert pool.num_free_blocks == 8
    assert 0 not in pool.allocate(8)


def test_block_pool_detects_double_free():
    pool = BlockPool(5)
    a = pool.allocate(2)
    pool.free(a)
    with pytest.raises(RuntimeError, match="twice"):
        pool.free(a[:1])
    pool2 = BlockPool(5)
    b = pool2.allocate(1)
    with pytest.raises(RuntimeError, match="twice"):
        pool2.free(b + b)


def test_block_pool_rejects_a_pool_without_usable_blocks():
    with pytest.raises(ValueError, match="num_kv_blocks"):
        BlockPool(1)


def test_kv_cache_manager_with_two_groups_draws_distinct_ids():
    from tokenmill.core.kv_cache_manager import KVCacheManager
    spec = FullAttentionSpec(4, 1, 8, "float32")
    cfg = KVCacheConfig(13, [KVCacheGroup(["l0"], spec), KVCacheGroup(["l1"], spec)])
    mgr = KVCacheManager(cfg)
    req = make_req("a", 6)
    new = mgr.allocate_slots(req, 6)
    assert [len(g) for g in new] == [2, 2]
    assert not set(new[0]) & set(new[1])
    assert mgr.num_used_blocks == 4
    req.num_computed_tokens = 6
    assert mgr.allocate_slots(req, 2) == [[], []]  # 8 tokens still fit in 2 blocks
    more = mgr.allocate_slots(req, 3)
    assert [len(g) for g in more] == [1, 1] and mgr.num_used_blocks == 6
    big = make_req("b", 30)
    assert mgr.allocate_slots(big, 30) is None  # 16 > 6 free: nothing changes
    assert mgr.num_used_blocks == 6 and "b" not in mgr.req_to_blocks
    mgr.free(req)
    assert mgr.num_used_blocks == 0


# ---- budget, max_num_seqs, chunked prefill ---------------------------------------------

def test_token_budget_and_max_num_seqs_respected_each_step():
    sched = make_sched(num_blocks=200, budget=20, max_num_seqs=3, max_model_len=64)
    rng = random.Random(0)
    for i in range(10):
        sched.add_request(make_req(f"r{i}", rng.randint(1, 30), max_tokens=rng.randint(1, 6)))
    totals, widths, steps = [], [], 0
    while sched.has_unfinished_requests():
        so, _ = fake_step(sched)
        check_invariants(sched, so)
        totals.append(so.total_num_scheduled_tokens)
        widths.append(len(so.num_scheduled_tokens))
        steps += 1
        assert steps < 500
    # The limits were reached, not just respected by a light load.
    assert max(totals) == 20
    assert max(widths) == 3
    assert sched.kv_cache_manager.num_used_blocks == 0


def test_chunked_prefill_mixes_a_prompt_chunk_with_decodes():
    sched = make_sched(budget=10, max_num_seqs=4)
    sched.add_request(make_req("a", 3, max_tokens=20))
    sched.add_request(make_req("b", 4, max_tokens=20))
    fake_step(sched)  # both prefills in one step (7 tokens)
    sched.add_request(make_req("long", 25, max_tokens=4))
    so, _ = fake_step(sched)
    # a and b decode (1 token each), the long prompt gets the rest of the budget.
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "long": 8}
    assert [nr.req_id for nr in so.scheduled_new_reqs] == ["long"]
    assert so.scheduled_cached_reqs.req_ids == ["a", "b"]
    assert sched.requests["long"].num_computed_tokens == 8
    assert sched.requests["long"].output_token_ids == []  # a chunk produces no token
    so, _ = fake_step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "long": 8}
    so, _ = fake_step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "long": 8}
    so, outs = fake_step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "long": 1}
    assert {o.request_id for o in outs} == {"a", "b", "long"}
    assert sched.requests["long"].output_token_ids == [5]


def test_without_chunked_prefill_a_prompt_waits_for_a_full_budget():
    sched = make_sched(budget=10, chunked=False)
    sched.add_request(make_req("a", 3, max_tokens=20))
    fake_step(sched)
    sched.add_request(make_req("b", 10, max_tokens=2))
    so, _ = fake_step(sched)
    assert so.num_scheduled_tokens == {"a": 1}  # 1 + 10 > 10: b is not split
    sched.abort_requests(["a"])
    so, _ = fake_step(sched)
    assert so.num_scheduled_tokens == {"b": 10}


# ---- preemption ---------------------------------------------------------------------------

def test_preemption_takes_the_newest_and_puts_it_at_the_front_of_waiting():
    # 6 usable blocks of 4 tokens. A, B, C admitted (4-token prompts); D waits (max_num_seqs).
    sched = make_sched(num_blocks=7, block_size=4, max_num_seqs=3, budget=64, max_model_len=24)
    for rid in "ABCD":
        sched.add_request(make_req(rid, 4, max_tokens=12))
    so, _ = fake_step(sched)
    assert set(so.num_scheduled_tokens) == {"A", "B", "C"}
    assert [r.request_id for r in sched.waiting] == ["D"]
    preempted_at = None
    for i in range(10):
        so, _ = fake_step(sched)
        check_invariants(sched, so)
        if so.preempted_req_ids:
            preempted_at = i
            break
    assert preempted_at is not None
    # C was admitted last: it goes, to the front of the queue, its blocks freed.
    assert so.preempted_req_ids == {"C"}
    assert [r.request_id for r in sched.waiting] == ["C", "D"]
    c = sched.requests["C"]
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert len(c.output_token_ids) > 0  # outputs are kept, to be recomputed
    assert "C" not in sched.kv_cache_manager.req_to_blocks
    assert "C" not in so.num_scheduled_tokens
    assert sched.num_preemptions == 1
    assert [r.request_id for r in sched.running] == ["A", "B"]
    # Nothing waiting is admitted in the step that preempted.
    assert not so.scheduled_new_reqs
    # Run on: C comes back before D, as a resumed request with all its tokens.
    resumed_so = None
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        so, _ = fake_step(sched)
        check_invariants(sched, so)
        if "C" in so.scheduled_cached_reqs.req_ids and resumed_so is None:
            idx = so.scheduled_cached_reqs.req_ids.index("C")
            if so.scheduled_cached_reqs.resumed_from_preemption[idx]:
                resumed_so = so
                assert so.scheduled_cached_reqs.num_computed_tokens[idx] == 0
                # All of C's tokens (prompt + kept outputs) recomputed, then one sampled.
                assert so.num_scheduled_tokens["C"] == c.num_computed_tokens == c.num_tokens - 1
                assert so.scheduled_cached_reqs.new_block_ids[idx] == \
                    sched.kv_cache_manager.get_block_ids("C")
        if any(nr.req_id == "D" for nr in so.scheduled_new_reqs):
            assert resumed_so is not None, "D was admitted before the preempted C"
    assert resumed_so is not None
    assert sched.kv_cache_manager.num_used_blocks == 0


def test_two_preemptions_in_one_step_take_the_newest_first():
    # 6 usable blocks: A, B hold 2 each (7-token prompts), C, D one each (3 tokens).
    sched = make_sched(num_blocks=7, block_size=4, max_num_seqs=4, budget=64, max_model_len=24)
    for rid, n in (("A", 7), ("B", 7), ("C", 3), ("D", 3)):
        sched.add_request(make_req(rid, n, max_tokens=12))
    fake_step(sched)
    assert sched.kv_cache_manager.pool.num_free_blocks == 0
    so, _ = fake_step(sched)
    assert not so.preempted_req_ids
    # A and B now need a third block each: A takes D's (the newest), B takes C's.
    so, _ = fake_step(sched)
    check_invariants(sched, so)
    assert so.preempted_req_ids == {"C", "D"}
    assert set(so.num_scheduled_tokens) == {"A", "B"}
    assert [r.request_id for r in sched.running] == ["A", "B"]
    # Each victim went to the front in turn: D first, then C ahead of it.
    assert [r.request_id for r in sched.waiting] == ["C", "D"]
    assert sched.num_preemptions == 2


# ---- abort ------------------------------------------------------------------------------

def test_abort_by_id_frees_blocks():
    sched = make_sched(num_blocks=40)
    for rid, n in (("a", 9), ("b", 5), ("c", 6)):
        sched.add_request(make_req(rid, n, max_tokens=10))
    sched.config.max_num_seqs = 2  # c stays waiting
    fake_step(sched)
    used = sched.kv_cache_manager.num_used_blocks
    a_blocks = len(sched.kv_cache_manager.get_block_ids("a")[0])
    assert a_blocks == 3
    assert sched.abort_requests(["a", "c", "nope"]) == ["a", "c"]
    assert sched.kv_cache_manager.num_used_blocks == used - a_blocks
    assert "a" not in sched.requests and "c" not in sched.requests
    assert [r.request_id for r in sched.running] == ["b"]
    assert not sched.waiting
    # Only the request the runner knew about is reported to it.
    so, _ = fake_step(sched)
    assert so.finished_req_ids == {"a"}
    assert sched.abort_requests(["a"]) == []  # already gone
    sched.abort_requests(["b"])
    assert sched.kv_cache_manager.num_used_blocks == 0
    assert not sched.has_unfinished_requests()


def test_duplicate_request_id_is_rejected():
    sched = make_sched()
    sched.add_request(make_req("x", 3))
    with pytest.raises(ValueError, match="request_id"):
        sched.add_request(make_req("x", 4))


# ---- through the engine -----------------------------------------------------------------

def _mixed_workload(llm, seed=0):
    engine = llm.llm_engine
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    prompts = make_prompts([rng.randint(2, 60) for _ in range(10)], vocab, seed=seed)
    ids = []
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=0.0 if i % 2 else 0.8, max_tokens=rng.randint(3, 25),
                            ignore_eos=True, seed=i if i % 3 == 0 else None)
        ids.append(engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp))
    finished = {}
    for _ in range(3):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    sched = scheduler_of(llm)
    running = [r.request_id for r in sched.running]
    waiting = [r.request_id for r in sched.waiting]
    assert running, "nothing running after 3 steps"
    aborted = running[:2] + waiting[-1:]
    engine.abort_request(aborted)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return ids, aborted, finished


def test_block_accounting_back_to_zero_after_mixed_workload_with_aborts(llama_tiny):
    # Small pool and budget: chunking and preemption happen along the way.
    llm = make_llm(llama_tiny.path, max_model_len=96, block_size=4, num_kv_blocks=40,
                   max_num_batched_tokens=24, max_num_seqs=6)
    ids, aborted, finished = _mixed_workload(llm)
    sched = scheduler_of(llm)
    assert sched.num_preemptions > 0  # the pool was small enough to preempt
    assert sched.kv_cache_manager.num_used_blocks == 0
    assert sched.kv_cache_manager.req_to_blocks == {}
    assert not sched.requests and not sched.running and not sched.waiting
    assert set(finished) == set(ids) - set(aborted)
    for rid, out in finished.items():
        assert out.outputs[0].finish_reason == "length"
    assert llm.llm_engine.output_processor.requests == {}
    # The engine is still usable.
    again = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                         SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(again[0].outputs[0].token_ids) == 4
    assert sched.kv_cache_manager.num_used_blocks == 0


def test_runner_state_dropped_once_idle(llama_tiny):
    """Once the engine is idle the runner holds no request (finished or aborted)."""
    llm = make_llm(llama_tiny.path, max_model_len=96, block_size=4, num_kv_blocks=40,
                   max_num_batched_tokens=24, max_num_seqs=6)
    runner, sched, engine = runner_of(llm), scheduler_of(llm), llm.llm_engine
    # 1. A workload that runs to completion (with aborts on the way).
    _mixed_workload(llm, seed=1)
    assert sched.kv_cache_manager.num_used_blocks == 0 and not sched.has_unfinished_requests()
    after_completion = sorted(runner.requests)
    rows_after_completion = runner.input_batch.num_reqs()
    # 2. Requests aborted mid-run until nothing is left.
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"x{i}", {"prompt_token_ids": [1 + i] * (5 + i)}, sp)
    engine.step()
    engine.step()
    engine.abort_request(["x0", "x1", "x2"])
    assert sched.kv_cache_manager.num_used_blocks == 0 and not sched.has_unfinished_requests()
    after_abort = sorted(set(runner.requests) - set(after_completion))
    assert (after_completion, rows_after_completion, after_abort) == ([], 0, []), (
        "the runner still holds requests the scheduler has finished: "
        f"after completion {after_completion} ({rows_after_completion} batch rows), "
        f"after aborting everything {after_abort}")


def test_engine_steps_respect_budget_and_max_num_seqs(llama_tiny):
    llm = make_llm(llama_tiny.path, max_num_batched_tokens=20, max_num_seqs=3, block_size=4)
    sched = scheduler_of(llm)
    seen = []
    orig = sched.schedule
    sched.schedule = lambda: seen.append(orig()) or seen[-1]
    prompts = make_prompts([5, 30, 12, 2, 17, 9], 384, seed=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    for so in seen:
        assert so.total_num_scheduled_tokens <= 20
        assert len(so.num_scheduled_tokens) <= 3
    assert max(so.total_num_scheduled_tokens for so in seen) == 20
    assert max(len(so.num_scheduled_tokens) for so in seen) == 3
    # Some step mixed a prompt chunk (a row that samples nothing) with decodes.
    assert any(
        any(n == 1 for n in so.num_scheduled_tokens.values())
        and any(n > 1 for n in so.num_scheduled_tokens.values()) for so in seen)


# ---- finishing rules ----------------------------------------------------------------------

def _greedy(**kw):
    kw.setdefault("temperature", 0.0)
    return SamplingParams(**kw)


def test_finish_on_max_tokens(eos_model):
    llm = make_llm(eos_model.path)
    out = llm.generate([{"prompt_token_ids": eos_model.eos_prompt}],
                       _greedy(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert out.finished
    assert out.outputs[0].token_ids == eos_model.eos_ref[:3]
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].stop_reason is None


def test_finish_on_eos_from_generation_config(eos_model):
    llm = make_llm(eos_model.path)
    # config.json has no EOS; generation_config.json names it.
    assert eos_model.hf_config.get("eos_token_id") is None
    assert eos_model.eos_id in llm.llm_engine.eos_token_ids
    k = eos_model.eos_index
    out = llm.generate([{"prompt_token_ids": eos_model.eos_prompt}], _greedy(max_tokens=20),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == eos_model.eos_ref[:k + 1]
    assert out.outputs[0].token_ids[-1] == eos_model.eos_id
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason is None
    assert scheduler_of(llm).kv_cache_manager.num_used_blocks == 0


def test_ignore_eos_runs_past_eos(eos_model):
    llm = make_llm(eos_model.path)
    out = llm.generate([{"prompt_token_ids": eos_model.eos_prompt}],
                       _greedy(max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == eos_model.eos_ref[:20]
    assert eos_model.eos_id in out.outputs[0].token_ids[:-1]
    assert out.outputs[0].finish_reason == "length"


def test_finish_on_stop_token_ids(eos_model):
    llm = make_llm(eos_model.path)
    j = eos_model.stop_index
    stop = eos_model.eos_ref[j]
    out = llm.generate([{"prompt_token_ids": eos_model.eos_prompt}],
                       _greedy(max_tokens=20, ignore_eos=True, stop_token_ids=[stop, 383]),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == eos_model.eos_ref[:j + 1]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop


def test_max_tokens_none_runs_to_max_model_len(eos_model):
    prompt = eos_model.eos_prompt
    llm = make_llm(eos_model.path, max_model_len=len(prompt) + 6)
    out = llm.generate([{"prompt_token_ids": prompt}], _greedy(max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == eos_model.eos_ref[:6]
    assert out.outputs[0].finish_reason == "length"


def test_finish_at_max_model_len(eos_model):
    prompt = eos_model.eos_prompt
    llm = make_llm(eos_model.path, max_model_len=len(prompt) + 4)
    out = llm.generate([{"prompt_token_ids": prompt}], _greedy(max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == eos_model.eos_ref[:4]
    assert out.outputs[0].finish_reason == "length"
