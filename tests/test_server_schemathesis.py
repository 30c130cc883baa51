"""Issue 14: schemathesis against the live server's own OpenAPI schema (/openapi.json).

POST /v1/completions, /v1/chat/completions, /tokenize and /detokenize get a fixed,
derandomized set of generated requests each: bodies that fit the schema (positive) and
bodies that break it (negative). No response may be a 5xx (schemathesis'
`not_a_server_error`) or leak internals; afterwards the process still runs, /health is
200 and no KV block is in use.

Shaping, and why:
* `model` is pinned to the served name where a body carries one: the server answers
  an unknown model with a 404 before it looks at any other field (the hostile table
  covers that 404), so random names would test nothing else.
* The server runs with `--max-model-len 64`, `--max-n 4`, `--max-prompts-per-request 4`
  (its documented caps, not a weakened server): the schema gives no bounds, so a
  generated `max_tokens` or `n` may be huge, and these keep an accepted request short.
Nothing else is filtered: a body the server cannot take must be a 4xx.
"""
from __future__ import annotations

import re
import time
from collections import Counter

import httpx
import pytest

import schemathesis  # the test extra installs it: a missing one fails, never skips
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from live_server import live_server
from tokenmill.demo_model import DEMO_MODEL_NAME, ensure_demo_model

MODEL = "m"
ENGINE = ("--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "64",
          "--num-kv-blocks", "64", "--max-n", "4", "--max-prompts-per-request", "4",
          "--log-stats-interval", "0")
OPERATIONS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
# per operation: 40 that fit the schema, 10 that do not -> 200 in all
EXAMPLES = {GenerationMode.POSITIVE: 40, GenerationMode.NEGATIVE: 10}
LEAKS = ("Traceback", "site-packages", 'File "/')

RUN: Counter = Counter()  # examples sent, per "operation mode"
STATUSES: Counter = Counter()  # their response statuses


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = ensure_demo_model(str(tmp_path_factory.mktemp("demo") / DEMO_MODEL_NAME))
    with live_server(path, tmp_path_factory.mktemp("schemathesis") / "server.log",
                     *ENGINE) as srv:
        yield srv


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


def pin_model(case):
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = MODEL
    return case


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^(tokenmill:[a-z_]+)(?:\{[^}]*\})? (\S+)$", text, re.M)}


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=[m.value for m in EXAMPLES])
@pytest.mark.parametrize("path", OPERATIONS)
def test_generated_requests_get_no_server_error(server, schema, path, mode):
    operation = schema[path]["POST"]
    strategy = operation.as_strategy(generation_mode=mode).map(pin_model)

    @settings(max_examples=EXAMPLES[mode], derandomize=True, database=None, deadline=None,
              phases=(Phase.explicit, Phase.generate),  # no shrinking against a live server
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(case=strategy)
    def run(case):
        RUN[f"{path} {mode.value}"] += 1
        response = case.call(base_url=server.url, timeout=60)
        STATUSES[response.status_code] += 1
        case.validate_response(response, checks=[not_a_server_error])
        assert response.status_code < 500, (response.status_code, response.text[:500])
        for leak in LEAKS:
            assert leak not in response.text, response.text[:500]

    run()


def test_after_the_run_the_engine_is_whole(server):
    total = sum(RUN.values())
    print(f"\nschemathesis: {total} examples run ({dict(sorted(RUN.items()))}); "
          f"statuses {dict(sorted(STATUSES.items()))}")
    # hypothesis runs the full count unless a strategy runs dry; allow a little slack
    assert total >= 0.9 * len(OPERATIONS) * sum(EXAMPLES.values()), RUN
    deadline = time.monotonic() + 30
    while True:
        m = metrics(server.url)
        if not (m["tokenmill:num_requests_running"] or m["tokenmill:num_requests_waiting"]):
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    assert m["tokenmill:kv_cache_used_blocks"] == 0
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert server.proc.poll() is None
    # and it still serves
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    server.log.flush()
    with open(server.log.name) as f:
        log = f.read()
    assert "Traceback" not in log and "unhandled" not in log, log[-3000:]
