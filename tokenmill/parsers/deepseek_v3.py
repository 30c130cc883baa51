"""`deepseek_v3`: DeepSeek-V3 / R1 calls in a section of special markers,
<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
(a newline after NAME); V3.1's shorter call body, NAME<｜tool▁sep｜>{...},
is taken too. The section markers never reach the content; a call block that does not
parse, or is never closed, stays content as written."""
from __future__ import annotations

import re

from tokenmill.parsers.scanning import dump_arguments, load_json, partial_tag_len
from tokenmill.parsers.tool_calls import (Segment, ToolCall, ToolCallParser,
                                          ToolCallScanner)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"

_V3_BODY = re.compile(r"\s*\w+" + SEP + r"(?P<name>[^\n]+?)\s*\n```(?:json)?[ \t]*\n"
                      r"(?P<args>.*?)```\s*", re.S)
_V31_BODY = re.compile(r"\s*(?P<name>[^\n]+?)" + SEP + r"\s*(?P<args>\{.*\})\s*", re.S)


def parse_call_body(body: str) -> ToolCall | None:
    m = _V3_BODY.fullmatch(body) or _V31_BODY.fullmatch(body)
    if m is None:
        return None
    try:
        args = load_json(m.group("args"))
    except ValueError:
        return None
    name = m.group("name").strip()
    if not isinstance(args, dict) or not name:
        return None
    return ToolCall(name, dump_arguments(args))


class DeepSeekV3Scanner(ToolCallScanner):
    def __init__(self, schemas):
        super().__init__(schemas)
        self.in_section = False

    def scan(self, text: str, final: bool) -> tuple[list[Segment], int]:
        out: list[Segment] = []
        pos = 0
        while True:
            if not self.in_section:
                begin = text.find(CALLS_BEGIN, pos)
                if begin < 0:
                    stop = len(text) - (0 if final else partial_tag_len(text, pos, (CALLS_BEGIN,)))
                    out.append(text[pos:stop])
                    return out, stop
                out.append(text[pos:begin])
                pos, self.in_section = begin + len(CALLS_BEGIN), True
            call = text.find(CALL_BEGIN, pos)
            section_end = text.find(CALLS_END, pos)
            if section_end >= 0 and (call < 0 or section_end < call):
                out.append(text[pos:section_end])
                pos, self.in_section = section_end + len(CALLS_END), False
                continue
            if call < 0:
                held = 0 if final else partial_tag_len(text, pos, (CALL_BEGIN, CALLS_END))
                out.append(text[pos:len(text) - held])
                return out, len(text) - held
            out.append(text[pos:call])
            call_end = text.find(CALL_END, call + len(CALL_BEGIN))
            if call_end < 0:
                if final:
                    out.append(text[call:])
                    return out, len(text)
                return out, call
            block_end = call_end + len(CALL_END)
            parsed = parse_call_body(text[call + len(CALL_BEGIN):call_end])
            out.append(parsed if parsed else text[call:block_end])
            pos = block_end


DEEPSEEK_V3 = ToolCallParser("deepseek_v3", DeepSeekV3Scanner)
