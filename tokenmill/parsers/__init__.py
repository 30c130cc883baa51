"""What a chat model's raw output text holds beside its answer: tool calls (`tool_calls`)
and reasoning (`reasoning`), each in the formats vLLM names with `--tool-call-parser` and
`--reasoning-parser`. Text in, text out: no tokenizer, engine or server here, so the server,
the offline `LLM.chat` and the grammar gate (reasoning first, then the schema) share them.
`registry` maps the flag names to the parsers."""
