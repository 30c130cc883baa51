"""Tool calling and reasoning at the response-building level, on canned outputs: the
request side (tools checked, tool_choice resolved against the server's flags, the
grammar of a forced call, which jsonschema holds valid calls to and invalid ones not),
and the output side (ChoiceOutput: the whole message, and the stream split at every
position assembling to the same reasoning, content and calls, in OpenAI's delta shape)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tokenmill.entrypoints.openai.chat_output import ChoiceOutput, chat_finish_reason
from tokenmill.entrypoints.openai.tools import (AUTO_NEEDS_FLAGS, calls_schema, check_tools,
                                                template_messages, tool_plan)
from tokenmill.errors import ParamError
from tokenmill.parsers.registry import get_reasoning_parser

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
NOARGS = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, NOARGS]


def plan(choice="auto", parallel=None, tools=TOOLS, enable=True, parser="hermes"):
    return tool_plan(tools, choice, parallel, enable, parser)


def hermes(name, args) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


# ---- the request side --------------------------------------------------------------------
@pytest.mark.parametrize("tools, where", [
    ([{"type": "function"}], "tools[0].function:"),
    ([{"type": "retrieval", "function": {"name": "f"}}], "tools[0].type:"),
    ([WEATHER, {"type": "function", "function": {"name": ""}}], "tools[1].function.name:"),
    ([WEATHER, WEATHER], "tools[1].function.name:"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
     "tools[0].function.parameters:"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}],
     "tools[0].function.parameters:"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}],
     "tools[0].function.parameters: invalid JSON schema"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}],
     "tools[0].function.description:"),
    (["not a tool"], "tools[0]:"),
])
def test_bad_tool_definitions_name_the_field(tools, where):
    with pytest.raises(ParamError) as e:
        check_tools(tools)
    assert e.value.param == "tools" and str(e.value).startswith(where), str(e.value)


def test_tool_choice_resolution():
    assert plan().mode == "auto" and plan(None).mode == "auto"  # the default with tools
    assert plan("none").mode == "none" and plan("none").output_stream() is None
    assert plan("required").mode == "required"
    named = plan({"type": "function", "function": {"name": "now"}})
    assert named.mode == "named" and named.name == "now"
    assert named.schemas["now"] == {"type": "object", "properties": {}}
    assert tool_plan(None, None, None, False, None) is None
    assert tool_plan([], "none", False, False, None) is None
    for choice, needle in [
            ("auto", AUTO_NEEDS_FLAGS), (None, AUTO_NEEDS_FLAGS),
            ({"type": "function", "function": {"name": "nope"}}, "'nope' is not among"),
            ({"type": "function"}, "a named function is"),
            ("sometimes", "must be"), (["auto"], "must be")]:
        with pytest.raises(ParamError) as e:
            tool_plan(TOOLS, choice, None, False, None)  # a server without the flags
        assert e.value.param == "tool_choice" and needle in str(e.value), str(e.value)
    with pytest.raises(ParamError, match="^tool_choice: needs tools"):
        tool_plan(None, "required", None, True, "hermes")
    # --enable-auto-tool-choice alone is not enough
    with pytest.raises(ParamError, match="--tool-call-parser"):
        tool_plan(TOOLS, "auto", None, True, None)


def test_parsers_with_special_token_markers_keep_them_in_the_text():
    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
    assert plan(parser="mistral").needs_special_tokens
    assert plan(parser="llama3_json").needs_special_tokens
    assert not plan(parser="hermes").needs_special_tokens
    assert not plan("required", parser="mistral").needs_special_tokens  # no parser then
    keep = {"skip_special_tokens": False}
    body = {"messages": [{"role": "user", "content": "x"}]}
    assert not ChatCompletionRequest(**body).to_sampling_params(
        None, defaults=keep).skip_special_tokens
    assert ChatCompletionRequest(**body, skip_special_tokens=True).to_sampling_params(
        None, defaults=keep).skip_special_tokens  # the request's own value wins
    forced = plan("required").grammar()
    sp = ChatCompletionRequest(**body).to_sampling_params(None, forced=forced)
    assert sp.structured_outputs is forced
    with pytest.raises(ValueError, match="^guided_regex: cannot be combined with a tool_choice"):
        ChatCompletionRequest(**body, guided_regex="a+").to_sampling_params(None, forced=forced)


def test_required_schema_accepts_exactly_valid_call_lists():
    schema = calls_schema(check_tools(TOOLS))
    validator = jsonschema.Draft202012Validator(schema)
    good = [[{"name": "get_weather", "parameters": {"city": "Oslo"}}],
            [{"name": "now", "parameters": {}},
             {"name": "get_weather", "parameters": {"city": ""}}]]
    bad = [[], [{"name": "get_weather", "parameters": {}}],  # city required
           [{"name": "get_weather", "parameters": {"city": 1}}],
           [{"name": "other", "parameters": {}}], [{"name": "now"}],
           [{"name": "now", "parameters": {}, "extra": 1}],
           [{"name": "get_weather", "parameters": {"city": "x", "day": 1}}]]
    for value in good:
        assert validator.is_valid(value), value
    for value in bad:
        assert not validator.is_valid(value), value
    one = jsonschema.Draft202012Validator(calls_schema(check_tools(TOOLS), parallel=False))
    assert one.is_valid(good[0]) and not one.is_valid(good[1])
    sop = plan("required", parallel=False).grammar()
    assert sop.json["maxItems"] == 1 and sop.disable_any_whitespace
    assert sop.field_name() == "tools"
    named = plan({"type": "function", "function": {"name": "get_weather"}}).grammar()
    assert named.json == WEATHER["function"]["parameters"]


def test_required_schema_lifts_defs_to_the_top():
    ref_tool = {"type": "function", "function": {"name": "place", "parameters": {
        "type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}}, "required": ["at"],
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}},
                            "required": ["x"]}}}}}
    schema = calls_schema(check_tools([ref_tool, WEATHER]))
    assert set(schema["$defs"]) == {"Point"}
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid([{"name": "place", "parameters": {"at": {"x": 1}}}])
    assert not validator.is_valid([{"name": "place", "parameters": {"at": {"y": 1}}}])
    clash = json.loads(json.dumps(ref_tool))
    clash["function"]["name"] = "other"
    clash["function"]["parameters"]["$defs"]["Point"] = {"type": "string"}
    with pytest.raises(ParamError, match="define \\$defs/Point differently"):
        calls_schema(check_tools([ref_tool, clash]))


def test_template_messages_give_templates_argument_objects():
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
                {"id": "c2", "type": "function", "function": {"name": "now", "arguments": ""}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out = template_messages(msgs)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert out[1]["tool_calls"][1]["function"]["arguments"] == {}
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'  # a copy
    assert out[0] is msgs[0] and out[2] is msgs[2]
    msgs[1]["tool_calls"][0]["function"]["arguments"] = "[1, 2]"
    with pytest.raises(ParamError) as e:
        template_messages(msgs)
    assert e.value.param == "messages"
    assert str(e.value).startswith("messages[1].tool_calls[0].function.arguments:")


# ---- the output side ---------------------------------------------------------------------
def assemble(deltas: list[dict]) -> dict:
    """What a client builds from a stream's deltas: reasoning, content, calls by index."""
    out = {"reasoning": "", "content": "", "calls": {}}
    for d in deltas:
        assert set(d) <= {"reasoning_content", "content", "tool_calls"} and len(d) == 1, d
        out["reasoning"] += d.get("reasoning_content", "")
        out["content"] += d.get("content", "")
        for entry in d.get("tool_calls", ()):
            call = out["calls"].setdefault(entry["index"], {"arguments": ""})
            if "id" in entry:
                assert "id" not in call and entry["type"] == "function"  # named once
                call["id"] = entry["id"]
                call["name"] = entry["function"]["name"]
            call["arguments"] += entry["function"]["arguments"]
    return out


