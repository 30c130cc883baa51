"""`qwen3_coder`: Qwen3-Coder's XML-style calls, <tool_call>\\n<function=NAME>\\n
<parameter=P>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>.
Values are written as text; each is converted to its parameter's JSON-schema type when the
request's tools give one (integer, number, boolean, null, object, array), and kept as the
string it is otherwise, or when it does not read as that type."""
from __future__ import annotations

import ast
import json
import math
import re

from tokenmill.parsers.scanning import TaggedBlockScanner, dump_arguments, load_json
from tokenmill.parsers.tool_calls import ToolCall, ToolCallParser

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
# A value ends at its closing tag; models sometimes leave the last one out.
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)
_INTEGER = re.compile(r"-?(?:0|[1-9]\d*)")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_FAILED = object()


def schema_types(schema: dict) -> list[str]:
    """The JSON types a schema allows, in its order ("type" as a string or a list, or the
    branches of anyOf / oneOf)."""
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return [k for branch in schema[key] if isinstance(branch, dict)
                    for k in schema_types(branch)]
    return []


def _container(text: str, kind: type):
    """A JSON object / array, or the Python literal models sometimes write instead
    ({'a': True}); only values that are JSON once converted."""
    for read in (load_json, ast.literal_eval):
        try:  # through JSON and back: tuples become lists, sets and bytes fail
            value = json.loads(json.dumps(read(text), allow_nan=False))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if isinstance(value, kind):
            return value
    return _FAILED


def convert_value(value: str, schema) -> object:
    """A parameter's text as the first non-string type of its schema that it reads as;
    else the text itself (string is the fallback of every schema, and the type of a
    parameter the schema does not describe)."""
    if not isinstance(schema, dict):
        return value
    text = value.strip()
    for kind in schema_types(schema):
        if kind == "integer" and _INTEGER.fullmatch(text):
            return int(text)
        if kind == "number" and _NUMBER.fullmatch(text):
            number = json.loads(text)
            if math.isfinite(number):
                return number
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind == "null" and text.lower() in ("null", "none"):
            return None
        if kind in ("object", "array"):
            got = _container(text, dict if kind == "object" else list)
            if got is not _FAILED:
                return got
    return value


def _trim(value: str) -> str:
    """The newline the format puts after the opening tag and before the closing one."""
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


class Qwen3CoderScanner(TaggedBlockScanner):
    START, END = "<tool_call>", "</tool_call>"

    def _arguments(self, name: str, inner: str) -> dict | None:
        schema = self.schemas.get(name)
        properties = schema.get("properties") if isinstance(schema, dict) else None
        properties = properties if isinstance(properties, dict) else {}
        args: dict = {}
        pos = 0
        for m in _PARAMETER.finditer(inner):
            if inner[pos:m.start()].strip():
                return None
            param = m.group(1).strip()
            args[param] = convert_value(_trim(m.group(2)), properties.get(param))
            pos = m.end()
        return None if inner[pos:].strip() else args

    def parse_body(self, body: str) -> list[ToolCall] | None:
        calls = []
        pos = 0
        for m in _FUNCTION.finditer(body):
            name = m.group(1).strip()
            args = self._arguments(name, m.group(2))
            if body[pos:m.start()].strip() or not name or args is None:
                return None
            calls.append(ToolCall(name, dump_arguments(args)))
            pos = m.end()
        return None if body[pos:].strip() or not calls else calls


QWEN3_CODER = ToolCallParser("qwen3_coder", Qwen3CoderScanner)
