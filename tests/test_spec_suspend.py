"""Suspended drafts: under a poor acceptance record the scheduler takes most new requests
in without drafts (spec_decode/drafter.py). Such a request is never proposed for, a step
of only such requests runs with neither the target's taps nor the draft model, and its
blocks are marked apart in the prefix cache (they lack the draft model's K/V), so a
drafting request that hits the cache drafts as in a cold engine. Every SCOUT_EVERY-th
request (and every seeded one) still drafts.
"""
from __future__ import annotations

import numpy as np
import pytest
from test_spec_decode import _random_draft, assert_no_leaks, generate, greedy  # noqa: F401
from test_spec_decode import hybrid  # noqa: F401 (fixture)

from conftest import make_llm, record_model_drafts, runner_of, scheduler_of
from tokenmill import SamplingParams
from tokenmill.core.kv_cache_utils import request_block_hashes
from tokenmill.core.request import Request
from tokenmill.spec_decode.drafter import SCOUT_EVERY

MAX_TOKENS = 24


def _engine(tm, draft, method, poor: bool, batch_limit: int | None = 0, **kw):
    """An engine whose record is poor (or good) from the start: the runner's, and the
    scheduler's copy of it (which it otherwise takes from the first step's output).
    `batch_limit`: 0 (default) no suspension by load (the record's rule alone, whatever
    the batch), None the engine's own limit, else that."""
    args = dict(enable_prefix_caching=True, block_size=8, max_model_len=192)
    llm = make_llm(tm.path, speculative_config={"method": method, "model": draft,
                                                "num_speculative_tokens": 3},
                   **dict(args, **kw))
    runner_of(llm).drafter.poor_record = lambda: poor
    sched = scheduler_of(llm)
    sched._draft_record_poor = poor
    if batch_limit is not None:
        sched.config.draft_batch_limit = batch_limit or None
    return llm


def watch(runner, sched):
    """Per forward: (the step's request ids, the layers the target tapped); per proposer
    call: the step's request ids, and the suspended requests that kept a row waiting;
    per request, as the scheduler first looked at it: whether it was suspended."""
    model, proposer = runner.model, runner.drafter.model_proposer
    seen = {"forward": [], "proposer": [], "suspended": {}, "kept": []}
    batch = runner.input_batch

    def ids():
        return tuple(batch.req_ids[:batch.num_reqs()])
    inner_forward = model.forward

    def forward(*args, **kw):
        seen["forward"].append((ids(), tuple(model.aux_layer_ids)))
        return inner_forward(*args, **kw)
    model.forward = forward
    for name in ("propose", "wait"):
        inner = getattr(proposer, name)

        def call(*args, _inner=inner, **kw):
            seen["proposer"].append(ids())
            out = _inner(*args, **kw)
            # rows kept waiting for the drafter, of requests taken in suspended
            seen["kept"] += [rid for rid in ids() if seen["suspended"].get(rid)
                             and proposer.deferred.num_waiting(rid)]
            return out
        setattr(proposer, name, call)
    inner_decide = sched._suspend_drafts

    def decide(req, others):
        inner_decide(req, others)
        seen["suspended"][req.request_id] = req.drafts_suspended
    sched._suspend_drafts = decide
    return seen


@pytest.mark.parametrize("method,target", [("eagle3", "qwen3_headdim"),
                                           ("dflash", "qwen3_headdim"),
                                           ("dflash", "hybrid")])
