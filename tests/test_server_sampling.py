"""Sampling over HTTP: logprobs, n, stop strings, logit_bias and their 400s, through the
official openai client against a live server on the demo model."""
from __future__ import annotations

import math
import threading

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import word_tokens  # noqa: E402
from live_server import live_server  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402

MODEL = "demo"
MAX_LOGPROBS = 8  # the server's --max-logprobs
SMALL = dict(dtype="float32", max_model_len=256, num_kv_blocks=128)
PROMPT = "The old mill by the river"
CHAT = [{"role": "user", "content": "Tell me about the mill"}]
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(demo_path, tmp_path_factory):
    with live_server(demo_path, tmp_path_factory.mktemp("server") / "server.log",
                     "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "256",
                     "--num-kv-blocks", "128", "--max-logprobs", str(MAX_LOGPROBS),
                     "--log-stats-interval", "0", "--uvicorn-log-level", "warning") as srv:
        yield srv.url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(demo_path):
    return LLM(demo_path, **SMALL)


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


def assert_serving(client):
    r = client.completions.create(model=MODEL, prompt="still here", max_tokens=2,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices) == 1 and r.usage.completion_tokens == 2


def offline(llm, prompt, **params):
    return llm.generate(prompt, SamplingParams(ignore_eos=True, **params), use_tqdm=False)[0]


def offline_chat(llm, messages, **params):
    return llm.chat(messages, SamplingParams(ignore_eos=True, **params), use_tqdm=False)[0]


def _close(a, b):
    return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4)


def _assert_completion_logprobs(lp, token_ids, expected, num):
    """A completions logprobs object against the engine's (token id, {id: Logprob}) rows."""
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(token_ids)
    offset = lp.text_offset[0]
    for j, (t, row) in enumerate(zip(token_ids, expected)):
        assert lp.tokens[j] == row[t].decoded_token
        assert _close(lp.token_logprobs[j], row[t].logprob)
        top = lp.top_logprobs[j]
        assert row[t].decoded_token in top and _close(top[row[t].decoded_token], row[t].logprob)
        best = sorted(row.values(), key=lambda x: x.rank)[:num]
        assert [x.rank for x in best] == list(range(1, num + 1))
        for x in best:
            assert _close(top[x.decoded_token], max(y.logprob for y in row.values()
                                                    if y.decoded_token == x.decoded_token))
        assert lp.text_offset[j] == offset
        offset += len(lp.tokens[j])


def _assert_chat_logprobs(content, token_ids, expected, num):
    assert len(content) == len(token_ids)
    for e, t, row in zip(content, token_ids, expected):
        assert e.token == row[t].decoded_token and _close(e.logprob, row[t].logprob)
        assert e.bytes == list(e.token.encode("utf-8"))
        assert len(e.top_logprobs) == num
        best = sorted(row.values(), key=lambda x: x.rank)[:num]
        assert [x.token for x in e.top_logprobs] == [x.decoded_token for x in best]
        assert all(_close(a.logprob, b.logprob) for a, b in zip(e.top_logprobs, best))
        lps = [x.logprob for x in e.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        if row[t].rank <= num:  # the sampled token is among the top ones
            assert e.token in [x.token for x in e.top_logprobs]


# ---- logprobs ----------------------------------------------------------------------
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=11)])
def test_completion_logprobs_equal_offline(client, llm, sampling):
    expected = offline(llm, PROMPT, max_tokens=6, logprobs=3, **sampling).outputs[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=3,
                                  extra_body={"ignore_eos": True}, **sampling)
    c = r.choices[0]
    assert c.text == expected.text
    _assert_completion_logprobs(c.logprobs, expected.token_ids, expected.logprobs, 3)
    assert c.logprobs.text_offset[0] == 0
    assert _close(sum(c.logprobs.token_logprobs), expected.cumulative_logprob)

    # streaming: the chunks' logprobs put together are the same
    chunks = [ch for ch in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=3, stream=True,
        extra_body={"ignore_eos": True}, **sampling) if ch.choices]
    assert "".join(ch.choices[0].text for ch in chunks) == expected.text
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        joined = [x for ch in chunks for x in getattr(ch.choices[0].logprobs, name)]
        assert joined == getattr(c.logprobs, name), name