def stream(make, pieces) -> tuple[dict, list]:
    out = make()
    deltas = []
    for p in pieces:
        deltas += out.feed(p)
    deltas += out.finish()
    return assemble(deltas), out.calls


def as_message(got: dict) -> tuple:
    """A stream's assembly in the message's terms (ids aside)."""
    return (got["reasoning"] or None, got["content"] or None,
            [(c["name"], c["arguments"]) for _, c in sorted(got["calls"].items())])


def message_terms(msg: dict) -> tuple:
    return (msg.get("reasoning_content"), msg["content"],
            [(c["function"]["name"], c["function"]["arguments"])
             for c in msg.get("tool_calls", ())])


QWEN3, R1 = get_reasoning_parser("qwen3"), get_reasoning_parser("deepseek_r1")
CANNED = [
    # (name, reasoning parser, starts_in_reasoning, plan, text, (reasoning, content, calls))
    ("hermes text and two calls", None, None, plan(),
     "Checking both.\n" + hermes("get_weather", {"city": "Oslo"}) + "\n" + hermes("now", {}),
     (None, "Checking both.\n",
      [("get_weather", '{"city": "Oslo"}'), ("now", "{}")])),
    ("hermes malformed stays content", None, None, plan(),
     'x <tool_call>\n{"name": "now", "arguments": {,}}\n</tool_call>',
     (None, 'x <tool_call>\n{"name": "now", "arguments": {,}}\n</tool_call>', [])),
    ("parallel false keeps the first", None, None, plan(parallel=False),
     hermes("now", {}) + hermes("get_weather", {"city": "Rome"}) + " done",
     (None, " done", [("now", "{}")])),
    ("thinking then a call", QWEN3, None, plan(),
     "<think>They want weather.</think>\n" + hermes("get_weather", {"city": "Oslo"}),
     ("They want weather.", None, [("get_weather", '{"city": "Oslo"}')])),
    ("r1 thinking, no tools", R1, None, None, "2 + 2 is 4.</think>\n\nFour.",
     ("2 + 2 is 4.", "\n\nFour.", [])),
    ("thinking off by the prompt", QWEN3, False, None, "Just the answer <b>.",
     (None, "Just the answer <b>.", [])),
    ("tool_choice none leaves calls in content", None, None, plan("none"),
     hermes("now", {}), (None, hermes("now", {}), [])),
    ("required: a list of calls", None, None, plan("required"),
     '[{"name":"get_weather","parameters":{"city":"[O]slo"}},{"name":"now","parameters":{}}]',
     (None, None, [("get_weather", '{"city": "[O]slo"}'), ("now", "{}")])),
    ("required cut off inside a call", None, None, plan("required"),
     '[{"name":"now","parameters":{}},{"name":"get_weather","parameters":{"ci',
     (None, None, [("now", "{}")])),
    ("named: the output is the arguments", QWEN3, True, plan(
        {"type": "function", "function": {"name": "get_weather"}}),
     'hmm</think>{"city":"Oslo"}',
     ("hmm", None, [("get_weather", '{"city":"Oslo"}')])),
]


