"""Request fields tokenmill does not implement: refused with a 400 naming the field when
they would change what a correct answer is (legacy functions, reasoning_effort, best_of,
suffix, audio, ...); accepted and ignored when they would not (user, metadata, store, ...);
any other unknown field is ignored and logged once per name at WARNING. (Tool calling
itself: test_server_tools.py; here only that the demo model's template, which has no place
for tools, refuses them rather than dropping them from the prompt.)

The `tools` refusal runs against a live server with the official openai client; every other
field is checked in process (no socket), each refusal followed by a request the same app
serves."""
from __future__ import annotations

import json
import logging
import uuid

import httpx
import pytest

openai = pytest.importorskip("openai")

from inprocess_app import async_llm, call  # noqa: E402,F401 (a fixture)
from test_server import MODEL, _error, assert_serving, client, server  # noqa: E402,F401
from tokenmill.entrypoints.openai import protocol  # noqa: E402
from tokenmill.entrypoints.openai.server import build_app  # noqa: E402

CHAT, CMPL, TOK = "/v1/chat/completions", "/v1/completions", "/tokenize"
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city.",
                     "parameters": {"type": "object",
                                    "properties": {"city": {"type": "string"}},
                                    "required": ["city"]}}}
PROTOCOL_LOGGER = "tokenmill.entrypoints.openai.protocol"


# ---- live, with the openai client ---------------------------------------------------------
def test_tools_a_template_cannot_render_are_a_400_naming_tools(client):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as ei:
            client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4,
                                           tools=[TOOL], tool_choice="required", stream=stream)
        body = _error(ei, 400)
        assert body["param"] == "tools" and body["message"].startswith("tools:")
        assert "does not render tools" in body["message"]
        assert body["type"] == "BadRequestError"
        assert_serving(client)
    # tool_choice "none" does not make the tools harmless: they belong in the prompt
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4,
                                       tools=[TOOL], tool_choice="none")
    assert _error(ei, 400)["param"] == "tools"
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert r.choices[0].message.tool_calls is None and r.usage.completion_tokens >= 1


def test_other_refusals_through_the_openai_client(client):
    refused = [
        (lambda: client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                                tool_choice="required"), "tool_choice"),
        (lambda: client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                                reasoning_effort="high"), "reasoning_effort"),
        (lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                           suffix=" the end"), "suffix"),
        (lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2, best_of=3),
         "best_of"),
    ]
    for send, param in refused:
        with pytest.raises(openai.BadRequestError) as ei:
            send()
        assert _error(ei, 400)["param"] == param
        assert_serving(client)


def test_nulls_and_ignored_fields_through_the_openai_client(client):
    # the client sends an explicit None as null: null is "not given"
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, tools=None,
                                       tool_choice=None, parallel_tool_calls=None,
                                       reasoning_effort=None, user="u-1",
                                       metadata={"team": "a"}, store=False,
                                       service_tier="auto")
    assert r.choices[0].finish_reason in ("length", "stop")


# ---- in process: every field ----------------------------------------------------------------
@pytest.fixture(scope="module")
def app(async_llm):
    return build_app(async_llm, MODEL)


def body_for(path: str, **fields) -> dict:
    base = {CHAT: {"model": MODEL, "messages": USER, "max_tokens": 1},
            CMPL: {"model": MODEL, "prompt": "hi", "max_tokens": 1},
            TOK: {"model": MODEL, "messages": USER}}[path]
    return {**base, **fields}


