"""Tool-call parsers on canned model outputs: the complete parse against hand-written
expectations, and the stream (split at every position, and char by char) assembling to
the same content and calls."""
from __future__ import annotations

import json
import random
import re
import time

import pytest

from tokenmill.parsers.deepseek_v3 import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP
from tokenmill.parsers.qwen3_coder import convert_value
from tokenmill.parsers.registry import TOOL_CALL_PARSERS, get_tool_call_parser
from tokenmill.parsers.tool_calls import ContentDelta, ToolCall, ToolCallDelta, tool_schemas


def call(name, **args):
    return (name, args)


def hermes_block(name, args):
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


UNICODE_ARGS = {"city": "Zürich", "note": "東京 🌧 — naïve", "quote": 'say "hi"\n\tand \\ go'}

# (parser, label, text, content, [(name, arguments)])
HERMES = [
    ("one", hermes_block("get_weather", {"city": "Paris", "unit": "celsius"}), None,
     [call("get_weather", city="Paris", unit="celsius")]),
    ("several", hermes_block("a", {"x": 1}) + "\n" + hermes_block("b", {"y": [1, 2]}) + "\n"
     + hermes_block("c", {}), None, [call("a", x=1), call("b", y=[1, 2]), call("c")]),
    ("text around", "Let me check.\n" + hermes_block("f", {"q": "w"}) + "\nDone.",
     "Let me check.\n\nDone.", [call("f", q="w")]),
    ("blank around", "\n\n" + hermes_block("f", {}) + "\n", None, [call("f")]),
    ("malformed json", '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>', []),
    ("good then malformed", hermes_block("g", {"k": True}) + '\n<tool_call>{"name": "h"'
     '</tool_call>', '\n<tool_call>{"name": "h"</tool_call>', [call("g", k=True)]),
    ("unclosed", 'Hi <tool_call>\n{"name": "f", "arguments": {}}\n',
     'Hi <tool_call>\n{"name": "f", "arguments": {}}\n', []),
    ("unicode", hermes_block("translate", UNICODE_ARGS), None, [call("translate", **UNICODE_ARGS)]),
    ("no name", '<tool_call>\n{"arguments": {}}\n</tool_call>',
     '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
    ("arguments as json text",
     '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
     None, [call("f", a=1)]),
    ("tag inside a string", hermes_block("echo", {"text": "<tool_call> is a tag"}), None,
     [call("echo", text="<tool_call> is a tag")]),
    ("NaN is not JSON", '<tool_call>\n{"name": "f", "arguments": {"a": NaN}}\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": {"a": NaN}}\n</tool_call>', []),
    ("no calls", "Plain text with < and <tool_ and </tool_call> in it <tool_c",
     "Plain text with < and <tool_ and </tool_call> in it <tool_c", []),
    ("blank, no calls", " \n ", " \n ", []),
    ("empty", "", None, []),
]

PT = "<|python_tag|>"
LLAMA = [
    ("one", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [call("get_weather", city="Paris")]),
    ("tag and semicolons", PT + '{"name": "a", "parameters": {}}; {"name": "b", "arguments": '
     '{"x": [1, 2]}} ;{"name": "c", "parameters": {"z": null}}', None,
     [call("a"), call("b", x=[1, 2]), call("c", z=None)]),
    ("text before tag", "Checking." + PT + '{"name": "f", "parameters": {"q": "é"}}',
     "Checking.", [call("f", q="é")]),
    ("text after", '  {"name": "f", "parameters": {}}\nThat is all.', "\nThat is all.",
     [call("f")]),
    ("newline separated", '{"name": "a", "parameters": {}}\n{"name": "b", "parameters": {}}',
     None, [call("a"), call("b")]),
    ("semicolon then text", '{"name": "a", "parameters": {}}; not json', "; not json",
     [call("a")]),
    ("malformed json", '{"name": "f", "parameters": {"a": }}',
     '{"name": "f", "parameters": {"a": }}', []),
    ("an answer, not a call", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ("unclosed", '{"name": "f", "parameters": {"a": "b"', '{"name": "f", "parameters": {"a": "b"',
     []),
    ("unicode", PT + json.dumps({"name": "t", "parameters": UNICODE_ARGS}, ensure_ascii=False),
     None, [call("t", **UNICODE_ARGS)]),
    ("builtin tool text", PT + 'brave_search.call(query="x")',
     PT + 'brave_search.call(query="x")', []),
    ("json in prose", 'Here: {"name": "f", "parameters": {}}',
     'Here: {"name": "f", "parameters": {}}', []),
    ("braces in strings", '{"name": "f", "parameters": {"s": "}{][\\"\\\\"}}', None,
     [call("f", s='}{]["\\')]),
    ("no calls", "Hello <|python_t", "Hello <|python_t", []),
]

TC = "[TOOL_CALLS]"
MISTRAL = [
    ("one, list", TC + ' [{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
     [call("get_weather", city="Paris")]),
    ("two, list", TC + '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": '
     '"{\\"y\\": 2}"}]', None, [call("a", x=1), call("b", y=2)]),
    ("one, named", TC + 'get_weather[ARGS]{"city": "Paris"}', None,
     [call("get_weather", city="Paris")]),
    ("two, named", TC + 'a[ARGS]{"x": 1}' + TC + 'b[ARGS]{"y": [true, null]}', None,
     [call("a", x=1), call("b", y=[True, None])]),
    ("text around", "Sure, checking." + TC + 'f[ARGS]{"q": 1} Anything else?',
     "Sure, checking. Anything else?", [call("f", q=1)]),
    ("unclosed list", TC + ' [{"name": "f", "arguments": {"a": 1}]',
     TC + ' [{"name": "f", "arguments": {"a": 1}]', []),
    ("malformed named", TC + 'f[ARGS]{"a": tru}', TC + 'f[ARGS]{"a": tru}', []),
    ("good then malformed", TC + 'f[ARGS]{}' + TC + 'g[ARG]{}', TC + 'g[ARG]{}', [call("f")]),
    ("marker in prose", "Use [TOOL_CALLS] to call.", "Use [TOOL_CALLS] to call.", []),
    ("unicode", TC + "t[ARGS]" + json.dumps(UNICODE_ARGS, ensure_ascii=False), None,
     [call("t", **UNICODE_ARGS)]),
    ("list item not a call", TC + '[{"name": "a", "arguments": {}}, 3]',
     TC + '[{"name": "a", "arguments": {}}, 3]', []),
    ("no calls", "Almost [TOOL_CALL", "Almost [TOOL_CALL", []),
]


def ds_call(name, args, v31=False):
    js = json.dumps(args, ensure_ascii=False)
    if v31:
        return f"{CALL_BEGIN}{name}{SEP}{js}{CALL_END}"
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{js}\n```{CALL_END}"


DEEPSEEK = [
    ("one", CALLS_BEGIN + ds_call("get_weather", {"city": "Paris"}) + CALLS_END, None,
     [call("get_weather", city="Paris")]),
    ("two", CALLS_BEGIN + ds_call("a", {"x": 1}) + "\n" + ds_call("b", {}) + CALLS_END, None,
     [call("a", x=1), call("b")]),
    ("text around", "Let me look.\n\n" + CALLS_BEGIN + ds_call("f", {"q": [1]}) + CALLS_END
     + "\nHere you go.", "Let me look.\n\n\nHere you go.", [call("f", q=[1])]),
    ("v3.1 body", CALLS_BEGIN + ds_call("get_weather", {"city": "Rome"}, v31=True) + CALLS_END,
     None, [call("get_weather", city="Rome")]),
    ("good then malformed", CALLS_BEGIN + ds_call("a", {}) + f"{CALL_BEGIN}function{SEP}b\n"
     f"```json\n{{\"x\": }}\n```{CALL_END}" + CALLS_END,
     f"{CALL_BEGIN}function{SEP}b\n```json\n{{\"x\": }}\n```{CALL_END}", [call("a")]),
    ("unclosed call", CALLS_BEGIN + f"{CALL_BEGIN}function{SEP}f\n```json\n{{\"a\": 1}}",
     f"{CALL_BEGIN}function{SEP}f\n```json\n{{\"a\": 1}}", []),
    ("no section end", CALLS_BEGIN + ds_call("a", {"k": "v"}), None, [call("a", k="v")]),
    ("unicode", CALLS_BEGIN + ds_call("t", UNICODE_ARGS) + CALLS_END, None,
     [call("t", **UNICODE_ARGS)]),
    ("no calls", "Nothing <｜tool▁calls", "Nothing <｜tool▁calls", []),
]

WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "ratio": {"type": "number"}, "tags": {"type": "array"}, "opts": {"type": "object"},
        "note": {"type": ["string", "null"]}}}}}]


