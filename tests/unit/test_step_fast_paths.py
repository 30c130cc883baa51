"""The shortcuts a decode step takes to cut its host time, against the plain
definitions they stand for:

* `greedy_argmax` (an all-plain-greedy step's sampling on CPU: one max() in the
  logits' dtype) gives the ids of `logits.float().argmax(-1)` and the NaN rows of
  `isnan(logits.amax(1))`, ties, NaN and infinities included;
* `nonfinite_rows` (the greedy head's check of the hidden rows) is
  `~isfinite(x).all(1)`, the largest finite values included;
* the persistent batch's kept answers (`all_plain_greedy`, the condense and free-row
  shortcuts) equal a fresh computation after any sequence of adds, removes, swaps
  and condenses.
"""
from __future__ import annotations

import random

import pytest
import torch

from tokenmill.sample.sampler import greedy_argmax, nonfinite_rows
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.input_batch import CachedRequestState, InputBatch

CPU = torch.device("cpu")


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Few distinct values: many ties for the maximum.
    x = torch.randint(-3, 4, (rows, vocab), generator=g).to(dtype)
    specials = torch.rand(rows, vocab, generator=g)
    x[specials < 0.002] = float("nan")
    x[(specials > 0.5) & (specials < 0.501)] = float("inf")
    x[(specials > 0.6) & (specials < 0.601)] = float("-inf")
    if rows > 2:
        x[1] = float("-inf")  # a row of -inf only
        x[2] = float("nan")   # a row of NaN only
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 5, 130])
@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_argmax_is_float_argmax_and_the_nan_rows(dtype, rows, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seed in range(6):
            logits = _logits(rows, 3001, dtype, seed)
            ids, nan_rows = greedy_argmax(logits)
            assert ids.dtype == torch.int64
            assert torch.equal(ids, logits.float().argmax(dim=-1))
            assert torch.equal(nan_rows, torch.isnan(logits.amax(dim=1)))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nonfinite_rows_is_not_isfinite_all(dtype):
    big = torch.finfo(dtype).max
    x = torch.randn(8, 512).to(dtype)
    x[1, 7] = float("inf")
    x[2, 0] = float("-inf")
    x[3, 511] = float("nan")
    x[4] = big        # finite, however large: a sum of x itself would overflow
    x[5, ::2] = -big
    x[6, 3], x[6, 4] = float("inf"), float("-inf")
    got = nonfinite_rows(x)
    assert torch.equal(got, ~torch.isfinite(x).all(dim=1))
    assert got.tolist() == [False, True, True, True, False, False, True, False]


def _state(i: int, rng: random.Random) -> CachedRequestState:
    kind = rng.choice(["greedy", "greedy", "random", "logprobs", "penalty"])
    sp = {"greedy": SamplingParams(temperature=0.0),
          "random": SamplingParams(temperature=0.8),
          "logprobs": SamplingParams(temperature=0.0, logprobs=2),
          "penalty": SamplingParams(temperature=0.0, presence_penalty=0.5)}[kind]
    prompt = [rng.randrange(100) for _ in range(rng.randint(1, 6))]
    return CachedRequestState(f"r{i}", prompt, sp, None, [[]], 0)


def _fresh_plain_greedy(batch: InputBatch) -> bool:
    n = batch.num_reqs()
    return all(batch.params[r].temperature < 1e-5 and batch.params[r].logprobs is None
               and not batch.needs_processors[r] and not batch.has_grammar[r]
               for r in range(n))


@pytest.mark.parametrize("seed", range(5))
def test_batch_shortcuts_equal_a_fresh_computation(seed):
    rng = random.Random(seed)
    batch = InputBatch(8, 32, [16], CPU, 100)
    live: list[str] = []
    for i in range(200):
        op = rng.random()
        if op < 0.45 and len(live) < 8:
            state = _state(i, rng)
            row = batch.add_request(state)
            assert batch.req_ids[row] == state.req_id
            assert row == min(r for r in range(8) if r not in
                              {batch.req_id_to_index[x] for x in live})
            live.append(state.req_id)
        elif op < 0.75 and live:
            batch.remove_request(live.pop(rng.randrange(len(live))))
            if rng.random() < 0.5:
                batch.condense()
        elif op < 0.9 and len(live) >= 2:
            batch.condense()
            a, b = rng.sample(range(batch.num_reqs()), 2)
            batch.swap_states(a, b)
        else:
            batch.condense()
        if rng.random() < 0.5:
            batch.condense()
            n = batch.num_reqs()
            # Dense after condense: rows [0, n) hold exactly the live requests.
            assert sorted(batch.req_ids[:n]) == sorted(live)
            assert all(r is None for r in batch.req_ids[n:])
            assert {batch.req_ids[r]: r for r in range(n)} == batch.req_id_to_index
            assert batch.all_plain_greedy() == _fresh_plain_greedy(batch)
            assert batch.all_plain_greedy() == _fresh_plain_greedy(batch)  # kept answer
