"""Reasoning in a model's output: the thinking between `<think>` and `</think>` goes to
`reasoning_content`, the rest to `content` (vLLM's `--reasoning-parser qwen3` and
`deepseek_r1`). The two parsers differ only in what an output without an opening tag means,
so they are two settings of one parser rather than two modules.

Whether the output begins inside the reasoning depends on the prompt: templates that write
`<think>` into the generation prompt (QwQ, Qwen3 thinking-2507, DeepSeek-R1's later
templates) leave only `</think>` to the model, and a prompt that closes an empty block
(Qwen3 with enable_thinking off) means no reasoning comes. `starts_in_reasoning(prompt)`
reads that from the rendered prompt; given it, the stream and the complete parse agree:

* an output that opens with `<think>` (after whitespace) is reasoning up to `</think>`;
* otherwise it is reasoning up to `</think>` when it starts in reasoning, else all content;
* reasoning never closed is all reasoning (the output was cut off while thinking).

Not knowing the prompt (None), `deepseek_r1` assumes it starts in reasoning (the text
before `</think>` is reasoning even without an opening tag; never closed, all of it is), and
`qwen3` assumes it does not while streaming; its complete parse looks ahead instead: text
before a `</think>` is reasoning, an output with neither tag is all content. That one case,
`</think>` without `<think>` and an unknown prompt, is where a qwen3 stream and its complete
parse differ: a stream cannot hold back a whole answer to see whether a `</think>` comes.

Tags are never emitted; a partial tag at the end of a feed is held until the next decides.
Whitespace-only reasoning or content is None; otherwise both are verbatim."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from tokenmill.parsers.scanning import partial_tag_len


class ReasoningResult(NamedTuple):
    reasoning: str | None
    content: str | None


class ReasoningDelta(NamedTuple):
    reasoning: str | None
    content: str | None


class _Channel:
    """One side's text: leading whitespace is held until other text follows it (dropped
    if none does), so a blank side is None rather than a few newlines."""

    def __init__(self):
        self.blank, self.started = "", False

    def take(self, text: str) -> str:
        if self.started or not text:
            return text
        self.blank += text
        if self.blank.isspace():
            return ""
        text, self.blank, self.started = self.blank, "", True
        return text


class StreamingReasoningParser:
    """One output's stream: feed() each new piece of text, finish() at the end."""

    def __init__(self, parser: ReasoningParser, starts_in_reasoning: bool):
        self._start_tag, self._end_tag = parser.start_tag, parser.end_tag
        self._starts_in_reasoning = starts_in_reasoning
        self._state = "start"  # -> "reasoning" -> "content", or "start" -> "content"
        self._pending = ""
        self._reasoning, self._content = _Channel(), _Channel()

    @property
    def reasoning_ended(self) -> bool:
        """Whether the text fed so far is past the reasoning (or has none)."""
        return self._state == "content"

    def feed(self, text: str) -> ReasoningDelta:
        self._pending += text
        return self._step(final=False)

    def finish(self) -> ReasoningDelta:
        return self._step(final=True)

    def _step(self, final: bool) -> ReasoningDelta:
        text, pos = self._pending, 0
        reasoning = content = ""
        if self._state == "start":
            rest = text.lstrip()
            if rest.startswith(self._start_tag):
                pos, self._state = len(text) - len(rest) + len(self._start_tag), "reasoning"
            elif not final and self._start_tag.startswith(rest):  # may still open: wait
                return ReasoningDelta(None, None)
            else:
                self._state = "reasoning" if self._starts_in_reasoning else "content"
        if self._state == "reasoning":
            end = text.find(self._end_tag, pos)
            if end < 0:
                stop = len(text) - (0 if final else partial_tag_len(text, pos, (self._end_tag,)))
                reasoning, pos = text[pos:stop], stop
            else:
                reasoning, pos, self._state = text[pos:end], end + len(self._end_tag), "content"
        if self._state == "content":
            content, pos = text[pos:], len(text)
        self._pending = text[pos:]
        return ReasoningDelta(self._reasoning.take(reasoning) or None,
                              self._content.take(content) or None)


