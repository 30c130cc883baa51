"""The min-p / top-k / top-p cut (tokenmill.sample.sampler.top_k_top_p_): the native
radix select (tokenmill/kernels/cpu_top_k_top_p.cpp) at every capability level this
CPU runs, and the sort the other devices take, both against a float64 reference of
the rule: min-p keeps the values whose probability is at least min_p times the top
one; top-k then the values at or above the k-th largest of those; top-p then the
values at or above the first one, from the top, at which the running mass
(renormalised over what is kept so far) reaches p. Vocabularies of 1 to 151,936, flat
and peaked rows, ties, -inf masks, k past the vocabulary, rows mixing the three,
NaN / inf rows; and the chain against transformers' warpers."""
from __future__ import annotations

import math

import pytest
import torch

from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.sample.sampler import top_k_top_p_

NEG_INF = float("-inf")


def native(ops, x, k, p, min_p=None):
    """The kernel's thresholds [N] on a copy of x, checked to have masked that copy by them."""
    y = x.clone()
    thr = ops.top_k_top_p_mask_(y, k, p, torch.empty(0) if min_p is None else min_p)
    assert thr.shape == (x.shape[0],) and thr.dtype == torch.float32
    assert torch.equal(y, x.masked_fill(x < thr.unsqueeze(1), NEG_INF))
    return thr


def cut(x, k, p, ops=None, min_p=None):
    """top_k_top_p_'s thresholds [N] on a copy of x (the native path with ops)."""
    return top_k_top_p_(x.clone(), k, p, ops, min_p=min_p).squeeze(1)


def reference(row: torch.Tensor, k: int, p: float, min_p: float = 0.0) -> tuple[float, float]:
    """(threshold, margin) of one fp32 row in float64: margin, how far the running mass
    at the top-p cut, and just before it, lie from p, and how far any value lies from
    the min-p cut (rows closer than rounding can tell are skipped by the caller)."""
    x = row.double()
    values, counts = torch.unique(x, sorted=True, return_counts=True)
    values, counts = values.flip(0), counts.flip(0)  # distinct values, largest first
    vocab = row.numel()
    thr = values[-1].item()
    margin = math.inf
    if min_p > 0:
        at_min = values[0].item() + math.log(min_p)
        thr = max(thr, at_min)
        finite = values[torch.isfinite(values)]
        margin = (finite - at_min).abs().min().item() if finite.numel() else math.inf
    if 0 < k < vocab:
        seen = counts.cumsum(0)
        kth = values[int((seen < k).sum())].item()
        thr = max(thr, kth)
    if p < 1:
        kept = values >= thr
        mass = torch.where(kept, (values - values[0]).exp() * counts, torch.zeros_like(values))
        share = mass.cumsum(0) / mass.sum()
        at = min(int((share < p).sum()), values.numel() - 1)
        thr = max(thr, values[at].item())
        margin = min(margin, (share - p).abs().min().item())
    return thr, margin


def check(got: torch.Tensor, logits: torch.Tensor, ks, ps, mins=None):
    got = got.squeeze(1) if got.dim() == 2 else got
    mins = mins or [0.0] * logits.shape[0]
    checked = 0
    for r in range(logits.shape[0]):
        want, margin = reference(logits[r], ks[r], ps[r], mins[r])
        if margin < 1e-5:
            continue  # the cut lies within rounding of p: either side is right
        # the same row once masked (a threshold of -inf and one of the row's smallest
        # value both keep all; a cut among zero-mass values changes no probability)
        row = logits[r]
        kept = row.masked_fill(row < got[r], NEG_INF)
        want_kept = row.masked_fill(row < want, NEG_INF)
        assert torch.equal(kept, want_kept), (r, got[r].item(), want, ks[r], ps[r], mins[r])
        checked += 1
    assert checked >= logits.shape[0] // 2  # the test compares something


