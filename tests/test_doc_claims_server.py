"""README claims about the server that no other test shows.

/metrics has `tokenmill:request_errors_total{reason}` (requests the engine failed
alone) and `tokenmill:requests_aborted_total` (a client that hung up): on a live
server whose sampler fault is armed for one token (tokenmill.faults, through
TOKENMILL_FAULTS, so it is armed in the engine core's process as well), a request
holding that token fails alone and moves the first by one with reason "fault";
a streaming client that closes its stream after the first chunk moves the second
by one. Nothing else moves either.
"""
from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from live_server import live_server

MODEL = "m"
POISON = 377  # the sampler fault fires for any request whose prompt holds this token
ERRORS = "tokenmill:request_errors_total"
ABORTED = "tokenmill:requests_aborted_total"


def scrape(url: str) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value, for every sample of /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def errors(m: dict) -> dict[str, float]:
    """request_errors_total by reason (the model_name label checked)."""
    out = {}
    for (name, labels), v in m.items():
        if name == ERRORS:
            labels = dict(labels)
            assert labels.pop("model_name") == MODEL and set(labels) == {"reason"}
            out[labels["reason"]] = v
    return out


def aborted(m: dict) -> float:
    return m[(ABORTED, (("model_name", MODEL),))]


def wait_for(url: str, done, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if done(m):
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"/metrics never got there: errors {errors(m)}, aborted "
                        f"{m.get((ABORTED, (('model_name', MODEL),)))}")
        time.sleep(0.1)


def idle(m: dict) -> bool:
    return m[("tokenmill:num_requests_running", (("model_name", MODEL),))] == 0 and \
        m[("tokenmill:kv_cache_used_blocks", (("model_name", MODEL),))] == 0


def test_metrics_count_engine_failures_by_reason_and_aborts(demo_path, tmp_path):
    with live_server(demo_path, tmp_path / "server.log", "--served-model-name", MODEL,
                     "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64",
                     "--log-stats-interval", "0",
                     extra_env={"TOKENMILL_FAULTS": f"sampler=token:{POISON}"}) as srv:
        before = scrape(srv.url)
        assert errors(before) == {} and aborted(before) == 0
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            # A request the engine fails alone: finish_reason "error", a 500.
            r = client.post("/v1/completions", json={
                "model": MODEL, "prompt": [5, POISON, 7], "max_tokens": 8})
            assert r.status_code == 500, r.text
            m = wait_for(srv.url, lambda m: errors(m).get("fault") == 1 and idle(m))
            assert errors(m) == {"fault": 1} and aborted(m) == 0
            # A request that is fine is not counted anywhere.
            r = client.post("/v1/completions", json={
                "model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200
            # A streaming client that hangs up after the first chunk: aborted.
            with client.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": [8, 9, 10], "max_tokens": 200,
                    "ignore_eos": True, "stream": True}) as stream:
                first = next(line for line in stream.iter_lines() if line)
                assert first.startswith("data: ")
            m = wait_for(srv.url, lambda m: aborted(m) == 1 and idle(m))
        assert errors(m) == {"fault": 1}
        assert m[("tokenmill:request_success_total", (("model_name", MODEL),))] == 1
