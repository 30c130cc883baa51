"""Bad sampling parameters are refused with a ValueError naming the field; nothing
else is affected: requests already in the engine run on unchanged, and the
engine ends idle with no KV blocks in use."""
from __future__ import annotations

import pytest

from conftest import make_llm, scheduler_of
from tokenmill import SamplingParams

MAX_LOGPROBS = 5
PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}


@pytest.fixture(scope="module")
def llm(llama_tiny):
    return make_llm(llama_tiny.path, max_model_len=64, max_logprobs=MAX_LOGPROBS)


@pytest.fixture(scope="module")
def vocab(llama_tiny):
    return llama_tiny.vocab_size


def assert_idle_and_usable(llm):
    sched = scheduler_of(llm)
    assert sched.kv_cache_manager.num_used_blocks == 0
    assert not sched.requests and not sched.waiting and not sched.running
    assert llm.llm_engine.output_processor.requests == {}
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert sched.kv_cache_manager.num_used_blocks == 0


# Refused when the SamplingParams is built.
BAD_PARAMS = [
    ("presence_penalty_above", dict(presence_penalty=2.5), "presence_penalty"),
    ("presence_penalty_below", dict(presence_penalty=-2.01), "presence_penalty"),
    ("frequency_penalty_below", dict(frequency_penalty=-3), "frequency_penalty"),
    ("frequency_penalty_above", dict(frequency_penalty=3.0), "frequency_penalty"),
    ("repetition_penalty_zero", dict(repetition_penalty=0), "repetition_penalty"),
    ("repetition_penalty_negative", dict(repetition_penalty=-1.0), "repetition_penalty"),
    ("min_p_above_one", dict(min_p=1.5), "min_p"),
    ("min_p_negative", dict(min_p=-0.1), "min_p"),
    ("n_zero", dict(n=0), r"\bn\b"),
    ("n_negative", dict(n=-2), r"\bn\b"),
    ("n_not_int", dict(n=2.0), r"\bn\b"),
    ("n_greedy", dict(n=3, temperature=0.0), r"n=3.*(greedy|temperature)"),
    ("min_tokens_above_max_tokens", dict(min_tokens=5, max_tokens=4), "min_tokens"),
    ("min_tokens_negative", dict(min_tokens=-1), "min_tokens"),
    ("stop_empty_string", dict(stop=[""]), "stop"),
    ("stop_empty_among_others", dict(stop=["ok", ""]), "stop"),
    ("stop_bare_empty_string", dict(stop=""), "stop"),
    ("stop_not_strings", dict(stop=[1, 2]), "stop"),
    ("stop_without_detokenize", dict(stop=["x"], detokenize=False), "stop"),
    ("logprobs_negative", dict(logprobs=-1), "logprobs"),
    ("prompt_logprobs_negative", dict(prompt_logprobs=-2), "prompt_logprobs"),
    ("logit_bias_not_dict", dict(logit_bias=[1, 2]), "logit_bias"),
    ("logit_bias_bad_key", dict(logit_bias={"abc": 1.0}), "logit_bias"),
    ("logit_bias_bad_value", dict(logit_bias={3: "big"}), "logit_bias"),
    ("allowed_token_ids_empty", dict(allowed_token_ids=[]), "allowed_token_ids"),
    ("allowed_token_ids_not_ints", dict(allowed_token_ids=["a"]), "allowed_token_ids"),
    ("bad_words_empty_word", dict(bad_words=[""]), "bad_words"),
    ("seed_not_int", dict(seed="7"), "seed"),
    ("output_kind_unknown", dict(output_kind=7), "output_kind"),
    ("detokenize_not_bool", dict(detokenize="no"), "detokenize"),
]


@pytest.mark.parametrize("kwargs,field", [b[1:] for b in BAD_PARAMS],
                         ids=[b[0] for b in BAD_PARAMS])
