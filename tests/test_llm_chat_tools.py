"""The offline `LLM.chat` with tools: rendered through the chat template, earlier turns
with tool calls and results, chat_template_kwargs, and tool_choice "required" / named
forced by the grammar (the text is the calls' JSON, checked with jsonschema)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tokenmill import LLM, SamplingParams
from tool_chat import SCHEMAS, TOOL_TEMPLATE, TOOLS

USER = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def llm(demo_path):
    return LLM(demo_path, dtype="float32", max_model_len=1024, num_kv_blocks=128)


def prompt_text(llm, out) -> str:
    return llm.get_tokenizer().decode(out.prompt_token_ids)


def test_tools_and_template_kwargs_reach_the_template(llm):
    sp = SamplingParams(max_tokens=1)
    plain, = llm.chat(USER, sp, use_tqdm=False, chat_template=TOOL_TEMPLATE)
    with_tools, = llm.chat(USER, sp, use_tqdm=False, chat_template=TOOL_TEMPLATE, tools=TOOLS,
                           chat_template_kwargs={"enable_thinking": False})
    assert "<tools>" not in prompt_text(llm, plain)
    text = prompt_text(llm, with_tools)
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    turn = [*USER, {"role": "assistant", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather",
                              "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out, = llm.chat(turn, sp, use_tqdm=False, chat_template=TOOL_TEMPLATE, tools=TOOLS)
    text = prompt_text(llm, out)
    assert '"arguments": {"city": "Oslo", "unit": "c"}' in text
    assert '<tool_response id="call_1">\nsunny\n</tool_response>' in text


def test_forced_tool_choices_give_valid_json(llm):
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=200)
    named, = llm.chat(USER, sp, use_tqdm=False, chat_template=TOOL_TEMPLATE, tools=TOOLS,
                      tool_choice={"type": "function", "function": {"name": "add"}})
    jsonschema.validate(json.loads(named.outputs[0].text), SCHEMAS["add"])
    required = llm.chat([USER, USER], [sp, sp.clone(seed=4)], use_tqdm=False,
                        chat_template=TOOL_TEMPLATE, tools=TOOLS, tool_choice="required")
    for out in required:
        calls = json.loads(out.outputs[0].text)
        assert calls and all(jsonschema.validate(c["parameters"], SCHEMAS[c["name"]]) is None
                             for c in calls)
    with pytest.raises(ValueError, match="is not among the request's tools"):
        llm.chat(USER, sp, use_tqdm=False, chat_template=TOOL_TEMPLATE, tools=TOOLS,
                 tool_choice={"type": "function", "function": {"name": "nope"}})
