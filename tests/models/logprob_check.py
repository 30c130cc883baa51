"""Reported logprobs against Hugging Face transformers (fp32): the shared checks.

The reference of a position is HF's log_softmax of the logits of one dense
forward over prompt + generated tokens (no cache, no padding), in fp32. Every
reported value must be within TOL of it: the chosen token's value and rank, the
top-k ids, values and ranks, the cumulative logprob.

A reference is a TinyModel-like object (its `.hf` model gets the token ids and
nothing else; results are cached per model and token sequence, so the parity
suites' variants of one spec share one HF forward per prompt) or a callable
tokens -> [len(tokens), vocab] log-probs, for models whose forward needs more
inputs than the token ids (the vision-language ones).
"""
from __future__ import annotations

import weakref

import pytest
import torch

TOL = 1e-4
K = 5  # the top-k width the parity suites ask for

_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


@torch.no_grad()
def hf_logprobs(source, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: row i is HF's log-distribution of the token after tokens[:i+1]."""
    if not hasattr(source, "hf"):
        return source(tokens)
    model = source.hf
    per_model = _CACHE.setdefault(model, {})
    key = tuple(tokens)
    if key not in per_model:
        per_model[key] = model(torch.tensor([tokens])).logits[0].float().log_softmax(-1).clone()
    return per_model[key]


def check_position(d: dict, hf_row: torch.Tensor, chosen: int, k: int, where: str) -> None:
    """One position's {token id: Logprob} against HF: the chosen token with its value and
    rank, plus the top-k (ranks 1..k, values and ids HF's)."""
    assert chosen in d, where
    x = hf_row[chosen].item()
    assert d[chosen].logprob == pytest.approx(x, abs=TOL), (where, chosen, d[chosen].logprob, x)
    # Rank = 1 + number of strictly more likely tokens; near-ties get TOL of slack.
    lo = 1 + int((hf_row > x + TOL).sum())
    hi = 1 + int((hf_row > x - TOL).sum())
    assert lo <= d[chosen].rank <= hi, (where, d[chosen].rank, lo, hi)
    assert len(d) in (k, k + 1), where
    top_vals = hf_row.topk(k).values.tolist() if k else []
    ranks = []
    for tok, lp in d.items():
        assert lp.logprob == pytest.approx(hf_row[tok].item(), abs=TOL), (
            where, tok, lp.logprob, hf_row[tok].item())
        if tok == chosen and lp.rank > k:
            continue  # the chosen token outside the top-k
        assert 1 <= lp.rank <= k, (where, tok, lp.rank)
        ranks.append(lp.rank)
        # It is the rank-th most likely token of HF's distribution.
        assert lp.logprob == pytest.approx(top_vals[lp.rank - 1], abs=TOL), (
            where, tok, lp.rank, lp.logprob, top_vals[lp.rank - 1])
    assert sorted(ranks) == list(range(1, k + 1)), (where, ranks)


def check_completion(source, prompt: list[int], comp, k: int, where: str = "",
                     greedy: bool = False) -> torch.Tensor:
    """A completion's per-token logprobs and cumulative logprob against HF; returns HF's
    rows for the generated positions. greedy: every chosen token is the engine's rank 1."""
    toks = list(comp.token_ids)
    assert comp.logprobs is not None and len(comp.logprobs) == len(toks), where
    hf = hf_logprobs(source, list(prompt) + toks[:-1])[len(prompt) - 1:]
    for i, (t, d) in enumerate(zip(toks, comp.logprobs)):
        check_position(d, hf[i], t, k, f"{where} token {i}")
        if greedy:
            assert d[t].rank == 1, (f"{where} token {i}", d[t].rank)
    total = sum(d[t].logprob for t, d in zip(toks, comp.logprobs))
    assert comp.cumulative_logprob == pytest.approx(total, abs=1e-5), where
    assert comp.cumulative_logprob == pytest.approx(
        float(hf[torch.arange(len(toks)), torch.tensor(toks)].sum()), abs=TOL * len(toks)), where
    return hf


def check_prompt_logprobs(source, prompt: list[int], plp, k: int, where: str = "") -> None:
    assert plp is not None and len(plp) == len(prompt), where
    assert plp[0] is None
    if len(prompt) < 2:
        return
    hf = hf_logprobs(source, prompt)
    for j in range(1, len(prompt)):
        check_position(plp[j], hf[j - 1], prompt[j], k, f"{where} prompt position {j}")
