"""All-greedy steps take their tokens from the int8-screened lm_head
(layers/greedy_head.py); the tokens must be those of the full lm_head + argmax."""
from __future__ import annotations

import pytest

from conftest import make_llm, runner_of
from tokenmill import SamplingParams
from tokenmill.worker import model_runner as runner_mod


def _generate(path, prompts, params, screen_rows, monkeypatch, **kw):
    """-> (token ids per request, rows of each greedy-head call)."""
    monkeypatch.setattr(runner_mod, "GREEDY_HEAD_MAX_ROWS", screen_rows)
    llm = make_llm(path, dtype="bfloat16", **kw)
    runner = runner_of(llm)
    calls = []
    if screen_rows:
        if runner.greedy_head is None:
            pytest.skip("this CPU runs bf16 GEMMs natively: no packed bf16 lm_head to screen")
        head = runner.greedy_head
        runner.greedy_head = lambda x: calls.append(x.shape[0]) or head(x)
    else:
        assert runner.greedy_head is None
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], calls


@pytest.mark.parametrize("name", ["qwen3_headdim", "llama_gqa_tied"])
def test_greedy_tokens_equal_with_and_without_screen(tiny_model_factory, monkeypatch, name):
    tm = tiny_model_factory(name)
    prompts = [{"prompt_token_ids": p} for p in tm.prompts]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # max_num_seqs 3: every decode step has at most 3 rows, under the screen's limit.
    off, _ = _generate(tm.path, prompts, params, 0, monkeypatch, max_num_seqs=3)
    on, calls = _generate(tm.path, prompts, params, 4, monkeypatch, max_num_seqs=3)
    assert on == off
    # Every step is all greedy: every token came through the screen.
    assert sum(calls) >= len(prompts) * 24 and max(calls) <= 3


def test_screen_stays_out_of_steps_that_need_logits(tiny_model_factory, monkeypatch):
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
    off, _ = _generate(tm.path, prompts, params, 0, monkeypatch)
    on, calls = _generate(tm.path, prompts, params, 4, monkeypatch)
    assert on == off
    # Only once the three requests that need logits are done: 2 rows, 20 steps.
    assert calls == [2] * 20


def test_row_limit(tiny_model_factory, monkeypatch):
    tm = tiny_model_factory("qwen3_headdim")
    prompts = [{"prompt_token_ids": p} for p in tm.prompts[:6]]
    params = [SamplingParams(max_tokens=4 + 4 * i, temperature=0.0, ignore_eos=True)
              for i in range(6)]
    off, _ = _generate(tm.path, prompts, params, 0, monkeypatch)
    on, calls = _generate(tm.path, prompts, params, 2, monkeypatch)
    assert on == off
    assert calls and max(calls) == 2


def test_async_scheduling_with_the_screen(tiny_model_factory, monkeypatch):
    """Async scheduling runs execute_model / sample_tokens on its worker thread: the
    greedy head there gives the synchronous, unscreened tokens."""
    tm = tiny_model_factory("qwen3_headdim")
    prompts = [{"prompt_token_ids": p} for p in tm.prompts[:5]]
    params = [SamplingParams(max_tokens=5 + 4 * i, temperature=0.0, ignore_eos=True)
              for i in range(5)]
    off, _ = _generate(tm.path, prompts, params, 0, monkeypatch, async_scheduling=False)
    on, calls = _generate(tm.path, prompts, params, 4, monkeypatch, async_scheduling=True,
                          max_num_seqs=4)
    assert on == off
    assert calls and max(calls) <= 4
