"""The built-in demo checkpoint: deterministic build, tokenizer, chat template, loading, generation."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tokenmill import demo_model
from tokenmill.demo_model import COMPLETE_MARKER, DEMO_MODEL_NAME, ensure_demo_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
OTHER_FILES = ("config.json", "generation_config.json", "model.safetensors")


@pytest.fixture(scope="module")
def demo_path(tmp_path_factory) -> str:
    return ensure_demo_model(str(tmp_path_factory.mktemp("demo") / DEMO_MODEL_NAME))


@pytest.fixture(scope="module")
def tokenizer(demo_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(demo_path)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_build_is_deterministic(demo_path, tmp_path):
    # The second build runs in another process (another hash seed), where
    # nondeterministic ordering would show if there were any.
    other = str(tmp_path / "again")
    code = ("import sys; from tokenmill.demo_model import ensure_demo_model; "
            "print(ensure_demo_model(sys.argv[1]))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code, other], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == other
    for name in TOKENIZER_FILES + OTHER_FILES:
        assert _read(os.path.join(demo_path, name)) == _read(os.path.join(other, name)), name
    a = load_file(os.path.join(demo_path, "model.safetensors"))
    b = load_file(os.path.join(other, "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_layout_and_config(demo_path, tokenizer):
    assert os.path.isfile(os.path.join(demo_path, COMPLETE_MARKER))
    with open(os.path.join(demo_path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]) == (256, 4, 4, 2, 64, 768)
    assert cfg["max_position_embeddings"] == 4096 and cfg["tie_word_embeddings"] is True
    assert cfg["vocab_size"] == len(tokenizer)
    assert 3500 <= cfg["vocab_size"] <= 4096
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert cfg["eos_token_id"] == tokenizer.eos_token_id == im_end
    assert cfg["pad_token_id"] == tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    with open(os.path.join(demo_path, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == im_end
    weights = load_file(os.path.join(demo_path, "model.safetensors"))
    assert "lm_head.weight" not in weights  # tied
    assert weights["model.embed_tokens.weight"].shape == (cfg["vocab_size"], 256)


def test_reused_without_rebuilding(demo_path, monkeypatch):
    def fail(_):
        raise AssertionError("rebuilt a complete demo model")
    monkeypatch.setattr(demo_model, "build_demo_model", fail)
    assert ensure_demo_model(demo_path) == demo_path


def test_default_location_from_env(demo_path, tmp_path, monkeypatch):
    shutil.copytree(demo_path, tmp_path / DEMO_MODEL_NAME)
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    monkeypatch.setattr(demo_model, "build_demo_model", lambda _: pytest.fail("rebuilt"))
    assert ensure_demo_model() == str(tmp_path / DEMO_MODEL_NAME)
    monkeypatch.delenv("TOKENMILL_CACHE")
    assert demo_model.default_demo_model_dir() == os.path.join(
        os.path.expanduser("~"), ".cache", "tokenmill", DEMO_MODEL_NAME)


def test_losing_a_race_returns_the_winners_model(demo_path, tmp_path, monkeypatch):
    final = tmp_path / DEMO_MODEL_NAME

    def build_while_another_process_wins(out_dir):
        with open(os.path.join(out_dir, "partial"), "w") as f:
            f.write("x")
        shutil.copytree(demo_path, final)  # the other process's rename lands first

    monkeypatch.setattr(demo_model, "build_demo_model", build_while_another_process_wins)
    assert ensure_demo_model(str(final)) == str(final)
    assert not os.path.exists(final / "partial")
    assert os.listdir(tmp_path) == [DEMO_MODEL_NAME]  # the temporary folder is gone


def test_refuses_a_foreign_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a complete tokenmill demo model"):
        ensure_demo_model(str(tmp_path))
    assert os.listdir(tmp_path) == ["notes.txt"]


@pytest.mark.parametrize("text", [
    "héllo wörld 你好 🙂",
    "Hello, world!  Two spaces, a tab\tand\nnew lines\r\n",
    " leading space, trailing space ",
    "e\u0301 (combining), \u200bzero-width, \U0001F468\u200D\U0001F469\u200D\U0001F467",
    "<|im_start|>user\nhi<|im_end|>\n",
])
def test_unicode_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text


def test_special_tokens(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_chat_template(tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                    "<|im_start|>user\nHi there<|im_end|>\n"
                    "<|im_start|>assistant\nHello.<|im_end|>\n"
                    "<|im_start|>user\nBye<|im_end|>\n"
                    "<|im_start|>assistant\n")
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == text[:-len("<|im_start|>assistant\n")]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    assert tokenizer.decode(ids) == text


def test_hf_model_loads(demo_path):
    from transformers import AutoModelForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(demo_path, output_loading_info=True)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_llm_generates_deterministically(demo_path):
    from tokenmill import LLM, SamplingParams
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = LLM(demo_path)
    first = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    second = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    assert len(first.token_ids) == 8
    assert first.token_ids == second.token_ids
    assert first.text == second.text
    # A second engine (with a small KV cache: the default one is 2 GiB here) agrees.
    fresh = LLM(demo_path, max_model_len=256, num_kv_blocks=64).generate(
        "Hello", params, use_tqdm=False)[0].outputs[0]
    assert fresh.token_ids == first.token_ids


def test_llm_matches_hf_greedy_in_float32(demo_path, tokenizer):
    """The demo weights give varied greedy tokens, so this checks the engine's numerics."""
    from transformers import AutoModelForCausalLM

    from tokenmill import LLM, SamplingParams
    prompt = "The baker on Mill Street"
    model = AutoModelForCausalLM.from_pretrained(demo_path, dtype=torch.float32)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
    assert len(set(ref)) > 1  # not a collapsed, repeated token
    llm = LLM(demo_path, dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=64)
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref
