"""The OpenAI-compatible server, live on 127.0.0.1, driven by the official openai client."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from live_server import live_server  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402

MODEL = "demo"
API_KEY = "test-key"
SMALL = dict(dtype="float32", max_model_len=256, num_kv_blocks=128)
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(demo_path, tmp_path_factory):
    with live_server(demo_path, tmp_path_factory.mktemp("server") / "server.log",
                     "--served-model-name", MODEL, "--api-key", API_KEY, "--dtype", "float32",
                     "--max-model-len", "256", "--num-kv-blocks", "128",
                     "--shutdown-grace", "20", "--log-stats-interval", "0.2") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(demo_path):
    return LLM(demo_path, **SMALL)


def metrics(server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=5).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = s.value
    return out


def wait_idle(server, timeout=20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if (m["tokenmill:num_requests_running"] == 0 and m["tokenmill:num_requests_waiting"] == 0
                and m["tokenmill:kv_cache_used_blocks"] == 0):
            return m
        assert time.monotonic() < deadline, f"server not idle: {m}"
        time.sleep(0.1)


def assert_serving(client):
    r = client.completions.create(model=MODEL, prompt="still here", max_tokens=2,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices) == 1 and r.usage.completion_tokens == 2


# ---- the happy paths ------------------------------------------------------------
def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version", headers=AUTH).json()["version"]


def test_completion(client, llm):
    r = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=5,
                                  temperature=0, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 5
    prompt_len = len(llm.get_tokenizer().encode("Hello, my name is"))
    assert r.usage.prompt_tokens == prompt_len and r.usage.total_tokens == prompt_len + 5
    expected = llm.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=5,
                                                                ignore_eos=True), use_tqdm=False)
    assert c.text == expected[0].outputs[0].text


def test_completion_list_of_prompts_token_ids_and_echo(client, llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("The town sat")
    r = client.completions.create(model=MODEL, prompt=["a first", "the second one"], max_tokens=3,
                                  temperature=0, echo=True, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text.startswith("a first") and r.choices[1].text.startswith("the second one")
    assert r.usage.completion_tokens == 6
    r = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == r.choices[1].text and r.usage.prompt_tokens == 2 * len(ids)


def test_completion_stream(client, llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = llm.generate("The railway came", params, use_tqdm=False)[0].outputs[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="The railway came", max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == expected
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices


def test_chat(client, llm):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6,
                                       temperature=0, extra_body={"ignore_eos": True})
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)[0]
    m = r.choices[0].message
    assert m.role == "assistant" and m.content == expected.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == 6


def test_chat_stream(client, llm):
    messages = [{"role": "user", "content": "Tell me about the bakery"}]
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=7, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    content = [c for c in chunks if c.choices]
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == expected
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert chunks[-1].usage.completion_tokens == 7


def test_raw_sse_ends_with_done(server):
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, timeout=30,
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        json.loads(e[len("data: "):])


def test_concurrent_greedy_equals_offline(client, llm):
    """16 concurrent streams (and 4 plain requests beside them) give the offline tokens."""
    prompts = [f"Request number {i} says" + " and" * (3 * i) for i in range(20)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]

    def one(i):
        if i < 16:
            stream = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=8,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            return "".join(c.choices[0].text for c in stream if c.choices)
        r = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text

    with ThreadPoolExecutor(20) as pool:
        got = list(pool.map(one, range(20)))
    assert got == expected


def test_stats_log_line_while_busy(server, client):
    # A stats line needs the engine busy for a whole interval (0.2 s), and one
    # request can finish sooner than that on a fast machine (CI saw it): keep
    # staggered requests overlapping until the line shows, with a deadline.
    done = threading.Event()

    def keep_busy(i):
        while not done.is_set():
            client.completions.create(model=MODEL, prompt="keep busy", max_tokens=120 + 25 * i,
                                      extra_body={"ignore_eos": True})

    text = ""
    with ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(keep_busy, i) for i in range(4)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(f.done() for f in busy):
            with open(server.log.name) as f:
                text = f.read()
            if "KV cache usage" in text and "generation throughput" in text:
                break
            time.sleep(0.1)
        done.set()
        for f in busy:
            f.result()  # a request that failed fails the test with its own error
    assert "KV cache usage" in text and "generation throughput" in text


def test_tokenize_detokenize(server, llm):
    tok = llm.get_tokenizer()
    r = httpx.post(f"{server.url}/tokenize", headers=AUTH, json={"prompt": "Hello world"}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    r = httpx.post(f"{server.url}/detokenize", headers=AUTH,
                   json={"tokens": tok.encode("Hello world")}).json()
    assert r["prompt"] == "Hello world"


# ---- errors ---------------------------------------------------------------------------
def _error(exc_info, status):
    e = exc_info.value
    assert e.status_code == status
    body = e.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["code"] == status
    return body


def test_bad_temperature_is_400_naming_the_param(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert _error(ei, 400)["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       top_p=0)
    assert _error(ei, 400)["param"] == "top_p"
    assert_serving(client)


def test_n_zero_and_greedy_n_are_400(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="x", n=0)
    assert _error(ei, 400)["param"] == "n"
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="x", n=2, temperature=0)
    body = _error(ei, 400)
    assert body["param"] == "n" and "greedy" in body["message"]
    assert_serving(client)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as ei:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert _error(ei, 404)["param"] == "model"
    assert_serving(client)


def test_over_length_prompt_is_400(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt=list(range(10, 310)), max_tokens=2)
    assert "max_model_len" in _error(ei, 400)["message"]
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "user", "content": "word " * 400}])
    _error(ei, 400)
    assert_serving(client)


@pytest.mark.parametrize("body", ['{"model": "demo", "prompt": "x",', '[1, 2',
                                  '{"model": "demo", "prompt": 5}',
                                  '{"model": "demo", "prompt": "x", "max_tokens": "many"}',
                                  '{"model": "demo"}'])
def test_malformed_json_and_wrong_types_are_400(server, client, body):
    r = httpx.post(f"{server.url}/v1/completions", content=body, timeout=10,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
    assert_serving(client)


def test_api_key_is_required(server, client):
    r = httpx.get(f"{server.url}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert httpx.get(f"{server.url}/tokenize").status_code == 401  # every route but /health
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert_serving(client)


# ---- disconnects, metrics, shutdown ------------------------------------------------------
def test_client_disconnect_mid_stream_frees_blocks(server, client):
    before = wait_idle(server)
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, timeout=30,
                      json={"model": MODEL, "prompt": "A long story:", "max_tokens": 200,
                            "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        assert metrics(server)["tokenmill:kv_cache_used_blocks"] > 0
    # closed after the first chunk: the request is aborted, its blocks freed
    after = wait_idle(server)
    generated = (after["tokenmill:generation_tokens_total"]
                 - before["tokenmill:generation_tokens_total"])
    assert 0 < generated < 200
    assert after["tokenmill:request_success_total"] == before["tokenmill:request_success_total"]
    assert_serving(client)


def test_client_gone_before_a_non_streaming_response_aborts(server, client):
    before = wait_idle(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=0.1,
                   json={"model": MODEL, "prompt": "A long story:", "max_tokens": 240,
                         "ignore_eos": True})
    after = wait_idle(server)
    assert after["tokenmill:request_success_total"] == before["tokenmill:request_success_total"]
    assert (after["tokenmill:generation_tokens_total"]
            - before["tokenmill:generation_tokens_total"]) < 240
    assert_serving(client)


def test_metrics_counters_move(server, client):
    before = wait_idle(server)
    client.completions.create(model=MODEL, prompt="count me", max_tokens=4,
                              extra_body={"ignore_eos": True})
    after = wait_idle(server)
    assert (after["tokenmill:generation_tokens_total"]
            - before["tokenmill:generation_tokens_total"]) == 4
    assert after["tokenmill:prompt_tokens_total"] > before["tokenmill:prompt_tokens_total"]
    assert (after["tokenmill:request_success_total"]
            - before["tokenmill:request_success_total"]) == 1

    def moved(name):
        return after[name] - before[name]
    assert moved("tokenmill:time_to_first_token_seconds_count") == 1
    assert moved("tokenmill:inter_token_latency_seconds_count") == 3
    assert moved("tokenmill:e2e_request_latency_seconds_count") == 1
    assert moved("tokenmill:e2e_request_latency_seconds_sum") > 0
    assert "tokenmill:num_preemptions_total" in after
    assert "tokenmill:spec_decode_resumed_requests_total" in after


def test_sigterm_finishes_in_flight_request_and_exits_0(server, client):
    """Last: it stops the module's server."""
    result = {}
    started = threading.Event()

    def long_request():
        stream = client.completions.create(model=MODEL, prompt="Before the end", max_tokens=200,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = []
        for c in stream:
            if c.choices:
                chunks.append(c)
                started.set()
        result["text_chunks"] = chunks

    t = threading.Thread(target=long_request)
    t.start()
    # SIGTERM once the first chunk is out: polling the running gauge every 50 ms missed a
    # 60-token request that a fast machine finished in between.
    assert started.wait(20)
    assert metrics(server)["tokenmill:num_requests_running"] == 1
    os.kill(server.proc.pid, signal.SIGTERM)
    assert server.proc.wait(60) == 0
    t.join(10)
    chunks = result["text_chunks"]
    assert chunks[-1].choices[0].finish_reason == "length"
