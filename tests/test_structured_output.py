"""Structured output end to end on the demo model (random weights, a real byte-level
BPE tokenizer): whatever the model would say, the grammar alone makes the output
valid. JSON schemas, regexes, choices, EBNF grammars, structural tags; mixed with
unconstrained requests (whose tokens must not change), with preemption, n > 1,
a grammar still compiling, and bad input. The server side is in
tests/test_server_structured_output.py."""
from __future__ import annotations

import json
import re
import threading

import pytest

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")

from tokenmill import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from tokenmill.core.request import RequestStatus  # noqa: E402
from tokenmill.engine.engine_args import EngineArgs  # noqa: E402

SMALL = dict(dtype="float32", device="cpu", max_model_len=512, max_num_seqs=32)

# Bounded everywhere (maxLength, ranges, enums, maxItems): a random model completes it.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["mill", "barn", "river"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "kind", "tags", "ok"],
    "additionalProperties": False,
}
PROMPTS = ["The old mill", "Tell me a story", "JSON please:", "Once upon a time",
           "The river", "A list of things"]


@pytest.fixture(scope="module")
def llm(demo_path):
    return LLM(demo_path, **SMALL)


def structured(i: int, max_tokens: int = 200, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**kw))


def completion(out):
    return out.outputs[0]


def assert_json_valid(c):
    assert c.finish_reason == "stop", (c.text, c.finish_reason, len(c.token_ids))
    # strict=False: xgrammar 0.2.9 compiles a string with maxLength to [^"\\\r\n]{0,n},
    # which lets raw control characters (a random model picks them) into the string.
    value = json.loads(c.text, strict=False)
    jsonschema.validate(value, SCHEMA)
    return value


def _has_async_flag() -> bool:
    return "async_scheduling" in EngineArgs.__dataclass_fields__


# ---- JSON schema, mixed with unconstrained requests --------------------------------
@pytest.mark.parametrize("mode", ["default", "sync"])
def test_json_schema_batch_with_unconstrained_neighbours(demo_path, llm, mode):
    if mode == "sync":
        if not _has_async_flag():
            pytest.skip("no async_scheduling engine argument")
        engine = LLM(demo_path, async_scheduling=False, **SMALL)
    else:
        engine = llm
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain_prompts = PROMPTS[:4]
    alone = engine.generate(plain_prompts, plain, use_tqdm=False)

    prompts, params = [], []
    for i in range(20):
        prompts.append(PROMPTS[i % len(PROMPTS)] + f" #{i}")
        # (free whitespace is unbounded: a random model would fill max_tokens with it)
        params.append(structured(i, json=SCHEMA, disable_any_whitespace=True))
        if i % 5 == 0:  # unconstrained ones in between
            prompts.append(plain_prompts[i // 5])
            params.append(plain)
    outs = engine.generate(prompts, params, use_tqdm=False)
    mixed = []
    for sp, out in zip(params, outs):
        if sp.structured_outputs is None:
            mixed.append(out)
        else:
            assert_json_valid(completion(out))
    # the structured neighbours do not change an unconstrained request's tokens
    assert [completion(o).token_ids for o in mixed] == [completion(o).token_ids for o in alone]
    assert all(completion(o).finish_reason == "length" for o in mixed)


def test_compact_json_has_no_free_whitespace(llm):
    outs = llm.generate(PROMPTS[:3], [structured(i, json=SCHEMA, disable_any_whitespace=True)
                                      for i in range(3)], use_tqdm=False)
    for o in outs:
        c = completion(o)
        assert_json_valid(c)
        # xgrammar's compact style: ", " and ": " separators, no other whitespace
        skeleton = re.sub(r'"(?:[^"\\]|\\.)*"', '""', c.text)
        assert not re.search(r"[\n\r\t]|\s\s|[^,:]\s", skeleton), c.text


def test_json_object(llm):
    # Bias toward closing quotes and braces so an unbounded object ends in time.
    tok = llm.get_tokenizer()
    bias = {t: 4.0 for t in tok.encode('"}', add_special_tokens=False)}
    outs = llm.generate(PROMPTS[:3], [
        SamplingParams(temperature=1.0, seed=i, max_tokens=300, logit_bias=bias,
                       structured_outputs=StructuredOutputsParams(json_object=True))
        for i in range(3)], use_tqdm=False)
    for o in outs:
        c = completion(o)
        assert c.finish_reason == "stop", c.text
        assert isinstance(json.loads(c.text), dict)


# ---- regex, choice, grammar, structural tag ----------------------------------------
REGEXES = [r"\d{3}-\d{4}", r"(cat|dog|bird)s?", r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8})?",
           r"0x[0-9a-f]{4}", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)", r"(yes|no|maybe)!{0,3}"]