@pytest.mark.parametrize("case", CANNED, ids=[c[0] for c in CANNED])
def test_message_and_stream_split_anywhere_agree(case):
    _, reasoning, starts, tool_plan_, text, expected = case

    def make():
        return ChoiceOutput(reasoning, starts, tool_plan_.output_stream() if tool_plan_
                            else None)

    msg = make().message(text)
    assert msg["role"] == "assistant"
    assert message_terms(msg) == expected
    assert ("reasoning_content" in msg) == (reasoning is not None)
    ids = [c["id"] for c in msg.get("tool_calls", ())]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)
    for i in range(len(text) + 1):
        got, calls = stream(make, [text[:i], text[i:]])
        assert as_message(got) == expected, i
        assert [c["id"] for _, c in sorted(got["calls"].items())] == [c.id for c in calls]
    got, _ = stream(make, list(text))
    assert as_message(got) == expected


def test_plain_output_passes_as_it_is():
    out = ChoiceOutput()
    assert out.plain and out.feed("") == [] and out.feed(" a ") == [{"content": " a "}]
    assert out.finish() == [] and out.calls == []
    assert ChoiceOutput().message("") == {"role": "assistant", "content": ""}


def test_stream_deltas_are_openai_shaped_and_live():
    out = ChoiceOutput(QWEN3, None, plan().output_stream())
    assert out.feed("<think>a") == [{"reasoning_content": "a"}]
    assert out.feed("b</think>Hi ") == [{"reasoning_content": "b"}, {"content": "Hi "}]
    assert out.feed("<tool_call>\n{\"name\": \"now\", ") == []  # a call not closed yet
    deltas = out.feed('"arguments": {}}\n</tool_call>')
    assert deltas == [{"tool_calls": [{"index": 0, "id": out.calls[0].id, "type": "function",
                                       "function": {"name": "now", "arguments": "{}"}}]}]
    assert out.finish() == []
    named = ChoiceOutput(None, None, plan({"type": "function",
                                           "function": {"name": "now"}}).output_stream())
    first = named.feed("{")
    assert first == [{"tool_calls": [{"index": 0, "id": named.calls[0].id, "type": "function",
                                      "function": {"name": "now", "arguments": "{"}}]}]
    assert named.feed("}") == [{"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}]


def test_chat_finish_reason():
    assert chat_finish_reason("stop", [object()]) == "tool_calls"
    assert chat_finish_reason("length", [object()]) == "length"
    assert chat_finish_reason("stop", []) == "stop" and chat_finish_reason(None, []) is None