def test_completion_echo_logprobs_start_with_the_prompt(client, llm, tok):
    expected = offline(llm, PROMPT, temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=2)
    n_prompt = len(expected.prompt_token_ids)
    for stream in (False, True):
        kw = dict(model=MODEL, prompt=PROMPT, max_tokens=3, logprobs=2, echo=True, **GREEDY)
        if stream:
            chunks = [ch.choices[0] for ch in client.completions.create(stream=True, **kw)
                      if ch.choices]
            text = "".join(ch.text for ch in chunks)
            lp = {name: [x for ch in chunks for x in getattr(ch.logprobs, name)]
                  for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        else:
            c = client.completions.create(**kw).choices[0]
            text, lp = c.text, c.logprobs.model_dump()
        assert text == PROMPT + expected.outputs[0].text
        assert len(lp["tokens"]) == n_prompt + 3
        assert lp["tokens"][0] == tok.decode(expected.prompt_token_ids[:1])
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for j in range(1, n_prompt):
            row, t = expected.prompt_logprobs[j], expected.prompt_token_ids[j]
            assert lp["tokens"][j] == row[t].decoded_token
            assert _close(lp["token_logprobs"][j], row[t].logprob)
            assert row[t].decoded_token in lp["top_logprobs"][j]
        for j, (t, row) in enumerate(zip(expected.outputs[0].token_ids,
                                         expected.outputs[0].logprobs)):
            assert _close(lp["token_logprobs"][n_prompt + j], row[t].logprob)
        assert lp["text_offset"][0] == 0


def test_prompt_logprobs_extra_field(client, llm):
    expected = offline(llm, PROMPT, temperature=0, max_tokens=2, prompt_logprobs=2)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                  extra_body={"prompt_logprobs": 2, "ignore_eos": True},
                                  temperature=0)
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(expected.prompt_token_ids) and plp[0] is None
    for got, row in zip(plp[1:], expected.prompt_logprobs[1:]):
        assert {int(k) for k in got} == set(row)
        for k, v in got.items():
            assert _close(v["logprob"], row[int(k)].logprob)
            assert v["rank"] == row[int(k)].rank
            assert v["decoded_token"] == row[int(k)].decoded_token
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 1})
    expected = offline_chat(llm, CHAT, temperature=0, max_tokens=2, prompt_logprobs=1)
    plp = r.model_extra["prompt_logprobs"]
    assert len(plp) == len(expected.prompt_token_ids) and plp[0] is None


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=5)])
def test_chat_logprobs_equal_offline(client, llm, sampling):
    expected = offline_chat(llm, CHAT, max_tokens=5, logprobs=3, **sampling).outputs[0]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True},
                                       **sampling)
    c = r.choices[0]
    assert c.message.content == expected.text
    _assert_chat_logprobs(c.logprobs.content, expected.token_ids, expected.logprobs, 3)

    chunks = [ch.choices[0] for ch in client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=3, stream=True,
        extra_body={"ignore_eos": True}, **sampling) if ch.choices]
    assert "".join(ch.delta.content or "" for ch in chunks) == expected.text
    streamed = [e for ch in chunks if ch.logprobs for e in ch.logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in c.logprobs.content]


def test_chat_logprobs_without_top_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, logprobs=True,
                                       **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(e.top_logprobs == [] for e in content)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, **GREEDY)
    assert r.choices[0].logprobs is None


