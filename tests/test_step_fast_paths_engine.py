"""The decode step's shortcuts (`ModelRunner.fast_paths`: the one-token-a-row input
prep `_prepare_decodes` and its Python-list form for a few rows, the sampling
write-back when every row keeps its token, the greedy head's ids without numpy;
`AttentionMetadataBuilder.fast_paths`: a few decode rows' slots from Python ints)
against the general path they stand for: the same engine run twice,
shortcuts on and off, must give the same outputs (token ids, text, logprobs, finish
reasons) and the same flat inputs and attention metadata in every step. The workloads
cover batch 1 (the greedy head), several greedy rows (argmax of the logits), logprobs,
seeded sampling with n > 1 beside greedy requests, stop strings, prompts chunked
between decode rows, and async scheduling.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import make_llm, runner_of
from tokenmill import SamplingParams
from tokenmill.attention.builder import AttentionMetadataBuilder
from tokenmill.worker.model_runner import ModelRunner

STEP_FIELDS = ("input_ids", "positions", "query_start_loc", "seq_lens", "req_indices",
               "logits_indices", "discard_mask", "block_table")
SPEC_FIELDS = ("cu_num_logits", "num_drafts")  # (None on a step without drafts)
META_FIELDS = ("slot_block", "slot_offset", "decode_block_table", "decode_seq_lens")


def _run(path, fast: bool, prompts, params, monkeypatch, **engine):
    monkeypatch.setattr(ModelRunner, "fast_paths", fast)
    monkeypatch.setattr(AttentionMetadataBuilder, "fast_paths", fast)
    llm = make_llm(path, dtype="bfloat16", max_num_batched_tokens=64, **engine)
    runner = runner_of(llm)
    steps = []
    inner = runner._step_metadata

    def record(*a, **kw):
        out = inner(*a, **kw)
        step, meta = runner.last_step, out[3]
        steps.append(([getattr(step, f).copy() for f in STEP_FIELDS]
                      + [None if getattr(step, f) is None else getattr(step, f).copy()
                         for f in SPEC_FIELDS]
                      + [None if getattr(meta, f) is None else getattr(meta, f).clone()
                         for f in META_FIELDS]
                      + [meta.num_decodes, len(meta.prefills)]))
        return out
    runner._step_metadata = record
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [[(c.index, list(c.token_ids), c.text, c.finish_reason, c.stop_reason,
             c.cumulative_logprob,
             None if c.logprobs is None else [{t: (lp.logprob, lp.rank, lp.decoded_token)
                                               for t, lp in d.items()} for d in c.logprobs])
            for c in o.outputs] for o in outs]
    return got, steps


def _same_steps(a, b):
    assert len(a) == len(b)
    for sa, sb in zip(a, b):
        for x, y in zip(sa, sb):
            if isinstance(x, np.ndarray):
                assert x.dtype == y.dtype and np.array_equal(x, y)
            elif isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and torch.equal(x, y)
            else:
                assert x == y


def _prompts(n, seed=0, lo=3, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 250, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def _fast_equals_general(demo_path, prompts, params, monkeypatch, async_scheduling):
    """The run with the shortcuts and without: the same outputs and the same inputs and
    attention metadata every step; -> the shortcuts' run."""
    fast = _run(demo_path, True, prompts, params, monkeypatch,
                async_scheduling=async_scheduling)
    slow = _run(demo_path, False, prompts, params, monkeypatch,
                async_scheduling=async_scheduling)
    assert fast[0] == slow[0]
    _same_steps(fast[1], slow[1])
    return fast


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("batch", [1, 3, 9])
def test_greedy_steps_equal_the_general_path(demo_path, monkeypatch, batch, async_scheduling):
    prompts = _prompts(batch, seed=batch)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    fast = _fast_equals_general(demo_path, prompts, params, monkeypatch, async_scheduling)
    assert all(len(c[1]) == 12 for o in fast[0] for c in o)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_batch_equals_the_general_path(demo_path, monkeypatch, async_scheduling):
    """Greedy, greedy with logprobs, seeded n = 2 sampling and a stop string in one batch,
    prompts of different lengths (chunked beside decode rows)."""
    prompts = _prompts(4, seed=7, lo=2, hi=90)
    probe = _run(demo_path, True, prompts[:1], SamplingParams(temperature=0, max_tokens=16,
                                                              ignore_eos=True),
                 monkeypatch)[0][0][0][2]
    stop = probe[6:8] if len(probe) >= 8 else probe[-2:]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]),
              SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, n=2, seed=11, max_tokens=14,
                             logprobs=2),
              SamplingParams(temperature=0, max_tokens=9)]
    fast = _fast_equals_general(demo_path, prompts, params, monkeypatch, async_scheduling)
    assert fast[0][0][0][3] == "stop" and fast[0][0][0][4] == stop  # the stop string hit
    assert len(fast[0][2]) == 2 and fast[0][1][0][6] is not None


@pytest.mark.parametrize("batch", [1, 3, 9])
def test_speculative_verification_equals_the_general_path(demo_path, monkeypatch, batch):
    """n-gram drafts over repeating prompts (accepted in full, in part, not at all): a
    small greedy batch's verification and its step's inputs on Python lists
    (`_verify_greedy_small`, `_prepare_verifies`, up to 8 rows; 9 takes the general
    path either way) against the general path: the same outputs, the same inputs
    every step, the same acceptance counted."""
    names = ("_verify_greedy_small", "_prepare_verifies")
    calls = {name: [] for name in names}  # per short path: whether each call took it
    for name in names:
        def counted(self, *a, _inner=getattr(ModelRunner, name), _seen=calls[name], **kw):
            out = _inner(self, *a, **kw)
            _seen.append(out is not None)
            return out
        monkeypatch.setattr(ModelRunner, name, counted)
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(5, 250, int(rng.integers(3, 7))).tolist() * 6 for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "adaptive": False}  # (k drafts at every batch size: no row budget)
    runs = []
    for fast in (True, False):
        for seen in calls.values():
            seen.clear()
        got, steps = _run(demo_path, fast, prompts, params, monkeypatch,
                          speculative_config=spec)
        runs.append((got, steps, [sum(calls[name]) for name in names]))
    (fast_out, fast_steps, fast_calls), (slow_out, slow_steps, slow_calls) = runs
    assert fast_out == slow_out
    _same_steps(fast_steps, slow_steps)
    assert slow_calls == [0, 0] and all((c > 0) == (batch <= 8) for c in fast_calls)
