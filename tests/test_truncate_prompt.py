"""SamplingParams.truncate_prompt_tokens (vLLM's field): the prompt's last k tokens only.

Greedy output with truncation equals the output for the last k tokens given directly,
for token-id and text prompts, offline and through the engine's request path; -1 keeps
the longest prompt the context holds; bad values are errors naming the field.
"""
from __future__ import annotations

import pytest

from conftest import make_llm, make_prompts
from inprocess_app import async_llm  # noqa: F401 (a fixture)
from tokenmill import SamplingParams
from tokenmill.errors import ParamError


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 6, **kw})


@pytest.fixture(scope="module")
def llm(llama_tiny):
    return make_llm(llama_tiny.path, max_model_len=64)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_token_prompt_keeps_its_last_k_tokens(llm, llama_tiny):
    prompt = make_prompts([40], llama_tiny.vocab_size, seed=3)[0]
    for k in (1, 7, 40, 50):
        got = llm.generate({"prompt_token_ids": prompt}, greedy(truncate_prompt_tokens=k))
        want = llm.generate({"prompt_token_ids": prompt[-k:]}, greedy())
        assert tokens(got) == tokens(want), k
        assert got[0].prompt_token_ids == prompt[-k:]


def test_minus_one_keeps_what_the_context_holds(llm, llama_tiny):
    """A prompt longer than the context (refused without truncation) keeps its last
    max_model_len - 1 tokens; a million-entry list costs no per-entry check first."""
    prompt = make_prompts([100], llama_tiny.vocab_size, seed=4)[0]
    with pytest.raises(ValueError, match="leaves no room for output"):
        llm.generate({"prompt_token_ids": prompt}, greedy())
    got = llm.generate({"prompt_token_ids": prompt}, greedy(truncate_prompt_tokens=-1,
                                                            max_tokens=1))
    assert got[0].prompt_token_ids == prompt[-63:]
    assert len(got[0].outputs[0].token_ids) == 1
    huge = [1] * 1_000_000 + prompt[-10:]
    got = llm.generate({"prompt_token_ids": huge}, greedy(truncate_prompt_tokens=10))
    assert got[0].prompt_token_ids == prompt[-10:]


def test_text_prompt_is_truncated_after_tokenizing(demo_path):
    llm = make_llm(demo_path)
    text = "The town sat at the edge of a long and quiet river, and nobody came."
    ids = llm.get_tokenizer().encode(text)
    got = llm.generate(text, greedy(truncate_prompt_tokens=5))
    want = llm.generate({"prompt_token_ids": ids[-5:]}, greedy())
    assert got[0].prompt_token_ids == ids[-5:]
    assert tokens(got) == tokens(want)


def test_engine_request_path_truncates(llm, llama_tiny):
    """add_request (what the server and AsyncLLM use) applies it too."""
    engine = llm.llm_engine
    prompt = make_prompts([30], llama_tiny.vocab_size, seed=5)[0]
    prepared = engine.prepare_request({"prompt_token_ids": prompt},
                                      greedy(truncate_prompt_tokens=4))
    assert prepared.prompt_token_ids == prompt[-4:]


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "3", 2**31])
def test_bad_values_name_the_field(value):
    with pytest.raises(ParamError, match="truncate_prompt_tokens") as e:
        SamplingParams(truncate_prompt_tokens=value)
    assert e.value.param == "truncate_prompt_tokens"


def test_refusals_that_need_the_engine(llm):
    with pytest.raises(ParamError, match=r"truncate_prompt_tokens \(65\) is greater than "
                                         r"max_model_len=64"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, greedy(truncate_prompt_tokens=65))
    with pytest.raises(ParamError, match="cannot be combined with multi_modal_data"):
        llm.llm_engine.process_prompt({"prompt_token_ids": [1, 2],
                                       "multi_modal_data": {"image": []}}, 1)


def test_server_takes_the_field(async_llm):
    """/v1/completions and /v1/chat/completions pass it (vLLM's extra body field):
    usage counts the kept tokens; a bad value is a 400 naming it."""
    from inprocess_app import call
    from tokenmill.entrypoints.openai.server import build_app
    app = build_app(async_llm, "m")
    ids = list(range(10, 50))
    body = {"model": "m", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    full, cut, chat, bad = call(
        app, ("POST", "/v1/completions", {"json": {**body, "prompt": ids}}),
        ("POST", "/v1/completions", {"json": {**body, "prompt": ids,
                                              "truncate_prompt_tokens": 7}}),
        ("POST", "/v1/chat/completions", {"json": {
            **body, "messages": [{"role": "user", "content": "hello there " * 20}],
            "truncate_prompt_tokens": 5}}),
        ("POST", "/v1/completions", {"json": {**body, "prompt": ids,
                                              "truncate_prompt_tokens": 0}}))
    assert full.json()["usage"]["prompt_tokens"] == 40
    assert cut.json()["usage"]["prompt_tokens"] == 7
    assert chat.json()["usage"]["prompt_tokens"] == 5
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"
