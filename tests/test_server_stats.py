"""GET /stats (what the web dashboard shows) on a real engine, in process: the engine's
counters, latency percentiles over the last minute, and the resolved configuration."""
from __future__ import annotations

import json


from inprocess_app import async_llm, call  # noqa: F401 (a fixture)
from tokenmill.entrypoints.openai.metrics import RecentLatencies
from tokenmill.entrypoints.openai.server import build_app

MODEL = "demo"


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
