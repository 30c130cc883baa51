"""Async scheduling: step N+1 is scheduled while step N runs, with placeholders for the
tokens N has not sampled yet. Output must be token-identical to synchronous scheduling."""
from __future__ import annotations

import random

import pytest

from conftest import make_llm, runner_of, scheduler_of
from tokenmill import SamplingParams
from tokenmill.core.request import Request
from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.engine.engine_args import EngineArgs, resolve_async
from tokenmill.sampling_params import RequestOutputKind
from unit.test_scheduler import make_req, make_sched


def _workload(vocab: int, n: int = 20, seed: int = 0):
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(rng.randint(1, 70))]}
               for _ in range(n)]
    params = []
    for i in range(n):
        kw = dict(max_tokens=rng.randint(1, 30), ignore_eos=True)
        if i % 3 == 0:
            kw.update(temperature=0.9, seed=1000 + i, top_k=20)
        elif i % 3 == 1:
            kw.update(temperature=0.0)
        else:
            kw.update(temperature=0.7, seed=2000 + i, n=2, presence_penalty=0.5)
        params.append(SamplingParams(**kw))
    return prompts, params


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("engine_kw", [
    dict(max_num_batched_tokens=32),  # chunked prefill mixed with decodes
    dict(max_num_batched_tokens=24, num_kv_blocks=14, block_size=8, max_model_len=104),
    dict(max_num_seqs=3),  # requests wait for a row
], ids=["chunked", "preemption", "few_rows"])
def test_async_outputs_equal_sync(llama_tiny, engine_kw):
    prompts, params = _workload(llama_tiny.vocab_size)
    results, preemptions = {}, {}
    for mode in (False, True):
        llm = make_llm(llama_tiny.path, async_scheduling=mode, **engine_kw)
        results[mode] = _tokens(llm.generate(prompts, params, use_tqdm=False))
        preemptions[mode] = scheduler_of(llm).num_preemptions
        assert scheduler_of(llm).kv_cache_manager.num_used_blocks == 0
        assert not runner_of(llm).requests and runner_of(llm).input_batch.num_reqs() == 0
    assert results[True] == results[False]
    if "num_kv_blocks" in engine_kw:
        assert preemptions[True] > 0 and preemptions[False] > 0


def test_async_with_aborts_and_stop_strings_matches_sync(llama_tiny):
    """Aborts and engine-side finishes (stop token ids here) arrive while a step is in
    flight: the dropped tokens never show up and the survivors match sync."""
    prompts, params = _workload(llama_tiny.vocab_size, n=12, seed=3)
    ref = make_llm(llama_tiny.path, async_scheduling=False, max_num_batched_tokens=32)
    want = _tokens(ref.generate(prompts, params, use_tqdm=False))
    llm = make_llm(llama_tiny.path, async_scheduling=True, max_num_batched_tokens=32)
    engine = llm.llm_engine
    ids = [engine.add_request(None, p, sp.clone(output_kind=RequestOutputKind.FINAL_ONLY))
           for p, sp in zip(prompts, params)]
    aborted = set(ids[::4])
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            finals[out.request_id] = out
        steps += 1
        if steps == 3:
            engine.abort_request(sorted(aborted))
    for i, rid in enumerate(ids):
        if rid in aborted:
            assert rid not in finals
        else:
            assert [c.token_ids for c in finals[rid].outputs] == want[i]
    assert scheduler_of(llm).kv_cache_manager.num_used_blocks == 0
    assert not runner_of(llm).requests


def test_async_stops_on_eos_and_max_tokens_like_sync(eos_model):
    prompt = {"prompt_token_ids": eos_model.eos_prompt}
    for mode in (False, True):
        llm = make_llm(eos_model.path, async_scheduling=mode)
        out = llm.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=30),
                                              SamplingParams(temperature=0, max_tokens=2)],
                           use_tqdm=False)
        assert out[0].outputs[0].token_ids == eos_model.eos_ref[:eos_model.eos_index + 1]
        assert out[0].outputs[0].finish_reason == "stop"
        assert out[1].outputs[0].token_ids == eos_model.eos_ref[:2]
        assert out[1].outputs[0].finish_reason == "length"


