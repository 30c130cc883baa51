"""The scheduler's side of speculative decoding, with a fake runner: drafts scheduled
as extra tokens inside the budget, capped at max_tokens / max_model_len, and
num_computed_tokens rolled back to the accepted length."""
from __future__ import annotations

from tokenmill import SamplingParams
from tokenmill.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup
from tokenmill.core.request import Request
from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.core.scheduler import Scheduler, SchedulerConfig


def make_sched(budget=32, max_model_len=64, k=4, num_blocks=64) -> Scheduler:
    spec = FullAttentionSpec(4, 1, 8, "float32")
    cfg = KVCacheConfig(num_blocks, [KVCacheGroup(["layers.0.attn"], spec)])
    return Scheduler(SchedulerConfig(8, budget, max_model_len, True,
                                     num_speculative_tokens=k), cfg)


def make_req(rid, n_prompt, max_tokens=32):
    return Request(rid, list(range(1, n_prompt + 1)),
                   SamplingParams(temperature=0.0, max_tokens=max_tokens), frozenset())


def step(sched, emitted: dict[str, list[int]], drafts: dict[str, list[int]]):
    """schedule(), then a runner that emits `emitted[rid]` (default [7]) for requests
    past their prompt and proposes `drafts[rid]`."""
    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        req = sched.requests[rid]
        done = req.num_computed_tokens >= req.num_tokens
        sampled.append(emitted.get(rid, [7]) if done else [])
    out = ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled,
                            spec_token_ids=[drafts.get(r, []) for r in ids])
    sched.update_from_output(so, out)
    return so


def test_drafts_are_scheduled_then_rolled_back_to_the_accepted_length():
    sched = make_sched()
    sched.add_request(make_req("a", 10))
    step(sched, {}, {"a": [1, 2, 3, 4]})  # prefill: first token, then drafts for next step
    req = sched.requests["a"]
    assert req.num_tokens == 11 and req.num_computed_tokens == 10
    so = step(sched, {"a": [1, 2, 9]}, {"a": [5, 5]})  # 2 of 4 accepted, then a 3rd token
    assert so.num_scheduled_tokens["a"] == 5
    assert so.scheduled_spec_decode_tokens["a"] == [1, 2, 3, 4]
    assert req.num_tokens == 14
    assert req.num_computed_tokens == 13  # the last token's KV is computed next step
    blocks = sched.kv_cache_manager.get_block_ids("a")[0]
    assert len(blocks) * 4 >= 10 + 1 + 4  # slots for every draft were allocated
    so = step(sched, {"a": [3]}, {})  # every draft rejected
    assert so.scheduled_spec_decode_tokens["a"] == [5, 5]
    assert req.num_computed_tokens == 14 and req.num_tokens == 15
    s = sched.spec_stats
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 6, 2)
    assert s.accepted_per_position == [1, 1, 0, 0]


def test_drafts_capped_by_max_tokens_max_model_len_and_budget():
    sched = make_sched(max_model_len=16)
    sched.add_request(make_req("len", 10, max_tokens=100))
    sched.add_request(make_req("tok", 4, max_tokens=3))
    step(sched, {}, {"len": [1, 2, 3, 4], "tok": [1, 2, 3, 4]})
    so = sched.schedule()
    # "tok": 1 token out, max_tokens 3: at most 1 draft (+1 sampled) this step.
    assert so.scheduled_spec_decode_tokens["tok"] == [1]
    # "len": 11 tokens of 16: an all-accepted run of d drafts ends at 12 + d <= 16.
    assert so.scheduled_spec_decode_tokens["len"] == [1, 2, 3, 4]
    sched2 = make_sched(budget=3)
    sched2.add_request(make_req("b", 2))
    step(sched2, {}, {"b": [1, 2, 3, 4]})
    so = sched2.schedule()
    assert so.num_scheduled_tokens["b"] == 3 and so.scheduled_spec_decode_tokens["b"] == [1, 2]


def test_preemption_drops_drafts():
    sched = make_sched(num_blocks=5)  # 4 usable blocks of 4 tokens
    sched.add_request(make_req("a", 6))
    sched.add_request(make_req("b", 6))
    step(sched, {}, {"a": [1, 2, 3, 4], "b": [1, 2, 3, 4]})
    so = sched.schedule()
    assert so.preempted_req_ids  # not enough blocks for both with drafts
    for rid in so.preempted_req_ids:
        assert sched.requests[rid].spec_token_ids == []
        assert rid not in so.scheduled_spec_decode_tokens