def test_regex_outputs_fullmatch(llm):
    params = [structured(i, max_tokens=40, regex=rx) for i, rx in enumerate(REGEXES)]
    params += [structured(50 + i, max_tokens=40, regex=rx) for i, rx in enumerate(REGEXES)]
    outs = llm.generate([PROMPTS[i % 6] for i in range(len(params))], params, use_tqdm=False)
    for sp, o in zip(params, outs):
        c = completion(o)
        assert c.finish_reason == "stop"
        assert re.fullmatch(sp.structured_outputs.regex, c.text), (sp.structured_outputs.regex,
                                                                   c.text)


def test_choice_outputs_are_one_of_the_choices(llm):
    choices = ["positive", "negative", "neutral", 'a "quoted" one', "emoji 🙂"]
    outs = llm.generate(PROMPTS * 2, [structured(i, max_tokens=30, choice=choices)
                                      for i in range(12)], use_tqdm=False)
    seen = set()
    for o in outs:
        c = completion(o)
        assert c.finish_reason == "stop" and c.text in choices, c.text
        seen.add(c.text)
    assert len(seen) > 1  # the draw still picks among them


GRAMMAR = r"""
root ::= greeting ", " name "! " number
greeting ::= "hello" | "hi" | "good " ("morning" | "evening")
name ::= [A-Z] [a-z]{1,7}
number ::= [1-9] [0-9]{0,2} | "zero"
"""
GRAMMAR_RE = r"(hello|hi|good (morning|evening)), [A-Z][a-z]{1,7}! ([1-9][0-9]{0,2}|zero)"


def test_ebnf_grammar_outputs_are_accepted_by_the_grammar(llm):
    outs = llm.generate(PROMPTS, [structured(i, max_tokens=40, grammar=GRAMMAR)
                                  for i in range(6)], use_tqdm=False)
    tok = llm.get_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=llm.llm_engine.model_config.vocab_size,
                                              stop_token_ids=[tok.eos_token_id])
    compiled = xgr.GrammarCompiler(info).compile_grammar(GRAMMAR)
    for o in outs:
        c = completion(o)
        assert c.finish_reason == "stop"
        assert re.fullmatch(GRAMMAR_RE, c.text), c.text
        m = xgr.GrammarMatcher(compiled)  # an independent check with a fresh matcher
        assert m.accept_string(c.text) and m.is_completed(), c.text


def test_structural_tag(llm):
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<answer>",
        "content": {"type": "json_schema", "max_whitespace_cnt": 1,
                    "json_schema": {"type": "object",
                                    "properties": {"kind": {"enum": ["mill", "barn"]}},
                                    "required": ["kind"]}},
        "end": "</answer>"}}
    outs = llm.generate(PROMPTS[:2], [structured(i, max_tokens=60, structural_tag=tag)
                                      for i in range(2)], use_tqdm=False)
    for o in outs:
        c = completion(o)
        assert c.finish_reason == "stop"
        m = re.fullmatch(r"<answer>(.*)</answer>", c.text, re.S)
        assert m and json.loads(m.group(1))["kind"] in ("mill", "barn"), c.text


def test_n_completions_each_follow_the_grammar(llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=40,
                        structured_outputs=StructuredOutputsParams(regex=REGEXES[4]))
    (out,) = llm.generate([PROMPTS[0]], sp, use_tqdm=False)
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert c.finish_reason == "stop" and re.fullmatch(REGEXES[4], c.text), c.text


