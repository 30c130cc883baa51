"""AsyncLLM directly: streaming, validation before anything runs, abort on a dropped consumer."""
from __future__ import annotations

import asyncio
import time

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.demo_model import DEMO_MODEL_NAME, ensure_demo_model
from tokenmill.engine.async_llm import AsyncLLM, EngineDeadError

SMALL = dict(dtype="float32", max_model_len=256, num_kv_blocks=64)


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    return LLM(ensure_demo_model(str(tmp_path_factory.mktemp("demo") / DEMO_MODEL_NAME)), **SMALL)


@pytest.fixture
def async_llm(llm):
    # Shares the offline LLM's engine: nothing else steps it while this test runs.
    a = AsyncLLM(llm.llm_engine, log_stats_interval=None)
    yield a
    a.shutdown()
    assert not a._thread.is_alive()


def _wait_idle(a: AsyncLLM, timeout=10.0):
    deadline = time.monotonic() + timeout
    while a.stats.num_running or a.stats.num_waiting or a.stats.num_used_blocks:
        assert time.monotonic() < deadline, a.stats
        time.sleep(0.02)


def test_streams_cumulative_outputs_equal_to_offline(llm, async_llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = ["one prompt", "another, longer prompt", "3"]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    async def one(i):
        seen = []
        async for out in async_llm.generate(prompts[i], params, f"r{i}"):
            seen.append(list(out.outputs[0].token_ids))
        return seen

    async def main():
        return await asyncio.gather(*(one(i) for i in range(3)))

    for seen, exp in zip(asyncio.run(main()), expected):
        assert seen[-1] == exp
        assert all(a == b[:len(a)] for a, b in zip(seen, seen[1:]))  # cumulative
    assert async_llm.stats.generation_tokens_total == 18
    _wait_idle(async_llm)


def test_validation_errors_raise_before_anything_runs(async_llm):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in async_llm.generate({"prompt_token_ids": [5] * 300}, SamplingParams()):
                pass
        with pytest.raises(ValueError, match="already in use"):
            params = SamplingParams(max_tokens=200, ignore_eos=True)
            gen = async_llm.generate("x", params, "same")
            await gen.__anext__()
            async for _ in async_llm.generate("y", params, "same"):
                pass
        await gen.aclose()
    asyncio.run(main())
    _wait_idle(async_llm)


def test_a_bad_prompt_among_several_runs_none(async_llm):
    """The prompts of one client request go in all or none: a bad one (here the second)
    fails the call before the good one enters the engine, and no token is computed."""
    before_prompt = async_llm.stats.prompt_tokens_total
    before_gen = async_llm.stats.generation_tokens_total
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await async_llm.add_requests(["a good prompt", {"prompt_token_ids": [5] * 300}],
                                         params, ["good", "bad"])
        await asyncio.sleep(0.2)  # (anything that went in would have run by now)
        # and the id of the good one was never taken: it serves now
        return [out async for out in async_llm.generate("a good prompt", params, "good")]
    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    assert async_llm.stats.generation_tokens_total - before_gen == 4
    assert async_llm.stats.prompt_tokens_total - before_prompt == len(outs[-1].prompt_token_ids)
    _wait_idle(async_llm)


def test_a_refused_id_leaves_the_request_of_that_id_running(async_llm):
    """A second request under an id in use is refused; the first runs on to its end
    (the refusal must not abort the id's other owner). The first asks for 200 tokens:
    with 12, a loaded machine (CI) had the engine thread finish it, freeing its id,
    before this coroutine got its first output back."""
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        gen = async_llm.generate("first", params, "taken")
        outs = [await gen.__anext__()]
        with pytest.raises(ValueError, match="already in use"):
            await async_llm.add_requests(["a", "b"], params, ["fresh", "taken"])
        outs += [out async for out in gen]
        return outs
    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 200
    assert outs[-1].outputs[0].finish_reason == "length"
    _wait_idle(async_llm)


def test_dropped_consumer_aborts_and_frees_blocks(async_llm):
    async def main():
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        n = 0
        async for out in async_llm.generate("a long one", params, "drop-me"):
            n += 1
            if n == 2:
                break  # the generator is closed by the async for: abort
        # cancelled consumer: cancelled once its first output has come (a fixed sleep
        # let a fast machine finish all 200 tokens first, and nothing was cancelled)
        started = asyncio.Event()
        task = asyncio.create_task(_consume(async_llm.generate("another", params, "cancel-me"),
                                            started))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main())
    _wait_idle(async_llm)
    assert async_llm.stats.requests_finished_total == 0


async def _consume(gen, started: asyncio.Event | None = None):
    async for _ in gen:
        if started is not None:
            started.set()


def test_after_shutdown_new_requests_fail(async_llm):
    async_llm.shutdown()

    async def main():
        async for _ in async_llm.generate("x", SamplingParams(max_tokens=2)):
            pass
    with pytest.raises(EngineDeadError):
        asyncio.run(main())