REFUSED = [
    # -- tool calling ------------------------------------------------------------------------
    (CHAT, "tool_choice", "required"),  # without tools
    (CHAT, "tool_choice", "auto"),
    (CHAT, "tool_choice", {"type": "function", "function": {"name": "get_weather"}}),
    (CHAT, "functions", [TOOL["function"]]),
    (CHAT, "function_call", "auto"),
    (CHAT, "function_call", {"name": "get_weather"}),
    (CMPL, "tools", [TOOL]),
    (CMPL, "tool_choice", "required"),
    (TOK, "tools", [TOOL]),  # the demo model's template renders no tools
    # -- OpenAI chat fields that change the answer ---------------------------------------------
    (CHAT, "reasoning_effort", "low"),
    (CHAT, "verbosity", "low"),
    (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "modalities", ["audio"]),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "web_search_options", {}),
    # -- OpenAI completions fields -------------------------------------------------------------
    (CMPL, "suffix", " and then"),
    (CMPL, "best_of", 2),
    (CHAT, "best_of", 2),
    # -- vLLM's extra fields -------------------------------------------------------------------
    (CMPL, "use_beam_search", True),
    (CHAT, "use_beam_search", True),
    (CMPL, "length_penalty", 0.5),
    (CMPL, "early_stopping", True),
    (CMPL, "add_special_tokens", False),
    (CMPL, "prompt_embeds", "AAAA"),
    (CMPL, "logits_processors", ["my.module:Proc"]),
    (CMPL, "return_tokens_as_token_ids", True),
    (CMPL, "return_token_ids", True),
    (CMPL, "guided_whitespace_pattern", " "),
    (CHAT, "guided_whitespace_pattern", " "),
    (CMPL, "mm_processor_kwargs", {"num_crops": 4}),
    (CHAT, "echo", True),
    (CHAT, "add_special_tokens", True),
    (CHAT, "documents", [{"title": "a", "text": "b"}]),
    (CHAT, "continue_final_message", True),
    (CHAT, "logits_processors", ["my.module:Proc"]),
    (CHAT, "return_tokens_as_token_ids", True),
    (CHAT, "mm_processor_kwargs", {"num_crops": 4}),
    (TOK, "documents", [{"title": "a", "text": "b"}]),
    (TOK, "continue_final_message", True),
    (TOK, "mm_processor_kwargs", {"num_crops": 4}),
    (TOK, "return_token_strs", True),
    # -- response_format types other than text / json_object / json_schema ---------------------
    (CHAT, "response_format", {"type": "structural_tag"}),
    (CMPL, "response_format", {"type": "grammar"}),
]


def good_request(path: str):
    return ("POST", path, {"json": body_for(path)})


@pytest.mark.parametrize("path, field, value", REFUSED,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{f}-{json.dumps(v)[:24]}"
                              for p, f, v in REFUSED])
def test_refused_field_is_a_400_naming_it_and_the_next_request_is_served(app, path, field,
                                                                          value):
    refused, after = call(app, ("POST", path, {"json": body_for(path, **{field: value})}),
                          good_request(path))
    assert refused.status_code == 400, refused.text
    err = refused.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
    assert err["param"] == field and err["message"].startswith(f"{field}:"), err
    assert err["type"] == "BadRequestError"
    assert after.status_code == 200, after.text


def test_best_of_above_n_is_refused_but_equal_to_n_is_not(app):
    over, equal, equal_chat = call(
        app, ("POST", CMPL, {"json": body_for(CMPL, n=2, best_of=3, temperature=1.0)}),
        ("POST", CMPL, {"json": body_for(CMPL, n=2, best_of=2, temperature=1.0)}),
        ("POST", CHAT, {"json": body_for(CHAT, best_of=1)}))
    assert over.status_code == 400 and over.json()["error"]["param"] == "best_of"
    assert equal.status_code == 200 and len(equal.json()["choices"]) == 2
    assert equal_chat.status_code == 200


