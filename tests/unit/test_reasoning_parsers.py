"""Reasoning parsers on canned model outputs: the complete parse against hand-written
expectations, the stream (split at every position, and char by char) assembling to the
same reasoning and content, the prompt's say on where the output starts, and the token-id
tracker a grammar waits on."""
from __future__ import annotations

import pytest

from tokenmill.parsers.registry import (REASONING_PARSERS, get_reasoning_parser,
                                        get_tool_call_parser)
from tokenmill.parsers.tool_calls import ContentDelta

# (parser, starts_in_reasoning, text, reasoning, content)
CASES = [
    ("qwen3", None, "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
     "\nLet me think.\n", "\n\nThe answer is 4."),
    ("qwen3", None, "Just an answer.", None, "Just an answer."),
    ("qwen3", True, "Reasoning here.</think>\n\nAnswer.", "Reasoning here.", "\n\nAnswer."),
    ("qwen3", True, "still thinking when cut off", "still thinking when cut off", None),
    ("qwen3", True, "<think>opened anyway</think>done", "opened anyway", "done"),
    ("qwen3", False, "No thinking: 1 < 2 and <b>bold</b>.", None,
     "No thinking: 1 < 2 and <b>bold</b>."),
    ("qwen3", False, "<think>cut off", "cut off", None),
    ("qwen3", False, "  \n<think>x</think>y", "x", "y"),
    ("qwen3", None, "<think>\n\n</think>\n\nHi", None, "\n\nHi"),
    ("qwen3", None, "<think>思考 🤔 naïve</think>答案 ✓", "思考 🤔 naïve", "答案 ✓"),
    ("qwen3", None, "<think>a < b </thin k</think>x <thi y </think>",
     "a < b </thin k", "x <thi y </think>"),
    ("qwen3", None, "<think>only thinking</think>", "only thinking", None),
    ("qwen3", None, "<think>x</think> \n ", "x", None),
    ("qwen3", None, "", None, None),
    ("qwen3", False, "<thinking>is not the tag", None, "<thinking>is not the tag"),
    ("deepseek_r1", None, "<think>x</think>y", "x", "y"),
    ("deepseek_r1", None, "Hmm, 2+2.\n</think>\n\n4", "Hmm, 2+2.\n", "\n\n4"),
    ("deepseek_r1", None, "never closed", "never closed", None),
    ("deepseek_r1", None, "</think>only content", None, "only content"),
    ("deepseek_r1", None, "中文推理</think>结论", "中文推理", "结论"),
    ("deepseek_r1", False, "plain answer", None, "plain answer"),
]
IDS = [f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)]


def run_stream(parser, pieces, starts_in):
    stream = parser.streaming(starts_in)
    reasoning = content = ""
    for delta in [stream.feed(p) for p in pieces] + [stream.finish()]:
        for part in delta:
            assert part is None or part  # no empty strings: None or text
        reasoning += delta.reasoning or ""
        content += delta.content or ""
    return reasoning or None, content or None


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_complete_parse(case):
    name, starts_in, text, reasoning, content = case
    assert get_reasoning_parser(name).extract(text, starts_in) == (reasoning, content)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_stream_split_anywhere_equals_complete(case):
    name, starts_in, text, reasoning, content = case
    parser = get_reasoning_parser(name)
    for i in range(len(text) + 1):
        assert run_stream(parser, [text[:i], text[i:]], starts_in) == (reasoning, content), i
    assert run_stream(parser, list(text), starts_in) == (reasoning, content)


def test_qwen3_unknown_prompt_stream_and_complete_differ_only_on_a_lone_end_tag():
    """The documented case: with the prompt unknown, qwen3's complete parse looks ahead
    for `</think>`; a stream cannot, and takes an output without `<think>` for content."""
    qwen3 = get_reasoning_parser("qwen3")
    text = "thinking</think>answer"
    assert qwen3.extract(text) == ("thinking", "answer")
    assert run_stream(qwen3, [text], None) == (None, "thinking</think>answer")
    assert run_stream(qwen3, [text], True) == qwen3.extract(text, True) == ("thinking", "answer")