# ---- scheduling: preemption, a grammar still compiling, abort ----------------------
def test_structured_outputs_stay_valid_under_preemption(demo_path):
    # 23 usable blocks of 16 tokens for 8 requests that each grow to 4+ blocks
    llm = LLM(demo_path, dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=24,
              max_num_seqs=8)
    long_prompts = [p + " " + "and then the mill turned again " * 3 for p in PROMPTS]
    params = [structured(i, max_tokens=180, json=SCHEMA, disable_any_whitespace=True)
              for i in range(8)]
    outs = llm.generate([long_prompts[i % 6] for i in range(8)], params, use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    for o in outs:
        assert_json_valid(completion(o))


def _drain(engine, limit=2000):
    final = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    raise AssertionError("the engine did not finish")


def test_request_waits_for_its_grammar_while_others_run(llm):
    engine = llm.llm_engine
    manager = engine.engine_core.structured_output
    backend = manager.backend
    gate = threading.Event()
    real_compile = backend.compile

    def slow_compile(grammar):
        assert gate.wait(60)
        return real_compile(grammar)

    backend.compile = slow_compile  # this engine's backend only
    try:
        rx = r"slow-[0-9]{2}"  # not compiled before in this module
        engine.add_request("plain", "The old mill",
                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        engine.add_request("slow", "The old mill", structured(0, max_tokens=20, regex=rx))
        sched = engine.engine_core.scheduler
        slow_req = sched.requests["slow"]
        for _ in range(6):
            engine.step()
        assert slow_req.status == RequestStatus.WAITING and slow_req.num_computed_tokens == 0
        assert sched.requests["plain"].num_computed_tokens > 5  # the other one ran
        gate.set()
        final = _drain(engine)
    finally:
        gate.set()
        del backend.compile
    assert completion(final["plain"]).finish_reason == "length"
    c = completion(final["slow"])
    assert c.finish_reason == "stop" and re.fullmatch(rx, c.text), c.text


def test_same_grammar_compiles_once_and_abort_frees_the_matcher(llm):
    engine = llm.llm_engine
    manager = engine.engine_core.structured_output
    rx = r"once-[a-z]{3}"
    before = manager.num_compiled
    engine.add_request("a", "x", structured(1, max_tokens=30, regex=rx))
    engine.add_request("b", "y", structured(2, max_tokens=30, regex=rx))
    assert manager.num_compiled == before + 1
    req_b = engine.engine_core.scheduler.requests["b"]
    assert req_b.structured_output is not None
    engine.step()
    engine.abort_request("b")
    assert req_b.structured_output is None and req_b.status == RequestStatus.FINISHED_ABORTED
    final = _drain(engine)
    assert re.fullmatch(rx, completion(final["a"]).text)


# ---- bad input -----------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    (dict(json={"type": "object", "properties": {"a": {"type": "nope"}}}),
     "structured_outputs.json"),
    (dict(json={"type": "string", "maxLength": -1}), "structured_outputs.json"),
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
    (dict(structural_tag={"type": "structural_tag", "format": {"type": "nope"}}),
     "structured_outputs.structural_tag"),
])
def test_invalid_grammar_is_a_value_error_for_that_request_only(llm, kwargs, field):
    engine = llm.llm_engine
    engine.add_request("good", "The mill", structured(3, max_tokens=30, choice=["a", "b"]))
    bad = SamplingParams(max_tokens=10, structured_outputs=StructuredOutputsParams(**kwargs))
    with pytest.raises(ValueError) as e:
        engine.add_request("bad", "The mill", bad)
    assert str(e.value).startswith(field + ": invalid"), str(e.value)
    assert "bad" not in engine.engine_core.scheduler.requests
    final = _drain(engine)
    assert set(final) == {"good"} and completion(final["good"]).text in ("a", "b")
    with pytest.raises(ValueError, match="^" + re.escape(field)):
        llm.generate(["x", "y"], [SamplingParams(max_tokens=4), bad], use_tqdm=False)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, field", [
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(json={"type": "object"}, regex="a"), "structured_outputs"),
    (dict(), "structured_outputs"),
])
def test_malformed_params_raise_at_construction(kwargs, field):
    with pytest.raises(ValueError) as e:
        SamplingParams(structured_outputs=kwargs)
    assert str(e.value).startswith(field)


def test_model_without_tokenizer_rejects_structured_requests(llama_tiny):
    llm = LLM(llama_tiny.path, dtype="float32", device="cpu", max_model_len=64, max_num_seqs=4)
    with pytest.raises(ValueError, match="^structured_outputs.regex: this model has no tokenizer"):
        llm.generate({"prompt_token_ids": [1, 2, 3]},
                     SamplingParams(structured_outputs={"regex": "a+"}), use_tqdm=False)
    # unconstrained requests are unaffected
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3),
                       use_tqdm=False)
    assert len(completion(out[0]).token_ids) == 3


# ---- through the server (the openai client) ----------------------------------------
MODEL = "demo"
CHAT = [{"role": "user", "content": "Describe the mill as JSON"}]


@pytest.fixture(scope="module")
def server(demo_path, tmp_path_factory):
    pytest.importorskip("httpx")
    from live_server import live_server
    with live_server(demo_path, tmp_path_factory.mktemp("server") / "server.log",
                     "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "512",
                     "--num-kv-blocks", "256", "--log-stats-interval", "0",
                     "--uvicorn-log-level", "warning") as srv:
        yield srv.url


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def no_whitespace(llm) -> dict[str, float]:
    """logit_bias banning whitespace-only tokens: response_format allows free whitespace
    between JSON tokens, which a random model would pick until max_tokens."""
    tok = llm.get_tokenizer()
    vocab = llm.llm_engine.model_config.vocab_size
    return {str(t): -100.0 for t in range(vocab)
            if (text := tok.decode([t])) and not text.strip()}


