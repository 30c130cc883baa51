"""Tool calling in a chat request, as vLLM serves it: the `tools` checked, `tool_choice`
resolved against the server's flags into a `ToolPlan`, the grammar that forces a
`required` or named call, and the stream that turns each choice's output into calls.

* `none`: the tools are in the prompt, the output is content.
* `auto`: the output goes through `--tool-call-parser` (tokenmill.parsers); needs
  `--enable-auto-tool-choice` too, as in vLLM. The default when tools are given.
* `required`: the grammar of a JSON list of calls, `[{"name": ..., "parameters": {...}}]`,
  each name bound to its own tool's parameters schema; at least one call.
* a named function: the grammar of that function's parameters; the output is its
  arguments, streamed as they come.

Forced calls (required, named) need no parser: the grammar guarantees their shape, and
their arguments validate against the tool's schema whatever the model.
`parallel_tool_calls: false` keeps one call (required: the grammar allows one).

Nothing here needs the server: the offline `LLM.chat` takes the same tools and choices.
Errors are ParamErrors naming the request field (the server's 400s)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from tokenmill.errors import ParamError
from tokenmill.parsers.registry import get_tool_call_parser
from tokenmill.parsers.scanning import JsonExtent, call_from_json
from tokenmill.parsers.tool_calls import (StreamingToolParser, ToolCall, ToolCallDelta,
                                          ToolCallScanner, openai_call_id)
from tokenmill.structured_output.backend import check_json_schema
from tokenmill.structured_output.params import StructuredOutputsParams

AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    '--tool-call-parser to be set')
_SCHEMA_DEFS = ("$defs", "definitions")  # where a schema keeps what its $refs name


def _bad(param: str, message: str) -> ParamError:
    return ParamError(param, message)  # the server's 400 naming `param`


def check_tools(tools) -> dict[str, dict]:
    """The request's `tools` (OpenAI's shape) -> name -> parameters JSON schema (an object
    schema; {} parameters when left out). A 400 naming the tool's field otherwise."""
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad("tools", f"{where}: must be an object")
        if tool.get("type") != "function":
            raise _bad("tools", f"{where}.type: must be \"function\", got "
                                f"{ascii(tool.get('type'))[:40]}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad("tools", f"{where}.function: must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip():
            raise _bad("tools", f"{where}.function.name: must be a non-empty string")
        if name in schemas:
            raise _bad("tools", f"{where}.function.name: {ascii(name)[:80]} is offered twice")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _bad("tools", f"{where}.function.description: must be a string")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise _bad("tools", f"{where}.function.parameters: must be a JSON schema of "
                                f"type \"object\"")
        try:
            check_json_schema(params, f"{where}.function.parameters")
        except ValueError as e:
            raise _bad("tools", str(e)) from None
        schemas[name] = {"type": "object", **params}
    return schemas


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tool calling."""
    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict]  # as the chat template gets them
    schemas: dict[str, dict] = field(repr=False)
    name: str | None = None  # the named function
    parallel: bool = True  # parallel_tool_calls
    parser_name: str | None = None  # auto: --tool-call-parser

    @property
    def needs_special_tokens(self) -> bool:
        """auto with a parser whose markers are special tokens: detokenize with them."""
        return self.mode == "auto" and get_tool_call_parser(self.parser_name).needs_special_tokens

    def grammar(self) -> StructuredOutputsParams | None:
        """The grammar of a forced call (required, named); None otherwise."""
        if self.mode == "named":
            schema = self.schemas[self.name]
        elif self.mode == "required":
            schema = calls_schema(self.schemas, self.parallel)
        else:
            return None
        sop = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        sop._origin = "tools"  # a schema xgrammar refuses is the tools' fault
        return sop

    def output_stream(self):
        """A new stream of one choice's calls (feed / finish -> deltas, `calls`), or None
        when the output is content only."""
        if self.mode == "auto":
            stream = get_tool_call_parser(self.parser_name).streaming(self.tools)
        elif self.mode == "required":
            stream = StreamingToolParser(CallListScanner(self.schemas), openai_call_id)
        elif self.mode == "named":
            stream = NamedCallStream(self.name)
        else:
            return None
        return stream if self.parallel else FirstCallOnly(stream)


def tool_plan(tools, tool_choice, parallel_tool_calls, enable_auto: bool,
              parser_name: str | None) -> ToolPlan | None:
    """The request's tool fields against the server's flags; None without tools (and a
    tool_choice that asks for none). A 400 naming the field otherwise."""
    if not tools:
        if tool_choice is None or tool_choice == "none":
            return None
        raise _bad("tool_choice", "tool_choice: needs tools (the request has none)")
    schemas = check_tools(tools)
    parallel = parallel_tool_calls is not False
    name = None
    if tool_choice is None:
        tool_choice = "auto"  # OpenAI's default with tools, as in vLLM
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise _bad("tool_choice", 'tool_choice: a named function is {"type": "function", '
                                      '"function": {"name": ...}}')
        if name not in schemas:
            raise _bad("tool_choice", f"tool_choice: the function {ascii(name)[:80]} is not "
                                      f"among the request's tools")
        mode = "named"
    elif tool_choice in ("none", "auto", "required"):
        mode = tool_choice
    else:
        raise _bad("tool_choice", f'tool_choice: must be "none", "auto", "required" or a '
                                  f'named function, got {ascii(tool_choice)[:40]}')
    if mode == "auto" and not (enable_auto and parser_name):
        raise _bad("tool_choice", f"tool_choice: {AUTO_NEEDS_FLAGS}")
    return ToolPlan(mode, list(tools), schemas, name, parallel,
                    parser_name if mode == "auto" else None)


def calls_schema(schemas: dict[str, dict], parallel: bool = True) -> dict:
    """The JSON schema of `required`'s output: a list of calls, each an object naming one
    tool with that tool's parameters. The tools' $defs move to the top, where their
    `#/$defs/...` references point once the schemas are nested."""
    top: dict[str, dict] = {}
    variants = []
    for name, params in schemas.items():
        params = dict(params)
        for key in _SCHEMA_DEFS:
            for def_name, definition in (params.pop(key, None) or {}).items():
                seen = top.setdefault(key, {}).setdefault(def_name, definition)
                if seen != definition:
                    raise _bad("tools", f"tools: two tools define {key}/{def_name} "
                                        f"differently; tool_choice \"required\" needs them "
                                        f"equal")
        variants.append({"type": "object",
                         "properties": {"name": {"type": "string", "enum": [name]},
                                        "parameters": params},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "items": {"anyOf": variants}, "minItems": 1, **top}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class CallListScanner(ToolCallScanner):
    """`required`'s output, the list of calls, cut into calls as each one closes; the
    list's own punctuation is dropped (the grammar leaves no other text)."""

    def __init__(self, schemas):
        super().__init__(schemas)
        self.extent = JsonExtent()

    def scan(self, text: str, final: bool):
        out, pos = [], 0
        while True:
            while pos < len(text) and text[pos] in " \t\r\n[,]":
                pos += 1
            if pos == len(text):
                return out, pos
            if text[pos] != "{":  # not the grammar's output: nothing to take from it
                return out, len(text)
            end = self.extent.end(text, pos, self.offset)
            if end is None:
                return out, (len(text) if final else pos)  # final: cut off inside a call
            try:
                # not strict: xgrammar 0.2.9 lets a string with maxLength hold raw control
                # characters; the arguments are dumped again, escaped
                obj = json.loads(text[pos:end], strict=False)
            except ValueError:
                return out, len(text)
            pos = end
            call = call_from_json(obj, ("parameters",), need_args=True)
            if call is not None:
                out.append(call)


class NamedCallStream:
    """The named function's call: its output is the arguments, streamed as they come
    (the call's id and name with the first text)."""

    def __init__(self, name: str):
        self.name = name
        self.calls: list[ToolCall] = []
        self._arguments: list[str] = []

    def feed(self, text: str) -> list:
        out = []
        if not text:
            return out
        if not self.calls:
            self.calls.append(ToolCall(self.name, "", openai_call_id()))
            out.append(ToolCallDelta(0, id=self.calls[0].id, name=self.name))
        self._arguments.append(text)
        out.append(ToolCallDelta(0, arguments=text))
        return out

    def finish(self) -> list:
        if self.calls:
            self.calls[0] = replace(self.calls[0], arguments="".join(self._arguments))
        return []


class FirstCallOnly:
    """parallel_tool_calls false: the first call passes, later ones are dropped."""

    def __init__(self, stream):
        self._stream = stream

    @property
    def calls(self) -> list[ToolCall]:
        return self._stream.calls[:1]

    def feed(self, text: str) -> list:
        return self._first(self._stream.feed(text))

    def finish(self) -> list:
        return self._first(self._stream.finish())

    @staticmethod
    def _first(deltas) -> list:
        return [d for d in deltas if not (isinstance(d, ToolCallDelta) and d.index > 0)]


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as chat templates read them: an assistant turn's tool call arguments
    as an object (Qwen's, Llama's and Hermes' templates dump them with `tojson`), not
    the JSON text OpenAI's shape carries. A 400 naming the message when they are not
    a JSON object."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            m = {**m, "tool_calls": [_template_call(c, f"messages[{i}].tool_calls[{j}]")
                                     for j, c in enumerate(calls)]}
        out.append(m)
    return out


def _template_call(call: dict, where: str) -> dict:
    fn = call["function"]
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise _bad("messages", f"{where}.function.arguments: must be the JSON text of "
                                   f"an object")
    return {**call, "function": {**fn, "arguments": args}}