@pytest.mark.parametrize("extra", [{}, {"async_scheduling": True}], ids=["sync", "async"])
def test_suspended_requests_run_without_the_drafter(request, tiny_model_factory, tmp_path,
                                                     method, target, extra):
    """Under a poor record, requests one at a time, then all at once: all but every
    SCOUT_EVERY-th are suspended; a step of only suspended requests taps nothing and
    calls no proposer; a step with a scout does both; no suspended request verifies a
    draft or keeps a row waiting for the drafter (its rows share steps with the
    scouts', where the drafter drops them); the plain greedy tokens throughout,
    logprobs within 1e-4 of the plain engine's, nothing leaked. With async scheduling too
    (no draft slots for a suspended request)."""
    tm = (request.getfixturevalue("hybrid") if target == "hybrid"
          else tiny_model_factory(target))
    draft = _random_draft(tm, tmp_path, method)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, tm.vocab_size, int(rng.integers(9, 30))).tolist()
               for _ in range(SCOUT_EVERY + 2)]
    plain_llm = make_llm(tm.path, block_size=8, max_model_len=192)
    plain = generate(plain_llm, prompts, greedy(MAX_TOKENS))
    with_logprobs = greedy(MAX_TOKENS, logprobs=3)
    ref = plain_llm.generate([{"prompt_token_ids": p} for p in prompts], with_logprobs,
                             use_tqdm=False)
    llm = _engine(tm, draft, method, True, **extra)
    runner = runner_of(llm)
    seen = watch(runner_of(llm), scheduler_of(llm))
    verified = {}
    inner_update = runner._update_states

    def update_states(so):
        inner_update(so)
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            verified[rid] = verified.get(rid, 0) + len(drafts)
        for rid, slots in so.scheduled_spec_slots.items():
            verified[rid] = verified.get(rid, 0) + slots
    runner._update_states = update_states
    # One at a time with logprobs (a step of a suspended request alone runs untapped:
    # the same numbers as a plain engine's), then all at once, greedy only.
    got = [llm.generate([{"prompt_token_ids": p}], with_logprobs, use_tqdm=False)[0]
           for p in prompts]
    for g, r in zip(got, ref):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, r.outputs[0].logprobs):
            assert list(a) == list(b)
            assert max(abs(a[t].logprob - b[t].logprob) for t in a) <= 1e-4
    got_batch = generate(llm, prompts, greedy(MAX_TOKENS))
    assert got_batch == plain
    flags = list(seen["suspended"].values())
    n = len(prompts)
    assert flags == [i % SCOUT_EVERY != 0 for i in range(2 * n)]
    suspended = {rid for rid, s in seen["suspended"].items() if s}
    taps = tuple(runner._aux_layer_ids)
    assert seen["forward"]
    for rids, tapped in seen["forward"]:
        assert tapped == (() if set(rids) <= suspended else taps), rids
    for rids in seen["proposer"]:
        assert not set(rids) <= suspended, rids
    # The one-at-a-time scouts ran the drafter, and no suspended request verified a draft.
    assert any(len(rids) == 1 and rids[0] not in suspended for rids in seen["proposer"])
    assert not suspended & {rid for rid, d in verified.items() if d}
    # In the batch, scouts and suspended requests shared steps; no suspended row waited.
    assert any(not set(rids) <= suspended for rids in seen["proposer"] if len(rids) > 2)
    assert not seen["kept"]
    assert not runner.drafter._suspended
    assert_no_leaks(llm)


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_suspended_blocks_are_cached_apart(tiny_model_factory, tmp_path, method):
    """A prompt computed by a suspended request is a prefix hit for the next suspended
    one, not for a drafting (seeded) one, whose drafts and tokens then equal a cold
    engine's; a prompt computed by a drafting request is not a hit for a suspended one
    either (the marks differ from block 0 on)."""
    tm = tiny_model_factory("qwen3_headdim")
    draft = _random_draft(tm, tmp_path, method)
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, tm.vocab_size, 40).tolist()
    other = rng.integers(0, tm.vocab_size, 40).tolist()
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)
    cold = _engine(tm, draft, method, False)
    cold_drafts = record_model_drafts(runner_of(cold))
    want = generate(cold, [prompt], seeded)

    llm = _engine(tm, draft, method, True)
    sched = scheduler_of(llm)
    seen = watch(runner_of(llm), scheduler_of(llm))
    stats = sched.kv_cache_manager.prefix_cache_stats

    def run(p, params):
        hits = stats.hits
        out = generate(llm, [p], params)
        return out, stats.hits - hits
    assert run(other, greedy(MAX_TOKENS))[1] == 0  # the first: a scout (drafts)
    assert run(prompt, greedy(MAX_TOKENS))[1] == 0  # suspended
    assert run(prompt, greedy(MAX_TOKENS))[1] > 0  # suspended: hits the one before
    drafts = record_model_drafts(runner_of(llm))
    out, hits = run(prompt, seeded)  # seeded: drafts, and cannot take those blocks
    assert hits == 0 and out == want and drafts == cold_drafts and drafts
    assert run(other, greedy(MAX_TOKENS))[1] == 0  # suspended: not the scout's blocks
    assert list(seen["suspended"].values()) == [False, True, True, False, True]
    assert_no_leaks(llm)


