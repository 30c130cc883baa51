"""One bad request never stops the server: auth on every route, the body cap, request
caps, request chat templates, admission (503 + Retry-After), errors without internals.

Two live servers per module (the flags differ), plus in-process tests of the error
paths against a scripted stand-in for AsyncLLM (streams that fail, a full queue)."""
from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")

from live_server import live_server  # noqa: E402

MODEL = "demo"
KEY, ENV_KEY = "hardening-key", "key-from-env"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENV_AUTH = {"Authorization": f"Bearer {ENV_KEY}"}
BODY_CAP = 20000
ENGINE = ("--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "256",
          "--num-kv-blocks", "128", "--log-stats-interval", "0")
LEAKS = ("Traceback", "/work", "/tmp", "Error(", 'File "', "0x")


def assert_clean(text: str) -> None:
    for s in LEAKS:
        assert s not in text, f"{s!r} in an error body: {text}"


def api_error(r, status: int) -> dict:
    """The OpenAI-shaped error of `r`, which must have `status` and leak nothing."""
    assert r.status_code == status, r.text
    assert_clean(r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def rejected(url: str, headers=None) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=5).text
    return {s.labels["reason"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "tokenmill:requests_rejected_total"}


@pytest.fixture(scope="module")
def guarded(demo_path, tmp_path_factory):
    """--api-key, a small body cap, few prompts and messages per request."""
    with live_server(demo_path, tmp_path_factory.mktemp("guarded") / "server.log", *ENGINE,
                     "--api-key", KEY, "--max-request-body-bytes", str(BODY_CAP),
                     "--max-prompts-per-request", "4", "--max-messages", "4") as srv:
        yield srv


@pytest.fixture(scope="module")
def trusting(demo_path, tmp_path_factory):
    """The key from TOKENMILL_API_KEY, public /metrics, request chat templates accepted,
    one running and one waiting request at most, prompts in the log."""
    with live_server(demo_path, tmp_path_factory.mktemp("trusting") / "server.log",
                     *ENGINE, "--metrics-public", "--trust-request-chat-template",
                     "--max-num-seqs", "1", "--max-num-waiting", "1", "--log-prompts",
                     extra_env={"TOKENMILL_API_KEY": ENV_KEY}) as srv:
        yield srv


def completion(url, headers, prompt="hi", **kw):
    return httpx.post(f"{url}/v1/completions", headers=headers, timeout=60,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 2, **kw})


def chat(url, headers, messages=None, **kw):
    messages = messages or [{"role": "user", "content": "hi"}]
    return httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=60,
                      json={"model": MODEL, "messages": messages, "max_tokens": 2, **kw})


