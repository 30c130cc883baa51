"""Speculative decoding with async scheduling (issue 33).

Async scheduling launches step N + 1 before step N's output is collected, so the
scheduler cannot know N's acceptance nor N + 1's drafts: it reserves k draft slots
per decoding request (Scheduler._num_spec_slots) and the runner, which runs the steps
in order, fills them with the drafts it proposed after N, corrects the row's
computed count, positions and slots to what N really accepted, and runs only the
drafts it has (ModelRunner._fill_spec_slots). The scheduler then rolls back exactly.

Every run here is compared, fp32 and greedy (or top_k=1 sampling), with the plain
engine (no speculation, synchronous): tokens equal, logprobs within 1e-4; and with the
synchronous speculative run where that adds something. Drafts must really be used
(acceptance counters > 0 where drafts pass) and nothing may be held afterwards (KV
blocks, state slots, the drafters' deferred rows, the runner's kept drafts).
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from conftest import make_llm, runner_of, scheduler_of
from tokenmill import SamplingParams
from tokenmill.sampling_params import RequestOutputKind

sys.path.insert(0, os.path.dirname(__file__))

from test_spec_decode import mtp_checkpoint  # noqa: E402
from test_spec_matrix import (CHUNKED, VOCAB, assert_idle, assert_same, batch,  # noqa: E402
                              install_partial_oracle, no_row_budget, plain_run, spec_configs,
                              targets)
from test_spec_oracle import PATTERNS, Oracle, install_oracle, setups  # noqa: E402

# The fixtures this file shares with the matrix and the oracle suites.
SHARED_FIXTURES = (mtp_checkpoint, no_row_budget, spec_configs, targets, setups)


def async_llm(path, spec, **extra):
    llm = make_llm(path, speculative_config=spec, async_scheduling=True, **extra)
    assert llm.llm_engine.engine_core.async_scheduling
    return llm


def record_runner_verifications(llm) -> list[tuple[tuple, int, int, int]]:
    """Every verification the runner made: (prompt, the request's tokens before the
    drafts, drafts verified, drafts accepted), from the drafter's observe()."""
    runner = runner_of(llm)
    drafter = runner.drafter
    seen, inner = [], drafter.observe

    def observe(req_ids, num_drafts, num_accepted):
        batch_ = runner.input_batch
        for r in np.nonzero(num_drafts > 0)[0].tolist():
            rid = req_ids[r]
            n = int(batch_.num_tokens_no_spec[r])  # (not yet advanced by this step)
            seen.append((tuple(runner.requests[rid].prompt_token_ids), n,
                         int(num_drafts[r]), int(num_accepted[r])))
        return inner(req_ids, num_drafts, num_accepted)
    drafter.observe = observe
    return seen


def assert_no_kept_drafts(llm) -> None:
    assert not runner_of(llm)._next_drafts
    assert_idle(llm)


# ---- the mixed batch, every method, dense and hybrid ------------------------------------------

METHODS = [("dense", "ngram"), ("dense", "eagle3"), ("dense", "dflash"),
           ("hybrid", "ngram"), ("hybrid", "mtp"), ("hybrid", "dflash")]