def test_which_requests_are_suspended(tiny_model_factory, tmp_path):
    """The scheduler's rule: only under a poor record or a full batch and with a draft
    model (not for n-gram lookups); never a seeded sampling request; an n > 1
    sibling as the request whose prompt it shares; every SCOUT_EVERY-th drafts under a
    poor record (none under load); the record is the runner's, as it reports it. The
    mark changes every block hash of a suspended request, from block 0 on."""
    tm = tiny_model_factory("qwen3_headdim")
    draft = _random_draft(tm, tmp_path, "eagle3")
    llm = _engine(tm, draft, "eagle3", False)
    sched = scheduler_of(llm)
    for poor in (True, False):  # the runner reports its record with every step
        runner_of(llm).drafter.poor_record = lambda: poor
        runner_of(llm).drafter.promising_record = lambda: not poor
        generate(llm, [[1, 2, 3]], greedy(2))
        assert sched._draft_record_poor is poor and sched._draft_record_promising is not poor
    sched._num_admitted_poor = 0  # (the second was taken in under a poor record: a scout)
    ngram = scheduler_of(make_llm(tm.path, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3}))
    assert sched.config.suspend_drafts and not ngram.config.suspend_drafts
    prompt = list(range(1, 20))

    def take(s, rid, share=None, **params):
        req = Request(rid, prompt, SamplingParams(max_tokens=4, **params),
                      share_prompt_with=share)
        s._suspend_drafts(req, len(s.running) + len(s.waiting))
        s.requests[rid] = req
        return req.drafts_suspended
    assert not take(sched, "good")  # the record is good
    sched._draft_record_poor = ngram._draft_record_poor = True
    assert not take(ngram, "lookups")
    assert not take(sched, "seeded", temperature=1.0, seed=3)
    assert take(sched, "greedy-seed", temperature=0.0, seed=3) is False  # the first: a scout
    assert take(sched, "sampled", temperature=1.0)
    assert take(sched, "sibling", share="sampled")
    assert not take(sched, "scout-sibling", share="greedy-seed")
    flags = [take(sched, f"r{i}") for i in range(2 * SCOUT_EVERY)]
    # (the scout count goes on from the two requests decided above)
    assert flags.count(False) == 2 and not flags[SCOUT_EVERY - 2]
    marked = sched.requests["sampled"]
    plain = sched.requests["good"]
    assert request_block_hashes(marked, 8)[0] != request_block_hashes(plain, 8)[0]
    # Load: from draft_batch_limit requests in (running or waiting), whatever the record
    # and with no scout; not a seeded one; a sibling as its donor.
    sched._draft_record_poor = False
    sched.config.draft_batch_limit = 2
    assert not take(sched, "first")
    sched.waiting.append(sched.requests["first"])
    assert not take(sched, "second") and not sched.requests["second"].suspended_by_load
    sched.waiting.append(sched.requests["second"])
    admitted = sched._num_admitted_poor
    assert take(sched, "loaded") and sched.requests["loaded"].suspended_by_load
    assert take(sched, "loaded-sibling", share="loaded")
    assert sched.requests["loaded-sibling"].suspended_by_load
    assert not take(sched, "loaded-seeded", temperature=1.0, seed=3)
    sched._draft_record_poor = True
    assert take(sched, "loaded-poor") and sched.requests["loaded-poor"].suspended_by_load
    assert sched._num_admitted_poor == admitted  # (not counted toward the scouts)
    sched.waiting.clear()
    for rid in list(sched.requests):
        sched.requests.pop(rid)


