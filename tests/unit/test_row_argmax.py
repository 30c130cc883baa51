"""Greedy sampling's native argmax (tokenmill/kernels/cpu_argmax.cpp) against torch.argmax,
at every capability level this CPU runs: vocabularies that are not whole blocks, ties
within and across blocks, NaN rows (the first NaN's index, flagged), infinities (a
+inf beside a -inf makes a block's sum NaN without a NaN in it), strided rows."""
from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.sample.sampler import greedy_argmax

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.float()
    return x.argmax(dim=1), torch.isnan(x).any(dim=1)


def check(ops, logits):
    ids, nan = ops.row_argmax(logits)
    want_ids, want_nan = reference(logits)
    assert ids.dtype == torch.int64 and nan.dtype == torch.bool
    assert torch.equal(nan, want_nan)
    assert torch.equal(ids, want_ids), (ids, want_ids)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 255, 256, 257, 1000, 32000, 151936])
def test_random_rows(ops, dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    rows = 3 if vocab > 100000 else 13
    check(ops, (torch.randn(rows, vocab, generator=g) * 5).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_take_the_first(ops, dtype):
    """Equal maxima in one block, in two blocks, in the tail, and a row of one value."""
    x = torch.zeros(6, 1000, dtype=dtype)
    x[0, [17, 40]] = 3  # one block
    x[1, [300, 600]] = 3  # two blocks: the earlier wins
    x[2, [999, 998]] = 3  # the tail (past the last whole block)
    x[3, [255, 256]] = 3  # the last value of a block, the first of the next
    x[4, [5, 700]] = 3
    x[4, 600] = 2.5  # a smaller maximum between
    check(ops, x)  # row 5: all zero -> 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_rows_take_the_first_nan(ops, dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 1000, generator=g).to(dtype)
    x[0, 500] = float("nan")
    x[1, [700, 20]] = float("nan")  # the first NaN by index, in an earlier block
    x[2, 999] = float("nan")  # in the tail
    x[3, 0] = float("nan")
    x[3, 1] = float("inf")
    x[4, 100] = float("inf")  # no NaN: +inf is the maximum
    check(ops, x)  # row 5: no NaN


@pytest.mark.parametrize("dtype", DTYPES)
def test_infinities(ops, dtype):
    """-inf masks (a grammar's), a row all -inf, +inf beside -inf in one block."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 2000, generator=g).to(dtype)
    x[0, :1500] = float("-inf")
    x[1] = float("-inf")  # argmax 0, no NaN
    x[2, 10] = float("-inf")
    x[2, 20] = float("inf")  # the block's sum is NaN: scanned, the +inf wins
    x[3, 600] = float("inf")
    x[3, 700] = float("inf")  # the first of two +inf
    x[4, :] = float("-inf")
    x[4, 1999] = -1e30 if dtype != torch.float16 else -60000.0
    check(ops, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_greedy_argmax(ops, dtype):
    """Rows lying further apart than the vocabulary (a slice of wider logits), and the
    sampler's greedy_argmax taking the kernel or torch's max with the same result."""
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(9, 3000, generator=g).to(dtype)
    logits = wide[:, :2999]
    logits[4, 1234] = float("nan")
    check(ops, logits)
    native = greedy_argmax(logits, ops)
    fallback = greedy_argmax(logits)
    assert torch.equal(native[0][native[1].logical_not()], fallback[0][fallback[1].logical_not()])
    assert torch.equal(native[1], fallback[1])


def test_refuses_bad_input(ops):
    with pytest.raises(RuntimeError, match="row_argmax"):
        ops.row_argmax(torch.zeros(3, 0))
    with pytest.raises(RuntimeError, match="row_argmax"):
        ops.row_argmax(torch.zeros(3, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="row_argmax"):
        ops.row_argmax(torch.zeros(8, 3).t())


@pytest.mark.parametrize("kind", ["greedy", "mixed"])
def test_sampler_draws_the_same_through_the_kernel(ops, kind):
    """The Sampler's argmaxes (greedy rows, alone or beside random ones) taken by
    row_argmax give what torch's argmax gives, the random rows drawing the same (the
    native draw_rows against softmax, cumsum and search: the same rule and uniforms)."""
    from tokenmill.sample.sampler import Sampler, SamplingMetadata
    n, vocab = 37, 5000
    greedy = [True] * n if kind == "greedy" else [r % 3 == 0 for r in range(n)]
    mask = torch.tensor(greedy)
    temp = torch.full((n,), 0.8)
    temp[mask] = 1.0
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(6)) * 3

    def draw(sampler):
        torch.manual_seed(11)
        gens = {r: torch.Generator().manual_seed(r) for r in range(1, n, 3)}  # (random rows)
        md = SamplingMetadata(temperature=temp, greedy_mask=mask, all_greedy=bool(mask.all()),
                              all_random=not bool(mask.any()), top_k=None, top_p=None,
                              generators=gens)
        return sampler(logits.clone(), md).sampled_token_ids
    calls = []

    class Counting:  # the kernels, counting row_argmax's calls
        def row_argmax(self, x):
            calls.append(x.shape)
            return ops.row_argmax(x)

        def __getattr__(self, name):  # the others (the random rows' draw_rows) as they are
            return getattr(ops, name)
    native, torch_ = draw(Sampler(Counting())), draw(Sampler())
    assert calls and all(shape == (n, vocab) for shape in calls)
    assert torch.equal(native, torch_)
    if kind != "greedy":  # (the draws are random: not every row its argmax)
        assert not torch.equal(native, logits.argmax(dim=-1))