# ---- auth ------------------------------------------------------------------------------
PROTECTED = [("GET", "/v1/models", None),
             ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}),
             ("POST", "/v1/chat/completions",
              {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
             ("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [1]}),
             ("GET", "/version", None), ("GET", "/metrics", None), ("GET", "/no/such/route", None)]


def test_every_route_but_health_needs_the_key(guarded):
    before = rejected(guarded.url, AUTH)
    for method, path, body in PROTECTED:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"bearer {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
            r = httpx.request(method, f"{guarded.url}{path}", headers=headers, json=body)
            err = api_error(r, 401)
            assert err["type"] == "AuthenticationError" and KEY not in r.text
        r = httpx.request(method, f"{guarded.url}{path}", headers=AUTH, json=body, timeout=60)
        assert r.status_code == (404 if path == "/no/such/route" else 200), (path, r.text)
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    after = rejected(guarded.url, AUTH)
    assert after["unauthorized"] - before["unauthorized"] == 5 * len(PROTECTED)
    assert after["not_found"] - before["not_found"] == 1


def test_key_from_the_environment_and_public_metrics(trusting):
    assert api_error(httpx.get(f"{trusting.url}/v1/models"), 401)
    assert api_error(httpx.post(f"{trusting.url}/tokenize", json={"prompt": "x"}), 401)
    assert httpx.get(f"{trusting.url}/v1/models", headers=ENV_AUTH).status_code == 200
    assert httpx.get(f"{trusting.url}/metrics").status_code == 200  # --metrics-public
    assert httpx.get(f"{trusting.url}/health").status_code == 200


# ---- the body cap ----------------------------------------------------------------------
def _big_body() -> bytes:
    return json.dumps({"model": MODEL, "prompt": "a " * BODY_CAP, "max_tokens": 1}).encode()


def test_oversize_body_is_413(guarded):
    before = rejected(guarded.url, AUTH)
    body = _big_body()
    r = httpx.post(f"{guarded.url}/v1/completions", headers=AUTH, content=body, timeout=30)
    err = api_error(r, 413)
    assert err["type"] == "RequestTooLarge" and err["param"] is None

    def chunks():  # no Content-Length: the server counts the bytes as they come
        for i in range(0, len(body), 4096):
            yield body[i:i + 4096]
    r = httpx.post(f"{guarded.url}/v1/completions", headers=AUTH, content=chunks(), timeout=30)
    assert "content-length" not in r.request.headers
    err = api_error(r, 413)
    assert err["type"] == "RequestTooLarge" and err["param"] is None
    # a body under the cap, chunked, still works
    small = json.dumps({"model": MODEL, "prompt": "fits", "max_tokens": 1}).encode()
    r = httpx.post(f"{guarded.url}/v1/completions", timeout=30,
                   content=iter([small[:10], small[10:]]),
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert rejected(guarded.url, AUTH)["too_large"] - before["too_large"] == 2


# ---- caps only the server sees --------------------------------------------------------
def test_too_many_prompts_and_messages_are_400(guarded):
    before = rejected(guarded.url, AUTH)
    assert completion(guarded.url, AUTH, ["a", "b", "c", "d"]).status_code == 200
    err = api_error(completion(guarded.url, AUTH, ["a", "b", "c", "d", "e"]), 400)
    assert err["param"] == "prompt" and "max_prompts_per_request" in err["message"]
    err = api_error(completion(guarded.url, AUTH, [[5, 6]] * 5), 400)
    assert err["param"] == "prompt"
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}] * 3
    assert chat(guarded.url, AUTH, msgs[:4]).status_code == 200
    err = api_error(chat(guarded.url, AUTH, msgs[:5]), 400)
    assert err["param"] == "messages" and "max_messages" in err["message"]
    r = httpx.post(f"{guarded.url}/tokenize", headers=AUTH, json={"messages": msgs[:5]})
    assert api_error(r, 400)["param"] == "messages"
    assert rejected(guarded.url, AUTH)["invalid"] - before["invalid"] == 4


def test_request_chat_template_needs_the_flag(guarded):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    err = api_error(chat(guarded.url, AUTH, chat_template=template), 400)
    assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]
    r = httpx.post(f"{guarded.url}/tokenize", headers=AUTH,
                   json={"messages": [{"role": "user", "content": "x"}],
                         "chat_template": template})
    assert api_error(r, 400)["param"] == "chat_template"


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ messages.append(1) }}",
    "{% for %}",
    "{{ raise_exception('no assistant here') }}",
    "{{ messages[0]['content'] + 1 }}",
])
def test_bad_request_template_is_400_without_internals(trusting, template):
    err = api_error(chat(trusting.url, ENV_AUTH, chat_template=template), 400)
    assert err["param"] == "chat_template" and "chat template" in err["message"]
    if "raise_exception" in template:  # the template's own message reaches the client
        assert "no assistant here" in err["message"]


def test_trusted_request_template_is_used(trusting):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    messages = [{"role": "user", "content": "Hello world"}]
    r = httpx.post(f"{trusting.url}/tokenize", headers=ENV_AUTH,
                   json={"messages": messages, "chat_template": template})
    plain = httpx.post(f"{trusting.url}/tokenize", headers=ENV_AUTH,
                       json={"prompt": "Hello world", "add_special_tokens": False})
    assert r.status_code == 200 and r.json()["tokens"] == plain.json()["tokens"]
    assert chat(trusting.url, ENV_AUTH, messages, chat_template=template).status_code == 200