def test_bad_sampling_params_name_the_field(llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
    assert_idle_and_usable(llm)


def test_edge_values_are_accepted():
    SamplingParams(presence_penalty=2.0, frequency_penalty=-2.0, repetition_penalty=1e-3,
                   min_p=1.0, n=1, temperature=0.0)
    SamplingParams(min_tokens=4, max_tokens=4)
    SamplingParams(n=2, temperature=0.5, stop=["a", "bc"], logit_bias={"3": 150})
    sp = SamplingParams(logit_bias={"3": 150, 4: -200})
    assert sp.logit_bias == {3: 100.0, 4: -100.0}  # JSON keys, clamped to OpenAI's range


def bad_engine_params(vocab):
    """Refused in add_request: they need the model (vocabulary, logprobs cap)."""
    return [
        ("logprobs_above_max", dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
        ("prompt_logprobs_above_max", dict(prompt_logprobs=MAX_LOGPROBS + 1), "prompt_logprobs"),
        ("logit_bias_id_too_big", dict(logit_bias={vocab: 1.0}), "logit_bias"),
        ("logit_bias_id_negative", dict(logit_bias={-1: 1.0}), "logit_bias"),
        ("allowed_token_ids_too_big", dict(allowed_token_ids=[1, vocab]), "allowed_token_ids"),
        ("allowed_token_ids_negative", dict(allowed_token_ids=[-3]), "allowed_token_ids"),
        ("stop_token_ids_too_big", dict(stop_token_ids=[vocab + 10]), "stop_token_ids"),
        # The tiny checkpoints have no tokenizer, so text stop strings cannot work.
        ("stop_without_tokenizer", dict(stop=["x"]), "stop"),
        ("bad_words_without_tokenizer", dict(bad_words=["x"]), "bad_words"),
        # With n > 1 nothing of the request may be left behind either.
        ("n3_logprobs_above_max", dict(n=3, temperature=1.0, logprobs=MAX_LOGPROBS + 1),
         "logprobs"),
        ("n2_logit_bias_too_big", dict(n=2, temperature=1.0, logit_bias={vocab: 1.0}),
         "logit_bias"),
    ]


BAD_ENGINE_IDS = [b[0] for b in bad_engine_params(384)]


@pytest.mark.parametrize("case", range(len(BAD_ENGINE_IDS)), ids=BAD_ENGINE_IDS)
def test_bad_params_refused_by_the_engine(llm, vocab, case):
    _, kwargs, field = bad_engine_params(vocab)[case]
    params = SamplingParams(max_tokens=4, **kwargs)  # fine on its own
    engine = llm.llm_engine

    # generate(): raises before anything runs, even after good prompts of the batch.
    with pytest.raises(ValueError, match=field):
        llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=2), params], use_tqdm=False)
    assert_idle_and_usable(llm)

    # add_request() next to a running request: that one is not affected.
    ref = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6),
                       use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("keep", PROMPT, SamplingParams(temperature=0.0, max_tokens=6))
    engine.step()
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", PROMPT, params)
    assert set(engine.unfinished_request_ids()) == {"keep"}
    assert {r for r in scheduler_of(llm).requests} == {"keep"}
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert list(done) == ["keep"] and done["keep"].outputs[0].token_ids == ref
    # The refused id is free to use.
    engine.add_request("bad", PROMPT, SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    assert_idle_and_usable(llm)


def test_logprobs_at_the_cap_are_accepted(llm):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=3, logprobs=MAX_LOGPROBS,
                                                prompt_logprobs=MAX_LOGPROBS),
                       use_tqdm=False)[0]
    assert all(len(row) >= MAX_LOGPROBS for row in out.outputs[0].logprobs)
    assert len(out.prompt_logprobs) == len(PROMPT["prompt_token_ids"])
    out = llm.generate([PROMPT], SamplingParams(max_tokens=2, logprobs=0), use_tqdm=False)[0]
    assert all(len(row) == 1 for row in out.outputs[0].logprobs)  # just the sampled token
    assert_idle_and_usable(llm)


def test_in_vocab_ids_are_accepted(llm, vocab):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0,
                                                allowed_token_ids=[0, vocab - 1],
                                                logit_bias={vocab - 1: 100}),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [vocab - 1] * 3
    assert_idle_and_usable(llm)