@pytest.mark.parametrize("config", ["plain", "chunked"])
@pytest.mark.parametrize("drafts", ["random", "oracle"])
@pytest.mark.parametrize("kind,method", METHODS)
def test_async_mixed_batch_equals_the_plain_engine(targets, spec_configs, kind, method,
                                                   drafts, config):
    """test_spec_matrix's batch (top-5 logprobs and prompt logprobs, sampled n=3 and
    seeded n=2 with top_k=1, a greedy request, a JSON grammar) under async scheduling:
    the plain engine's tokens, finish reasons and logprobs; drafts verified (and, with
    the oracle, accepted part-way); under chunked prefill with preemption too."""
    path = targets(kind)
    want = plain_run(path, config)
    extra = CHUNKED if config == "chunked" else {}
    llm = async_llm(path, spec_configs(kind, method), **extra)
    oracle = install_partial_oracle(llm, method, want, VOCAB) if drafts == "oracle" else None
    seen = record_runner_verifications(llm)
    prompts, params = batch()
    got = llm.generate(prompts, params, use_tqdm=False)
    assert_same(got, want)
    stats = scheduler_of(llm).spec_stats
    # The scheduler counts every verification the runner made, but those of a step that
    # was launched after its request had finished (its output is dropped): here only the
    # grammar request can finish early (its grammar completes), so its count is a bound.
    grammar_prompt = tuple(want[-1].prompt_token_ids)
    others = [(d, a) for p, _, d, a in seen if p != grammar_prompt]
    in_grammar = [(d, a) for p, _, d, a in seen if p == grammar_prompt]
    for i, counted in ((0, stats.num_draft_tokens), (1, stats.num_accepted_tokens)):
        least = sum(v[i] for v in others)
        assert least <= counted <= least + sum(v[i] for v in in_grammar)
    assert stats.num_draft_tokens > 0
    if oracle is not None:
        assert not oracle.errors, oracle.errors[:5]
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        # every request verified drafts, the grammar one too (its bitmask built over the
        # drafts the runner put in its slots)
        assert {p for p, _, _, _ in seen} == {tuple(o.prompt_token_ids) for o in want}
        assert sum(a for _, a in in_grammar) > 0
    if config == "chunked":
        assert scheduler_of(llm).num_preemptions > 0
    assert_no_kept_drafts(llm)


# ---- n-gram on prompts that loop: against HF -------------------------------------------------

def test_async_ngram_on_loops_equals_hf_and_sync(llama_tiny):
    """Prompts ending in a repeated motif (drafts accepted at once): HF's greedy tokens,
    the plain engine's logprobs, the synchronous speculative run's tokens; drafts
    accepted, and a step in flight whenever drafts are verified (truly async)."""
    from test_spec_decode import NGRAM, loop_prompts
    prompts = loop_prompts(llama_tiny.vocab_size, n=4, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    want = make_llm(llama_tiny.path).generate(inputs, params, use_tqdm=False)
    sync_llm = make_llm(llama_tiny.path, speculative_config=NGRAM)
    sync = sync_llm.generate(inputs, params, use_tqdm=False)
    # (synchronous steps take their drafts from the scheduler: the runner keeps none)
    assert not runner_of(sync_llm).keep_own_drafts
    llm = async_llm(llama_tiny.path, NGRAM)
    core = llm.llm_engine.engine_core
    assert core.runner.keep_own_drafts
    launched_while_in_flight, inner = [], core.runner.execute_model

    def execute_model(so):  # (on the worker thread: the step before is collected or not)
        if so.scheduled_spec_slots:
            launched_while_in_flight.append(True)
        return inner(so)
    core.runner.execute_model = execute_model
    seen = record_runner_verifications(llm)
    got = llm.generate(inputs, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == \
        [llama_tiny.reference(p, 24) for p in prompts]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in sync]
    assert_same(got, want)
    stats = scheduler_of(llm).spec_stats
    assert stats.num_accepted_tokens > 0 and launched_while_in_flight
    assert stats.num_draft_tokens == sum(d for _, _, d, _ in seen)
    assert_no_kept_drafts(llm)


# ---- oracle drafts: full, partial and zero acceptance -----------------------------------------

ORACLE_METHODS = ["ngram", "eagle3", "dflash", "mtp"]


def run_async_oracle(setup, pattern: str, params=None, **extra):
    llm = async_llm(setup.path, setup.spec, **extra)
    oracle = Oracle(setup.seqs, pattern, setup.vocab)
    install_oracle(llm, setup.spec["method"], oracle, setup.k)
    seen = record_runner_verifications(llm)
    from test_spec_oracle import MAX_TOKENS
    params = params or SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in setup.prompts], params,
                       use_tqdm=False)
    return llm, oracle, seen, got