# ---- error bodies never leak internals ---------------------------------------------------
@pytest.mark.parametrize("body", [
    '{"model": "demo", "prompt": "x",', '{"model": "demo", "prompt": [[1, "a"]]}',
    '{"model": "demo", "prompt": "x", "n": 1e999}', '{"model": "demo", "prompt": [99999999]}',
    '{"model": "demo", "prompt": "x", "logit_bias": {"nope": 1}}',
    '{"model": "demo", "prompt": "x", "stop_token_ids": [-5]}',
    '{"model": "demo", "prompt": "x", "structured_outputs": {"json": "{"}}',
    '{"model": "demo", "prompt": "x", "guided_regex": "("}', '"just a string"', '[]',
])
def test_error_bodies_leak_nothing(guarded, body):
    r = httpx.post(f"{guarded.url}/v1/completions", content=body, timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    assert_clean(r.text)
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# ---- request logging ---------------------------------------------------------------------
def _log(server) -> str:
    server.log.flush()
    with open(server.log.name) as f:
        return f.read()


def test_request_log_line_without_the_prompt(guarded, trusting):
    assert completion(guarded.url, AUTH, "secret words here").status_code == 200
    lines = [x for x in _log(guarded).splitlines() if "request cmpl-" in x]
    assert lines and "1 prompt(s)" in lines[-1] and "max_tokens=2" in lines[-1]
    assert "secret words" not in _log(guarded)
    assert completion(trusting.url, ENV_AUTH, "visible words here").status_code == 200
    assert "visible words here" in _log(trusting)  # --log-prompts


# ---- admission -------------------------------------------------------------------------
def test_full_queue_is_503_with_retry_after(trusting):
    before = rejected(trusting.url)
    # Twelve sent at once over connections opened beforehand, each long enough to still
    # run when the others arrive: the server (one running, one waiting at most) admits
    # them one at a time between its engine steps, and on a fast machine six 160-token
    # requests sent as their connections opened could each finish before the next came.
    start = threading.Barrier(12)

    def one(i):
        with httpx.Client(base_url=trusting.url, headers=ENV_AUTH, timeout=60) as client:
            assert client.get("/health").status_code == 200  # (the connection, open)
            start.wait(timeout=30)
            return client.post("/v1/completions", json={
                "model": MODEL, "prompt": f"request {i} goes", "max_tokens": 240,
                "ignore_eos": True})
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    busy = [r for r in results if r.status_code == 503]
    assert busy, [r.status_code for r in results]
    for r in busy:
        err = api_error(r, 503)
        assert err["type"] == "ServiceUnavailableError"
        assert r.headers["Retry-After"].isdigit() and int(r.headers["Retry-After"]) >= 1
    for r in results:
        if r.status_code != 503:
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 240
    assert rejected(trusting.url)["overloaded"] - before["overloaded"] == len(busy)
    assert completion(trusting.url, ENV_AUTH).status_code == 200  # and it serves on


# ---- in process: the error paths, against a scripted engine ------------------------------
class _Tokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


class FakeLLM:
    """Just enough of AsyncLLM for the server: each request streams `script` (outputs,
    or an exception to raise); `add_error` is raised by add_requests."""

    def __init__(self, script=(), add_error=None):
        from types import SimpleNamespace

        from tokenmill.engine.async_llm import EngineStats
        from tokenmill.limits import RequestLimits
        self.script, self.add_error, self.aborted = list(script), add_error, []
        self.tokenizer = _Tokenizer()
        self.model_config = SimpleNamespace(max_model_len=64, path="/x", vocab_size=100)
        self.engine = SimpleNamespace(
            args=SimpleNamespace(max_logprobs=5, limits=RequestLimits()),
            apply_chat_template=lambda msgs, *a, **k: [1, 2, 3])
        self.stats, self.observer = EngineStats(), None

    async def add_requests(self, prompts, params, request_ids):
        if self.add_error is not None:
            raise self.add_error
        return [(rid, None) for rid in request_ids]

    async def stream(self, request_id, queue):
        for item in self.script:
            await asyncio.sleep(0)
            if isinstance(item, BaseException):
                raise item
            yield item

    def abort(self, request_id):
        self.aborted.append(request_id)

    def is_healthy(self):
        return True


def _out(text, finish_reason=None, error=None, index=0):
    from tokenmill.outputs import CompletionOutput, RequestOutput
    out = RequestOutput("r", "p", [1, 2], [CompletionOutput(index, text, [7], None, None,
                                                            finish_reason)],
                        finish_reason is not None)
    out.error = error
    return out


def _call(fake, path, body, api_key=None):
    """POST `body` to an app over `fake`; (status, headers, text)."""
    from tokenmill.entrypoints.openai.server import build_app

    async def go():
        transport = httpx.ASGITransport(app=build_app(fake, MODEL, api_key=api_key),
                                        raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post(path, json=body)
            return r.status_code, r.headers, r.text
    return asyncio.run(go())


def _events(text: str) -> list:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


STREAM = {"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True}
CHAT_STREAM = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}


@pytest.mark.parametrize("path, body", [("/v1/completions", STREAM),
                                        ("/v1/chat/completions", CHAT_STREAM)])
def test_stream_of_a_dead_engine_ends_with_an_error_event(path, body):
    from tokenmill.errors import EngineDeadError
    fake = FakeLLM([_out("ab"), EngineDeadError("engine failed: RuntimeError('x at /work')")])
    status, _, text = _call(fake, path, body)
    events = _events(text)
    assert status == 200 and events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 503 and err["type"] == "ServiceUnavailableError"
    assert_clean(text)
    assert fake.aborted  # the job was closed


@pytest.mark.parametrize("path, body", [("/v1/completions", STREAM),
                                        ("/v1/chat/completions", CHAT_STREAM)])
def test_failed_request_streams_finish_reason_error_then_an_error_event(path, body):
    fake = FakeLLM([_out("ab"), _out("c", "error", "NaN in the logits")])
    status, _, text = _call(fake, path, body)
    events = _events(text)
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"] == {"message": "NaN in the logits",
                                               "type": "InternalServerError", "param": None,
                                               "code": 500}
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "error"


def test_unexpected_stream_failure_is_a_500_event_without_details():
    fake = FakeLLM([_out("ab"), KeyError("/work/secret.py")])
    _, _, text = _call(fake, "/v1/completions", STREAM)
    events = _events(text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "internal server error"
    assert_clean(text)


def test_failed_request_without_streaming_is_a_500_with_the_message():
    fake = FakeLLM([_out("abc", "error", "NaN in the logits")])
    status, _, text = _call(fake, "/v1/completions", {**STREAM, "stream": False})
    assert status == 500 and json.loads(text)["error"]["message"] == "NaN in the logits"


def test_admission_errors():
    from tokenmill.errors import EngineDeadError, EngineOverloadedError, ParamError
    body = {**STREAM, "stream": False}
    status, headers, text = _call(FakeLLM(add_error=EngineOverloadedError("queue full", 2.2)),
                                  "/v1/completions", body)
    assert status == 503 and headers["retry-after"] == "3"
    assert json.loads(text)["error"]["type"] == "ServiceUnavailableError"
    status, headers, text = _call(FakeLLM(add_error=EngineOverloadedError("full", 0.01)),
                                  "/v1/completions", body)
    assert status == 503 and headers["retry-after"] == "1"
    status, _, text = _call(FakeLLM(add_error=EngineDeadError("failed: Boom('/tmp/x')")),
                            "/v1/completions", body)
    assert status == 503 and "/tmp" not in text and "Boom" not in text
    status, _, text = _call(FakeLLM(add_error=RuntimeError("at /work/x.py, <obj 0x1>")),
                            "/v1/completions", body)
    assert status == 500 and json.loads(text)["error"] == {
        "message": "internal server error", "type": "InternalServerError", "param": None,
        "code": 500}
    # ParamError names its field; the route's renames still apply
    status, _, text = _call(FakeLLM(add_error=ParamError("top_k", "too big")),
                            "/v1/completions", body)
    assert status == 400 and json.loads(text)["error"]["param"] == "top_k"
    status, _, text = _call(FakeLLM(add_error=ParamError("logprobs", "too many")),
                            "/v1/chat/completions", {**CHAT_STREAM, "stream": False})
    assert status == 400 and json.loads(text)["error"]["param"] == "top_logprobs"