@pytest.mark.parametrize("method,target,extra", [
    ("eagle3", "qwen3_headdim", {}), ("dflash", "qwen3_headdim", {}),
    ("dflash", "hybrid", {}), ("eagle3", "qwen3_headdim", {"async_scheduling": True})])
def test_load_suspends_and_a_drained_batch_resumes(request, tiny_model_factory, tmp_path,
                                                   monkeypatch, method, target, extra):
    """Requests taken in beside draft_batch_limit others (a batch none of whose requests
    drafts: the CPU row budget) are suspended whatever the record. Once the batch
    drains under a promising record (here: good) so that a row is left for a draft, one
    whose token budget left is long is recomputed with the drafter's data (not counted
    as a preemption, no prefix hit on its own suspended blocks) and drafts what a
    never-suspended engine drafts at the same positions; one with little budget left
    stays suspended, and so do one whose prompt is longer than what it may still
    decode and one for whose drafts no row is left; under a poor record nobody is
    resumed. Greedy tokens and logprobs (1e-4) as the plain engine's,
    nothing leaked. With async scheduling too (a request resumed with its last step in
    flight)."""
    from tokenmill.spec_decode import drafter as drafter_mod
    monkeypatch.setattr(drafter_mod, "backoff", lambda misses: 0)  # drafts every step
    tm = (request.getfixturevalue("hybrid") if target == "hybrid"
          else tiny_model_factory(target))
    draft = _random_draft(tm, tmp_path, method)
    llm = _engine(tm, draft, method, False, batch_limit=None, **extra)
    sched, runner = scheduler_of(llm), runner_of(llm)
    limit = sched.config.draft_batch_limit
    assert limit is not None and limit == runner.drafter.row_budget
    runner.drafter.promising_record = lambda: True
    rng = np.random.default_rng(5)
    def prompt(n):
        return rng.integers(0, tm.vocab_size, n).tolist()
    # limit short requests (too short to resume); then L, a prompt longer than what it
    # may decode after the batch drains; A and B, two long ones; and C, whose budget
    # ends soon. At 24 tokens the batch drains to L, A, B, C: no row left for a draft
    # under the limit; at 30, C finishes, and once A has decoded 32 tokens (more than
    # its prompt) it is resumed; L never (the rule), nor B (no row for its drafts).
    prompts = [prompt(int(rng.integers(9, 20))) for _ in range(limit)] + [
        prompt(36), prompt(17), prompt(12), prompt(15)]
    lengths = [24] * limit + [64, 64, 64, 30]
    reqs = [{"prompt_token_ids": p} for p in prompts]
    params = [greedy(n, logprobs=2) for n in lengths]
    ref = make_llm(tm.path, block_size=8, max_model_len=192).generate(
        reqs, params, use_tqdm=False)
    cold = _engine(tm, draft, method, False, batch_limit=None)
    runner_of(cold).drafter.promising_record = lambda: True
    cold_drafts = record_model_drafts(runner_of(cold))
    cold.generate(reqs[limit + 1:limit + 3], params[limit + 1:limit + 3], use_tqdm=False)

    seen = watch(runner, sched)
    drafts = record_model_drafts(runner)
    stats = sched.kv_cache_manager.prefix_cache_stats
    got = llm.generate(reqs, params, use_tqdm=False)
    for g, r in zip(got, ref):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, r.outputs[0].logprobs):
            assert max(abs(a[t].logprob - b[t].logprob) for t in b) <= 1e-4
    assert list(seen["suspended"].values()) == [True] * (limit + 4)  # (seen together)
    assert sched.num_draft_resumes == 1 and sched.num_preemptions == 0
    assert llm.llm_engine.engine_core.stats().num_draft_resumes == 1
    assert stats.hits == 0
    # The resumed requests drafted, as a cold engine did at the same positions (its
    # K/V or context rebuilt by the recompute); the others never did.
    resumed = tuple(prompts[limit + 1])
    theirs = {key: d for key, d in drafts.items() if key[0] == resumed}
    assert theirs and theirs.keys() == drafts.keys()
    common = theirs.keys() & cold_drafts.keys()
    assert len(common) >= 10
    for key in common:
        m = min(len(theirs[key]), len(cold_drafts[key]))
        assert theirs[key][:m] == cold_drafts[key][:m], key
    assert_no_leaks(llm)

    # A poor record: the drained batch's suspended requests stay so.
    runner.drafter.promising_record = lambda: False
    drafts.clear()
    again = llm.generate(reqs, params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in again] == [r.outputs[0].token_ids for r in ref]
    assert sched.num_draft_resumes == 1 and not drafts
    assert_no_leaks(llm)