# ---- n ----------------------------------------------------------------------------
def test_n_completions_are_seeded_and_indexed(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=5, n=3, seed=42, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1
    assert a.usage.completion_tokens == 15
    assert a.usage.prompt_tokens == b.usage.prompt_tokens < 15

    # two prompts x n=2: index = prompt index * n + completion index
    r = client.completions.create(model=MODEL, prompt=[PROMPT, "a second prompt"],
                                  max_tokens=5, n=2, seed=42, temperature=1.0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices[:2]] == [c.text for c in a.choices[:2]]
    assert r.usage.completion_tokens == 20


def test_n_streaming_assembles_per_index(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, n=2, seed=3, temperature=1.0,
              logprobs=1, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    texts, tokens, finish = {}, {}, {}
    for ch in client.completions.create(stream=True, stream_options={"include_usage": True},
                                        **kw):
        if not ch.choices:
            assert ch.usage.completion_tokens == 12
            continue
        for c in ch.choices:
            assert c.index not in finish  # nothing after a choice's final chunk
            texts[c.index] = texts.get(c.index, "") + c.text
            tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert finish == {0: "length", 1: "length"}
    assert [texts[i] for i in (0, 1)] == [c.text for c in full.choices]
    assert [tokens[i] for i in (0, 1)] == [c.logprobs.tokens for c in full.choices]


def test_chat_n(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=5, n=2, seed=9, temperature=1.0,
              logprobs=True, top_logprobs=1, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 10
    assert all(len(c.logprobs.content) == 5 for c in r.choices)
    texts, roles, finish, lps = {}, {}, {}, {}
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.logprobs:
                lps.setdefault(c.index, []).extend(c.logprobs.content)
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert roles == {0: "assistant", 1: "assistant"} and finish == {0: "length", 1: "length"}
    assert [texts[i] for i in (0, 1)] == [c.message.content for c in r.choices]
    assert [len(lps[i]) for i in (0, 1)] == [5, 5]


# ---- stop strings ------------------------------------------------------------------------
def _stop_string(text: str) -> str:
    """A 2-letter piece of `text`: the first from its middle on that occurs there first
    (the output is cut there), else its first one (text of word tokens always has one)."""
    pieces = [k for k in range(len(text) - 1)
              if text[k:k + 2].isascii() and text[k:k + 2].isalpha()]
    assert pieces, f"no 2-letter piece in {text!r}"
    mid = [k for k in pieces if k >= len(text) // 2 and text.find(text[k:k + 2]) == k]
    k = (mid or pieces)[0]
    return text[k:k + 2]


def test_stop_string_truncates_there(client, llm, tok):
    """Generated from word tokens only (allowed_token_ids), so the greedy text always has
    a stop string to take; each request below generates the same text up to it."""
    words = word_tokens(tok)
    greedy_words = dict(temperature=0, extra_body={"ignore_eos": True,
                                                   "allowed_token_ids": words})
    greedy = offline(llm, PROMPT, temperature=0, max_tokens=24,
                     allowed_token_ids=words).outputs[0].text
    stop = _stop_string(greedy)
    cut = greedy.index(stop)
    assert cut > 0
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stop=stop,
                                  **greedy_words)
    c = r.choices[0]
    assert c.text == greedy[:cut] and c.finish_reason == "stop"
    assert c.model_extra["stop_reason"] == stop
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                  stop=["\x00never", stop], temperature=0,
                                  extra_body={"ignore_eos": True, "allowed_token_ids": words,
                                              "include_stop_str_in_output": True})
    assert r.choices[0].text == greedy[:cut + len(stop)]
    # streaming: the text held back for a possible stop string is never sent
    chunks = [ch.choices[0] for ch in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, stop=[stop], stream=True, **greedy_words)
        if ch.choices]
    assert "".join(ch.text for ch in chunks) == greedy[:cut]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].model_extra["stop_reason"] == stop
    # chat too
    greedy = offline_chat(llm, CHAT, temperature=0, max_tokens=24,
                          allowed_token_ids=words).outputs[0].text
    stop = _stop_string(greedy)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, stop=stop,
                                       **greedy_words)
    assert r.choices[0].message.content == greedy[:greedy.index(stop)]
    assert r.choices[0].finish_reason == "stop"


# ---- logit_bias and the other extra fields -------------------------------------------
def test_logit_bias(client, llm, tok):
    target = tok.encode(" mill")[-1]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=0,
                                  logit_bias={str(target): 100}, **GREEDY)
    assert r.choices[0].logprobs.tokens == [tok.decode([target])] * 4
    assert r.choices[0].text == tok.decode([target] * 4)

    first = offline(llm, PROMPT, temperature=0, max_tokens=1).outputs[0].token_ids[0]
    expected = offline(llm, PROMPT, temperature=0, max_tokens=3, logit_bias={first: -100})
    assert expected.outputs[0].token_ids[0] != first
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                  logit_bias={str(first): -100}, **GREEDY)
    assert r.choices[0].text == expected.outputs[0].text