@pytest.mark.parametrize("config", ["plain", "chunked"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("method", ORACLE_METHODS)
def test_async_oracle_acceptance_is_exact(setups, method, pattern, config):
    """Oracle drafts (the plain run's tokens, corrupted where the pattern says) through
    each method's real proposer, under async scheduling (and chunked prefill with
    preemption): the plain tokens; every verification accepts exactly the drafts the
    pattern lets through at that request's real position (so the runner verified the
    drafts proposed for where the request really was, after the step before's
    acceptance); the counters are those verifications'; nothing held."""
    from test_spec_oracle import expected_stats
    setup = setups(method)
    llm, oracle, seen, got = run_async_oracle(setup, pattern,
                                              **(CHUNKED if config == "chunked" else {}))
    assert [o.outputs[0].token_ids for o in got] == setup.plain
    assert not oracle.errors, oracle.errors[:5]
    for prompt, n, d, a in seen:
        assert a == oracle.accepted(n, d), (prompt[:3], n, d, a)
    s = scheduler_of(llm).spec_stats.as_dict()
    want = expected_stats([(p, n, d) for p, n, d, _ in seen], oracle, setup.k)
    assert {key: s[key] for key in want} == want
    if pattern == "all":
        assert s["num_accepted_tokens"] == s["num_draft_tokens"] > 0
    elif pattern == "none":
        assert s["num_accepted_tokens"] == 0 < s["num_draft_tokens"]
    else:
        assert 0 < s["num_accepted_tokens"] < s["num_draft_tokens"]
    if config == "chunked":
        assert scheduler_of(llm).num_preemptions > 0
    runner = runner_of(llm)
    if runner.state_slots is not None:
        assert not runner.state_slots.slot_of
        assert runner.state_slots.num_free == runner.state_slots.num_slots
    if method == "dflash":  # (its context lives in the paged KV cache: only waiting rows)
        assert not runner.drafter.model_proposer.deferred._slot
    assert_no_kept_drafts(llm)


# ---- finishing inside an accepted run, aborts -------------------------------------------------

@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_async_finishes_inside_an_accepted_run(setups, method):
    """Every draft accepted (runs of up to k + 1 tokens): requests that end on max_tokens
    or on a stop token in the middle of such a run emit exactly the plain engine's
    tokens and finish reason, and the tokens of the step in flight are dropped."""
    setup = setups(method)
    stops = [seq[len(p) + 5] for p, seq in zip(setup.prompts,
                                               (setup.seqs[tuple(p)] for p in setup.prompts))]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (2, 6, 7, 9)]
    params[1] = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                               stop_token_ids=[stops[1]])
    params[3] = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                               stop_token_ids=[stops[3]])
    inputs = [{"prompt_token_ids": p} for p in setup.prompts]
    want = make_llm(setup.path).generate(inputs, params, use_tqdm=False)
    llm, oracle, seen, got = run_async_oracle(setup, "all", params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].finish_reason for o in got] == \
        [o.outputs[0].finish_reason for o in want] == ["length", "stop", "length", "stop"]
    assert not oracle.errors, oracle.errors[:5]
    assert scheduler_of(llm).spec_stats.num_accepted_tokens > 0
    assert_no_kept_drafts(llm)


def test_async_aborts_mid_run(setups):
    """Aborts while steps with draft slots are in flight: the aborted requests end with
    no output, the others emit the plain tokens, nothing is held."""
    setup = setups("ngram")
    llm = async_llm(setup.path, setup.spec)
    oracle = Oracle(setup.seqs, "all", setup.vocab)
    install_oracle(llm, "ngram", oracle, setup.k)
    engine = llm.llm_engine
    from test_spec_oracle import MAX_TOKENS
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    ids = [engine.add_request(None, {"prompt_token_ids": p}, params) for p in setup.prompts]
    aborted = {ids[0], ids[2]}
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            finals[out.request_id] = out
        steps += 1
        if steps == 4:
            assert engine.engine_core._in_flight is not None
            engine.abort_request(sorted(aborted))
    for i, rid in enumerate(ids):
        if rid in aborted:
            assert rid not in finals or not finals[rid].finished or \
                finals[rid].outputs[0].finish_reason == "abort"
        else:
            assert finals[rid].outputs[0].token_ids == setup.plain[i]
    assert scheduler_of(llm).spec_stats.num_accepted_tokens > 0
    assert_no_kept_drafts(llm)


