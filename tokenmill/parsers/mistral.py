"""`mistral`: Mistral's calls after the `[TOOL_CALLS]` token, in either of its two forms:
a JSON list of {"name", "arguments"} (older tokenizers; one object also taken), or
`[TOOL_CALLS]name[ARGS]{...}` once per call (tokenizer v11 and later). A marker not
followed by a call stays content, marker included."""
from __future__ import annotations

import re

from tokenmill.parsers.scanning import (BAD, WAIT, JsonExtent, call_from_json,
                                        dump_arguments, partial_tag_len, take_json)
from tokenmill.parsers.tool_calls import (Segment, ToolCall, ToolCallParser,
                                          ToolCallScanner, mistral_call_id)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_SPACE = re.compile(r"\s*")
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


class MistralScanner(ToolCallScanner):
    def __init__(self, schemas):
        super().__init__(schemas)
        self.at_marker = False  # the text left begins with [TOOL_CALLS]
        self.extent = JsonExtent()

    def scan(self, text: str, final: bool) -> tuple[list[Segment], int]:
        out: list[Segment] = []
        pos = 0
        while True:
            if not self.at_marker:
                marker = text.find(TOOL_CALLS, pos)
                if marker < 0:
                    stop = len(text) - (0 if final else partial_tag_len(text, pos, (TOOL_CALLS,)))
                    out.append(text[pos:stop])
                    return out, stop
                out.append(text[pos:marker])
                pos, self.at_marker = marker, True
            after = pos + len(TOOL_CALLS)
            k = _SPACE.match(text, after).end()
            if k == len(text):
                got = None if final else WAIT
            elif text[k] in "[{":
                got = self._json_calls(text, k, final)
            else:
                got = self._named_call(text, k, final)
            if got is WAIT:
                return out, pos
            self.at_marker = False
            if got is None:
                out.append(TOOL_CALLS)
                pos = after
            else:
                calls, pos = got
                out.extend(calls)

    def _json_calls(self, text: str, start: int, final: bool):
        got = take_json(text, start, final, self.extent, self.offset)
        if got is WAIT or got is BAD:
            return None if got is BAD else WAIT
        value, end = got
        items = value if isinstance(value, list) else [value]
        calls = [call_from_json(item) for item in items]
        if not calls or None in calls:
            return None
        return calls, end

    def _named_call(self, text: str, start: int, final: bool):
        name_end = _NAME.match(text, start).end()
        if name_end == start:
            return None
        if not text.startswith(ARGS, name_end):
            return WAIT if not final and ARGS.startswith(text[name_end:]) else None
        k = _SPACE.match(text, name_end + len(ARGS)).end()
        if k == len(text):
            return None if final else WAIT
        if text[k] != "{":
            return None
        got = take_json(text, k, final, self.extent, self.offset)
        if got is WAIT or got is BAD:
            return None if got is BAD else WAIT
        args, end = got
        return [ToolCall(text[start:name_end], dump_arguments(args))], end


MISTRAL = ToolCallParser("mistral", MistralScanner, needs_special_tokens=True,
                         new_call_id=mistral_call_id)
