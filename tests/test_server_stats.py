"""GET /stats (what the web dashboard shows) on a real engine, in process: the engine's
counters, latency percentiles over the last minute, and the resolved configuration."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tokenmill.demo_model import DEMO_MODEL_NAME, ensure_demo_model
from tokenmill.entrypoints.openai.metrics import RecentLatencies
from tokenmill.entrypoints.openai.server import build_app

MODEL = "demo"


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


def test_stats_reports_counters_latencies_and_the_engine_config(async_llm):
    app = build_app(async_llm, MODEL)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    r_chat, r_stats = call(app, ("POST", "/v1/chat/completions", {"json": chat}),
                           ("GET", "/stats", {}))
    assert r_chat.status_code == 200 and r_stats.status_code == 200
    s = r_stats.json()
    assert s["model"] == MODEL and s["healthy"] is True and s["uptime_s"] > 0
    assert s["requests"]["running"] == s["requests"]["waiting"] == 0
    assert s["requests"]["finished_total"] >= 1
    assert s["tokens"]["generation_total"] >= 6 and s["tokens"]["prompt_total"] > 0
    assert s["kv_cache"]["used_blocks"] == 0 and s["kv_cache"]["usage"] == 0
    assert s["spec_decoding"] is None
    lat = s["latency"]
    assert lat["window_s"] == 60
    assert lat["ttft"]["count"] >= 1 and lat["itl"]["count"] >= 5
    for kind in ("ttft", "itl", "e2e"):
        assert 0 < lat[kind]["p50"] <= lat[kind]["p90"] <= lat[kind]["p99"]
    engine = async_llm.engine
    c = s["config"]
    assert c["model"] == MODEL and c["model_path"] == engine.model_config.path
    assert (c["dtype"], c["device"]) == ("float32", "cpu")
    assert c["kernels"] == engine.platform.describe() == c["platform"]["description"]
    assert (c["block_size"], c["num_kv_blocks"], c["max_num_seqs"], c["max_model_len"]) == (
        16, 64, 8, 256)
    assert c["prefix_caching"] is True and c["speculative"] is None
    assert c["kv_stores"] is None and c["chunked_prefill"] is True
    json.dumps(s)  # all of it JSON


def test_recent_latencies_are_exact_percentiles_over_the_window():
    now = [100.0]
    recent = RecentLatencies(("ttft",), window_s=10, cap=150, clock=lambda: now[0])
    for v in range(100, 0, -1):  # 100 .. 1 ms, in any order
        recent.add("ttft", v / 1000)
    assert recent.percentiles()["ttft"] == {"count": 100, "p50": 0.05, "p90": 0.09, "p99": 0.099}
    now[0] = 105.0
    recent.add("ttft", 1.0)
    assert recent.percentiles()["ttft"]["count"] == 101
    now[0] = 110.5  # the first 100 are out of the window
    assert recent.percentiles()["ttft"] == {"count": 1, "p50": 1.0, "p90": 1.0, "p99": 1.0}
    now[0] = 116.0
    assert recent.percentiles()["ttft"] == {"count": 0, "p50": None, "p90": None, "p99": None}
    for _ in range(200):  # at most `cap` kept
        recent.add("ttft", 0.5)
    assert recent.percentiles()["ttft"]["count"] == 150