# ---- prefix caching on the hybrid target ------------------------------------------------------

@pytest.mark.parametrize("method", ["ngram", "mtp", "eagle3"])
def test_async_hybrid_prefix_caching(targets, spec_configs, method):
    """A batch sharing a prefix, twice on one engine with prefix caching (recurrent state
    restored from snapshots, then verify steps over the state slots), in chunks with a
    pool that preempts: the uncached plain tokens both times, hits > 0, nothing held."""
    from test_spec_matrix import _shared_prefix_prompts
    path = targets("hybrid")
    prompts = [{"prompt_token_ids": p} for p in _shared_prefix_prompts()]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    want = make_llm(path, enable_prefix_caching=False).generate(prompts, params,
                                                                use_tqdm=False)
    llm = async_llm(path, spec_configs("hybrid", method), enable_prefix_caching=True,
                    state_snapshot_interval=8, **CHUNKED)
    oracle = install_partial_oracle(llm, method, want, VOCAB)
    for _ in range(2):
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.llm_engine.engine_core.kv_cache_stats()["prefix_cache_hits"] > 0
    assert scheduler_of(llm).num_preemptions > 0
    assert not oracle.errors, oracle.errors[:5]
    assert scheduler_of(llm).spec_stats.num_accepted_tokens > 0
    assert_no_kept_drafts(llm)


# ---- the scheduler's bookkeeping, step by step -----------------------------------------------

def test_draft_slots_roll_back_exactly():
    """Async steps with k = 3 draft slots: N + 1 is scheduled before N's output; N's
    runner verified only 2 drafts and accepted 1, N + 1's none: the computed count and
    placeholders come back to the request's real tokens, the counters count what was
    verified, and max_tokens bounds the slots by every in-flight token."""
    from tokenmill.core.sched_output import ModelRunnerOutput
    from unit.test_scheduler import make_req, make_sched
    sched = make_sched(budget=32)
    sched.config.num_speculative_tokens, sched.config.async_scheduling = 3, True
    from tokenmill.spec_decode.metrics import SpecDecodingStats
    sched.spec_stats = SpecDecodingStats(3)
    req = make_req("a", 6, max_tokens=12)
    sched.add_request(req)

    def out(tokens, verified=None):
        return ModelRunnerOutput(["a"], {"a": 0}, [tokens], num_draft_tokens=verified)

    so0 = sched.schedule()  # the prompt: no slots (nothing proposed yet)
    assert so0.num_scheduled_tokens == {"a": 6} and not so0.scheduled_spec_slots
    so1 = sched.schedule()  # its first decode, while the prompt's step is in flight
    assert so1.scheduled_spec_slots == {"a": 3} and so1.num_scheduled_tokens == {"a": 4}
    assert (req.num_computed_tokens, req.num_output_placeholders) == (10, 5)
    sched.update_from_output(so0, out([7]))
    assert (req.num_tokens, req.num_computed_tokens, req.num_output_placeholders) == (7, 10, 4)
    so2 = sched.schedule()  # in flight: up to 4 more tokens; room 12 - 1 - 4 = 7
    assert so2.scheduled_spec_slots == {"a": 3}
    assert (req.num_computed_tokens, req.num_output_placeholders) == (14, 8)
    sched.update_from_output(so1, out([8, 9], [2]))  # 2 drafts verified, 1 accepted
    assert (req.num_tokens, req.num_computed_tokens, req.num_output_placeholders) == (9, 12, 4)
    so3 = sched.schedule()  # room 12 - 3 - 4 = 5: 3 slots still
    assert so3.scheduled_spec_slots == {"a": 3}
    sched.update_from_output(so2, out([10]))  # no drafts at all (None: nothing verified)
    assert (req.num_tokens, req.num_computed_tokens, req.num_output_placeholders) == (10, 13, 4)
    so4 = sched.schedule()  # room 12 - 4 - 4 = 4: 3 slots
    assert so4.scheduled_spec_slots == {"a": 3}
    sched.update_from_output(so3, out([11, 12, 13, 14], [3]))  # all 3 accepted
    assert (req.num_tokens, req.num_computed_tokens, req.num_output_placeholders) == (14, 17, 4)
    so5 = sched.schedule()  # 8 outputs + 4 in flight = max_tokens: nothing scheduled
    assert "a" not in so5.num_scheduled_tokens
    s = sched.spec_stats
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 5, 4)
    sched.update_from_output(so4, out([15, 16], [1]))
    assert len(req.output_token_ids) == 10 and req.num_output_placeholders == 0
    assert req.num_computed_tokens == req.num_tokens - 1
    so6 = sched.schedule()  # 10 outputs, nothing in flight: room 2, one slot
    assert so6.scheduled_spec_slots == {"a": 1} and so6.num_scheduled_tokens == {"a": 2}
    done = sched.update_from_output(so6, out([17, 18], [1]))
    assert done[0].finish_reason == "length" and sched.kv_cache_manager.num_used_blocks == 0


