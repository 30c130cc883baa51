"""`hermes`: Hermes / Qwen2.5 / Qwen3 calls, one JSON object per block,
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several in a row."""
from __future__ import annotations

from tokenmill.parsers.scanning import TaggedBlockScanner, call_from_json, load_json
from tokenmill.parsers.tool_calls import ToolCall, ToolCallParser


class HermesScanner(TaggedBlockScanner):
    START, END = "<tool_call>", "</tool_call>"

    def parse_body(self, body: str) -> list[ToolCall] | None:
        try:
            obj = load_json(body)
        except ValueError:
            return None
        call = call_from_json(obj)
        return [call] if call else None


HERMES = ToolCallParser("hermes", HermesScanner)
