"""A chat choice's output split as vLLM serves it: the thinking to `reasoning_content`
(`--reasoning-parser`), the calls to `tool_calls` (tools.py's ToolPlan), the rest to
`content`. One `ChoiceOutput` per choice (n > 1: each its own parser state), fed the text
as it comes, so a stream and the whole message are cut the same way.

Without a reasoning parser and a tool stream the text passes as it is: the deltas and
the message are what they were before tool calling existed."""
from __future__ import annotations

from tokenmill.parsers.tool_calls import ContentDelta, ToolCallDelta


class ChoiceOutput:
    def __init__(self, reasoning=None, starts_in_reasoning: bool | None = None,
                 tool_stream=None):
        """`reasoning`: a tokenmill.parsers ReasoningParser (None: no reasoning channel);
        `starts_in_reasoning`: its say from the rendered prompt; `tool_stream`: a
        ToolPlan.output_stream() (None: content only)."""
        self._reasoning_parser = reasoning
        self._starts_in = starts_in_reasoning
        self._reasoning = reasoning.streaming(starts_in_reasoning) if reasoning else None
        self._tools = tool_stream

    @property
    def plain(self) -> bool:
        return self._reasoning is None and self._tools is None

    @property
    def calls(self) -> list:
        return self._tools.calls if self._tools is not None else []

    # ---- streaming ----------------------------------------------------------------
    def feed(self, text: str) -> list[dict]:
        """The chunk deltas (OpenAI's shape, in order) that `text` decides."""
        if self.plain:
            return [{"content": text}] if text else []
        if self._reasoning is None:
            return self._content(self._tools.feed(text) if self._tools else [text])
        delta = self._reasoning.feed(text)
        return self._split(delta.reasoning, delta.content, final=False)

    def finish(self) -> list[dict]:
        """The deltas held back until the end (a partial tag, an unclosed call)."""
        if self.plain:
            return []
        if self._reasoning is None:
            return self._content(self._tools.finish())
        delta = self._reasoning.finish()
        return self._split(delta.reasoning, delta.content, final=True)

    def _split(self, reasoning, content, final: bool) -> list[dict]:
        out = [{"reasoning_content": reasoning}] if reasoning else []
        if self._tools is None:
            return out + ([{"content": content}] if content else [])
        pieces = self._tools.feed(content) if content else []
        if final:
            pieces += self._tools.finish()
        return out + self._content(pieces)

    @staticmethod
    def _content(pieces) -> list[dict]:
        """Tool-stream deltas (or plain strings) -> chunk deltas: content as it comes,
        consecutive call pieces in one chunk's `tool_calls`."""
        out: list[dict] = []
        for p in pieces:
            if isinstance(p, str):
                p = ContentDelta(p)
            if isinstance(p, ContentDelta):
                if p.text:
                    out.append({"content": p.text})
            elif isinstance(p, ToolCallDelta):
                entry = p.to_openai()
                if not (out and "tool_calls" in out[-1]):
                    out.append({"tool_calls": [entry]})
                elif out[-1]["tool_calls"][-1]["index"] == p.index:  # one entry per call
                    _merge(out[-1]["tool_calls"][-1], entry)
                else:
                    out[-1]["tool_calls"].append(entry)
        return out

    # ---- the whole message -----------------------------------------------------------
    def message(self, text: str) -> dict:
        """The assistant message of a finished output `text` (this object unused before):
        `content` None when nothing is left beside the thinking and the calls."""
        msg: dict = {"role": "assistant", "content": text}
        if self.plain:
            return msg
        content = text
        if self._reasoning_parser is not None:
            # the complete parse (it may look ahead where a stream cannot)
            reasoning, content = self._reasoning_parser.extract(text, self._starts_in)
            msg["reasoning_content"] = reasoning
        if self._tools is not None:
            pieces = (self._tools.feed(content) if content else []) + self._tools.finish()
            content = "".join(p.text for p in pieces if isinstance(p, ContentDelta)) or None
            calls = [c.to_openai() for c in self._tools.calls]
            if calls:
                msg["tool_calls"] = calls
        msg["content"] = content
        return msg


def _merge(entry: dict, more: dict) -> None:
    """A call's next piece into its entry of the same chunk: the arguments joined."""
    for key in ("id", "type"):
        if key in more:
            entry[key] = more[key]
    fn, more_fn = entry["function"], more["function"]
    if "name" in more_fn:
        fn["name"] = more_fn["name"]
    fn["arguments"] = fn.get("arguments", "") + more_fn.get("arguments", "")


def chat_finish_reason(reason: str | None, calls) -> str | None:
    """OpenAI's "tool_calls" for an output that made calls and ended by itself (one cut
    off keeps "length")."""
    return "tool_calls" if calls and reason == "stop" else reason
