"""`llama3_json`: Llama 3.x JSON calls. The output opens with the call object,
{"name": ..., "parameters": {...}} ("arguments" also taken), or the object follows
`<|python_tag|>`; several calls are separated by `;` (or just whitespace). A JSON object
without a name and an argument key is an answer, not a call: it stays content."""
from __future__ import annotations

import re

from tokenmill.parsers.scanning import (BAD, WAIT, JsonExtent, call_from_json,
                                        partial_tag_len, take_json)
from tokenmill.parsers.tool_calls import Segment, ToolCallParser, ToolCallScanner

PYTHON_TAG = "<|python_tag|>"
ARG_KEYS = ("parameters", "arguments")
_SPACE = re.compile(r"\s*")

# Where the scanner stands: "start" (only whitespace so far), "text" (prose, where a python
# tag may still open calls), "tag" (the text left begins with the python tag), "after" (a
# call was just read: another may follow), "plain" (no more calls: the rest is content).


class Llama3JsonScanner(ToolCallScanner):
    def __init__(self, schemas):
        super().__init__(schemas)
        self.phase = "start"
        self.extent = JsonExtent()

    def _call(self, text: str, start: int, final: bool):
        """(call or None, end) for the object at text[start], or WAIT."""
        got = take_json(text, start, final, self.extent, self.offset)
        if got is WAIT:
            return WAIT
        if got is BAD:
            return None, start
        obj, end = got
        return call_from_json(obj, ARG_KEYS, need_args=True), end

    def scan(self, text: str, final: bool) -> tuple[list[Segment], int]:
        out: list[Segment] = []
        pos = 0
        while True:
            if self.phase == "plain":
                out.append(text[pos:])
                return out, len(text)
            if self.phase == "text":
                tag = text.find(PYTHON_TAG, pos)
                if tag < 0:
                    stop = len(text) - (0 if final else partial_tag_len(text, pos, (PYTHON_TAG,)))
                    out.append(text[pos:stop])
                    return out, stop
                out.append(text[pos:tag])
                pos, self.phase = tag, "tag"
                continue
            if self.phase == "tag":
                after_tag = pos + len(PYTHON_TAG)
                k = _SPACE.match(text, after_tag).end()
                if k == len(text) and not final:
                    return out, pos
                got = (self._call(text, k, final) if k < len(text) and text[k] == "{"
                       else (None, k))
                if got is WAIT:
                    return out, pos
                call, end = got
                if call is not None:
                    out.append(call)
                    pos, self.phase = end, "after"
                    continue
                out.append(PYTHON_TAG)  # no call follows: the tag is text
                pos, self.phase = after_tag, "text"
                continue
            # "start" and "after": whitespace is content (the driver drops it next to calls)
            k = _SPACE.match(text, pos).end()
            out.append(text[pos:k])
            pos = k
            if k == len(text):
                return out, k
            c = text[k]
            if self.phase == "start" and c != "{":
                if text.startswith(PYTHON_TAG, k):
                    self.phase = "tag"
                elif not final and PYTHON_TAG.startswith(text[k:]):
                    return out, k
                else:
                    self.phase = "text"
                continue
            if self.phase == "after" and c == ";":
                k = _SPACE.match(text, k + 1).end()
                if k == len(text):
                    if not final:
                        return out, pos
                    self.phase = "plain"
                    continue
            if text[k] != "{":
                self.phase = "plain"
                continue
            got = self._call(text, k, final)
            if got is WAIT:
                return out, pos
            call, end = got
            if call is None:
                self.phase = "plain"
                continue
            out.append(call)
            pos, self.phase = end, "after"


LLAMA3_JSON = ToolCallParser("llama3_json", Llama3JsonScanner, needs_special_tokens=True)
