"""Issue 14: nothing a client sends can stop or stall the engine for the other clients,
and nothing is lost.

One live server (module-scoped) and a table of hostile request bodies: numbers at and
just past the int32 / int64 / float32 limits, NaN / Infinity literals, negative and
empty values, huge lists, deep nesting, bytes that are not UTF-8, lone surrogates, a
body over the cap, unknown models, wrong types, token ids outside the vocabulary,
grammars over the size cap or invalid, request chat templates, template injection.

Each hostile body is sent while a greedy streaming completion runs. For every case:
the hostile request gets its 4xx quickly (naming the culprit field in `error.param`
where there is one) with an error body that leaks nothing; the concurrent stream's
tokens equal those of a clean run alone; /health stays 200; once idle no KV block is
in use and the engine finished exactly the requests it was given. A few values sit
exactly at the limits: those are served (beside the stream, in its batches), and must
end normally. At the end the process is still running and its log holds no traceback.
"""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from live_server import live_server

MODEL = "m"
VOCAB = 4096  # the demo model's vocabulary
MAX_LOGPROBS = 20
# Above a 1,000,000-id prompt as compact JSON (2 MB), so that one is the engine's fast
# 400 naming `prompt`; the oversize case is just past it.
BODY_CAP = 3 * 2**20
ENGINE = ("--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "256",
          "--num-kv-blocks", "64", "--max-request-body-bytes", str(BODY_CAP),
          "--log-stats-interval", "0")

# The concurrent stream: greedy, fixed length, token ids in and token strings out.
STREAM_TOKENS = 40
STREAM_BODY = {"model": MODEL, "prompt": [11, 22, 33, 44, 55, 66, 77, 88],
               "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True,
               "stream": True, "logprobs": 0}

LEAKS = ("Traceback", "/work", "/tmp", "site-packages", "Error(", 'File "')
HOSTILE_DEADLINE_S = 10.0  # a hostile request that takes longer stalls its handler


# ---- the table ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    id: str
    method: str
    path: str
    # a dict (sent as json.dumps: NaN / Infinity become JSON's literals), raw bytes, or a
    # function making either (the big bodies are built when their case runs)
    body: Any
    status: int | tuple[int, int]  # exact, or an inclusive range
    param: str | None  # error.param; None: no field is to blame
    deadline_s: float = HOSTILE_DEADLINE_S

    def payload(self) -> bytes:
        body = self.body() if callable(self.body) else self.body
        if isinstance(body, bytes):
            return body
        return json.dumps(body, allow_nan=True).encode()


C, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"


def cmpl(**kw) -> dict:
    return {"model": MODEL, "prompt": "hello there", "max_tokens": 2, **kw}


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 2, **kw}


def raw(path_body: dict, field: str, literal: str) -> bytes:
    """`path_body` with `"field": literal` spliced in as raw JSON text."""
    text = json.dumps(path_body)
    return (text[:-1] + f', "{field}": {literal}}}').encode()