class ReasoningEndTracker:
    """Which of an output's token ids come after its reasoning, for a grammar (a JSON
    schema, a tool call) that applies to the answer only. Needs the tags as single tokens,
    as the Qwen3 and DeepSeek-R1 tokenizers have them."""

    def __init__(self, start_id: int | None, end_id: int, starts_in_reasoning: bool):
        self.start_id, self.end_id = start_id, end_id
        self._starts_in_reasoning = starts_in_reasoning
        self._state = "start"

    @property
    def ended(self) -> bool:
        return self._state == "content"

    @property
    def undecided(self) -> bool:
        """Nothing fed yet, and the output may begin with its answer: it enters the
        reasoning only by opening with the start tag."""
        return self._state == "start" and not self._starts_in_reasoning

    def feed(self, token_ids) -> list[int]:
        """The ids among these new ones that come after the reasoning (the end tag's own
        id is part of the reasoning)."""
        ids = list(token_ids)
        for i, tok in enumerate(ids):
            if self._state == "content":
                return ids[i:]
            if self._state == "start":
                self._state = "reasoning" if (tok == self.start_id or
                                              self._starts_in_reasoning) else "content"
                if self._state == "content":
                    return ids[i:]
            if tok == self.end_id:
                self._state = "content"
        return []


@dataclass(frozen=True)
class ReasoningParser:
    """A `--reasoning-parser` choice."""
    name: str
    unknown_start: bool  # starts in reasoning when the prompt does not say
    look_ahead: bool  # the complete parse of an unknown prompt decides from the text
    start_tag: str = "<think>"
    end_tag: str = "</think>"

    def starts_in_reasoning(self, prompt: str) -> bool | None:
        """From the rendered prompt: True when its last think tag opens a block (the
        template wrote the start tag), False when it closes one (thinking switched off, or
        a finished turn before the generation prompt), None when it has none."""
        opened, closed = prompt.rfind(self.start_tag), prompt.rfind(self.end_tag)
        if opened < 0 and closed < 0:
            return None
        return opened > closed

    def streaming(self, starts_in_reasoning: bool | None = None) -> StreamingReasoningParser:
        if starts_in_reasoning is None:
            starts_in_reasoning = self.unknown_start
        return StreamingReasoningParser(self, starts_in_reasoning)

    def extract(self, text: str, starts_in_reasoning: bool | None = None) -> ReasoningResult:
        if starts_in_reasoning is None and self.look_ahead:
            starts_in_reasoning = self.end_tag in text
        stream = self.streaming(starts_in_reasoning)
        parts = [stream.feed(text), stream.finish()]
        reasoning = "".join(p.reasoning or "" for p in parts)
        content = "".join(p.content or "" for p in parts)
        return ReasoningResult(reasoning or None, content or None)

    def is_reasoning_end(self, text: str, starts_in_reasoning: bool | None = None) -> bool:
        """Whether `text` (an output so far) is past its reasoning."""
        stream = self.streaming(starts_in_reasoning)
        stream.feed(text)
        return stream.reasoning_ended

    def end_tracker(self, tokenizer, starts_in_reasoning: bool | None = None
                    ) -> ReasoningEndTracker:
        """A tracker over token ids, from a tokenizer whose vocabulary has the end tag as
        one token (ValueError otherwise)."""
        vocab = tokenizer.get_vocab()
        if self.end_tag not in vocab:
            raise ValueError(f"the {self.name} reasoning parser needs {self.end_tag} as one "
                             f"token, and this tokenizer has no such token")
        if starts_in_reasoning is None:
            starts_in_reasoning = self.unknown_start
        return ReasoningEndTracker(vocab.get(self.start_tag), vocab[self.end_tag],
                                   starts_in_reasoning)


QWEN3 = ReasoningParser("qwen3", unknown_start=False, look_ahead=True)
DEEPSEEK_R1 = ReasoningParser("deepseek_r1", unknown_start=True, look_ahead=False)
