"""An AsyncLLM on the demo model inside the test process, and requests sent straight to
a server app built on it (no socket): for route tests that need no live server."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from tokenmill.demo_model import DEMO_MODEL_NAME, ensure_demo_model


@pytest.fixture(scope="module")
def async_llm(tmp_path_factory):
    from tokenmill.engine.async_llm import AsyncLLM
    from tokenmill.engine.llm_engine import EngineArgs
    path = ensure_demo_model(str(tmp_path_factory.mktemp("demo") / DEMO_MODEL_NAME))
    llm = AsyncLLM.from_engine_args(
        EngineArgs.from_kwargs(path, dtype="float32", max_model_len=256, num_kv_blocks=64,
                               max_num_seqs=8), log_stats_interval=0)
    yield llm
    llm.shutdown()


def call(app, *requests):
    """Send (method, path, kwargs) requests in order to `app`; their responses."""
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=60) as c:
            return [await c.request(method, path, **kw) for method, path, kw in requests]
    return asyncio.run(go())
