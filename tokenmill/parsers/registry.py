"""The parsers by the names vLLM's `--tool-call-parser` and `--reasoning-parser` take."""
from __future__ import annotations

from tokenmill.parsers.deepseek_v3 import DEEPSEEK_V3
from tokenmill.parsers.hermes import HERMES
from tokenmill.parsers.llama3_json import LLAMA3_JSON
from tokenmill.parsers.mistral import MISTRAL
from tokenmill.parsers.qwen3_coder import QWEN3_CODER
from tokenmill.parsers.reasoning import DEEPSEEK_R1, QWEN3, ReasoningParser
from tokenmill.parsers.tool_calls import ToolCallParser

TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {
    p.name: p for p in (HERMES, LLAMA3_JSON, MISTRAL, DEEPSEEK_V3, QWEN3_CODER)}
REASONING_PARSERS: dict[str, ReasoningParser] = {p.name: p for p in (QWEN3, DEEPSEEK_R1)}


def _lookup(table: dict, kind: str, name: str):
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; choose one of "
                         f"{', '.join(sorted(table))}") from None


def get_tool_call_parser(name: str) -> ToolCallParser:
    return _lookup(TOOL_CALL_PARSERS, "tool call parser", name)


def get_reasoning_parser(name: str) -> ReasoningParser:
    return _lookup(REASONING_PARSERS, "reasoning parser", name)
