"""The user-facing entry points on the demo model: LLM.chat, text prompts, the CLI, model resolution."""
from __future__ import annotations

import json

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.entrypoints.cli import main

SMALL = dict(dtype="float32", max_model_len=256, num_kv_blocks=64)


@pytest.fixture(scope="module")
def llm(demo_path) -> LLM:
    return LLM(demo_path, **SMALL)


def test_chat_goes_through_the_chat_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.chat(messages, params, use_tqdm=False)[0]
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.decode(out.prompt_token_ids) == expected
    assert expected.endswith("<|im_start|>assistant\n")
    # Same tokens as generating from the rendered template directly.
    direct = llm.generate({"prompt_token_ids": out.prompt_token_ids}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids


def test_text_prompt_round_trips_and_outputs_are_in_input_order(llm):
    prompts = ["The first prompt", {"prompt": "a second, longer prompt than the first"}, "3"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                        use_tqdm=False)
    tok = llm.get_tokenizer()
    for prompt, out in zip(["The first prompt", "a second, longer prompt than the first", "3"], outs):
        assert out.prompt == prompt
        assert out.prompt_token_ids == tok.encode(prompt)
        c = out.outputs[0]
        assert len(c.token_ids) == 5 and c.finish_reason == "length" and out.finished
        assert c.text == tok.decode(c.token_ids)


def test_cli_generate_prints_json(demo_path, capsys):
    rc = main(["generate", "--model", demo_path, "--dtype", "float32", "--max-model-len", "256",
               "--num-kv-blocks", "64", "--prompt", "Hello", "--prompt", "World",
               "--max-tokens", "4", "--ignore-eos", "--json"])
    assert rc == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [d["prompt"] for d in lines] == ["Hello", "World"]
    assert all(len(d["token_ids"]) == 4 and d["finish_reason"] == "length" for d in lines)


def test_cli_reports_bad_input_as_an_error(demo_path, capsys):
    rc = main(["generate", "--model", demo_path, "--max-model-len", "256", "--num-kv-blocks", "64",
               "--prompt", "Hello", "--temperature", "-1"])
    assert rc == 2
    assert "temperature" in capsys.readouterr().err


def test_missing_local_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_unreachable_hub_id_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="could not be fetched"):
        LLM("tokenmill-test-org/no-such-model")


def test_cli_chat_keeps_the_conversation(demo_path, llm, monkeypatch, capsys):
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\nAnd again\nexit\n"))
    rc = main(["chat", "--model", demo_path, "--dtype", "float32", "--max-model-len", "256",
               "--num-kv-blocks", "64", "--max-tokens", "5", "--temperature", "0",
               "--system", "Be brief."])
    assert rc == 0
    replies = capsys.readouterr().out.splitlines()
    # The second turn sees the first exchange: same as LLM.chat on the whole history.
    params = SamplingParams(temperature=0, max_tokens=5)
    first = llm.chat([{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Hello"}], params, use_tqdm=False)[0].outputs[0].text
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
               {"role": "assistant", "content": first}, {"role": "user", "content": "And again"}]
    second = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
    assert "\n".join(replies) == f"{first}\n{second}"


def test_llm_without_a_model_uses_the_demo_model(demo_path, monkeypatch):
    import os
    monkeypatch.setenv("TOKENMILL_CACHE", os.path.dirname(demo_path))
    llm = LLM(**SMALL)
    assert llm.llm_engine.model_config.path == demo_path
