"""A random row's draw straight from its logits (tokenmill/kernels/cpu_draw.cpp, the
Sampler's CPU path) at every capability level this CPU runs: the inverse-CDF rule
against a float64 reference given the same uniforms (vocabularies not whole blocks,
flat, peaked and masked rows, u at 0 and just below 1), never a token of weight 0,
40k draws following the softmax, seeded rows drawing their own streams, bad input."""
from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)
from tokenmill.sample.sampler import Sampler, SamplingMetadata

BELOW_ONE = float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))


def reference(x: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the first index whose running mass passes u * total, in float64; how far the
    target lies from the nearest running mass, relative to the total)."""
    e = (x.double() - x.double().max(dim=1, keepdim=True).values).exp()
    cum = e.cumsum(dim=1)
    total = cum[:, -1:]
    target = u.double().unsqueeze(1) * total
    ids = (cum <= target).sum(dim=1).clamp(max=x.shape[1] - 1)
    margin = ((cum - target).abs() / total).min(dim=1).values
    return ids, margin


def rows(vocab: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g)
    x *= torch.tensor([0.3, 1.0, 3.0, 10.0])[torch.arange(n) % 4].unsqueeze(1)
    if vocab > 4:
        x[1::3, : vocab // 2] = float("-inf")  # a grammar's / top-p's mask
    return x


@pytest.mark.parametrize("vocab", [1, 7, 255, 256, 257, 1000, 32000, 151936])
def test_draws_follow_the_rule(ops, vocab):
    n = 8 if vocab > 100000 else 40
    x = rows(vocab, n, vocab)
    u = torch.rand(n, generator=torch.Generator().manual_seed(vocab + 1))
    u[0], u[1], u[2] = 0.0, BELOW_ONE, 0.5
    got = ops.draw_rows(x, u)
    want, margin = reference(x, u)
    clear = margin > 1e-5  # a target within rounding of a running mass: either side is right
    assert clear.sum() >= n // 2
    assert torch.equal(got[clear], want[clear]), (got[clear], want[clear])
    assert torch.isfinite(x.gather(1, got.unsqueeze(1))).all()  # never a masked token


def test_never_a_token_of_weight_zero(ops):
    """Mass between and after long runs of -inf, u at both ends: only tokens of weight."""
    x = torch.full((6, 3000), float("-inf"))
    x[:, [5, 1700]] = torch.tensor([0.0, 2.0])
    x[3:, 2999] = 1.0
    for u in (0.0, BELOW_ONE, 0.3, 0.99):
        got = ops.draw_rows(x, torch.full((6,), u))
        assert torch.isfinite(x.gather(1, got.unsqueeze(1))).all(), (u, got)
    assert ops.draw_rows(x, torch.zeros(6)).tolist() == [5] * 6
    assert ops.draw_rows(x, torch.full((6,), BELOW_ONE)).tolist() == [1700] * 3 + [2999] * 3


def _md(n, temperature=1.0, generators=None):
    return SamplingMetadata(temperature=torch.full((n,), temperature),
                            greedy_mask=torch.zeros(n, dtype=torch.bool), all_greedy=False,
                            all_random=True, top_k=None, top_p=None,
                            generators=generators or {})


def test_sampler_draws_follow_the_softmax(ops):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0]).expand(40000, -1)
    torch.manual_seed(5)
    for temperature in (0.7, 1.5):
        out = Sampler(ops)(logits.contiguous(), _md(40000, temperature)).sampled_token_ids
        freq = torch.bincount(out, minlength=8).float() / 40000
        expect = (logits[0] / temperature).softmax(-1)
        assert (freq - expect).abs().max() < 0.015, (temperature, freq, expect)


def test_seeded_rows_draw_their_own_streams(ops):
    logits = torch.randn(1, 500).expand(4, -1).contiguous()  # every row the same

    def draw(seed_rows):
        gens = {r: torch.Generator().manual_seed(s) for r, s in seed_rows.items()}
        return torch.stack([Sampler(ops)(logits, _md(4, generators=gens)).sampled_token_ids
                            for _ in range(100)], 1)

    a, b = draw({0: 5, 2: 6}), draw({0: 5, 3: 6})
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[3])
    assert not torch.equal(a[0], a[2])


def test_bad_input_is_refused(ops):
    with pytest.raises(RuntimeError, match="fp32"):
        ops.draw_rows(torch.randn(2, 10).bfloat16(), torch.rand(2))
    with pytest.raises(RuntimeError, match="one uniform a row"):
        ops.draw_rows(torch.randn(2, 10), torch.rand(3))
