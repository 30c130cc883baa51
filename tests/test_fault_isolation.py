"""Per-request fault isolation (issue 14): a failure that belongs to one request
finishes that request with finish_reason "error"; every other request of the
batch finishes with the tokens it gets alone, and nothing leaks (KV blocks,
runner rows, state). A failure nobody can be blamed for kills the engine.

Faults are injected with tokenmill.faults (sampler, detokenizer, grammar
matcher, input preparation) and with a model whose hidden state goes NaN for
one prompt. The demo model has a real tokenizer, so the detokenizer runs.
"""
from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams, faults
from tokenmill.errors import EngineDeadError
from tokenmill.structured_output.params import StructuredOutputsParams

MAX_TOKENS = 10
PROMPTS = {"a": [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28],
           "b": [40, 41, 42, 43, 44],
           "c": [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71],
           "victim": [90, 91, 92, 93, 94, 95, 96]}


def make_llm(**kw):
    args = dict(max_model_len=128, num_kv_blocks=64, block_size=16, max_num_seqs=8,
                dtype="float32", device="cpu")
    args.update(kw)
    return LLM(**args)


@pytest.fixture(scope="module")
def llm():
    return make_llm()


@pytest.fixture(autouse=True)
def _disarm():
    faults.disarm_all()
    yield
    faults.disarm_all()


def params_of(name: str) -> SamplingParams:
    if name == "c":  # a seeded random request: its stream must survive a recompute
        return SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def solo(llm, name: str) -> list[int]:
    out = llm.generate([{"prompt_token_ids": PROMPTS[name]}], params_of(name), use_tqdm=False)
    return out[0].outputs[0].token_ids


def assert_clean(llm):
    engine = llm.llm_engine
    core = engine.engine_core
    assert not engine.has_unfinished_requests()
    assert core.scheduler.kv_cache_manager.num_used_blocks == 0
    assert not core.scheduler.requests and not core.scheduler.waiting
    assert engine.output_processor.requests == {}
    assert core.runner.requests == {} and core.runner.input_batch.num_reqs() == 0


def run_with_victim(llm, victim_params: SamplingParams, arm=None, steps_before: int = 2):
    """a, b, c run a few steps; then the victim joins alone (so it is the only request
    entering the batch in its first step). Returns {id: final RequestOutput}."""
    engine = llm.llm_engine
    for name in ("a", "b", "c"):
        engine.add_request(name, {"prompt_token_ids": PROMPTS[name]}, params_of(name))
    finals = {}

    def step():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out

    for _ in range(steps_before):
        step()
    if arm is not None:
        arm()
    engine.add_request("victim", {"prompt_token_ids": PROMPTS["victim"]}, victim_params)
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        step()
    return finals


@pytest.mark.parametrize("site", ["input", "sampler", "detokenizer"])
def test_a_fault_fails_only_its_request(llm, site):
    refs = {name: solo(llm, name) for name in ("a", "b", "c")}
    errors_before = dict(llm.llm_engine.engine_core.scheduler.num_errors)
    finals = run_with_victim(llm, params_of("victim"),
                             arm=lambda: faults.arm(site, "rid:victim"))
    victim = finals["victim"]
    assert victim.outputs[0].finish_reason == "error"
    assert victim.error and "Traceback" not in victim.error
    for name, ref in refs.items():
        assert finals[name].outputs[0].token_ids == ref, name
        assert finals[name].outputs[0].finish_reason == "length"
        assert finals[name].error is None
    errors = llm.llm_engine.engine_core.scheduler.num_errors
    assert sum(errors.values()) == sum(errors_before.values()) + 1
    assert_clean(llm)
    faults.disarm_all()
    assert solo(llm, "a") == refs["a"]  # the engine is fine afterwards


def test_a_grammar_matcher_fault_fails_only_its_request(llm):
    refs = {name: solo(llm, name) for name in ("a", "b", "c")}
    structured = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                structured_outputs=StructuredOutputsParams(regex="[a-z]{1,40}"))
    finals = run_with_victim(llm, structured, arm=lambda: faults.arm("grammar", "rid:victim"))
    assert finals["victim"].outputs[0].finish_reason == "error"
    for name, ref in refs.items():
        assert finals[name].outputs[0].token_ids == ref, name
    assert_clean(llm)


