"""Draft models with prefix caching: a request whose prompt hits blocks that an earlier
request left cached drafts exactly as in a cold engine. The hit blocks carry the draft
model's own K/V (EAGLE-3) or context (DFlash) beside the target's, so they must hold
what a cold run writes there: the rows a request kept waiting (spec_decode/deferred.py)
are written when it finishes or is preempted, and for a drafter whose K/V at a position
read the next token a hit ends at a block whose successor is cached too
(KVCacheManager's draft_reads_next_token).

Drafts decide nothing in greedy output (the tests of test_spec_decode.py hold that),
but they decide a seeded sampling request's tokens and every request's speed, so a
hit must not change them.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_spec_decode import _random_draft, generate, greedy, hybrid  # noqa: F401 (fixture)

from conftest import make_llm, record_model_drafts, runner_of, scheduler_of


def _engine(tm, draft, method, **kw):
    args = dict(enable_prefix_caching=True, block_size=8, max_model_len=192)
    llm = make_llm(tm.path, speculative_config={"method": method, "model": draft,
                                                "num_speculative_tokens": 3},
                   **dict(args, **kw))
    runner = runner_of(llm)
    # Both engines start each request at k (the server-wide record would start the
    # warm engine's later requests backed off, the cold one's not).
    runner.drafter.poor_record = lambda: False
    return llm, record_model_drafts(runner)


def _record_draft_hidden(llm) -> list:
    """The draft model's output hidden states at every proposal (what its head takes the
    argmax of): EAGLE-3's forward, DFlash's block pass."""
    model = runner_of(llm).drafter.model_proposer.model
    seen = []
    name = "draft_hidden" if hasattr(model, "draft_hidden") else "forward"
    inner = getattr(model, name)

    def call(*args, **kw):
        out = inner(*args, **kw)
        seen.append((out[0] if isinstance(out, tuple) else out).detach().clone())
        return out
    setattr(model, name, call)
    return seen


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("qwen3_headdim")


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
@pytest.mark.parametrize("target", ["qwen3_headdim", "mistral_swa", "gemma3", "hybrid"])
def test_the_next_turn_of_a_conversation_drafts_as_in_a_cold_engine(
        request, tiny_model_factory, tmp_path, method, target):
    """Turn 1 (random drafts: every one rejected, so its decode rows wait, backed off)
    finishes with rows still waiting; turn 2's prompt (turn 1's tokens and more) hits
    its blocks: every draft of turn 2 equals a cold engine's. Dense, sliding-window
    (Mistral's every layer, Gemma 3's two KV groups) and hybrid targets (the hybrid
    resumes from a state snapshot, which decode steps do not take: its hit ends in
    turn 1's prompt)."""
    tiny = (request.getfixturevalue("hybrid") if target == "hybrid"
            else tiny_model_factory(target))
    draft = _random_draft(tiny, tmp_path, method)
    rng = np.random.default_rng(7)
    first = rng.integers(0, tiny.vocab_size, 21).tolist()
    warm, warm_drafts = _engine(tiny, draft, method)
    proposer = runner_of(warm).drafter.model_proposer
    taken = []
    inner = proposer.deferred.take_cached

    def take_cached(runner, req_ids):
        out = inner(runner, req_ids)
        taken.append(out[0].size)
        return out
    proposer.deferred.take_cached = take_cached
    reply = generate(warm, [first], greedy(60))[0]
    assert sum(taken) > 0  # rows that waited were written as turn 1 finished
    second = first + list(reply) + rng.integers(0, tiny.vocab_size, 5).tolist()
    warm_drafts.clear()
    warm_hidden = _record_draft_hidden(warm)
    out_warm = generate(warm, [second], greedy(12))
    hits = scheduler_of(warm).kv_cache_manager.prefix_cache_stats.hits
    assert hits >= (16 if target == "hybrid" else 40)
    cold, cold_drafts = _engine(tiny, draft, method)
    cold_hidden = _record_draft_hidden(cold)
    assert generate(cold, [second], greedy(12)) == out_warm
    assert warm_drafts and warm_drafts == cold_drafts
    # Not only the argmax: the draft model's outputs themselves (fp32; its K/V or
    # context written in passes of other row counts rounds alike to ~1e-6).
    assert len(warm_hidden) == len(cold_hidden) > 0
    for w, c in zip(warm_hidden, cold_hidden):
        assert torch.allclose(w, c, atol=1e-5, rtol=1e-5), (w - c).abs().max()


def test_an_eagle_hit_stops_before_a_block_another_token_followed(tiny, tmp_path):
    """Two prompts share 24 tokens (3 blocks of 8) and part right after: the first's
    EAGLE-3 K/V at position 23 was made from its own token 24, so the second hits 2
    blocks, not 3, and recomputes the third with its token 24."""
    draft = _random_draft(tiny, tmp_path, "eagle3")
    rng = np.random.default_rng(8)
    shared = rng.integers(0, tiny.vocab_size, 24).tolist()
    a = shared + [1, 2, 3, 4, 5, 6]
    b = shared + [9, 8, 7, 6, 5, 4]
    warm, warm_drafts = _engine(tiny, draft, "eagle3")
    generate(warm, [a], greedy(4))
    stats = scheduler_of(warm).kv_cache_manager.prefix_cache_stats
    hits = stats.hits
    warm_drafts.clear()
    out_warm = generate(warm, [b], greedy(8))
    assert stats.hits - hits == 16
    cold, cold_drafts = _engine(tiny, draft, "eagle3")
    assert generate(cold, [b], greedy(8)) == out_warm
    assert warm_drafts and warm_drafts == cold_drafts


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_preempted_requests_write_their_waiting_rows(tiny, tmp_path, method):
    """A small KV cache preempts requests mid-decode: each one's rows waiting in full
    blocks are written as it leaves (its blocks stay cached; resumed, it hits them and
    has no waiting rows left to write), and every draft equals an engine's in which no
    row ever waits."""
    draft = _random_draft(tiny, tmp_path, method)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, tiny.vocab_size, 12).tolist() for _ in range(4)]
    runs = []
    for max_rows in (0, None):  # 0: no row ever waits
        llm, drafts = _engine(tiny, draft, method, num_kv_blocks=16, max_model_len=96,
                              max_num_batched_tokens=16)
        runner = runner_of(llm)
        deferred = runner.drafter.model_proposer.deferred
        if max_rows is not None:
            deferred.max_rows = max_rows
        sched = scheduler_of(llm)
        preempted, written = set(), []  # requests preempted; those with rows written
        inner_preempt, inner_take = sched._preempt, deferred.take_cached

        def preempt(req, _inner=inner_preempt, _seen=preempted):
            _seen.add(req.request_id)
            return _inner(req)

        def take_cached(runner, req_ids, _inner=inner_take, _d=deferred, _w=written,
                        _seen=preempted):
            _w.extend(r for r in req_ids if r in _seen and _d.num_waiting(r))
            return _inner(runner, req_ids)
        sched._preempt, deferred.take_cached = preempt, take_cached
        out = generate(llm, prompts, greedy(48))
        runs.append((out, dict(drafts), preempted, written,
                     sched.kv_cache_manager.prefix_cache_stats.hits))
    (out0, drafts0, _, written0, _), (out1, drafts1, preempted, written1, hits) = runs
    assert out0 == out1
    assert preempted and hits > 0  # resumed requests hit their own blocks
    assert not written0 and written1  # rows waited at a preemption, and were written
    assert drafts1 == drafts0


def test_an_eagle_hit_in_the_external_tier_stops_there_too(tiny, tmp_path):
    """The same rule for blocks the external KV tier holds (prefix caching off: every
    hit is the tier's): the second prompt loads 2 blocks, not 3."""
    draft = _random_draft(tiny, tmp_path, "eagle3")
    rng = np.random.default_rng(8)
    shared = rng.integers(0, tiny.vocab_size, 24).tolist()
    b = shared + [9, 8, 7, 6, 5, 4]
    warm, warm_drafts = _engine(tiny, draft, "eagle3", enable_prefix_caching=False,
                                kv_connector="cpu")
    generate(warm, [shared + [1, 2, 3, 4, 5, 6]], greedy(4))
    core = warm.llm_engine.engine_core
    before = core.kv_cache_stats()["external"]["hit_tokens"]
    warm_drafts.clear()
    out_warm = generate(warm, [b], greedy(8))
    assert core.kv_cache_stats()["external"]["hit_tokens"] - before == 16
    cold, cold_drafts = _engine(tiny, draft, "eagle3")
    assert generate(cold, [b], greedy(8)) == out_warm
    assert warm_drafts and warm_drafts == cold_drafts