def test_which_requests_are_resumed(tiny_model_factory, tmp_path):
    """The scheduler's resume rule, on requests suspended by load in a drained batch:
    only under a promising record; not one suspended for the record; one whose budget
    left is short, or who has decoded less than its prompt, stays; oldest first, while
    a row is left under draft_batch_limit for each drafting request's draft. A resumed
    request is requeued first, from its first token, with its drafts on, rehashed
    without the mark, sent to the runner as new and to be dropped from its batch."""
    from tokenmill.core.request import RequestStatus
    tm = tiny_model_factory("qwen3_headdim")
    draft = _random_draft(tm, tmp_path, "eagle3")
    sched = scheduler_of(_engine(tm, draft, "eagle3", False, batch_limit=4))

    def running(rid, prompt_len, out, max_tokens, by_load=True):
        req = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))
        req.output_token_ids = [7] * out
        req.drafts_suspended, req.suspended_by_load = True, by_load
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = req.num_tokens - 1
        request_block_hashes(req, 8)
        sched.requests[rid] = req
        sched.running.append(req)
        return req

    def resume(promising=True):
        sched._draft_record_promising = promising
        preempted = set()
        limit = sched.config.draft_batch_limit
        if promising and len(sched.running) + len(sched.waiting) < limit:
            sched._resume_drafts(preempted)
        return preempted
    short_left = running("short-left", 10, 40, 50)
    long_prompt = running("long-prompt", 60, 40, 400)
    ok = running("ok", 10, 40, 400)
    marked = list(ok.block_hashes)
    assert resume(promising=False) == set()
    assert resume() == {"ok"}
    assert sched.running == [short_left, long_prompt] and sched.waiting[0] is ok
    assert not ok.drafts_suspended and not ok.suspended_by_load
    assert ok.status == RequestStatus.PREEMPTED and ok.num_computed_tokens == 0
    assert "ok" in sched._resend_as_new and sched.num_draft_resumes == 1
    assert sched.num_preemptions == 0
    assert request_block_hashes(ok, 8)[0] != marked[0]  # no mark now
    for req in (short_left, long_prompt):
        assert req.drafts_suspended and req.suspended_by_load
    # Rows: with one request drafting in three, none is left for a second.
    sched.running.remove(short_left)
    sched.running.remove(long_prompt)
    sched.waiting.clear()
    record = running("record", 10, 40, 400, by_load=False)  # (the oldest)
    running("first", 10, 40, 400)
    second = running("second", 10, 40, 400)
    assert resume() == {"first"} and second.suspended_by_load and record.drafts_suspended
    assert resume() == set()  # (first waits, drafting: 3 + 1 rows)
    sched.running.clear()
    sched.waiting.clear()
    sched._resend_as_new.clear()
    sched.requests.clear()
