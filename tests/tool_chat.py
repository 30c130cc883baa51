"""What the tool-calling and reasoning tests share: a Hermes-style chat template that
renders tools (the demo model's own does not), tools whose schemas keep a random model's
forced output short (a pattern rather than maxLength bounds the string: xgrammar 0.2.9's
maxLength strings may hold raw control characters), and a demo checkpoint whose
tokenizer has `<think>` / `</think>` as tokens (the reasoning gate needs the end tag as one
token)."""
from __future__ import annotations

import json
import os
import shutil

# ChatML with Qwen2.5's way of offering tools: a system turn listing each tool's JSON in
# <tools>, calls in <tool_call> blocks, results as <tool_response> in a user turn; with
# enable_thinking false (chat_template_kwargs) the generation prompt closes an empty
# <think> block, as Qwen3's template does; with thinking true it opens one (the output
# starts inside the reasoning, as with QwQ's template).
TOOL_TEMPLATE = r"""{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\n\n' -}}{%- endif -%}
{{- '# Tools\n\nYou may call functions. Their signatures:\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools>\nFor each call write <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call><|im_end|>\n' -}}
{%- elif messages[0]['role'] == 'system' -%}
{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message['role'] == 'system' -%}
{%- elif message['role'] == 'assistant' -%}
{{- '<|im_start|>assistant\n' + (message['content'] or '') -}}
{%- for call in message.get('tool_calls') or [] -%}
{{- '\n<tool_call>\n{"name": ' + (call['function']['name'] | tojson) + ', "arguments": ' + (call['function']['arguments'] | tojson) + '}\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif message['role'] == 'tool' -%}
{{- '<|im_start|>user\n<tool_response id="' + message['tool_call_id'] + '">\n' + message['content'] + '\n</tool_response><|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\n\n</think>\n\n' -}}
{%- elif thinking is defined and thinking -%}{{- '<think>\n' -}}{%- endif -%}
{%- endif -%}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "pattern": "[A-Z][a-z]{1,9}"},
                                  "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "The sum of two small numbers.",
    "parameters": {"type": "object",
                   "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                  "b": {"type": "integer", "minimum": 0, "maximum": 99},
                                  "exact": {"type": "boolean"}},
                   "required": ["a", "b", "exact"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

THINK_TOKENS = ["<think>", "</think>"]


def think_checkpoint(demo_path: str, out_dir: str) -> str:
    """The demo checkpoint with `<think>` and `</think>` added to its tokenizer as
    (non-special) tokens, and two rows more in its tied embedding (seeded)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from tokenmill.demo_model import _make_tokenizer_config_portable

    if os.path.exists(out_dir):
        return out_dir
    tmp = out_dir + ".tmp"
    shutil.copytree(demo_path, tmp)
    tok = AutoTokenizer.from_pretrained(demo_path)
    tok.add_tokens(THINK_TOKENS)
    tok.save_pretrained(tmp)
    _make_tokenizer_config_portable(os.path.join(tmp, "tokenizer_config.json"))
    with open(os.path.join(tmp, "config.json")) as f:
        config = json.load(f)
    old = config["vocab_size"]
    config["vocab_size"] = len(tok)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    weights = os.path.join(tmp, "model.safetensors")
    tensors = load_file(weights)
    gen = torch.Generator().manual_seed(0)
    for name, t in list(tensors.items()):
        if t.shape[0] == old and name.endswith(("embed_tokens.weight", "lm_head.weight")):
            extra = torch.randn(len(tok) - old, t.shape[1], generator=gen) * 0.1
            tensors[name] = torch.cat([t, extra.to(t.dtype)])
    save_file(tensors, weights, metadata={"format": "pt"})
    os.rename(tmp, out_dir)
    return out_dir
