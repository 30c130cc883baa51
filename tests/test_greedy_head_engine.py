"""All-greedy steps take their tokens from the int8-screened lm_head
(layers/greedy_head.py); the tokens must be those of the full lm_head + argmax.

Every test runs at each capability level this CPU runs, with the GEMMs widened as
on a CPU without native bf16 (the screen needs the packed bf16 lm_head). The screen
exists where the level's `has_greedy_lm_head` says so; elsewhere the runner has none
and takes the full lm_head, with the same tokens. The engine argument
greedy_head_max_rows sets the row limit (0: off)."""
from __future__ import annotations

import pytest
import torch

from conftest import make_llm, runner_of
from tokenmill import SamplingParams
from tokenmill import kernels
from tokenmill.platforms import cpu as cpu_platform
from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.models.layers.greedy_head import GreedyHead


@pytest.fixture(autouse=True)
def widened(monkeypatch):
    monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: False)


def _generate(path, prompts, params, screen_rows, monkeypatch, ops, **kw):
    """-> (token ids per request, rows of each greedy-head call)."""
    llm = make_llm(path, dtype="bfloat16", greedy_head_max_rows=screen_rows, **kw)
    runner = runner_of(llm)
    calls = []
    if screen_rows and ops.has_greedy_lm_head:
        assert runner.greedy_head is not None
        assert runner.greedy_head_max_rows == screen_rows
        real = GreedyHead.__call__
        monkeypatch.setattr(GreedyHead, "__call__",
                            lambda self, x: calls.append(x.shape[0]) or real(self, x))
    else:
        assert runner.greedy_head is None  # off, or a build without the screen: the full lm_head
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], calls


@pytest.mark.parametrize("name", ["qwen3_headdim", "llama_gqa_tied"])
def test_greedy_tokens_equal_with_and_without_screen(tiny_model_factory, monkeypatch, ops,
                                                     name):
    tm = tiny_model_factory(name)
    prompts = [{"prompt_token_ids": p} for p in tm.prompts]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # max_num_seqs 3: every decode step has at most 3 rows, under the screen's limit.
    off, _ = _generate(tm.path, prompts, params, 0, monkeypatch, ops, max_num_seqs=3)
    on, calls = _generate(tm.path, prompts, params, 4, monkeypatch, ops, max_num_seqs=3)
    assert on == off
    # Every step is all greedy: every token came through the screen.
    assert not ops.has_greedy_lm_head or (sum(calls) >= len(prompts) * 24 and max(calls) <= 3)


def test_screen_stays_out_of_steps_that_need_logits(tiny_model_factory, monkeypatch, ops):
    """Sampled rows, logprobs and logits processors need the full logits: those steps
    take the sampler, and the greedy rows' tokens do not change either way."""
    tm = tiny_model_factory("qwen3_headdim")
    prompts = [{"prompt_token_ids": p} for p in tm.prompts[:5]]
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.0, presence_penalty=1.5,
                             ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)]
    off, _ = _generate(tm.path, prompts, params, 0, monkeypatch, ops)
    on, calls = _generate(tm.path, prompts, params, 4, monkeypatch, ops)
    assert on == off
    # Only once the three requests that need logits are done: 2 rows, 20 steps.
    assert calls == ([2] * 20 if ops.has_greedy_lm_head else [])


def test_row_limit(tiny_model_factory, monkeypatch, ops):
    tm = tiny_model_factory("qwen3_headdim")
    prompts = [{"prompt_token_ids": p} for p in tm.prompts[:6]]
    params = [SamplingParams(max_tokens=4 + 4 * i, temperature=0.0, ignore_eos=True)
              for i in range(6)]
    off, _ = _generate(tm.path, prompts, params, 0, monkeypatch, ops)
    on, calls = _generate(tm.path, prompts, params, 2, monkeypatch, ops)
    assert on == off
    assert not ops.has_greedy_lm_head or (calls and max(calls) == 2)


def test_async_scheduling_with_the_screen(tiny_model_factory, monkeypatch, ops):
    """Async scheduling runs execute_model / sample_tokens on its worker thread: the
    greedy head there gives the synchronous, unscreened tokens."""
    tm = tiny_model_factory("qwen3_headdim")
    prompts = [{"prompt_token_ids": p} for p in tm.prompts[:5]]
    params = [SamplingParams(max_tokens=5 + 4 * i, temperature=0.0, ignore_eos=True)
              for i in range(5)]
    off, _ = _generate(tm.path, prompts, params, 0, monkeypatch, ops, async_scheduling=False)
    on, calls = _generate(tm.path, prompts, params, 4, monkeypatch, ops, async_scheduling=True,
                          max_num_seqs=4)
    assert on == off
    assert not ops.has_greedy_lm_head or (calls and max(calls) <= 4)


def test_screen_where_bf16_gemms_are_native(tiny_model_factory, monkeypatch):
    """A CPU with AVX512-BF16 / AMX keeps bf16 GEMMs (oneDNN's) for large inputs but
    packs the lm_head for decode-sized ones, so the screen runs there too, with the
    tokens of the full lm_head."""
    monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", lambda: True)
    tm = tiny_model_factory("qwen3_headdim")
    llm = make_llm(tm.path, dtype="bfloat16", greedy_head_max_rows=4)
    platform = llm.llm_engine.platform
    if not platform.ops.has_greedy_lm_head:
        pytest.skip(f"the {platform.capability} kernels have no screen")
    levels = kernels.all_levels()
    below_avx512 = "avx512" in levels and levels.index(platform.capability) < levels.index("avx512")
    # an AVX2-only CPU (or a level forced below avx512) computes in fp32 even so
    assert platform.gemm_dtype == ("float32" if below_avx512 else "bfloat16")
    assert platform.lm_head == "greedy_int8" and runner_of(llm).greedy_head is not None
    full = make_llm(tm.path, dtype="bfloat16", greedy_head_max_rows=0)
    assert runner_of(full).greedy_head is None
    prompts = [{"prompt_token_ids": p} for p in tm.prompts[:3]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = [[o.outputs[0].token_ids for o in m.generate(prompts, params, use_tqdm=False)]
              for m in (llm, full)]
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("name", ["qwen3_headdim", "llama_gqa_tied"])
def test_fp32_model_screen_equals_hf(tiny_model_factory, monkeypatch, ops, name):
    """An fp32 model packs its lm_head for linear_f32 and screens it in int8 (a quarter
    of the fp32 bytes a batch-1 step would read): the greedy tokens are HF's."""
    tm = tiny_model_factory(name)
    llm = make_llm(tm.path, greedy_head_max_rows=4, max_num_seqs=3)
    runner = runner_of(llm)
    if not ops.has_greedy_lm_head:
        assert runner.greedy_head is None
        return
    assert llm.llm_engine.platform.lm_head == "greedy_int8"
    assert runner.greedy_head is not None and runner.greedy_head.dtype == torch.float32
    calls = []
    real = GreedyHead.__call__
    monkeypatch.setattr(GreedyHead, "__call__",
                        lambda self, x: calls.append(x.dtype) or real(self, x))
    prompts = tm.prompts[:4]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [tm.reference(p) for p in prompts]
    assert calls and set(calls) == {torch.float32}