def rows(vocab: int, n: int, seed: int) -> torch.Tensor:
    """Flat, peaked and sharp rows, some with -inf masks and ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g)
    x *= torch.tensor([0.3, 1.0, 3.0, 10.0])[torch.arange(n) % 4].unsqueeze(1)
    if vocab > 4:
        x[1::3, : vocab // 3] = NEG_INF  # a grammar's / min_p's mask
        x[2::3] = (x[2::3] * 2).round() / 2  # many ties
    return x


def params(n: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    k_choices = [0, -1, 1, 2, 5, 50, vocab - 1, vocab, vocab + 7]
    p_choices = [1.0, 1e-6, 0.1, 0.5, 0.9, 0.95, 0.999]
    min_choices = [0.0, 0.0, 0.0, 1e-4, 0.05, 0.3, 1.0]
    ks = [k_choices[int(i)] for i in torch.randint(len(k_choices), (n,), generator=g)]
    ps = [p_choices[int(i)] for i in torch.randint(len(p_choices), (n,), generator=g)]
    mins = [min_choices[int(i)] for i in torch.randint(len(min_choices), (n,), generator=g)]
    return ks, ps, mins


@pytest.mark.parametrize("vocab", [1, 2, 7, 100, 2051, 32000, 151936])
def test_native_matches_the_rule(ops, vocab):
    n = 6 if vocab > 100000 else 24
    x = rows(vocab, n, vocab)
    ks, ps, mins = params(n, vocab, vocab)
    k, p, m = torch.tensor(ks, dtype=torch.int32), torch.tensor(ps), torch.tensor(mins)
    none = [0] * n, [1.0] * n, [0.0] * n
    check(native(ops, x, k, p, m), x, ks, ps, mins)
    # each alone and in pairs (the others given as none)
    e = torch.empty(0)
    check(native(ops, x, k, e), x, ks, none[1])
    check(native(ops, x, e, p), x, none[0], ps)
    check(native(ops, x, e, e, m), x, none[0], none[1], mins)
    check(native(ops, x, k, p), x, ks, ps)
    check(native(ops, x, e, p, m), x, none[0], ps, mins)


@pytest.mark.parametrize("vocab", [1, 7, 2051, 32000])
def test_sort_path_matches_the_rule(vocab):
    n = 24
    x = rows(vocab, n, vocab + 5)
    ks, ps, mins = params(n, vocab, vocab + 5)
    k, p, m = torch.tensor(ks, dtype=torch.int32), torch.tensor(ps), torch.tensor(mins)
    check(cut(x, k, p, min_p=m), x, ks, ps, mins)
    check(cut(x, None, p), x, [0] * n, ps)
    check(cut(x, k, None), x, ks, [1.0] * n)
    check(cut(x, None, None, min_p=m), x, [0] * n, [1.0] * n, mins)


def test_native_and_sort_masks_agree(ops):
    """The mask top_k_top_p_ makes is the same on both paths (the sampler's and the
    rejection sampler's distributions do not depend on which ran)."""
    x = rows(32000, 32, 11)
    ks, ps, mins = params(32, 32000, 11)
    k, p, m = torch.tensor(ks, dtype=torch.int32), torch.tensor(ps), torch.tensor(mins)
    native, sort = x.clone(), x.clone()
    top_k_top_p_(native, k, p, ops, min_p=m)
    top_k_top_p_(sort, k, p, min_p=m)
    same = (native.isinf() == sort.isinf()).all(dim=1)
    assert same.float().mean() >= 0.9  # (rows at a rounding boundary may differ by a tie group)
    assert torch.equal(native[same], sort[same])


def test_ties_are_kept_together(ops):
    x = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0],
                      [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    for path in (ops, None):
        # top-k 2 of [3, 2, 2, 2, ...]: the k-th largest is 2, all three 2s stay
        thr = cut(x, torch.tensor([2, 3]), None, path)
        assert thr.tolist() == [2.0, 1.0]
        # top-p 0.9: 3 holds 0.44 of the mass, the three 2s reach 0.92 together (any
        # one of them alone would not); a flat row: the first value reaches 0.5, and its
        # equals stay
        thr = cut(x, None, torch.tensor([0.9, 0.5]), path)
        assert thr.tolist() == [2.0, 1.0]


def test_most_likely_always_stays(ops):
    x = rows(5000, 8, 3)
    p = torch.full((8,), 1e-9)
    for path in (ops, None):
        thr = cut(x, torch.ones(8, dtype=torch.int32), p, path)
        assert torch.equal(thr, x.max(dim=1).values)


def test_nan_and_inf_rows_stay_in_bounds(ops):
    """A row with a NaN or an inf gets some threshold (its request fails on the NaN
    elsewhere); the other rows are unaffected."""
    x = rows(1000, 6, 9)
    x[0, 10] = float("nan")
    x[1, 20] = float("inf")
    x[2] = NEG_INF
    x[3, 5] = float("-nan")
    ks, ps = [10] * 6, [0.9] * 6
    thr = ops.top_k_top_p_mask_(x.clone(), torch.tensor(ks), torch.tensor(ps),
                                torch.full((6,), 0.01))
    assert thr.shape == (6,)
    check(thr[4:], x[4:], ks[4:], ps[4:], [0.01] * 2)


def test_bad_input_is_refused(ops):
    x, e = torch.randn(4, 100), torch.empty(0)
    with pytest.raises(RuntimeError, match="fp32"):
        ops.top_k_top_p_mask_(x.bfloat16(), e, torch.full((4,), 0.9), e)
    with pytest.raises(RuntimeError, match="top_k"):
        ops.top_k_top_p_mask_(x, torch.ones(3, dtype=torch.int32), e, e)
    with pytest.raises(RuntimeError, match="top_p"):
        ops.top_k_top_p_mask_(x, e, torch.ones(5), e)
    with pytest.raises(RuntimeError, match="min_p"):
        ops.top_k_top_p_mask_(x, e, e, torch.ones(2))
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.top_k_top_p_mask_(x.t(), e, torch.ones(100), e)


@pytest.mark.parametrize("k,p,min_p", [(5, None, 0.1), (None, 0.7, 0.05), (10, 0.5, None),
                                       (None, None, 0.3), (20, 0.9, 0.01), (1, 0.05, 0.9),
                                       (5, None, None), (None, 0.05, None), (1, None, None),
                                       (500, 0.95, None)])
def test_the_chain_matches_transformers_warpers(ops, k, p, min_p):
    """min-p, top-k, top-p in that order (compute_probs's), native and sorted, against
    transformers' MinP / TopK / TopP warpers chained the same way (k = 500: the whole
    vocabulary)."""
    from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    g = torch.Generator().manual_seed(17)
    logits = torch.randn(8, 500, generator=g) * 2.5
    ids = torch.zeros(8, 1, dtype=torch.long)
    want = logits.clone()
    if min_p is not None:
        want = MinPLogitsWarper(min_p)(ids, want)
    if k is not None:
        want = TopKLogitsWarper(k)(ids, want)
    if p is not None:
        want = TopPLogitsWarper(p)(ids, want)
    kt = None if k is None else torch.full((8,), k, dtype=torch.int32)
    pt = None if p is None else torch.full((8,), float(p))
    mt = None if min_p is None else torch.full((8,), float(min_p))
    for path in (ops, None):
        got = logits.clone()
        top_k_top_p_(got, kt, pt, path, min_p=mt)
        assert torch.equal(torch.isfinite(got), torch.isfinite(want)), path
        torch.testing.assert_close(got.softmax(-1), want.softmax(-1), rtol=0, atol=1e-6)


def test_sampler_draws_from_the_cut_distribution(ops):
    """The Sampler with the native cut: top-k 4, then top-p 0.8 of these logits keeps
    three tokens (shares .58, .21, .13 of the top four: .79 of them stops short of .8),
    and 40k draws follow the softmax renormalised over those three."""
    from tokenmill.sample.sampler import Sampler, SamplingMetadata
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0]).expand(40000, -1)
    n = logits.shape[0]
    md = SamplingMetadata(temperature=torch.ones(n), greedy_mask=torch.zeros(n, dtype=torch.bool),
                          all_greedy=False, all_random=True,
                          top_k=torch.full((n,), 4, dtype=torch.int32),
                          top_p=torch.full((n,), 0.8))
    torch.manual_seed(7)
    out = Sampler(ops)(logits.contiguous(), md).sampled_token_ids
    freq = torch.bincount(out, minlength=8).float() / n
    expect = torch.zeros(8)
    expect[:3] = logits[0, :3].softmax(-1)
    assert freq[3:].sum() == 0
    assert (freq - expect).abs().max() < 0.015, (freq, expect)
