"""Prefix caching over HTTP: `tokenmill serve --kv-store cpu` on the demo model; the
`cache_salt` request field separates caches; /metrics counts queries, hits and
the external store's traffic."""
from __future__ import annotations

import re

import pytest

httpx = pytest.importorskip("httpx")

from live_server import live_server  # noqa: E402
from tokenmill.demo_model import DEMO_MODEL_NAME, ensure_demo_model  # noqa: E402

PROMPT = ("The town sat where two rivers met, one brown with the silt of the farmland to "
          "the north and one clear and cold from the hills. ") * 6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    demo = ensure_demo_model(str(tmp_path_factory.mktemp("demo") / DEMO_MODEL_NAME))
    with live_server(demo, tmp_path_factory.mktemp("server") / "server.log",
                     "--served-model-name", "demo", "--dtype", "float32",
                     "--max-model-len", "512", "--num-kv-blocks", "128",
                     "--kv-store", "cpu", "--kv-cpu-bytes", str(64 << 20),
                     "--log-stats-interval", "0", "--uvicorn-log-level", "warning",
                     timeout=180) as srv:
        yield srv.url


def metric(url: str, name: str, **labels) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def complete(url: str, **extra) -> dict:
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_cache_salt_and_metrics(server):
    hits = lambda: metric(server, "tokenmill:prefix_cache_hits_total")  # noqa: E731
    r = complete(server, cache_salt="tenant-a")
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    h0 = hits()
    assert metric(server, "tokenmill:prefix_cache_queries_total") > 0
    r = complete(server, cache_salt="tenant-b")  # another tenant: no hit
    assert r.json()["choices"][0]["text"] == text
    assert hits() == h0
    r = complete(server, cache_salt="tenant-a")  # the same tenant: its prefix is cached
    assert r.json()["choices"][0]["text"] == text
    assert hits() > h0
    # Chat takes the field too.
    r = httpx.post(f"{server}/v1/chat/completions", timeout=120, json={
        "model": "demo", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
        "cache_salt": "tenant-a"})
    assert r.status_code == 200, r.text
    # The cpu store wrote the prompt blocks.
    assert metric(server, "tokenmill:external_kv_stored_bytes_total", store="cpu") > 0
    assert metric(server, "tokenmill:prefix_cache_blocks") > 0
    bad = complete(server, cache_salt="")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