MESSAGES_REFUSED = [
    ("role-tool-without-id", [*USER, {"role": "assistant", "content": "calling"},
                              {"role": "tool", "content": "sunny"}],
     "messages[2].tool_call_id"),
    ("role-function", [*USER, {"role": "function", "name": "get_weather", "content": "sunny"}],
     "messages[1].role"),
    ("user-tool_calls",
     [{"role": "user", "content": "hi",
       "tool_calls": [{"id": "c1", "type": "function",
                       "function": {"name": "get_weather", "arguments": "{}"}}]}],
     "messages[0].tool_calls"),
    ("tool_calls-not-a-call",
     [*USER, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]},
      {"role": "user", "content": "and?"}], "messages[1].tool_calls[0]"),
    ("tool_calls-arguments-number",
     [*USER, {"role": "assistant", "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": 3}}]},
      {"role": "user", "content": "and?"}], "messages[1].tool_calls[0].function.arguments"),
    ("assistant-function_call",
     [*USER, {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
      {"role": "user", "content": "and?"}], "messages[1].function_call"),
    ("assistant-audio", [*USER, {"role": "assistant", "audio": {"id": "audio_1"}},
                         {"role": "user", "content": "and?"}], "messages[1].audio"),
    ("part-input_audio", [{"role": "user", "content": [
        {"type": "text", "text": "what is said?"},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}],
     "messages[0].content[1]"),
    ("part-audio_url", [{"role": "user", "content": [
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}}]}],
     "messages[0].content[0]"),
    ("part-video_url", [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}],
     "messages[0].content[0]"),
    ("part-file", [{"role": "user", "content": [
        {"type": "file", "file": {"file_id": "file-1"}}]}], "messages[0].content[0]"),
]


@pytest.mark.parametrize("path", [CHAT, TOK])
@pytest.mark.parametrize("messages, where", [c[1:] for c in MESSAGES_REFUSED],
                         ids=[c[0] for c in MESSAGES_REFUSED])
def test_refused_message_fields_name_the_message(app, path, messages, where):
    refused, after = call(app, ("POST", path, {"json": body_for(path, messages=messages)}),
                          good_request(path))
    assert refused.status_code == 400, refused.text
    err = refused.json()["error"]
    assert err["param"] == "messages" and err["message"].startswith(where + ":"), err
    assert after.status_code == 200, after.text


