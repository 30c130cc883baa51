"""AsyncLLM under failure (issue 14): engine death is loud and short, a stalled step
counts as death, admission control bounds the queue, a slow grammar is a 400."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tokenmill import LLM, SamplingParams, faults
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.errors import EngineDeadError, EngineOverloadedError, ParamError
from tokenmill.structured_output.params import StructuredOutputsParams

SMALL = dict(dtype="float32", max_model_len=128, num_kv_blocks=64, device="cpu")
POISON = 377  # a prompt holding this token trips the armed step-loop fault


@pytest.fixture(autouse=True)
def _disarm():
    faults.disarm_all()
    yield
    faults.disarm_all()


def make_async(**kw) -> AsyncLLM:
    return AsyncLLM(LLM(**SMALL).llm_engine, log_stats_interval=None, **kw)


async def _collect(a: AsyncLLM, prompt, params, rid=None):
    outs = []
    async for out in a.generate(prompt, params, rid):
        outs.append(out)
    return outs


def test_engine_death_fails_every_stream_and_runs_the_callbacks():
    a = make_async()
    died = []
    dead = threading.Event()
    a.add_death_callback(lambda e: (died.append(e), dead.set()))
    faults.arm("step_loop", f"token:{POISON}")
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def healthy():
        gen = a.generate({"prompt_token_ids": [5, 6, 7]}, long)
        await gen.__anext__()  # it is running: now the poisoned request comes in
        started.set()
        async for _ in gen:
            pass

    async def main():
        first = asyncio.create_task(healthy())
        await started.wait()
        poisoned = asyncio.create_task(
            _collect(a, {"prompt_token_ids": [5, POISON]}, long))
        return await asyncio.gather(first, poisoned, return_exceptions=True)

    started = asyncio.Event()

    t0 = time.monotonic()
    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "Error(" not in str(results[0])  # no repr of the cause for clients
    assert time.monotonic() - t0 < 10
    assert dead.wait(5) and len(died) == 1 and not a.is_healthy()
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(a, "x", SamplingParams(max_tokens=2)))
    a.shutdown()


def test_a_stalled_step_counts_as_death():
    a = make_async(step_timeout=1.0)
    died = threading.Event()
    a.add_death_callback(lambda e: died.set())
    release = threading.Event()
    step = a.engine.step

    def stuck_step():
        release.wait(30)
        return step()

    a.engine.step = stuck_step
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="stalled"):
        asyncio.run(_collect(a, "x", SamplingParams(max_tokens=4)))
    assert died.wait(5) and time.monotonic() - t0 < 6
    assert not a.is_healthy()
    release.set()
    a.shutdown()


def test_admission_control_bounds_the_waiting_queue():
    a = make_async(max_num_waiting=2)
    gate = threading.Event()
    in_step = threading.Event()
    step = a.engine.step

    def gated_step():
        out = step()  # "first" is scheduled (running) before the engine is held
        in_step.set()
        gate.wait(30)
        return out

    a.engine.step = gated_step
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    async def main():
        first = asyncio.create_task(_collect(a, "first", params))
        while not in_step.is_set():  # the engine thread is now held inside a step
            await asyncio.sleep(0.01)
        waiting = [asyncio.create_task(_collect(a, f"w{i}", params)) for i in range(2)]
        await asyncio.sleep(0.2)
        with pytest.raises(EngineOverloadedError) as info:
            await _collect(a, "one too many", params)
        assert info.value.retry_after >= 1
        gate.set()
        done = await asyncio.gather(first, *waiting)
        return done

    done = asyncio.run(main())
    assert all(outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3 for outs in done)
    a.shutdown()


def test_a_grammar_that_compiles_too_slowly_is_refused():
    a = make_async()
    a.engine.limits.grammar_compile_timeout = 0.3
    som = a.engine.engine_core.structured_output
    compile_ = som.backend.compile

    def slow(grammar):
        time.sleep(1.5)
        return compile_(grammar)

    som.backend.compile = slow
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        regex="[a-c]{2,5}q"))
    with pytest.raises(ParamError) as info:
        asyncio.run(_collect(a, "x", params))
    assert info.value.param == "structured_outputs.regex"
    assert "did not compile" in str(info.value)
    # The engine was never touched: nothing waits, and it serves the next request.
    outs = asyncio.run(_collect(a, "y", SamplingParams(max_tokens=2)))
    assert outs[-1].finished
    a.shutdown()