def test_next_step_input_is_the_token_sampled_in_flight(llama_tiny):
    """While the scheduler has not seen step N's token, step N+1 (already scheduled
    with a placeholder) feeds exactly that token to the model."""
    llm = make_llm(llama_tiny.path, async_scheduling=True)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": [3, 4, 5, 6]},
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    core, runner = engine.engine_core, runner_of(llm)
    seen_inputs = []
    orig = runner.execute_model

    def spy(so):
        orig(so)
        if so.total_num_scheduled_tokens:
            seen_inputs.append(runner.last_step.input_ids.tolist())

    runner.execute_model = spy
    sched = scheduler_of(llm)
    outs = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.append(out)
        req = sched.requests.get("a")
        if req is not None and core._in_flight is not None:
            # Scheduled one step ahead: one token the scheduler does not know yet.
            assert req.num_output_placeholders == 1
    tokens = outs[-1].outputs[0].token_ids
    assert len(tokens) == 6
    assert seen_inputs[0] == [3, 4, 5, 6]
    assert [s[0] for s in seen_inputs[1:6]] == tokens[:5]


def test_scheduler_schedules_ahead_with_placeholders():
    sched = make_sched(budget=32)
    sched.add_request(make_req("a", 5, max_tokens=3))
    so1 = sched.schedule()  # the prompt; it samples -> one placeholder
    assert so1.num_scheduled_tokens == {"a": 5}
    req = sched.requests["a"]
    assert req.num_output_placeholders == 1 and req.num_computed_tokens == 5
    so2 = sched.schedule()  # before step 1's output: the next token already
    assert so2.num_scheduled_tokens == {"a": 1}
    assert req.num_output_placeholders == 2
    # Step 1's token arrives; then step 2's; max_tokens=3 -> one more, then nothing.
    for so in (so1, so2):
        out = ModelRunnerOutput(["a"], {"a": 0}, [[7]])
        sched.update_from_output(so, out)
    assert req.num_output_placeholders == 0 and req.output_token_ids == [7, 7]
    so3 = sched.schedule()
    assert so3.num_scheduled_tokens == {"a": 1}
    # With max_tokens reached by tokens in flight, nothing more is scheduled.
    assert sched.schedule().num_scheduled_tokens == {}
    sched.update_from_output(so3, ModelRunnerOutput(["a"], {"a": 0}, [[7]]))
    assert req.is_finished and sched.kv_cache_manager.num_used_blocks == 0


def test_preempted_while_in_flight_finishes_from_the_waiting_queue():
    sched = make_sched(num_blocks=4, block_size=4, budget=32)  # 3 usable blocks
    a, b = make_req("a", 4, max_tokens=1), make_req("b", 4, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    so1 = sched.schedule()  # a: 1 block, b: 1 block; both sample
    assert set(so1.num_scheduled_tokens) == {"a", "b"}
    # Step 2 is scheduled before step 1's output: a is at max_tokens in flight, b
    # needs a second block (one free) ...
    so2 = sched.schedule()
    assert "a" not in so2.num_scheduled_tokens
    assert so2.num_scheduled_tokens.get("b") == 1
    # ... then step 1's output finishes a, and b goes on.
    out = ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[9], [9]])
    done = sched.update_from_output(so1, out)
    assert {o.request_id: o.finish_reason for o in done}["a"] == "length"
    assert b.num_output_placeholders == 1
    # Force b out while its step is in flight, then let the step's token arrive.
    sched.running.remove(b)
    sched._preempt(b)
    assert b.num_output_placeholders == 1
    assert sched.schedule().num_scheduled_tokens == {}  # waits for its in-flight token
    sched.update_from_output(so2, ModelRunnerOutput(["b"], {"b": 0}, [[9]]))
    assert b.output_token_ids == [9, 9] and b.num_output_placeholders == 0
    so3 = sched.schedule()  # resumed: recompute prompt + both outputs
    assert so3.num_scheduled_tokens == {"b": 6}


def test_async_scheduling_flag():
    import torch
    assert resolve_async(True, torch.device("cpu")) and not resolve_async(False, torch.device("cpu"))
    assert EngineArgs(model="x").async_scheduling is None
    # Default: on where the forward runs beside the host, off on CPU (measured).
    assert not resolve_async(None, torch.device("cpu"))
    assert resolve_async(None, torch.device("cuda"))


def test_cli_async_scheduling_flag_reaches_the_engine_args():
    from tokenmill.engine.arg_utils import engine_kwargs
    from tokenmill.entrypoints.cli import build_parser
    parser = build_parser()
    for argv, want in ((["serve"], None), (["serve", "--no-async-scheduling"], False),
                       (["serve", "--async-scheduling"], True)):
        assert engine_kwargs(parser.parse_args(argv))["async_scheduling"] is want