def test_a_refused_part_type_is_never_echoed_raw(app):
    """The part type is the client's string: a lone surrogate in it must not turn the
    400 into a 500 (the response is UTF-8)."""
    raw = ('{"model": "%s", "max_tokens": 1, "messages": [{"role": "user", "content": '
           '[{"type": "\\ud800%s"}]}]}' % (MODEL, "x" * 1000)).encode()
    r, = call(app, ("POST", CHAT, {"content": raw,
                                   "headers": {"Content-Type": "application/json"}}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and len(err["message"]) < 300


# ---- values that ask for nothing tokenmill does not do are accepted ---------------------------
HARMLESS = [
    (CHAT, dict(tools=None, tool_choice=None, parallel_tool_calls=None, functions=None,
                function_call=None, reasoning_effort=None, verbosity=None, modalities=None,
                audio=None, web_search_options=None, best_of=None)),
    (CHAT, dict(tools=[], functions=[], tool_choice="none", function_call="none")),
    (CHAT, dict(parallel_tool_calls=False, chat_template_kwargs={"enable_thinking": False})),
    (CHAT, dict(modalities=["text"], best_of=1, use_beam_search=False, length_penalty=1.0,
                early_stopping=False, echo=False, add_special_tokens=False,
                chat_template_kwargs={}, documents=[], continue_final_message=False,
                logits_processors=[], return_tokens_as_token_ids=False,
                return_token_ids=False, mm_processor_kwargs={})),
    (CHAT, dict(response_format={"type": "text"})),
    (CMPL, dict(tools=None, tool_choice="none", suffix=None, best_of=None, prompt_embeds=None)),
    (CMPL, dict(tools=[], suffix="", best_of=1, use_beam_search=False, length_penalty=1,
                add_special_tokens=True)),
    (TOK, dict(tools=[], chat_template_kwargs=None, continue_final_message=False,
               return_token_strs=False)),
    (TOK, dict(chat_template_kwargs={"enable_thinking": False})),
]


@pytest.mark.parametrize("path, fields", HARMLESS,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{i}" for i, (p, _) in enumerate(HARMLESS)])
def test_null_and_off_values_are_accepted(app, path, fields):
    r, = call(app, ("POST", path, {"json": body_for(path, **fields)}))
    assert r.status_code == 200, r.text


IGNORED = dict(user="user-1", metadata={"team": "a"}, store=True, service_tier="auto",
               safety_identifier="hash-1", prompt_cache_key="k-1", prompt_cache_retention="24h",
               prediction={"type": "content", "content": "hello"}, priority=3,
               request_id="my-id", guided_decoding_backend="xgrammar")


def test_fields_ignored_on_purpose_are_accepted_without_a_warning(app, caplog):
    caplog.set_level(logging.WARNING, logger=PROTOCOL_LOGGER)
    chat, cmpl = call(app, ("POST", CHAT, {"json": body_for(CHAT, **IGNORED)}),
                      ("POST", CMPL, {"json": body_for(CMPL, **IGNORED)}))
    assert chat.status_code == 200 and cmpl.status_code == 200, (chat.text, cmpl.text)
    assert not [r for r in caplog.records if r.name == PROTOCOL_LOGGER]
    # what the README lists, the server ignores (and the other way round)
    assert set(IGNORED) - {"user"} == set(protocol.IGNORED_FIELDS)


def test_an_unknown_field_is_ignored_and_logged_once_per_name(app, caplog):
    caplog.set_level(logging.WARNING, logger=PROTOCOL_LOGGER)
    name, other = f"x_unknown_{uuid.uuid4().hex[:8]}", f"x_other_{uuid.uuid4().hex[:8]}"
    responses = call(app, ("POST", CHAT, {"json": body_for(CHAT, **{name: 1})}),
                     ("POST", CHAT, {"json": body_for(CHAT, **{name: {"a": 2}})}),
                     ("POST", CMPL, {"json": body_for(CMPL, **{name: None, other: "x"})}),
                     ("POST", TOK, {"json": body_for(TOK, **{other: True})}))
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    logged = [r for r in caplog.records if r.name == PROTOCOL_LOGGER]
    assert all(r.levelno == logging.WARNING for r in logged)
    assert [r.getMessage() for r in logged if name in r.getMessage()] == [
        f"{CHAT}: unknown request field '{name}' is ignored (logged once per field name)"]
    assert [r.getMessage() for r in logged if other in r.getMessage()] == [
        f"{CMPL}: unknown request field '{other}' is ignored (logged once per field name)"]


def test_unknown_names_are_logged_safely_and_boundedly(monkeypatch, caplog):
    """A client sending hostile or endless names gets neither a raw line in the log nor an
    unbounded set of remembered names."""
    caplog.set_level(logging.WARNING, logger=PROTOCOL_LOGGER)
    monkeypatch.setattr(protocol, "_warned", set())
    monkeypatch.setattr(protocol, "_warned_cap_reached", False)
    monkeypatch.setattr(protocol, "_MAX_WARNED_NAMES", 3)
    hostile = "evil\nINFO forged line \ud800" + "y" * 100
    protocol.CompletionRequest.model_validate({"prompt": "x", hostile: 1})
    for i in range(5):
        protocol.CompletionRequest.model_validate({"prompt": "x", f"n{i}": 1, f"m{i}": 2})
    messages = [r.getMessage() for r in caplog.records if r.name == PROTOCOL_LOGGER]
    assert "\n" not in messages[0] and "\\ud800" in messages[0] and "..." in messages[0]
    assert len(protocol._warned) == 3
    assert len(messages) == 4 and "no more are logged" in messages[-1]


# ---- a live server, raw HTTP: nulls from clients that send every field ---------------------
def test_raw_nulls_are_accepted_by_the_live_server(server):
    from test_server import AUTH
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, "tools": None,
            "tool_choice": None, "functions": None, "function_call": None,
            "response_format": None, "reasoning_effort": None}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