def coder_block(name, params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


QWEN3_CODER = [
    ("one, typed", coder_block("get_weather", [
        ("city", "Paris"), ("days", "3"), ("metric", "True"), ("ratio", "0.5"),
        ("tags", '["a", "b"]'), ("opts", "{'deep': True}"), ("note", "null")]), None,
     [call("get_weather", city="Paris", days=3, metric=True, ratio=0.5, tags=["a", "b"],
           opts={"deep": True}, note=None)]),
    ("two", coder_block("get_weather", [("city", "Oslo")]) + "\n"
     + coder_block("other", [("days", "3")]), None,
     [call("get_weather", city="Oslo"), call("other", days="3")]),
    ("text around", "I will look it up.\n\n" + coder_block("get_weather", [("days", "two")])
     + "\nOK?", "I will look it up.\n\n\nOK?", [call("get_weather", days="two")]),
    ("multi-line value", coder_block("write", [("code", "def f():\n    return a < b\n")]), None,
     [call("write", code="def f():\n    return a < b\n")]),
    ("last closing tag left out", "<tool_call>\n<function=get_weather>\n<parameter=days>\n7\n"
     "</function>\n</tool_call>", None, [call("get_weather", days=7)]),
    ("no parameters", "<tool_call>\n<function=ping>\n</function>\n</tool_call>", None,
     [call("ping")]),
    ("no function close", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
     "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>", []),
    ("unclosed", "x " + "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>",
     "x <tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>", []),
    ("unicode", coder_block("get_weather", [("city", "Zürich 東京 🌧"), ("note", 'say "hi"')]),
     None, [call("get_weather", city="Zürich 東京 🌧", note='say "hi"')]),
]

CASES = ([("hermes",) + c for c in HERMES] + [("llama3_json",) + c for c in LLAMA]
         + [("mistral",) + c for c in MISTRAL] + [("deepseek_v3",) + c for c in DEEPSEEK]
         + [("qwen3_coder",) + c for c in QWEN3_CODER])
IDS = [f"{c[0]}-{c[1]}" for c in CASES]
TOOLS = {"qwen3_coder": WEATHER_TOOLS}


def assemble(deltas):
    """Content and calls from a stream's deltas, checking OpenAI's order on the way: a
    call's first delta names it (index, id, name), later ones carry arguments only."""
    content, calls = "", []
    for d in deltas:
        if isinstance(d, ContentDelta):
            assert d.text
            content += d.text
            continue
        assert isinstance(d, ToolCallDelta)
        if d.index == len(calls):
            assert d.id and d.name and d.arguments == ""
            assert d.to_openai()["type"] == "function"
            calls.append([d.name, ""])
        else:
            assert d.index == len(calls) - 1 and d.id is None and d.name is None
            calls[-1][1] += d.arguments
    return content or None, [tuple(c) for c in calls]


def run_stream(parser, pieces, tools=None):
    stream = parser.streaming(tools)
    deltas = []
    for piece in pieces:
        deltas += stream.feed(piece)
    deltas += stream.finish()
    return assemble(deltas)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_complete_parse(case):
    name, _, text, content, calls = case
    result = get_tool_call_parser(name).parse(text, TOOLS.get(name))
    assert result.content == content
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == calls
    for c in result.calls:  # the arguments are JSON of an object, non-ASCII as is
        assert isinstance(json.loads(c.arguments), dict)
        assert c.arguments == json.dumps(json.loads(c.arguments), ensure_ascii=False)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_stream_split_anywhere_equals_complete(case):
    name, _, text, _, _ = case
    parser, tools = get_tool_call_parser(name), TOOLS.get(name)
    result = parser.parse(text, tools)
    expected = (result.content, [(c.name, c.arguments) for c in result.calls])
    for i in range(len(text) + 1):
        assert run_stream(parser, [text[:i], text[i:]], tools) == expected, i
    assert run_stream(parser, list(text), tools) == expected
    rng = random.Random(len(text))
    for _ in range(20):  # a few random many-piece splits
        cuts = sorted(rng.sample(range(len(text) + 1), min(6, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert run_stream(parser, pieces, tools) == expected, cuts


def test_mutated_outputs_never_raise_and_stream_alike():
    """Canned outputs with characters cut, pasted from other formats, or added: every
    parser keeps its promise (no exception; a split stream equals the complete parse)."""
    rng = random.Random(34)
    for _ in range(300):
        name, _, text, _, _ = rng.choice(CASES)
        other = rng.choice(CASES)[2]
        for _ in range(rng.randint(1, 3)):
            i = rng.randint(0, len(text))
            op = rng.randrange(3)
            if op == 0:
                text = text[:i] + text[rng.randint(i, min(len(text), i + 5)):]
            elif op == 1:
                text = text[:i] + other[rng.randint(0, len(other)):][:30] + text[i:]
            else:
                text = text[:i] + rng.choice('{}[]"\\;\n <>') + text[i:]
        parser, tools = get_tool_call_parser(name), TOOLS.get(name)
        result = parser.parse(text, tools)
        expected = (result.content, [(c.name, c.arguments) for c in result.calls])
        for i in rng.sample(range(len(text) + 1), min(3, len(text) + 1)):
            assert run_stream(parser, [text[:i], text[i:]], tools) == expected, (text, i)
        assert run_stream(parser, list(text), tools) == expected, text


# ---- the stream streams: content and calls as soon as they are decided -----------------

def fed(parser, pieces, tools=None):
    stream = parser.streaming(tools)
    return [stream.feed(p) for p in pieces], stream


@pytest.mark.parametrize("name, before, call_text, after", [
    ("hermes", "Let me check. ", hermes_block("f", {"a": 1}), "tail"),
    ("qwen3_coder", "Let me check. ", coder_block("f", [("a", "1")]), "tail"),
    ("llama3_json", "Let me check. " + PT, '{"name": "f", "parameters": {"a": 1}}', "; tail"),
    ("mistral", "Let me check. ", TC + 'f[ARGS]{"a": 1}', "tail"),
    ("mistral", "Let me check. ", TC + '[{"name": "f", "arguments": {"a": 1}}]', "tail"),
    ("deepseek_v3", "Let me check. ", CALLS_BEGIN + ds_call("f", {"a": 1}), CALLS_END + "tail"),
])
def test_deltas_come_when_decided(name, before, call_text, after):
    parser = get_tool_call_parser(name)
    cut = len(call_text) // 2
    outs, stream = fed(parser, [before, call_text[:cut], call_text[cut:], after])
    assert outs[0] == [ContentDelta("Let me check. ")]  # before the call's end, at once
    assert outs[1] == []  # half a call: nothing yet
    first, args = outs[2]  # the call the moment it closes: its name, then its arguments
    assert (first.index, first.name, first.arguments) == (0, "f", "")
    value = "1" if name == "qwen3_coder" else 1  # no tools given: qwen3_coder keeps text
    assert (args.index, json.loads(args.arguments)) == (0, {"a": value})
    assert stream.calls[0].id == first.id


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_long_call_streams_in_linear_time(name):
    """A 20k-character call fed 4 characters at a time: each feed goes on where the last
    stopped (a rescan of the whole call per token took seconds: quadratic)."""
    args = {"items": [{"k": i, "v": 'x"y{[' * 3} for i in range(600)]}
    text = {"hermes": hermes_block("f", args),
            "llama3_json": json.dumps({"name": "f", "parameters": args}),
            "mistral": TC + "f[ARGS]" + json.dumps(args),
            "deepseek_v3": CALLS_BEGIN + ds_call("f", args) + CALLS_END,
            "qwen3_coder": coder_block("f", [("items", json.dumps(args["items"]))])}[name]
    parser = get_tool_call_parser(name)
    start = time.perf_counter()
    stream = parser.streaming()
    for i in range(0, len(text), 4):
        stream.feed(text[i:i + 4])
    stream.finish()
    assert time.perf_counter() - start < 2.0  # ~0.02 s; the quadratic scan took ~5 s
    assert len(stream.calls) == 1


@pytest.mark.parametrize("name, tag", [("hermes", "<tool_call>"), ("mistral", TC),
                                       ("llama3_json", PT), ("deepseek_v3", CALLS_BEGIN)])
def test_partial_marker_held_then_released(name, tag):
    parser = get_tool_call_parser(name)
    (out1, out2), stream = fed(parser, ["Hi " + tag[:5], "x" + tag[6:]])
    assert out1 == [ContentDelta("Hi ")]  # the partial marker held back
    assert out2 == [ContentDelta(tag[:5] + "x" + tag[6:])]  # not a marker after all
    assert stream.finish() == []


# ---- qwen3_coder: parameter values by the schema's type ---------------------------------

@pytest.mark.parametrize("value, schema, expected", [
    ("42", {"type": "integer"}, 42),
    ("-7", {"type": "integer"}, -7),
    ("4.0", {"type": "integer"}, "4.0"),
    ("forty", {"type": "integer"}, "forty"),
    ("2.5", {"type": "number"}, 2.5),
    ("3", {"type": "number"}, 3),
    ("1e400", {"type": "number"}, "1e400"),  # not finite: kept as written
    ("NaN", {"type": "number"}, "NaN"),
    ("TRUE", {"type": "boolean"}, True),
    ("false", {"type": "boolean"}, False),
    ("yes", {"type": "boolean"}, "yes"),
    ('{"a": [1, null]}', {"type": "object"}, {"a": [1, None]}),
    ("{'a': None, 'b': (1, 2)}", {"type": "object"}, {"a": None, "b": [1, 2]}),
    ("[1, 2]", {"type": "object"}, "[1, 2]"),
    ("[1, 'x']", {"type": "array"}, [1, "x"]),
    ("{1, 2}", {"type": "array"}, "{1, 2}"),  # a Python set is no JSON value
    ("null", {"type": ["integer", "null"]}, None),
    ("5", {"type": ["null", "integer"]}, 5),
    ("5", {"type": ["string", "integer"]}, 5),
    ("5", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, 5),
    ("5", {"type": "string"}, "5"),
    ("5", {}, "5"),
    ("5", None, "5"),
    (" 5 ", {"type": "integer"}, 5),
])
def test_qwen3_coder_values(value, schema, expected):
    got = convert_value(value, schema)
    assert got == expected and type(got) is type(expected)


def test_qwen3_coder_types_from_pydantic_tools_and_unknown_names():
    class Tool:  # what a pydantic request model hands over
        def model_dump(self):
            return WEATHER_TOOLS[0]
    text = coder_block("get_weather", [("days", "3")]) + coder_block("nope", [("days", "3")])
    result = get_tool_call_parser("qwen3_coder").parse(text, [Tool()])
    assert [json.loads(c.arguments) for c in result.calls] == [{"days": 3}, {"days": "3"}]
    without = get_tool_call_parser("qwen3_coder").parse(text)  # no tools: strings
    assert [json.loads(c.arguments) for c in without.calls] == [{"days": "3"}, {"days": "3"}]


# ---- shapes, ids, registry ---------------------------------------------------------------

def test_openai_shapes_and_ids():
    result = get_tool_call_parser("hermes").parse(hermes_block("a", {}) + hermes_block("b", {}))
    ids = [c.id for c in result.calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == 2
    assert result.calls[0].to_openai() == {"id": ids[0], "type": "function",
                                           "function": {"name": "a", "arguments": "{}"}}
    assert ToolCallDelta(1, id="call_x", name="f").to_openai() == {
        "index": 1, "id": "call_x", "type": "function",
        "function": {"name": "f", "arguments": ""}}
    assert ToolCallDelta(1, arguments='{"a"').to_openai() == {
        "index": 1, "function": {"arguments": '{"a"'}}
    mistral = get_tool_call_parser("mistral").parse(TC + "a[ARGS]{}" + TC + "b[ARGS]{}")
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in mistral.calls)
    assert ToolCall("a", "{}", id="x") == ToolCall("a", "{}", id="y")  # ids aside


def test_registry():
    assert sorted(TOOL_CALL_PARSERS) == ["deepseek_v3", "hermes", "llama3_json", "mistral",
                                         "qwen3_coder"]
    with pytest.raises(ValueError, match="hermes"):
        get_tool_call_parser("nope")
    # markers that are special tokens need the output detokenized with them kept
    assert get_tool_call_parser("mistral").needs_special_tokens
    assert not get_tool_call_parser("hermes").needs_special_tokens


def test_stream_lifecycle():
    stream = get_tool_call_parser("hermes").streaming()
    assert stream.feed("a") == [ContentDelta("a")]
    assert stream.finish() == []
    assert stream.finish() == []
    with pytest.raises(RuntimeError):
        stream.feed("b")


def test_tool_schemas():
    assert tool_schemas(None) == {}
    assert tool_schemas([{"type": "function", "function": {"name": "f"}}, "junk",
                         {"name": "g", "parameters": {"type": "object"}}]) == {
        "f": {}, "g": {"type": "object"}}