def compact(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


DEEP = "[" * 100_000 + "]" * 100_000  # 100,000 nested lists
LONE = '"\\ud800"'  # a lone surrogate, as JSON escapes it
INJECT = "{{ ''.__class__.__mro__ }}"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
BIG_SCHEMA = {"type": "object",
              "properties": {f"field_{i}": {"type": "string"} for i in range(5000)}}

CASES: list[Case] = [
    # -- /v1/completions: integers at the int32 / int64 limits and just past them ---------
    Case("top_k-int32+1", "POST", C, cmpl(top_k=2**31), 400, "top_k"),
    Case("top_k-below-minus-1", "POST", C, cmpl(top_k=-2), 400, "top_k"),
    Case("seed-2**64", "POST", C, cmpl(seed=2**64), 400, "seed"),
    Case("seed-int64min-1", "POST", C, cmpl(seed=-2**63 - 1), 400, "seed"),
    Case("seed-fractional", "POST", C, cmpl(seed=1.5), 400, "seed"),
    Case("seed-5000-digits", "POST", C, raw(cmpl(), "seed", "9" * 5000), 400, None),
    Case("min_tokens-int32+1", "POST", C, cmpl(min_tokens=2**31), 400, "min_tokens"),
    Case("min_tokens-over-max_tokens", "POST", C, cmpl(min_tokens=5, max_tokens=2), 400,
         "min_tokens"),
    Case("max_tokens-2**63", "POST", C, cmpl(max_tokens=2**63), 400, "max_tokens"),
    Case("max_tokens-zero", "POST", C, cmpl(max_tokens=0), 400, "max_tokens"),
    Case("max_tokens-negative", "POST", C, cmpl(max_tokens=-1), 400, "max_tokens"),
    Case("max_tokens-1e999", "POST", C, raw(cmpl(), "max_tokens", "1e999"), 400, "max_tokens"),
    Case("n-1e6", "POST", C, cmpl(n=1_000_000, temperature=1), 400, "n"),  # was a 503
    Case("n-2**64", "POST", C, cmpl(n=2**64, temperature=1), 400, "n"),
    Case("n-zero", "POST", C, cmpl(n=0), 400, "n"),
    Case("n-negative", "POST", C, cmpl(n=-1), 400, "n"),
    Case("logprobs-2**63", "POST", C, cmpl(logprobs=2**63), 400, "logprobs"),
    Case("logprobs-negative", "POST", C, cmpl(logprobs=-1), 400, "logprobs"),
    Case("logprobs-echo-huge", "POST", C, cmpl(echo=True, logprobs=10**6), 400, "logprobs"),
    Case("prompt_logprobs-huge", "POST", C, cmpl(prompt_logprobs=2**64), 400,
         "prompt_logprobs"),
    Case("prompt_logprobs-negative", "POST", C, cmpl(prompt_logprobs=-5), 400,
         "prompt_logprobs"),
    Case("stream-top_k-int32+1", "POST", C, cmpl(stream=True, top_k=2**31), 400, "top_k"),
    # -- ... and exactly at them: accepted, and run in the same batches as the stream ---
    Case("at-limit-top_k-int32", "POST", C, cmpl(top_k=2**31 - 1, temperature=1), 200, None),
    Case("at-limit-seed-uint64", "POST", C, cmpl(seed=2**64 - 1, temperature=1), 200, None),
    Case("at-limit-seed-int64min", "POST", C, cmpl(seed=-2**63, temperature=1), 200, None),
    Case("at-limit-seed-plus-n", "POST", C, cmpl(seed=2**64 - 4, n=4, temperature=1), 200,
         None),
    Case("at-limit-max_tokens-int64", "POST", C, cmpl(max_tokens=2**63 - 1), 200, None),
    Case("at-limit-min_tokens-int32", "POST", C,
         cmpl(min_tokens=2**31 - 1, max_tokens=2**63 - 1), 200, None),
    Case("at-limit-logprobs", "POST", C,
         cmpl(logprobs=MAX_LOGPROBS, prompt_logprobs=MAX_LOGPROBS, echo=True), 200, None),
    Case("at-limit-temperature-float32", "POST", C, cmpl(temperature=3.4028234663852886e38),
         200, None),
    Case("at-limit-repetition_penalty-float32", "POST", C,
         cmpl(repetition_penalty=3.4028234663852886e38, temperature=1), 200, None),
    Case("at-limit-repetition_penalty-denormal", "POST", C,
         cmpl(repetition_penalty=1.4e-45, temperature=1), 200, None),
    Case("at-limit-top_p-denormal", "POST", C, cmpl(top_p=1.4e-45, temperature=1), 200, None),
    Case("at-limit-logit_bias-1e308", "POST", C,
         cmpl(logit_bias={str(i): 1e308 for i in range(1024)}, temperature=1), 200, None),
    Case("at-limit-logit_bias--1e308", "POST", C,
         cmpl(logit_bias={str(i): -1e308 for i in range(1024)}, temperature=1), 200, None),
    Case("at-limit-min_tokens-vs-allowed-eos", "POST", C,
         cmpl(allowed_token_ids=[2], min_tokens=5, max_tokens=6), 200, None),
    Case("chat-at-limit-top_logprobs", "POST", CHAT,
         chat(logprobs=True, top_logprobs=MAX_LOGPROBS, seed=2**64 - 1, temperature=1), 200,
         None),
    # -- floats: past float32, out of range, NaN / Infinity literals ----------------------
    Case("temperature-past-float32", "POST", C, cmpl(temperature=1e39), 400, "temperature"),
    Case("temperature-negative", "POST", C, cmpl(temperature=-1), 400, "temperature"),
    Case("top_p-zero", "POST", C, cmpl(top_p=0), 400, "top_p"),
    Case("min_p-negative", "POST", C, cmpl(min_p=-0.5), 400, "min_p"),
    Case("repetition_penalty-zero", "POST", C, cmpl(repetition_penalty=0), 400,
         "repetition_penalty"),
    Case("presence_penalty-3", "POST", C, cmpl(presence_penalty=3), 400, "presence_penalty"),
    Case("frequency_penalty--1e30", "POST", C, cmpl(frequency_penalty=-1e30), 400,
         "frequency_penalty"),
    *[Case(f"{field}-{literal}", "POST", C, raw(cmpl(), field, literal), 400, field)
      for field in ("temperature", "top_p", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty")
      for literal in ("NaN", "Infinity", "-Infinity")],
    *[Case(f"logit_bias-{name}", "POST", C, cmpl(logit_bias={"5": value}), 400, "logit_bias")
      for name, value in (("NaN", math.nan), ("Infinity", math.inf),
                          ("-Infinity", -math.inf))],
    # -- /v1/chat/completions: the same, under chat's names -------------------------------
    Case("chat-max_completion_tokens-2**63", "POST", CHAT,
         chat(max_completion_tokens=2**63), 400, "max_completion_tokens"),
    Case("chat-max_tokens-2**63", "POST", CHAT, chat(max_tokens=2**63), 400, "max_tokens"),
    Case("chat-top_logprobs-huge", "POST", CHAT, chat(logprobs=True, top_logprobs=2**64), 400,
         "top_logprobs"),
    Case("chat-top_logprobs-negative", "POST", CHAT, chat(logprobs=True, top_logprobs=-1), 400,
         "top_logprobs"),
    Case("chat-top_logprobs-without-logprobs", "POST", CHAT, chat(top_logprobs=2), 400,
         "top_logprobs"),
    Case("chat-prompt_logprobs-negative", "POST", CHAT, chat(prompt_logprobs=-1), 400,
         "prompt_logprobs"),
    Case("chat-n-int32+1", "POST", CHAT, chat(n=2**31, temperature=1), 400, "n"),
    Case("chat-seed-2**64", "POST", CHAT, chat(seed=2**64), 400, "seed"),
    Case("chat-top_k-int32+1", "POST", CHAT, chat(top_k=2**31), 400, "top_k"),
    Case("chat-min_tokens-int32+1", "POST", CHAT, chat(min_tokens=2**31), 400, "min_tokens"),
    Case("chat-temperature-NaN", "POST", CHAT, raw(chat(), "temperature", "NaN"), 400,
         "temperature"),
    Case("chat-top_p-Infinity", "POST", CHAT, raw(chat(), "top_p", "Infinity"), 400, "top_p"),
    # -- empty --------------------------------------------------------------------------
    Case("prompt-empty-string", "POST", C, cmpl(prompt=""), 400, "prompt"),
    Case("prompt-empty-list", "POST", C, cmpl(prompt=[]), 400, "prompt"),
    Case("prompt-empty-token-list", "POST", C, cmpl(prompt=[[]]), 400, "prompt"),
    Case("prompt-list-of-empty-string", "POST", C, cmpl(prompt=[""]), 400, "prompt"),
    Case("chat-messages-empty", "POST", CHAT, chat(messages=[]), 400, "messages"),
    Case("stop-empty-string", "POST", C, cmpl(stop=""), 400, "stop"),
    Case("stop-list-with-empty-string", "POST", C, cmpl(stop=["x", ""]), 400, "stop"),
    Case("allowed_token_ids-empty", "POST", C, cmpl(allowed_token_ids=[]), 400,
         "allowed_token_ids"),
    Case("bad_words-empty-word", "POST", C, cmpl(bad_words=[""]), 400, "bad_words"),
    Case("cache_salt-empty", "POST", C, cmpl(cache_salt=""), 400, "cache_salt"),
    Case("tokenize-nothing", "POST", TOK, {}, 400, "prompt"),
    Case("body-empty", "POST", C, b"", 400, None),
    # -- huge ---------------------------------------------------------------------------
    # a fast 400 naming prompt: length is checked before the ids are looked at
    # (0.2 s; it was 1.9 s of the event loop before the prompt field's fail_fast)
    Case("prompt-1M-token-ids", "POST", C, lambda: compact(cmpl(prompt=[5] * 1_000_000)), 400,
         "prompt", deadline_s=1.5),
    Case("prompt-10k-prompts", "POST", C, lambda: compact(cmpl(prompt=[[5, 6]] * 10_000)), 400,
         "prompt"),
    Case("stop_token_ids-100k", "POST", C,
         lambda: compact(cmpl(stop_token_ids=[i % VOCAB for i in range(100_000)])), 400,
         "stop_token_ids"),
    Case("allowed_token_ids-100k", "POST", C,
         lambda: compact(cmpl(allowed_token_ids=list(range(100_000)))), 400,
         "allowed_token_ids"),
    Case("bad_words-100k", "POST", C,
         lambda: compact(cmpl(bad_words=[f"w{i}" for i in range(100_000)])), 400, "bad_words"),
    Case("logit_bias-100k", "POST", C,
         lambda: compact(cmpl(logit_bias={str(i): 1.0 for i in range(100_000)})), 400,
         "logit_bias"),
    Case("stop-1000-strings", "POST", C, cmpl(stop=[f"s{i}" for i in range(1000)]), 400,
         "stop"),
    Case("stop-100k-chars", "POST", C, lambda: cmpl(stop="x" * 100_000), 400, "stop"),
    Case("chat-3000-messages", "POST", CHAT,
         lambda: chat(messages=[{"role": "user", "content": "x"}] * 3000), 400, "messages"),
    # -- deep nesting (json.loads gives up: a 400 about the body) --------------------------
    Case("deep-prompt", "POST", C, raw(cmpl(), "prompt", DEEP), 400, None),
    Case("deep-unknown-field", "POST", C, raw(cmpl(), "junk", DEEP), 400, None),
    Case("deep-objects", "POST", C,
         raw(cmpl(), "structured_outputs", '{"a":' * 100_000 + "1" + "}" * 100_000), 400, None),
    Case("chat-deep-content", "POST", CHAT,
         ('{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": '
          + DEEP + "}]}").encode(), 400, None),
    # -- not UTF-8; lone surrogates (were 500s) -------------------------------------------
    Case("invalid-utf8-prompt", "POST", C,
         b'{"model": "m", "max_tokens": 2, "prompt": "\xff\xfe\xc3("}', 400, None),
    Case("invalid-utf8-key", "POST", CHAT,
         b'{"model": "m", "messages": [{"role": "user", "\xc0\xaf": "x"}]}', 400, None),
    Case("cesu8-surrogate-prompt", "POST", C,
         b'{"model": "m", "max_tokens": 2, "prompt": "\xed\xa0\x80"}', 400, "prompt"),
    Case("lone-surrogate-prompt", "POST", C, raw(cmpl(), "prompt", LONE), 400, "prompt"),
    Case("lone-surrogate-prompt-list", "POST", C, raw(cmpl(), "prompt", f'["a", {LONE}]'), 400,
         "prompt"),
    Case("lone-surrogate-model", "POST", C, raw(cmpl(), "model", LONE), 400, "model"),
    Case("lone-surrogate-bad_words", "POST", C, raw(cmpl(), "bad_words", f"[{LONE}]"), 400,
         "bad_words"),
    Case("lone-surrogate-guided_regex", "POST", C, raw(cmpl(), "guided_regex", LONE), 400,
         "guided_regex"),
    Case("chat-lone-surrogate-content", "POST", CHAT,
         ('{"model": "m", "messages": [{"role": "user", "content": ' + LONE + "}]}").encode(),
         400, "messages"),
    Case("tokenize-lone-surrogate", "POST", TOK, ('{"prompt": ' + LONE + "}").encode(), 400,
         "prompt"),
    # -- the body cap, routes, models --------------------------------------------------------
    Case("body-over-cap", "POST", C,
         lambda: b'{"model": "m", "prompt": "' + b"a" * BODY_CAP + b'"}', 413, None),
    Case("tokenize-body-over-cap", "POST", TOK,
         lambda: b'{"prompt": "' + b"a " * (BODY_CAP // 2) + b'"}', 413, None),
    Case("unknown-model", "POST", C, cmpl(model="gpt-17"), 404, "model"),
    Case("chat-unknown-model", "POST", CHAT, chat(model="gpt-17"), 404, "model"),
    Case("tokenize-unknown-model", "POST", TOK, {"model": "gpt-17", "prompt": "x"}, 404,
         "model"),
    Case("detokenize-unknown-model", "POST", DETOK, {"model": "gpt-17", "tokens": [1]}, 404,
         "model"),
    Case("unknown-route", "POST", "/v1/engines/m/completions", cmpl(), 404, None),
    Case("wrong-method", "GET", C, b"", 405, None),
    # -- malformed JSON, wrong types ----------------------------------------------------------
    Case("not-json", "POST", C, b"this is not json", 400, None),
    Case("truncated-json", "POST", C, b'{"model": "m", "prompt": "x",', 400, None),
    Case("json-array-body", "POST", C, b"[]", 400, None),
    Case("json-string-body", "POST", CHAT, b'"hello"', 400, None),
    Case("prompt-object", "POST", C, cmpl(prompt={"text": "hi"}), 400, "prompt"),
    Case("prompt-mixed-types", "POST", C, cmpl(prompt=[1, "a", [2]]), 400, "prompt"),
    Case("chat-messages-string", "POST", CHAT, chat(messages="hello"), 400, "messages"),
    Case("chat-message-without-role", "POST", CHAT, chat(messages=[{"content": "x"}]), 400,
         "messages"),
    Case("chat-role-object", "POST", CHAT, chat(messages=[{"role": {"a": 1}, "content": "x"}]),
         400, "messages"),
    Case("max_tokens-word", "POST", C, cmpl(max_tokens="ten"), 400, "max_tokens"),
    Case("n-list", "POST", C, cmpl(n=[2]), 400, "n"),
    Case("ignore_eos-word", "POST", C, cmpl(ignore_eos="maybe"), 400, "ignore_eos"),
    Case("stop-int", "POST", C, cmpl(stop=5), 400, "stop"),
    Case("logit_bias-list", "POST", C, cmpl(logit_bias=[1, 2]), 400, "logit_bias"),
    Case("logit_bias-value-word", "POST", C, cmpl(logit_bias={"5": "x"}), 400, "logit_bias"),
    Case("stream_options-string", "POST", C, cmpl(stream_options="x"), 400, "stream_options"),
    Case("response_format-unknown-type", "POST", CHAT, chat(response_format={"type": "xml"}),
         400, "response_format"),
    Case("json-body-as-text-plain", "POST", C, b"plain text", 400, None),
    # -- token ids outside the vocabulary -------------------------------------------------------
    Case("prompt-id-vocab", "POST", C, cmpl(prompt=[5, VOCAB]), 400, "prompt"),
    Case("prompt-id-negative", "POST", C, cmpl(prompt=[-1]), 400, "prompt"),
    Case("prompt-id-2**64", "POST", C, cmpl(prompt=[2**64]), 400, "prompt"),
    Case("prompt-ids-2d-one-bad", "POST", C, cmpl(prompt=[[5, 6], [2**70]]), 400, "prompt"),
    Case("stop_token_ids-vocab", "POST", C, cmpl(stop_token_ids=[VOCAB]), 400,
         "stop_token_ids"),
    Case("stop_token_ids-int32+1", "POST", C, cmpl(stop_token_ids=[2**31]), 400,
         "stop_token_ids"),
    Case("allowed_token_ids-2**63", "POST", C, cmpl(allowed_token_ids=[2**63]), 400,
         "allowed_token_ids"),
    Case("logit_bias-key-vocab", "POST", C, cmpl(logit_bias={str(VOCAB): 1}), 400,
         "logit_bias"),
    Case("logit_bias-key-negative", "POST", C, cmpl(logit_bias={"-1": 1}), 400, "logit_bias"),
    Case("logit_bias-key-word", "POST", C, cmpl(logit_bias={"nope": 1}), 400, "logit_bias"),
    Case("detokenize-id-vocab", "POST", DETOK, {"tokens": [1, VOCAB]}, 400, "tokens"),
    Case("detokenize-id-negative", "POST", DETOK, {"tokens": [-1]}, 400, "tokens"),
    Case("detokenize-id-2**64", "POST", DETOK, {"tokens": [2**64]}, 400, "tokens"),
    Case("detokenize-tokens-string", "POST", DETOK, {"tokens": "abc"}, 400, "tokens"),
    Case("detokenize-tokens-nested", "POST", DETOK, {"tokens": [[1]]}, 400, "tokens"),
    Case("detokenize-no-tokens", "POST", DETOK, {}, 400, "tokens"),
    Case("tokenize-prompt-object", "POST", TOK, {"prompt": {"a": 1}}, 400, "prompt"),
    Case("tokenize-messages-string", "POST", TOK, {"messages": "hi"}, 400, "messages"),
    Case("tokenize-messages-empty", "POST", TOK, {"messages": []}, 400, "messages"),
    # -- structured output ------------------------------------------------------------------------
    Case("guided_regex-over-cap", "POST", C, lambda: cmpl(guided_regex="a" * 70_000), 400,
         "guided_regex"),
    Case("guided_json-over-cap", "POST", C, cmpl(guided_json=BIG_SCHEMA), 400, "guided_json"),
    Case("guided_choice-100k", "POST", C,
         lambda: cmpl(guided_choice=[f"c{i}" for i in range(100_000)]), 400, "guided_choice"),
    Case("guided_regex-invalid", "POST", C, cmpl(guided_regex="(a"), 400, "guided_regex"),
    Case("guided_regex-bad-range", "POST", C, cmpl(guided_regex="[z-a]"), 400, "guided_regex"),
    Case("guided_grammar-invalid", "POST", C, cmpl(guided_grammar="root ::= ("), 400,
         "guided_grammar"),
    Case("guided_json-invalid", "POST", C, cmpl(guided_json={"type": "nonsense"}), 400,
         "guided_json"),
    Case("structured_outputs-bad-json", "POST", C, cmpl(structured_outputs={"json": "{"}), 400,
         "structured_outputs"),
    Case("structured-two-ways", "POST", C, cmpl(guided_json={"type": "string"}, guided_regex="a"),
         400, "guided_regex"),
    Case("chat-response_format-no-schema", "POST", CHAT,
         chat(response_format={"type": "json_schema"}), 400, "response_format"),
    # -- chat templates -----------------------------------------------------------------------
    Case("chat-request-template", "POST", CHAT, chat(chat_template=TEMPLATE), 400,
         "chat_template"),
    Case("tokenize-request-template", "POST", TOK,
         {"messages": [{"role": "user", "content": "x"}], "chat_template": INJECT}, 400,
         "chat_template"),
    Case("chat-content-part-image", "POST", CHAT,
         chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
         400, "messages"),
    # injection attempts in the message are text: served, or refused, never a 5xx
    Case("chat-template-injection-content", "POST", CHAT,
         chat(messages=[{"role": "user", "content": INJECT}]), (200, 499), None),
    Case("chat-template-injection-role-and-name", "POST", CHAT,
         chat(messages=[{"role": INJECT, "content": "{% for x in range(10**9) %}{% endfor %}",
                         "name": "{{ self.__init__.__globals__ }}"}]), (200, 499), None),
    Case("tokenize-template-injection-content", "POST", TOK,
         {"messages": [{"role": "user", "content": INJECT}]}, (200, 499), None),
]

assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"


# ---- the server, the stream, the checks ------------------------------------------------------
@pytest.fixture(scope="module")
def server(demo_path, tmp_path_factory):
    with live_server(demo_path, tmp_path_factory.mktemp("hostile") / "server.log",
                     *ENGINE) as srv:
        yield srv


class StreamReader:
    """Reads an SSE completion stream: token strings, text, finish reason, errors."""

    def __init__(self, response: httpx.Response):
        assert response.status_code == 200, response.read()
        self.lines = response.iter_lines()
        self.tokens: list[str] = []
        self.text = ""
        self.finish_reason = None
        self.done = False

    def _take(self, line: str) -> None:
        if not line.startswith("data: "):
            return
        data = line[len("data: "):]
        if data == "[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        assert "error" not in chunk, chunk
        choice = chunk["choices"][0]
        self.text += choice["text"]
        if choice["logprobs"]:
            self.tokens += choice["logprobs"]["tokens"]
        self.finish_reason = choice["finish_reason"] or self.finish_reason

    def until_first_token(self) -> None:
        for line in self.lines:
            self._take(line)
            if self.tokens or self.done:
                return

    def rest(self) -> "StreamReader":
        for line in self.lines:
            self._take(line)
        return self


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^(tokenmill:[a-z_]+)(?:\{[^}]*\})? (\S+)$", text, re.M)}


def wait_idle(url: str, timeout: float = 15.0) -> dict[str, float]:
    """The metrics once nothing runs or waits and no KV block is held."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if not (m["tokenmill:num_requests_running"] or m["tokenmill:num_requests_waiting"]
                or m["tokenmill:kv_cache_used_blocks"]):
            return m
        assert time.monotonic() < deadline, f"not idle: {m}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(server) -> StreamReader:
    """The stream's tokens in a clean run, alone."""
    wait_idle(server.url)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=STREAM_BODY) as s:
            ref = StreamReader(s).rest()
    assert ref.done and ref.finish_reason == "length"
    assert len(ref.tokens) == STREAM_TOKENS and ref.text
    wait_idle(server.url)
    return ref


def check_error_body(case: Case, r: httpx.Response) -> None:
    for leak in LEAKS:
        assert leak not in r.text, f"{leak!r} in the error body: {r.text[:500]}"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == r.status_code and err["message"]
    assert err["param"] == case.param, (case.param, err)


def test_the_table_is_big_enough():
    assert len(CASES) >= 40


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_request_does_not_disturb_a_running_stream(server, reference, case: Case):
    body = case.payload()
    before = wait_idle(server.url)
    headers = {"Content-Type": "text/plain" if case.id == "json-body-as-text-plain"
               else "application/json"}
    with httpx.Client(base_url=server.url, timeout=60) as streamer, \
            httpx.Client(base_url=server.url, timeout=60) as hostile:
        with streamer.stream("POST", "/v1/completions", json=STREAM_BODY) as s:
            stream = StreamReader(s)
            stream.until_first_token()  # the stream is running: now the hostile request
            t0 = time.monotonic()
            r = hostile.request(case.method, case.path, content=body, headers=headers)
            elapsed = time.monotonic() - t0
            assert hostile.get("/health").status_code == 200
            stream.rest()

    lo, hi = case.status if isinstance(case.status, tuple) else (case.status, case.status)
    assert lo <= r.status_code <= hi, (r.status_code, r.text[:500])
    assert r.status_code < 500
    assert elapsed < case.deadline_s, f"the hostile request took {elapsed:.1f} s"
    if r.status_code >= 400:
        check_error_body(case, r)
    elif case.path in (C, CHAT):  # served: every completion ran to a normal end
        assert all(c["finish_reason"] in ("stop", "length") for c in r.json()["choices"]), r.text
    # Nothing lost: the concurrent stream is the clean run, token for token.
    assert stream.done and stream.finish_reason == "length"
    assert stream.tokens == reference.tokens
    assert stream.text == reference.text
    # Nothing held: idle again, no KV block in use; the engine still serves.
    after = wait_idle(server.url)
    # the engine finished the stream (and the hostile request, if it was served) and
    # nothing else: a refused request never ran
    served = int(r.status_code == 200 and case.path in (C, CHAT))  # one prompt each, any n
    assert (after["tokenmill:request_success_total"]
            - before["tokenmill:request_success_total"]) == 1 + served
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert server.proc.poll() is None


def test_a_million_token_ids_validate_fast():
    """The event loop validates the body: the prompt field's union stops at a member's
    first bad item (fail_fast). Before, a 1,000,000-id prompt spent about a second there
    collecting a million list[list[int]] errors; now it is a tenth of that."""
    from tokenmill.entrypoints.openai.protocol import CompletionRequest
    body = {"model": MODEL, "prompt": [5] * 1_000_000}
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        CompletionRequest.model_validate(body)
        times.append(time.perf_counter() - t0)
    assert min(times) < 0.4, times


def test_after_the_table_the_server_is_whole(server, reference):
    m = wait_idle(server.url)
    assert m["tokenmill:kv_cache_used_blocks"] == 0
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=STREAM_BODY) as s:
            assert StreamReader(s).rest().tokens == reference.tokens
    assert server.proc.poll() is None
    server.log.flush()
    with open(server.log.name) as f:
        log = f.read()
    # every refusal was an answer, not an accident: no unhandled exception was logged
    assert "Traceback" not in log and "unhandled" not in log, log[-3000:]