def test_a_grammar_that_fails_to_compile_never_runs_unconstrained(llm, monkeypatch):
    som = llm.llm_engine.engine_core.structured_output
    som.backend  # loaded before patching

    def broken(grammar):
        raise RuntimeError("compiler bug")

    monkeypatch.setattr(som.backend, "compile", broken)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                            structured_outputs=StructuredOutputsParams(regex="[0-9]{3}x"))
    out = llm.generate([{"prompt_token_ids": PROMPTS["b"]}], params, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error"
    assert out.outputs[0].token_ids == []  # not one unconstrained token
    assert llm.llm_engine.engine_core.scheduler.num_errors.get("grammar", 0) >= 1
    assert_clean(llm)


def poison_model(llm, monkeypatch, seen: set[int]) -> int:
    """A token id not in `seen` whose rows the model's hidden state turns NaN."""
    poison = next(t for t in range(300, 400) if t not in seen)
    model = llm.llm_engine.engine_core.runner.model
    forward = model.forward

    def nan_forward(input_ids, positions, meta):
        hidden = forward(input_ids, positions, meta)
        return hidden.masked_fill((input_ids == poison).unsqueeze(1), float("nan"))

    monkeypatch.setattr(model, "forward", nan_forward)
    return poison


def run_to_end(engine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_nan_logits_fail_only_that_request(llm, monkeypatch):
    """A model whose hidden state goes NaN at one token: the request whose prompt ends
    with it never emits a token (not token 0); the others are untouched."""
    refs = {name: solo(llm, name) for name in ("a", "b", "c")}
    poison = poison_model(llm, monkeypatch, {t for name in refs
                                              for t in refs[name] + PROMPTS[name]})
    victim_prompt = PROMPTS["victim"] + [poison]
    engine = llm.llm_engine
    for name in ("a", "b", "c"):
        engine.add_request(name, {"prompt_token_ids": PROMPTS[name]}, params_of(name))
    engine.add_request("victim", {"prompt_token_ids": victim_prompt}, params_of("victim"))
    finals = run_to_end(engine)
    assert finals["victim"].outputs[0].finish_reason == "error"
    assert finals["victim"].outputs[0].token_ids == []
    assert "NaN" in finals["victim"].error
    for name, ref in refs.items():
        assert finals[name].outputs[0].token_ids == ref, name
    assert engine.engine_core.scheduler.num_errors.get("nan_logits", 0) >= 1
    assert_clean(llm)


def test_nan_logits_fail_only_that_request_in_a_greedy_batch(monkeypatch):
    """Every row plain greedy and more of them than the greedy head takes: the step's
    argmax is the native row_argmax over the logits (sampler.greedy_argmax), whose NaN
    flag must fail the victim alone, never give it a token."""
    llm = make_llm(greedy_head_max_rows=0)
    assert llm.llm_engine.platform.ops is not None and hasattr(llm.llm_engine.platform.ops,
                                                                "row_argmax")
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = {name: PROMPTS[name] for name in ("a", "b", "c")}
    prompts.update({f"d{i}": [100 + 7 * i + j for j in range(5 + i)] for i in range(3)})
    refs = {name: llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)[0]
            .outputs[0].token_ids for name, p in prompts.items()}
    poison = poison_model(llm, monkeypatch, {t for name in refs
                                              for t in refs[name] + prompts[name]})
    import tokenmill.worker.runner_sampling as runner_sampling
    native = []
    inner = runner_sampling.greedy_argmax

    def greedy_argmax(logits, ops=None):
        native.append(ops is not None and logits.shape[0] > 4)
        return inner(logits, ops)
    monkeypatch.setattr(runner_sampling, "greedy_argmax", greedy_argmax)
    engine = llm.llm_engine
    for name, p in prompts.items():
        engine.add_request(name, {"prompt_token_ids": p}, greedy)
    engine.add_request("victim", {"prompt_token_ids": PROMPTS["victim"] + [poison]}, greedy)
    finals = run_to_end(engine)
    assert any(native)
    assert finals["victim"].outputs[0].finish_reason == "error"
    assert finals["victim"].outputs[0].token_ids == []
    for name, ref in refs.items():
        assert finals[name].outputs[0].token_ids == ref, name
    assert_clean(llm)


def test_nan_hidden_fails_its_request_on_the_greedy_head(llm, monkeypatch):
    """All-greedy steps of a few rows take the int8-screened lm_head, which returns a
    token even for a NaN row: the runner must still see the row and fail its request
    (it skips its own check only when the screen proves every row finite)."""
    runner = llm.llm_engine.engine_core.runner
    if runner.greedy_head is None:
        pytest.skip("no greedy lm_head on this platform")
    refs = {name: solo(llm, name) for name in ("a", "b")}
    poison = poison_model(llm, monkeypatch, {t for name in refs
                                              for t in refs[name] + PROMPTS[name]})
    head_calls = []
    head = runner.greedy_head
    call = head.__call__

    def counted(x):
        head_calls.append(x.shape[0])
        return call(x)

    monkeypatch.setattr(runner, "greedy_head", type("Counted", (), {
        "__call__": lambda self, x: counted(x),
        "rows_surely_finite": lambda self: head.rows_surely_finite(),
        "lm_head": head.lm_head})())
    engine = llm.llm_engine
    for name in ("a", "b"):
        engine.add_request(name, {"prompt_token_ids": PROMPTS[name]}, params_of(name))
    engine.add_request("victim", {"prompt_token_ids": PROMPTS["victim"] + [poison]},
                       params_of("victim"))
    finals = run_to_end(engine)
    assert head_calls and max(head_calls) == 3  # the poisoned step went through the screen
    assert finals["victim"].outputs[0].finish_reason == "error"
    assert finals["victim"].outputs[0].token_ids == []
    for name, ref in refs.items():
        assert finals[name].outputs[0].token_ids == ref, name
    assert_clean(llm)


def test_a_fault_under_async_scheduling():
    llm = make_llm(async_scheduling=True)
    refs = {name: solo(llm, name) for name in ("a", "b", "c")}
    finals = run_with_victim(llm, params_of("victim"),
                             arm=lambda: faults.arm("sampler", "rid:victim"))
    assert finals["victim"].outputs[0].finish_reason == "error"
    for name, ref in refs.items():
        assert finals[name].outputs[0].token_ids == ref, name
    assert_clean(llm)


def test_a_failure_nobody_can_be_blamed_for_kills_the_engine(monkeypatch):
    llm = make_llm()
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": PROMPTS["a"]}, params_of("a"))
    engine.step()
    engine.step()  # "a" is decoding: no request enters the next step

    def broken(so):
        raise RuntimeError("kernel bug")

    monkeypatch.setattr(engine.engine_core.runner, "execute_model", broken)
    with pytest.raises(EngineDeadError):
        engine.step()


def test_a_retry_that_fails_too_kills_the_engine(monkeypatch):
    llm = make_llm()
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": PROMPTS["a"]}, params_of("a"))
    engine.step()
    engine.step()
    engine.add_request("victim", {"prompt_token_ids": PROMPTS["victim"]}, params_of("victim"))

    def broken(so):
        raise RuntimeError("kernel bug")

    monkeypatch.setattr(engine.engine_core.runner, "execute_model", broken)
    outs = engine.step()  # blames the request that entered: "victim"
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [("victim", "error")]
    with pytest.raises(EngineDeadError):  # the retry with "a" alone fails as well
        engine.step()


def test_check_sampled_flags_nan_rows_and_ids_outside_the_vocabulary():
    import numpy as np

    from tokenmill.worker.step_checks import check_sampled
    discard = np.array([False, False, False, True])
    nan_rows = np.array([False, True, False, True])
    sampled = np.array([[3], [4], [10_000_000], [-1]])
    errored = check_sampled(["r0", "r1", "r2", "r3"], discard, nan_rows, sampled,
                            np.ones(4, dtype=np.int64), 1000)
    assert {k: v[0] for k, v in errored.items()} == {"r1": "nan_logits",
                                                      "r2": "token_out_of_vocab"}
    # Several tokens a row (speculative decoding): only the emitted ones are checked.
    tokens = np.array([[3, 5000], [4, 5], [6, -1], [7, 8]])
    errored = check_sampled(["r0", "r1", "r2", "r3"], discard, np.zeros(4, bool),
                            tokens, np.array([1, 2, 2, 2]), 1000)
    assert {k: v[0] for k, v in errored.items()} == {"r2": "token_out_of_vocab"}


def test_async_engine_admits_new_requests_after_a_step_with_no_survivors():
    """The victim is the only request: after it fails nothing is left to retry, and the
    next request (not a preempted one) must still be admitted."""
    llm = make_llm(async_scheduling=True)
    faults.arm("sampler", "rid:victim")
    engine = llm.llm_engine
    engine.add_request("victim", {"prompt_token_ids": PROMPTS["victim"]}, params_of("victim"))
    finals = {}
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["victim"].outputs[0].finish_reason == "error"
    faults.disarm_all()
    out = llm.generate([{"prompt_token_ids": PROMPTS["b"]}], params_of("b"), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == MAX_TOKENS
    assert_clean(llm)
