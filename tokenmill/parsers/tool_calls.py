"""Tool calls in a model's output: the shared types, the scanner contract every format
implements, and the driver that turns a scanner into a complete parse and a stream.

A format's scanner cuts the text into content and calls. It is fed the text not yet
consumed and says how much of it is decided; what it cannot decide yet (a marker that may be
arriving, a call not closed) it leaves for the next feed. The complete parse is the same
scanner fed the whole text once, so a stream split anywhere ends with the same content and
calls as the complete parse, provided the scanner decides from the text alone (the unit
tests feed every split).

A call is emitted once it is whole and valid: a call streamed early could not be taken back
when its JSON turned out broken or its tag never closed, and such text must stay content.
So a call's arguments arrive in one fragment, after the delta that names it.

Whitespace-only text between calls, or between a call and either end of the output (the
newlines around `<tool_call>` blocks), is formatting and dropped; any other text outside
calls is content, verbatim. A call naming a function the request did not offer is still a
call (as in vLLM): the client sees what the model tried."""
from __future__ import annotations

import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Union


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the JSON text of an object
    id: str = field(default="", compare=False)

    def to_openai(self) -> dict:
        """The call as a chat message's `tool_calls` entry."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolParseResult:
    content: str | None  # None when no text is left beside the calls
    calls: list[ToolCall]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of call `index`: the first names it (id, name, empty arguments),
    the next carry argument text; a call's argument pieces concatenate to its JSON."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        """The piece as an entry of a chunk's `delta.tool_calls`."""
        out: dict = {"index": self.index}
        function: dict = {"arguments": self.arguments}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
        if self.name is not None:
            function["name"] = self.name
        out["function"] = function
        return out


Delta = Union[ContentDelta, ToolCallDelta]
Segment = Union[str, ToolCall]  # what a scanner decides: content text, or a call (no id yet)


def tool_schemas(tools) -> dict[str, dict]:
    """name -> JSON schema of the parameters, from a request's `tools` (OpenAI's shape:
    {"type": "function", "function": {"name", "parameters"}}; dicts or pydantic models)."""
    schemas: dict[str, dict] = {}
    for tool in tools or ():
        if hasattr(tool, "model_dump"):
            tool = tool.model_dump()
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            schemas[fn["name"]] = params if isinstance(params, dict) else {}
    return schemas


class ToolCallScanner(ABC):
    """One output's scanner for one format; it may keep state between feeds about the
    text it has consumed (never about text it left unconsumed)."""

    def __init__(self, schemas: dict[str, dict]):
        self.schemas = schemas
        self.offset = 0  # where the text scan() gets begins in the whole output

    @abstractmethod
    def scan(self, text: str, final: bool) -> tuple[list[Segment], int]:
        """Cut `text` (everything not consumed so far) into decided segments; returns them
        and how many characters they consumed. With `final` (no more text will come) it
        consumes everything: an unfinished call is content then."""


def openai_call_id() -> str:
    return "call_" + secrets.token_hex(12)


_ALNUM = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Nine letters or digits: Mistral's chat templates refuse any other tool call id
    when the call comes back in the next turn's messages."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


class StreamingToolParser:
    """One output's stream: feed() the new text of each engine output, finish() at the end;
    each returns the deltas decided by then, in order. `calls` holds the calls emitted."""

    def __init__(self, scanner: ToolCallScanner, new_id: Callable[[], str]):
        self._scanner, self._new_id = scanner, new_id
        self._pending = ""  # fed text the scanner has not consumed
        self._blank = ""  # whitespace held: it is dropped if a call or the end comes next
        self._piece_has_text = False  # the text since the last call has non-whitespace
        self._done = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Delta]:
        if self._done:
            raise RuntimeError("feed() after finish()")
        self._pending += text
        segments, used = self._scanner.scan(self._pending, final=False)
        self._pending = self._pending[used:]
        self._scanner.offset += used
        return self._deltas(segments)

    def finish(self) -> list[Delta]:
        if self._done:
            return []
        segments, used = self._scanner.scan(self._pending, final=True)
        assert used == len(self._pending), "a scanner consumes everything when final"
        self._pending, self._done = "", True
        out = self._deltas(segments)
        if self._blank and not self.calls:  # a blank output without calls stays as it is
            out.append(ContentDelta(self._blank))
        self._blank = ""
        return _merged(out)

    def _deltas(self, segments: list[Segment]) -> list[Delta]:
        out: list[Delta] = []
        for seg in segments:
            if isinstance(seg, ToolCall):
                self._blank, self._piece_has_text = "", False
                call = replace(seg, id=self._new_id())
                index = len(self.calls)
                self.calls.append(call)
                out.append(ToolCallDelta(index, id=call.id, name=call.name))
                out.append(ToolCallDelta(index, arguments=call.arguments))
            elif self._piece_has_text:
                out.append(ContentDelta(seg))
            elif seg:
                self._blank += seg
                if not self._blank.isspace():
                    out.append(ContentDelta(self._blank))
                    self._blank, self._piece_has_text = "", True
        return _merged(out)


def _merged(deltas: list[Delta]) -> list[Delta]:
    """Adjacent content deltas joined into one."""
    out: list[Delta] = []
    for d in deltas:
        if isinstance(d, ContentDelta) and out and isinstance(out[-1], ContentDelta):
            out[-1] = ContentDelta(out[-1].text + d.text)
        elif not isinstance(d, ContentDelta) or d.text:
            out.append(d)
    return out


@dataclass(frozen=True)
class ToolCallParser:
    """A `--tool-call-parser` choice: its scanner, its call ids, and whether its markers
    are special tokens (the output must then be detokenized with skip_special_tokens off,
    or the markers vanish before the parser sees them)."""
    name: str
    scanner: type[ToolCallScanner]
    needs_special_tokens: bool = False
    new_call_id: Callable[[], str] = openai_call_id

    def streaming(self, tools=None) -> StreamingToolParser:
        return StreamingToolParser(self.scanner(tool_schemas(tools)), self.new_call_id)

    def parse(self, text: str, tools=None) -> ToolParseResult:
        stream = self.streaming(tools)
        deltas = stream.feed(text) + stream.finish()
        content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
        return ToolParseResult(content or None, stream.calls)
