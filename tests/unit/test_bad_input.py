"""Bad input is refused with a ValueError naming the field, before anything runs,
and leaves the engine usable with no KV blocks in use."""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import make_llm, runner_of, scheduler_of
from tokenmill import LLM, SamplingParams
from tokenmill.engine.llm_engine import LLMEngine

MAX_LEN = 64


@pytest.fixture(scope="module")
def llm(llama_tiny):
    return make_llm(llama_tiny.path, max_model_len=MAX_LEN)


def assert_idle_and_usable(llm):
    sched = scheduler_of(llm)
    assert sched.kv_cache_manager.num_used_blocks == 0
    assert not sched.requests and not sched.waiting and not sched.running
    assert llm.llm_engine.output_processor.requests == {}
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                       SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert sched.kv_cache_manager.num_used_blocks == 0


BAD_PROMPTS = [
    ("too_long", {"prompt_token_ids": [1] * (MAX_LEN + 5)}, r"prompt.*max_model_len"),
    ("empty", {"prompt_token_ids": []}, r"prompt.*empty"),
    ("token_too_big", {"prompt_token_ids": [1, 2, 384]}, r"prompt_token_ids.*384.*vocab"),
    ("token_negative", {"prompt_token_ids": [1, -1, 2]}, r"prompt_token_ids.*-1.*vocab"),
    ("not_ints", {"prompt_token_ids": [1, "a"]}, r"prompt_token_ids"),
    ("wrong_type", 12345, r"prompt"),
    ("text_without_tokenizer", "hello", r"prompt.*tokenizer"),
]


@pytest.mark.parametrize("prompt,pattern", [b[1:] for b in BAD_PROMPTS],
                         ids=[b[0] for b in BAD_PROMPTS])
def test_bad_prompt_raises_and_runs_nothing(llm, prompt, pattern):
    with pytest.raises(ValueError, match=pattern):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=pattern):
        llm.llm_engine.add_request("x", prompt, SamplingParams(max_tokens=2))
    assert_idle_and_usable(llm)


BAD_PARAMS = [
    ("temperature_negative", dict(temperature=-0.1), "temperature"),
    ("top_p_zero", dict(top_p=0.0), "top_p"),
    ("top_p_above_one", dict(top_p=1.5), "top_p"),
    ("top_k_below_minus_one", dict(top_k=-2), "top_k"),
    ("max_tokens_zero", dict(max_tokens=0), "max_tokens"),
    ("max_tokens_negative", dict(max_tokens=-3), "max_tokens"),
    ("unknown_keyword", dict(best_of_typo=2), "best_of_typo"),
    ("n_zero", dict(n=0), r"\bn\b"),
    ("n_two_greedy", dict(n=2, temperature=0.0), r"\bn=2\b.*greedy"),
    ("stop_token_ids_not_ints", dict(stop_token_ids=["x"]), "stop_token_ids"),
]


@pytest.mark.parametrize("kwargs,field", [b[1:] for b in BAD_PARAMS],
                         ids=[b[0] for b in BAD_PARAMS])
def test_bad_sampling_params_raise_naming_the_field(llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
    assert_idle_and_usable(llm)


def test_edge_values_are_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=1)
    sp = SamplingParams(top_k=-1)
    assert sp.top_k == 0


def test_stop_token_id_outside_vocab_is_refused(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([{"prompt_token_ids": [1, 2]}],
                     SamplingParams(max_tokens=2, stop_token_ids=[10_000]), use_tqdm=False)
    assert_idle_and_usable(llm)


def test_unknown_llm_keyword(llama_tiny):
    with pytest.raises(ValueError, match="max_num_seq_typo"):
        LLM(llama_tiny.path, dtype="float32", device="cpu", max_num_seq_typo=3)


@pytest.mark.parametrize("kwargs,field", [
    (dict(block_size=0), "block_size"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(dtype="float8"), "dtype"),
    (dict(max_model_len=100_000), "max_model_len"),
    (dict(num_kv_blocks=1), "num_kv_blocks"),
    (dict(num_kv_blocks=4, block_size=16), "num_kv_blocks"),  # 3 usable < 64 / 16
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=32), "max_num_batched_tokens"),
])
def test_bad_engine_arguments(llama_tiny, kwargs, field):
    args = dict(dtype="float32", device="cpu", max_model_len=64)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        LLM(llama_tiny.path, **args)


def test_unknown_architecture_lists_the_supported_ones(llama_tiny, tmp_path):
    path = tmp_path / "bad_arch"
    shutil.copytree(llama_tiny.path, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["MysteryForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as exc:
        make_llm(str(path))
    msg = str(exc.value)
    assert "MysteryForCausalLM" in msg
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg


def test_bad_request_into_a_running_engine_is_refused_alone(llama_tiny):
    llm = make_llm(llama_tiny.path, max_model_len=MAX_LEN)
    engine: LLMEngine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, n in enumerate((5, 12, 30)):
        engine.add_request(f"ok{i}", {"prompt_token_ids": list(range(1, n + 1))}, sp)
    finished = {}
    for _ in range(2):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    used = scheduler_of(llm).kv_cache_manager.num_used_blocks
    assert used > 0
    bad = [("bad_len", {"prompt_token_ids": [1] * (MAX_LEN + 1)}, sp),
           ("bad_tok", {"prompt_token_ids": [1, 999]}, sp),
           ("bad_empty", {"prompt_token_ids": []}, sp),
           ("bad_stop", {"prompt_token_ids": [1]}, SamplingParams(stop_token_ids=[-5])),
           ("ok0", {"prompt_token_ids": [1, 2]}, sp)]  # the id is already in use
    for rid, prompt, params in bad:
        with pytest.raises(ValueError):
            engine.add_request(rid, prompt, params)
    # Nothing changed for the running requests.
    assert scheduler_of(llm).kv_cache_manager.num_used_blocks == used
    assert set(scheduler_of(llm).requests) == {"ok0", "ok1", "ok2"}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"ok0", "ok1", "ok2"}
    assert all(len(o.outputs[0].token_ids) == 8 for o in finished.values())
    assert scheduler_of(llm).kv_cache_manager.num_used_blocks == 0


def test_generate_with_one_bad_prompt_runs_nothing(llama_tiny, monkeypatch):
    llm = make_llm(llama_tiny.path, max_model_len=MAX_LEN)
    engine = llm.llm_engine
    steps = []
    orig_step = engine.engine_core.step
    monkeypatch.setattr(engine.engine_core, "step", lambda: steps.append(1) or orig_step())
    good = {"prompt_token_ids": [1, 2, 3]}
    for bad in ({"prompt_token_ids": [1, 999]}, {"prompt_token_ids": []},
                {"prompt_token_ids": [2] * 100}):
        with pytest.raises(ValueError):
            llm.generate([good, good, bad, good], SamplingParams(max_tokens=4), use_tqdm=False)
    # A bad SamplingParams among good ones (validated when its request is added).
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([good, good, good],
                     [SamplingParams(max_tokens=4), SamplingParams(stop_token_ids=[10_000]),
                      SamplingParams(max_tokens=4)], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([good, good], [SamplingParams()], use_tqdm=False)
    assert steps == []
    assert runner_of(llm).requests == {}
    assert_idle_and_usable(llm)
    assert steps  # the good generate did run
