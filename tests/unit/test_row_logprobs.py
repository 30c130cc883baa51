"""The logprobs of a step in one pass (tokenmill/kernels/cpu_logprobs.cpp, through
sampler.gather_logprobs) at every capability level this CPU runs, against torch's
gather / topk / compare-and-sum: vocabularies that are not whole vectors, k from 0 to
64, ties (the earlier index first), -inf entries and rows of fewer finite values than
k, chosen tokens at the ends of the row, NaN rows in bounds, bad input refused."""
from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.sample.sampler import gather_logprobs


def reference(x: torch.Tensor, k: int, chosen: torch.Tensor):
    """torch's result, ties ordered by index (a stable sort: topk leaves their order open)."""
    chosen = chosen.long()
    chosen_lp = x.gather(1, chosen.unsqueeze(1))
    ranks = (x > chosen_lp).sum(dim=1) + 1
    order = torch.sort(x, dim=1, descending=True, stable=True).indices[:, :k]
    ids = torch.cat([chosen.unsqueeze(1), order], dim=1)
    return ids, x.gather(1, ids), ranks


def check(ops, x, k, chosen):
    got = gather_logprobs(x, k, chosen, ops)
    ids, lps, ranks = reference(x, k, chosen)
    assert got.token_ids.dtype == torch.int64 and got.ranks.dtype == torch.int64
    assert torch.equal(got.token_ids, ids)
    assert torch.equal(got.logprobs, lps)
    assert torch.equal(got.ranks, ranks)


@pytest.mark.parametrize("vocab", [1, 5, 17, 1000, 32000, 151936])
@pytest.mark.parametrize("k", [0, 1, 5, 20, 64])
def test_random_rows(ops, vocab, k):
    if k > vocab:
        pytest.skip("k past the vocabulary takes torch's path (which refuses it)")
    g = torch.Generator().manual_seed(vocab + k)
    rows = 3 if vocab > 100000 else 17
    x = (torch.randn(rows, vocab, generator=g) * 4).log_softmax(dim=1)
    chosen = torch.randint(0, vocab, (rows,), generator=g)
    chosen[0], chosen[-1] = 0, vocab - 1
    check(ops, x, k, chosen)


def test_ties_take_the_earlier_index(ops):
    x = torch.zeros(4, 300)
    x[0, [7, 200, 33]] = 5.0  # three equal maxima
    x[1] = torch.arange(300).float() % 3  # many ties, rank of a tied chosen value
    x[2, 299] = 1.0  # the last value alone above a row of zeros
    check(ops, x, 5, torch.tensor([200, 4, 0, 299]))


def test_rows_of_few_finite_values(ops):
    """-inf entries (a mask), and rows with fewer finite values than k: the -inf ones
    follow, by index."""
    x = torch.full((3, 40), float("-inf"))
    x[0, [3, 30]] = torch.tensor([-1.0, -0.5])
    x[1, :] = torch.randn(40)
    x[1, ::2] = float("-inf")
    x[2, 39] = 0.0
    check(ops, x, 6, torch.tensor([30, 1, 0]))


def test_a_sorted_row_inserts_every_value(ops):
    """Ascending rows: every block beats the kept k (the slowest input), still right."""
    x = torch.linspace(-20, 0, 5000).repeat(2, 1)
    x[1] = x[1].flip(0)
    check(ops, x, 20, torch.tensor([10, 4999]))


def test_nan_rows_stay_in_bounds(ops):
    x = torch.randn(4, 500).log_softmax(dim=1)
    x[0, 17] = float("nan")
    x[1] = float("nan")
    x[2, 3] = float("inf")
    got = gather_logprobs(x, 5, torch.tensor([17, 0, 3, 9]), ops)
    assert got.token_ids.shape == (4, 6) and ((got.token_ids >= 0) & (got.token_ids < 500)).all()
    ids, lps, ranks = reference(x[3:], 5, torch.tensor([9]))
    assert torch.equal(got.token_ids[3:], ids) and torch.equal(got.ranks[3:], ranks)


def test_bad_input_is_refused(ops):
    x = torch.randn(3, 100)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        ops.row_logprobs(x, torch.tensor([0, 100, 1]), 5)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        ops.row_logprobs(x, torch.tensor([0, -1, 1]), 5)
    with pytest.raises(RuntimeError, match="k must be"):
        ops.row_logprobs(x, torch.tensor([0, 1, 2]), 65)
    with pytest.raises(RuntimeError, match="chosen must be"):
        ops.row_logprobs(x, torch.tensor([0, 1]), 5)
    with pytest.raises(RuntimeError, match="fp32"):
        ops.row_logprobs(x.bfloat16(), torch.tensor([0, 1, 2]), 5)


def test_past_the_kernel_torch_takes_it(ops):
    """k above 64 and bf16 rows go through torch (the same result)."""
    x = torch.randn(2, 300).log_softmax(dim=1)
    chosen = torch.tensor([5, 6])
    got = gather_logprobs(x, 100, chosen, ops)
    want = gather_logprobs(x, 100, chosen)
    assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.ranks, want.ranks)
