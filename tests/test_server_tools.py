"""Tool calling through the official openai client against a live server on the demo
model, with a chat template that renders tools (tool_chat.py) and the hermes parser.

The demo model's weights are random: it calls no tool by itself. Named and `required`
calls are forced by the grammar, so their arguments validate (jsonschema) whatever the
model does; the `auto` path is driven by a one-string guided_choice that makes the model
write a canned Hermes output, which the server parses like any other."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

openai = pytest.importorskip("openai")

from inprocess_app import async_llm, call  # noqa: E402,F401 (a fixture)
from live_server import live_server  # noqa: E402
from tool_chat import ADD, SCHEMAS, TOOL_TEMPLATE, TOOLS, WEATHER  # noqa: E402

MODEL = "demo-tools"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]
SEEDS = (1, 2, 3)
FORCED = dict(temperature=1.0, max_tokens=200)


@pytest.fixture(scope="module")
def server(demo_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    template = folder / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    with live_server(demo_path, folder / "server.log", "--served-model-name", MODEL,
                     "--dtype", "float32", "--max-model-len", "1024", "--num-kv-blocks", "256",
                     "--chat-template", str(template), "--enable-auto-tool-choice",
                     "--tool-call-parser", "hermes", "--log-stats-interval", "0") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=120)


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def check_call(call, names=tuple(SCHEMAS)) -> dict:
    """A tool call of the response: OpenAI's shape, a known name, arguments valid for that
    tool's parameters (the independent check: jsonschema, not the grammar)."""
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
    assert call.function.name in names
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def stream_assembled(client, **kwargs):
    """(content, [(name, arguments)], finish_reason, ids) from a streamed response, put
    together from its deltas as a client does; every tool_calls entry checked."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            for entry in d.tool_calls or ():
                got = calls.setdefault(entry.index, {"name": None, "arguments": "", "id": None})
                if entry.id is not None:
                    assert got["id"] is None and entry.type == "function"
                    got["id"], got["name"] = entry.id, entry.function.name
                else:
                    assert entry.function.name is None  # the name comes once, first
                got["arguments"] += entry.function.arguments or ""
            if choice.finish_reason is not None:
                finish = choice.finish_reason
    ordered = [calls[i] for i in sorted(calls)]
    assert sorted(calls) == list(range(len(calls)))  # indexes 0, 1, ... in order
    return (content or None, [(c["name"], c["arguments"]) for c in ordered], finish,
            [c["id"] for c in ordered])


# ---- forced calls: named and required --------------------------------------------------------
@pytest.mark.parametrize("tool", [WEATHER, ADD], ids=lambda t: t["function"]["name"])
def test_named_tool_choice_gives_a_valid_call(client, tool):
    name = tool["function"]["name"]
    for seed in SEEDS:
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                           tool_choice=named(name), seed=seed, **FORCED)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0], names=(name,))


def test_required_gives_valid_calls(client):
    for seed in SEEDS:
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                           tool_choice="required", seed=seed, **FORCED)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and choice.message.tool_calls
        for tool_call in choice.message.tool_calls:
            check_call(tool_call)
        ids = [c.id for c in choice.message.tool_calls]
        assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("choice", ["required", named("add")], ids=["required", "named"])
def test_streamed_deltas_assemble_to_the_same_calls(client, choice):
    for seed in SEEDS[:2]:
        kw = dict(messages=USER, tools=TOOLS, tool_choice=choice, seed=seed, **FORCED)
        whole = client.chat.completions.create(model=MODEL, **kw).choices[0]
        content, calls, finish, ids = stream_assembled(client, **kw)
        assert content is None and finish == "tool_calls" == whole.finish_reason
        assert calls == [(c.function.name, c.function.arguments)
                         for c in whole.message.tool_calls]
        assert all(i.startswith("call_") for i in ids)


def test_parallel_tool_calls_false_gives_one_call(client):
    for seed in SEEDS:
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False,
                                           seed=seed, **FORCED)
        assert len(r.choices[0].message.tool_calls) == 1
        check_call(r.choices[0].message.tool_calls[0])
    # auto: the parser finds two calls, the first is kept
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                       parallel_tool_calls=False,
                                       extra_body={"guided_choice": [CANNED]}, max_tokens=300)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]


# ---- auto: the hermes parser on a canned output the grammar makes the model write ----------
CANNED = ("Let me look that up.\n<tool_call>\n"
          '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40, "exact": true}}\n'
          "</tool_call>")


def test_auto_parses_the_models_calls(client):
    kw = dict(messages=USER, tools=TOOLS, extra_body={"guided_choice": [CANNED]},
              max_tokens=300)  # tool_choice left out: "auto", the default with tools
    r = client.chat.completions.create(model=MODEL, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look that up.\n"
    calls = choice.message.tool_calls
    assert [check_call(c) for c in calls] == [{"city": "Oslo", "unit": "c"},
                                              {"a": 2, "b": 40, "exact": True}]
    content, streamed, finish, _ = stream_assembled(client, tool_choice="auto", **kw)
    assert (content, finish) == ("Let me look that up.\n", "tool_calls")
    assert streamed == [(c.function.name, c.function.arguments) for c in calls]


def test_each_choice_has_its_own_parser(client):
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, n=3,
                                       temperature=1.0, seed=5, max_tokens=300,
                                       extra_body={"guided_choice": [CANNED]})
    assert len(r.choices) == 3
    for choice in r.choices:
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather", "add"]
    ids = [c.id for choice in r.choices for c in choice.message.tool_calls]
    assert len(set(ids)) == len(ids)
    # required, n = 2, streamed: every choice's calls validate
    seen = set()
    for chunk in client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, n=2,
                                                tool_choice="required", seed=7, stream=True,
                                                **FORCED):
        for choice in chunk.choices:
            for entry in choice.delta.tool_calls or ():
                if entry.id:
                    seen.add((choice.index, entry.index))
    assert {i for i, _ in seen} == {0, 1}


def test_tool_choice_none_gives_content(client):
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, seed=1)
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                       tool_choice="none", max_tokens=8, seed=1,
                                       extra_body={"guided_choice": [CANNED]})
    choice = r.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    assert CANNED.startswith(choice.message.content)  # the call's text left as it is
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools are in the prompt


# ---- the next turn --------------------------------------------------------------------------
def test_follow_up_turn_with_the_tool_result_is_accepted(server, client):
    first = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                           tool_choice=named("get_weather"), seed=1, **FORCED)
    assistant = first.choices[0].message
    call = assistant.tool_calls[0]
    messages = [*USER, assistant.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    for choice, max_tokens in (("auto", 8), ("none", 8), ("required", 200)):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           tool_choice=choice, seed=2, temperature=1.0,
                                           max_tokens=max_tokens)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert r.usage.prompt_tokens > first.usage.prompt_tokens  # the turn and the result
    # what the model read: the call's arguments as an object, and the result
    tokens = httpx.post(f"{server.url}/tokenize", timeout=30,
                        json={"model": MODEL, "messages": messages, "tools": TOOLS}).json()
    text = httpx.post(f"{server.url}/detokenize", timeout=30,
                      json={"model": MODEL, "tokens": tokens["tokens"]}).json()["prompt"]
    rendered = json.dumps(json.loads(call.function.arguments), ensure_ascii=False)
    assert f'"arguments": {rendered}' in text
    assert f'<tool_response id="{call.id}">\nsunny, 21 C\n</tool_response>' in text
    assert '"name": "get_weather"' in text and "<tools>" in text


# ---- refusals --------------------------------------------------------------------------------
def _error(exc_info, param: str) -> str:
    e = exc_info.value
    assert e.status_code == 400
    body = e.response.json()["error"]
    assert body["param"] == param and body["code"] == 400, body
    return body["message"]


@pytest.mark.parametrize("kwargs, param, needle", [
    (dict(tools=TOOLS, tool_choice=named("nope")), "tool_choice", "'nope' is not among"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]), "tools", "tools[0].function.parameters:"),
    (dict(tools=TOOLS, tool_choice="required",
          response_format={"type": "json_object"}), "response_format", "cannot be combined"),
    (dict(tools=TOOLS, extra_body={"chat_template_kwargs": {"tokenize": False}}),
     "chat_template_kwargs", "'tokenize'"),
    (dict(messages=[*USER, {"role": "tool", "content": "x"}]), "messages",
     "messages[1].tool_call_id:"),
    (dict(extra_body={"functions": [WEATHER["function"]]}), "functions", "legacy"),
])
def test_refusals_name_the_field(client, kwargs, param, needle):
    kwargs = {"messages": USER, **kwargs}
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, max_tokens=4, **kwargs)
    assert needle in _error(ei, param)


# ---- servers started otherwise (in process: the app on an engine, no socket) ----------------
@pytest.fixture(scope="module")
def app_without_flags(async_llm):
    from tokenmill.entrypoints.openai.context import ServerOptions
    from tokenmill.entrypoints.openai.server import build_app
    return build_app(async_llm, MODEL, options=ServerOptions(chat_template=TOOL_TEMPLATE))


def test_auto_without_the_flags_is_a_400_naming_them(app_without_flags):
    """No --enable-auto-tool-choice / --tool-call-parser: "auto" (and tools without a
    tool_choice, which means auto) is a 400 naming the flags; "none" is served."""
    base = {"model": MODEL, "messages": USER, "tools": TOOLS, "max_tokens": 1}
    auto, default, none = call(app_without_flags,
                               ("POST", CHAT, {"json": {**base, "tool_choice": "auto"}}),
                               ("POST", CHAT, {"json": base}),
                               ("POST", CHAT, {"json": {**base, "tool_choice": "none"}}))
    for r in (auto, default):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "tool_choice", err
        assert "--enable-auto-tool-choice" in err["message"]
        assert "--tool-call-parser" in err["message"]
    assert none.status_code in (200, 400), none.text
    if none.status_code == 400:  # the tools may not fit this engine's 256 tokens
        assert none.json()["error"]["param"] == "prompt", none.text


def test_a_template_without_tools_is_a_400(async_llm):
    """The demo model's own template has no place for tools: they would silently be left
    out of the prompt."""
    from tokenmill.entrypoints.openai.server import build_app
    r, = call(build_app(async_llm, MODEL),
              ("POST", CHAT, {"json": {"model": MODEL, "messages": USER, "tools": TOOLS,
                                       "tool_choice": "none", "max_tokens": 1}}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools" and "does not render tools" in err["message"], err


def test_parser_flags_are_checked_at_start(capsys):
    """An unknown parser name stops `tokenmill serve` before anything loads, listing the
    valid ones; so does --enable-auto-tool-choice without a parser."""
    from tokenmill.entrypoints.cli import main
    for argv, needle in [
            (["--tool-call-parser", "bogus"], "(choose from 'deepseek_v3', 'hermes', "
                                              "'llama3_json', 'mistral', 'qwen3_coder')"),
            (["--reasoning-parser", "o1"], "(choose from 'deepseek_r1', 'qwen3')")]:
        with pytest.raises(SystemExit) as e:
            main(["serve", *argv])
        assert e.value.code == 2 and needle in capsys.readouterr().err
    assert main(["serve", "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
    assert main(["serve", "--chat-template", "/no/such/file"]) == 2