def test_stream_is_live():
    """Reasoning and content flow as they come; only a possible tag is held."""
    stream = get_reasoning_parser("qwen3").streaming(False)
    assert stream.feed("<thi") == (None, None)
    assert not stream.reasoning_ended
    assert stream.feed("nk>Let me") == ("Let me", None)
    assert stream.feed(" see</th") == (" see", None)
    assert stream.feed("ink>") == (None, None)
    assert stream.reasoning_ended
    assert stream.feed("\n\n") == (None, None)  # blank so far: held
    assert stream.feed("It is 4") == (None, "\n\nIt is 4")
    assert stream.feed(".") == (None, ".")
    assert stream.finish() == (None, None)
    r1 = get_reasoning_parser("deepseek_r1").streaming()
    assert r1.feed("Hmm") == ("Hmm", None)  # in reasoning from the first token


def test_is_reasoning_end():
    qwen3 = get_reasoning_parser("qwen3")
    assert qwen3.is_reasoning_end("<think>a</think>")
    assert not qwen3.is_reasoning_end("<think>a</thi")
    assert qwen3.is_reasoning_end("plain", False)
    assert not qwen3.is_reasoning_end("a", True)
    assert not get_reasoning_parser("deepseek_r1").is_reasoning_end("a")


@pytest.mark.parametrize("prompt, expected", [
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", None),
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n", True),
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
    ("<think>old</think>turn<|im_start|>assistant\n<think>\n", True),
])
def test_starts_in_reasoning_from_the_prompt(prompt, expected):
    assert get_reasoning_parser("qwen3").starts_in_reasoning(prompt) is expected


class FakeTokenizer:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return self.vocab


@pytest.mark.parametrize("starts_in, batches, after", [
    (None, [[10, 5, 6], [7, 11, 8, 9], [12]], [[], [8, 9], [12]]),  # <think> ... </think>
    (True, [[5, 11], [6]], [[], [6]]),  # the prompt opened it
    (True, [[10, 5], [11, 6]], [[], [6]]),
    (False, [[5, 6], [11, 7]], [[5, 6], [11, 7]]),  # no reasoning: everything counts
    (False, [[10], [5, 11, 6]], [[], [6]]),  # ... unless the output opens it
    (None, [[5, 6, 7]], [[5, 6, 7]]),
])
def test_end_tracker(starts_in, batches, after):
    tracker = get_reasoning_parser("qwen3").end_tracker(
        FakeTokenizer({"<think>": 10, "</think>": 11}), starts_in)
    assert [tracker.feed(b) for b in batches] == after
    assert tracker.ended == any(after)


def test_end_tracker_deepseek_and_missing_token():
    r1 = get_reasoning_parser("deepseek_r1")
    tracker = r1.end_tracker(FakeTokenizer({"</think>": 3}))
    assert tracker.feed([1, 2]) == [] and tracker.feed([3, 4]) == [4]
    with pytest.raises(ValueError, match="</think>"):
        r1.end_tracker(FakeTokenizer({"<think>": 1}))


def test_content_feeds_a_tool_parser():
    """What the server will do: the reasoning parser's content stream into a tool-call
    parser; split anywhere, it ends as the two complete parses in a row."""
    text = ('<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>')
    reasoning_parser, tool_parser = get_reasoning_parser("qwen3"), get_tool_call_parser("hermes")
    reasoning, content = reasoning_parser.extract(text)
    expected = tool_parser.parse(content)
    assert reasoning == "\nThe user wants weather.\n" and expected.content is None
    for i in range(len(text) + 1):
        think, tools = reasoning_parser.streaming(), tool_parser.streaming()
        got_reasoning, deltas = "", []
        for piece in (text[:i], text[i:], None):
            delta = think.feed(piece) if piece is not None else think.finish()
            got_reasoning += delta.reasoning or ""
            deltas += tools.feed(delta.content or "")
        deltas += tools.finish()
        assert got_reasoning == reasoning
        assert not any(isinstance(d, ContentDelta) for d in deltas)
        assert [(c.name, c.arguments) for c in tools.calls] == [
            (c.name, c.arguments) for c in expected.calls]


def test_registry():
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("nope")
