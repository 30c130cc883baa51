"""Pieces the format scanners share: markers that may still be arriving, JSON values
delimited by bracket depth, calls from decoded JSON, and the scanner of calls wrapped in
an open / close tag pair."""
from __future__ import annotations

import json
import re
from abc import abstractmethod

from tokenmill.parsers.tool_calls import Segment, ToolCall, ToolCallScanner


def partial_tag_len(text: str, start: int, tags) -> int:
    """The length of the longest end of text[start:] that is a proper prefix of one of
    `tags`: a marker that may be arriving, held back until the next feed decides."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text) - start), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


_JSON_SPECIAL = re.compile(r'["\\{}\[\]]')


class JsonExtent:
    """Where the object or array opening at text[start] ('{' or '[') ends, by bracket
    depth outside strings; whether it is valid JSON is json.loads's to say. The text grows
    between calls while a call's JSON arrives a token at a time, so the scan goes on where
    the last call for the same value stopped instead of starting over."""

    def __init__(self):
        self._start = -1  # the value's position in the whole output

    def end(self, text: str, start: int, offset: int = 0) -> int | None:
        """The index just past the value, or None when the text ends first; `offset` is
        text[0]'s position in the whole output."""
        if self._start != offset + start:
            self._start = self._pos = offset + start
            self._depth, self._in_string = 0, False
        depth, in_string, pos = self._depth, self._in_string, self._pos - offset
        while True:
            m = _JSON_SPECIAL.search(text, pos)
            if m is None:
                self._pos, self._depth, self._in_string = offset + pos, depth, in_string
                return None
            c, pos = m.group(), m.end()
            if in_string:
                if c == "\\":
                    pos += 1  # the escaped character, whatever it is
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    self._start = -1
                    return pos


class _Wait:
    def __repr__(self):
        return "WAIT"


WAIT = _Wait()  # take_json: the value may still be completed by more text
BAD = object()  # take_json: malformed JSON, or unterminated in a final text


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")  # NaN / Infinity: a re-dump would not parse


def load_json(text: str):
    """json.loads without NaN / Infinity (ValueError)."""
    return json.loads(text, parse_constant=_no_constant)


def take_json(text: str, start: int, final: bool, extent: JsonExtent | None = None,
              offset: int = 0):
    """The JSON value opening at text[start]: (value, end), or BAD, or WAIT. A scanner
    passes its `extent` and `offset` (ToolCallScanner.offset) to resume a waiting value."""
    end = (extent or JsonExtent()).end(text, start, offset)
    if end is None:
        return BAD if final else WAIT
    try:
        return load_json(text[start:end]), end
    except ValueError:
        return BAD


def dump_arguments(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)


def call_from_json(obj, arg_keys=("arguments",), need_args: bool = False) -> ToolCall | None:
    """A call from {"name": ..., <arg key>: {...}}; the arguments may also come as the
    JSON text of an object. None when the value is not a call."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    key = next((k for k in arg_keys if k in obj), None)
    if key is None and need_args:
        return None
    args = {} if key is None else obj[key]
    if isinstance(args, str):
        try:
            args = load_json(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name.strip(), dump_arguments(args))


class TaggedBlockScanner(ToolCallScanner):
    """Calls wrapped in START ... END, anywhere in the text. A block whose body is not a
    call stays content as written, tags and all; so does a block never closed."""
    START: str
    END: str

    @abstractmethod
    def parse_body(self, body: str) -> list[ToolCall] | None:
        """The calls of one block's body, or None when it holds none."""

    def scan(self, text: str, final: bool) -> tuple[list[Segment], int]:
        out: list[Segment] = []
        pos = 0
        while True:
            start = text.find(self.START, pos)
            if start < 0:
                stop = len(text) - (0 if final else partial_tag_len(text, pos, (self.START,)))
                out.append(text[pos:stop])
                return out, stop
            out.append(text[pos:start])
            body_start = start + len(self.START)
            end = text.find(self.END, body_start)
            if end < 0:
                if final:
                    out.append(text[start:])
                    return out, len(text)
                return out, start
            block_end = end + len(self.END)
            calls = self.parse_body(text[body_start:end])
            if calls:
                out.extend(calls)
            else:
                out.append(text[start:block_end])
            pos = block_end