def test_extra_sampling_fields_reach_the_engine(client, llm, tok):
    params = dict(temperature=0.8, seed=1, top_k=40, min_p=0.02, presence_penalty=0.5,
                  frequency_penalty=0.3, repetition_penalty=1.2, min_tokens=2)
    expected = offline(llm, PROMPT, max_tokens=6, **params).outputs[0].text
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.8, seed=1,
        presence_penalty=0.5, frequency_penalty=0.3,
        extra_body={"top_k": 40, "min_p": 0.02, "repetition_penalty": 1.2, "min_tokens": 2,
                    "ignore_eos": True})
    assert r.choices[0].text == expected
    allowed = [tok.encode(" mill")[-1], tok.encode(" river")[-1]]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=0,
                                  temperature=1.0, seed=2,
                                  extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    assert set(r.choices[0].logprobs.tokens) <= {tok.decode([t]) for t in allowed}
    # more top logprobs than allowed tokens (no -inf in the JSON should it come to that)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, logprobs=True,
                                       top_logprobs=4, temperature=0,
                                       extra_body={"allowed_token_ids": allowed})
    for e in r.choices[0].logprobs.content:
        assert e.token in {tok.decode([t]) for t in allowed} and len(e.top_logprobs) == 4

    greedy = offline(llm, PROMPT, temperature=0, max_tokens=6)
    word = tok.decode(greedy.outputs[0].token_ids[:1]).strip()
    expected = offline(llm, PROMPT, temperature=0, max_tokens=6, bad_words=[word]).outputs[0]
    assert expected.text != greedy.outputs[0].text
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                  extra_body={"bad_words": [word], "ignore_eos": True},
                                  temperature=0)
    assert r.choices[0].text == expected.text


# ---- bad input: 400 naming the field, the server keeps serving ---------------------------
COMPLETION_ERRORS = [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(extra_body={"min_p": 1.5}), "min_p"),
    (dict(n=0), "n"),
    (dict(n=2, temperature=0), "n"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (dict(logprobs=MAX_LOGPROBS + 1, echo=True), "logprobs"),
    (dict(extra_body={"prompt_logprobs": MAX_LOGPROBS + 1}), "prompt_logprobs"),
    (dict(logit_bias={"1000000": 5}), "logit_bias"),
    (dict(logit_bias={"x": 5}), "logit_bias"),
    (dict(extra_body={"allowed_token_ids": [1000000]}), "allowed_token_ids"),
    (dict(extra_body={"min_tokens": -1}), "min_tokens"),
]


@pytest.mark.parametrize("kw,param", COMPLETION_ERRORS,
                         ids=[f"{p}-{i}" for i, (_, p) in enumerate(COMPLETION_ERRORS)])
def test_bad_completion_fields_are_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, **kw)
    err = ei.value.response.json()["error"]
    assert ei.value.status_code == 400 and err["param"] == param, err
    assert_serving(client)


CHAT_ERRORS = [
    (dict(top_logprobs=2), "top_logprobs"),  # without logprobs=true
    (dict(logprobs=True, top_logprobs=MAX_LOGPROBS + 1), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=-1), "top_logprobs"),
    (dict(presence_penalty=-2.5), "presence_penalty"),
    (dict(n=3, temperature=0), "n"),
    (dict(logit_bias={"99999": 1}), "logit_bias"),
]


@pytest.mark.parametrize("kw,param", CHAT_ERRORS,
                         ids=[f"{p}-{i}" for i, (_, p) in enumerate(CHAT_ERRORS)])
def test_bad_chat_fields_are_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, **kw)
    err = ei.value.response.json()["error"]
    assert ei.value.status_code == 400 and err["param"] == param, err
    assert_serving(client)


def test_bad_requests_leave_a_running_stream_alone(client, llm):
    expected = offline(llm, PROMPT, temperature=0, max_tokens=40).outputs[0].text
    result = {}

    def stream():
        result["text"] = "".join(ch.choices[0].text for ch in client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=40, stream=True, **GREEDY) if ch.choices)

    t = threading.Thread(target=stream)
    t.start()
    for kw, _ in COMPLETION_ERRORS:
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, **kw)
    t.join(60)
    assert result["text"] == expected