def test_server_response_format_json_schema(client, no_whitespace):
    fmt = {"type": "json_schema", "json_schema": {"name": "mill", "schema": SCHEMA,
                                                  "strict": True}}
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=300, temperature=1.0, seed=5, n=2,
        response_format=fmt, logit_bias=no_whitespace)
    for ch in r.choices:
        assert ch.finish_reason == "stop", ch.message.content
        jsonschema.validate(json.loads(ch.message.content, strict=False), SCHEMA)
    # streamed: the pieces add up to valid JSON too
    text, finish = "", None
    for chunk in client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=300, temperature=1.0, seed=6, stream=True,
            logit_bias=no_whitespace, response_format={"type": "json_schema",
                             "json_schema": {"name": "m", "schema": SCHEMA}}):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text, strict=False), SCHEMA)


def test_server_response_format_json_object(client, llm):
    tok = llm.get_tokenizer()
    bias = {str(t): 4.0 for t in tok.encode('"}', add_special_tokens=False)}
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=300,
                                       temperature=1.0, seed=3, logit_bias=bias,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    # "text" asks for nothing
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5,
                                       temperature=0, response_format={"type": "text"},
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"


def test_server_guided_fields_and_structured_outputs(client, no_whitespace):
    r = client.completions.create(model=MODEL, prompt="Phone:", max_tokens=30, seed=1,
                                  temperature=1.0, extra_body={"guided_regex": REGEXES[0]})
    assert re.fullmatch(REGEXES[0], r.choices[0].text)
    r = client.completions.create(model=MODEL, prompt="Verdict:", max_tokens=30, seed=2,
                                  temperature=1.0, n=3,
                                  extra_body={"guided_choice": ["guilty", "not guilty"]})
    assert all(c.text in ("guilty", "not guilty") for c in r.choices)
    r = client.completions.create(model=MODEL, prompt="Greet:", max_tokens=40, seed=3,
                                  temperature=1.0, extra_body={"guided_grammar": GRAMMAR})
    assert re.fullmatch(GRAMMAR_RE, r.choices[0].text), r.choices[0].text
    r = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=300, seed=4,
                                  temperature=1.0, logit_bias=no_whitespace,
                                  extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].text, strict=False), SCHEMA)
    r = client.completions.create(
        model=MODEL, prompt="JSON:", max_tokens=300, seed=4, temperature=1.0,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text, strict=False), SCHEMA)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, seed=5,
                                       temperature=1.0,
                                       extra_body={"structured_outputs": {"regex": REGEXES[4]}})
    assert re.fullmatch(REGEXES[4], r.choices[0].message.content)


@pytest.mark.parametrize("kwargs, param", [
    (dict(response_format={"type": "json_schema",
                           "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
     "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format"),
    (dict(response_format={"type": "xml"}), "response_format"),
    (dict(extra_body={"guided_regex": "(unclosed"}), "guided_regex"),
    (dict(extra_body={"guided_choice": []}), "guided_choice"),
    (dict(extra_body={"guided_grammar": "root ::= nothing_here"}), "guided_grammar"),
    (dict(extra_body={"guided_json": "{not json"}), "guided_json"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}),
     "structured_outputs"),
    (dict(extra_body={"structured_outputs": {"json": {"type": "object",
                                                      "required": "name"}}}),
     "structured_outputs"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"}),
     "guided_regex"),
])
def test_server_bad_structured_output_is_400_naming_the_field(client, kwargs, param):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, **kwargs)
    body = e.value.response.json()["error"]
    assert e.value.status_code == 400 and body["param"] == param, body
    assert body["message"].startswith(param), body
    # the server still serves
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_grammar_requests_keep_their_logits(demo_path, dtype):
    """A greedy request under a grammar in a small batch: the int8-screened greedy head
    would take such a step (all rows greedy, few rows), but its bitmask is filled after
    the forward, so the step keeps its logits and the grammar holds - alone, and beside
    plain greedy requests whose tokens do not change."""
    from conftest import runner_of
    llm = LLM(demo_path, **dict(SMALL, dtype=dtype, max_num_seqs=4))
    screen = runner_of(llm).greedy_head is not None
    regex = "(the mill ){2,6}end"
    params = SamplingParams(temperature=0.0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(regex=regex))
    alone = llm.generate(["The old mill"], params, use_tqdm=False)[0]
    assert re.fullmatch(regex, completion(alone).text), completion(alone).text
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [completion(o).token_ids for o in llm.generate(PROMPTS[:2], plain, use_tqdm=False)]
    mixed = llm.generate(["The old mill", *PROMPTS[:2]], [params, plain, plain], use_tqdm=False)
    assert re.fullmatch(regex, completion(mixed[0]).text)
    assert [completion(o).token_ids for o in mixed[1:]] == want
    # Without a grammar in the batch the screen does take the greedy steps.
    assert not screen or runner_of(llm).greedy_head.blocks_recomputed > 0
