"""Reasoning output through the openai client against a live server started with
`--reasoning-parser qwen3`, on the demo model with `<think>` / `</think>` added as tokens
(tool_chat.think_checkpoint) and a template that opens a think block when asked
(chat_template_kwargs {"thinking": true}) or closes an empty one ({"enable_thinking":
false}).

The model is random, so where its thinking ends is steered with logit_bias on the end
tag. What is checked is the gate: a JSON schema or a tool grammar applies only after
`</think>`. Had the grammar applied from the first token, the end tag (not JSON) could not
be written, the output would be all JSON inside an unclosed think block, and
`reasoning_content` would hold it, `content` none."""
from __future__ import annotations

import json

import jsonschema
import pytest

openai = pytest.importorskip("openai")

from live_server import live_server  # noqa: E402
from tool_chat import SCHEMAS, TOOL_TEMPLATE, TOOLS, think_checkpoint  # noqa: E402

MODEL = "demo-think"
USER = [{"role": "user", "content": "Is 2 + 2 four?"}]
# no free strings: a `</think>` token cannot be part of the answer
ANSWER = {"type": "object",
          "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9},
                         "sure": {"type": "boolean"},
                         "mood": {"type": "string", "enum": ["calm", "glad"]}},
          "required": ["answer", "sure", "mood"], "additionalProperties": False}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
# compact: a random model pads free JSON whitespace until max_tokens
COMPACT = {"structured_outputs": {"json": ANSWER, "disable_any_whitespace": True}}
THINK = {"chat_template_kwargs": {"thinking": True}}


@pytest.fixture(scope="module")
def checkpoint(demo_path, tmp_path_factory):
    return think_checkpoint(demo_path, str(tmp_path_factory.mktemp("think") / "model"))


@pytest.fixture(scope="module")
def tag_ids(checkpoint):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(checkpoint)
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    assert start >= 4096 and end >= 4096  # added past the demo vocabulary
    return str(start), str(end)


@pytest.fixture(scope="module")
def client(checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("reasoning")
    template = folder / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    with live_server(checkpoint, folder / "server.log", "--served-model-name", MODEL,
                     "--dtype", "float32", "--max-model-len", "1024", "--num-kv-blocks", "256",
                     "--chat-template", str(template), "--reasoning-parser", "qwen3",
                     "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                     "--log-stats-interval", "0") as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0,
                            timeout=120)


def reasoning_of(message):
    return (message.model_extra or {}).get("reasoning_content")


def streamed(client, **kwargs):
    """(reasoning, content, finish_reason) put together from a stream's deltas."""
    reasoning = content = ""
    finish = None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return reasoning or None, content or None, finish


def test_json_schema_applies_after_the_thinking(client, tag_ids):
    _, end = tag_ids
    thought = []
    for bias, seed in [(100, 1), (6, 2), (6, 3), (6, 4)]:
        kw = dict(messages=USER, seed=seed, temperature=1.0, max_tokens=200,
                  logit_bias={end: bias}, extra_body={**THINK, **COMPACT})
        r = client.chat.completions.create(model=MODEL, **kw)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), ANSWER)
        reasoning = reasoning_of(choice.message)
        assert reasoning is None or "</think>" not in reasoning
        assert streamed(client, **kw) == (reasoning, choice.message.content, "stop")
        thought.append(reasoning)
    assert thought[0] is None and any(thought[1:])  # some answers came after some thinking


def test_thinking_switched_off_answers_under_the_grammar_at_once(client, tag_ids):
    start, _ = tag_ids
    r = client.chat.completions.create(
        model=MODEL, messages=USER, seed=1, max_tokens=100, logit_bias={start: -100},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, **COMPACT})
    message = r.choices[0].message
    assert reasoning_of(message) is None and "reasoning_content" in message.model_extra
    jsonschema.validate(json.loads(message.content), ANSWER)


def test_a_tool_grammar_applies_after_the_thinking(client, tag_ids):
    _, end = tag_ids
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                           tool_choice=choice, seed=2, temperature=1.0,
                                           max_tokens=200, logit_bias={end: 100},
                                           extra_body=THINK)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments),
                                SCHEMAS[call.function.name])


def test_thinking_then_parsed_calls(client, tag_ids):
    """auto: the thinking goes to reasoning_content, the rest through the hermes parser
    (the canned calls forced by a one-string guided_choice once the thinking is over)."""
    _, end = tag_ids
    canned = ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2, "exact": true}}'
              "\n</tool_call>")
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, seed=1,
                                       max_tokens=300, logit_bias={end: 100},
                                       extra_body={**THINK, "guided_choice": [canned]})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] \
        == [("add", {"a": 2, "b": 2, "exact": True})]
    assert c.message.content is None and reasoning_of(c.message) is None


def test_unfinished_thinking_streams_as_reasoning(client, tag_ids):
    _, end = tag_ids
    kw = dict(messages=USER, seed=5, temperature=1.0, max_tokens=12, logit_bias={end: -100},
              extra_body=THINK)
    r = client.chat.completions.create(model=MODEL, **kw)
    message = r.choices[0].message
    reasoning = reasoning_of(message)
    assert reasoning and message.content is None and r.choices[0].finish_reason == "length"
    assert streamed(client, **kw) == (reasoning, None, "length")


# ---- a reasoning parser on a tokenizer without the tags ----------------------------------------
def test_a_grammar_is_refused_where_the_thinking_cannot_be_told(demo_path):
    """--reasoning-parser on the plain demo tokenizer (no `</think>` token): text is still
    split, but a grammar that would have to wait for the end tag is a 400 naming both."""
    from inprocess_app import call
    from tokenmill.engine.async_llm import AsyncLLM
    from tokenmill.engine.engine_args import EngineArgs
    from tokenmill.entrypoints.openai.server import build_app
    llm = AsyncLLM.from_engine_args(
        EngineArgs.from_kwargs(demo_path, dtype="float32", max_model_len=256, num_kv_blocks=32,
                               reasoning_parser="qwen3"), log_stats_interval=0)
    try:
        base = {"model": MODEL, "messages": USER, "max_tokens": 2}
        refused, served = call(build_app(llm, MODEL),
                               ("POST", "/v1/chat/completions",
                                {"json": {**base, "response_format": JSON_FORMAT}}),
                               ("POST", "/v1/chat/completions", {"json": base}))
    finally:
        llm.shutdown()
    assert refused.status_code == 400, refused.text
    err = refused.json()["error"]
    assert err["param"] == "response_format" and "--reasoning-parser qwen3" in err["message"]
    assert served.status_code == 200, served.text
    assert "reasoning_content" in served.json()["choices"][0]["message"]