def test_no_draft_slots_where_the_runner_gives_no_drafts():
    """Requests whose logits processors leave them without drafts (penalties, min_tokens)
    get no draft slots: their budget and KV blocks are not reserved for nothing."""
    from tokenmill.core.sched_output import ModelRunnerOutput
    from unit.test_scheduler import make_req, make_sched
    sched = make_sched(budget=32)
    sched.config.num_speculative_tokens, sched.config.async_scheduling = 3, True
    reqs = [make_req("plain", 4), make_req("pen", 4, presence_penalty=0.5),
            make_req("min", 4, min_tokens=2)]
    for r in reqs:
        sched.add_request(r)
    so0 = sched.schedule()
    so1 = sched.schedule()
    assert so1.scheduled_spec_slots == {"plain": 3}
    assert so1.num_scheduled_tokens == {"plain": 4, "pen": 1, "min": 1}
    ids = list(so0.num_scheduled_tokens)
    sched.update_from_output(so0, ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)},
                                                    [[7]] * 3))
    assert [r.num_output_placeholders for r in reqs] == [4, 1, 1]


def test_async_stops_on_eos_inside_an_accepted_run(eos_model):
    """The model's own EOS (from generation_config.json) emitted in the middle of a run
    of accepted drafts (oracle drafts: HF's greedy tokens, which go on past the EOS):
    the output ends at the EOS as HF's does, the run's later tokens and the step in
    flight are dropped, nothing is held."""
    from test_spec_decode import NGRAM
    prompt, ref = list(eos_model.eos_prompt), list(eos_model.eos_ref)
    llm = async_llm(eos_model.path, NGRAM)
    oracle = Oracle({tuple(prompt): prompt + ref}, "all", eos_model.vocab_size)
    install_oracle(llm, "ngram", oracle, NGRAM["num_speculative_tokens"])
    seen = record_runner_verifications(llm)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0,
                                                                     max_tokens=20),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[:eos_model.eos_index + 1]
    assert out.finish_reason == "stop"
    eos_at = len(prompt) + eos_model.eos_index  # its position in the sequence
    assert any(n <= eos_at < n + a for _, n, _, a in seen)  # accepted past the EOS
    assert not oracle.errors, oracle.errors[:5]
    assert_no_kept_drafts(llm)
