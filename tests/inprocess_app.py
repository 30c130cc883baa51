"""An AsyncLLM on the demo model inside the test process, and requests sent straight to
a server app built on it (no socket): for route tests that need no live server."""
from __future__ import annotations

import asyncio

import httpx
import pytest



@pytest.fixture(scope="module")
def async_llm(demo_path):
    from tokenmill.engine.async_llm import AsyncLLM
    from tokenmill.engine.engine_args import EngineArgs
    llm = AsyncLLM.from_engine_args(
        EngineArgs.from_kwargs(demo_path, dtype="float32", max_model_len=256, num_kv_blocks=64,
                               max_num_seqs=8, engine_process=engine_process_mode()),
        log_stats_interval=0)
    yield llm
    llm.shutdown()


def engine_process_mode() -> bool:
    """As the server decides it: TOKENMILL_ENGINE_PROCESS (0 / 1), else the server's
    default. `make test` runs the server suite both ways."""
    from tokenmill.entrypoints.openai.server import resolve_engine_process
    return resolve_engine_process(None)


def call(app, *requests):
    """Send (method, path, kwargs) requests in order to `app`; their responses."""
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=60) as c:
            return [await c.request(method, path, **kw) for method, path, kw in requests]
    return asyncio.run(go())
