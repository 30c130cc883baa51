"""Rejection sampler (speculative decoding): greedy verification, the lossless
random rule against chi-square tests (with wrong rules that must fail them),
acceptance rates, the target transform (top-k, temperature) applied before
verification, seeded streams equal to the normal sampler's, and input checks."""
from __future__ import annotations

import pytest
import torch

import tokenmill.spec_decode.rejection_sampler as rs
from tokenmill.sample.sampler import Sampler, SamplingMetadata
from tokenmill.spec_decode.rejection_sampler import RejectionSampler

# Chi-square critical values at alpha = 0.001 (scipy is not in the venv), by degrees of freedom.
CHI2_CRIT = {5: 20.515, 7: 24.322}


def metadata(n, temperature=1.0, greedy=None, top_k=None, top_p=None, min_p=None,
             generators=None):
    """Per-request metadata; scalar or per-request list arguments."""
    def per_req(x, dtype):
        return None if x is None else torch.as_tensor(
            x if isinstance(x, (list, tuple)) else [x] * n, dtype=dtype)
    greedy_mask = torch.zeros(n, dtype=torch.bool) if greedy is None else torch.tensor(greedy)
    if bool(greedy_mask.all()):
        return SamplingMetadata(None, None, True, False, None, None,
                                generators=generators or {})
    temp = per_req(temperature, torch.float32)
    temp[greedy_mask] = 1.0
    return SamplingMetadata(temp, greedy_mask, False, not bool(greedy_mask.any()),
                            per_req(top_k, torch.int32), per_req(top_p, torch.float32),
                            generators=generators or {}, min_p=per_req(min_p, torch.float32))


def cu_of(ks):
    return torch.tensor([0] + [k + 1 for k in ks]).cumsum(0)


def one_hot_logits(tokens, vocab, high=20.0):
    """Rows whose argmax (and, at temperature 1, almost all mass) is the given token."""
    lg = torch.zeros(len(tokens), vocab)
    lg[torch.arange(len(tokens)), torch.tensor(tokens)] = high
    return lg


def chi2(tokens, p):
    """Pearson's statistic of the observed tokens against probabilities p."""
    obs = torch.bincount(tokens, minlength=p.numel()).double()
    exp = p.double() * tokens.numel()
    assert exp.min() >= 5, "too few samples for a chi-square test"
    return float(((obs - exp) ** 2 / exp).sum())


def test_cu_of():
    assert cu_of([2, 0, 3]).tolist() == [0, 3, 4, 8]


# ---- greedy ------------------------------------------------------------------------------

V = 8


def test_greedy_accepts_the_matching_prefix():
    # Target argmaxes per request (k drafts + the bonus row) and the drafts.
    targets = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5], [6, 7]]
    drafts = [[0, 2, 3], [1, 2, 0], [1, 2, 3], [], [6]]
    logits = one_hot_logits(sum(targets, []), V)
    ks = [len(d) for d in drafts]
    out = RejectionSampler()(logits, cu_of(ks), torch.tensor(sum(drafts, [])),
                             metadata(len(ks), greedy=[True] * len(ks)))
    assert out.num_accepted.tolist() == [0, 2, 3, 0, 1]
    assert out.num_emitted.tolist() == [1, 3, 4, 1, 2]
    assert out.token_ids.tolist() == [[1, -1, -1, -1],   # first draft wrong: the target's token
                                      [1, 2, 3, -1],     # third wrong: two drafts, then 3
                                      [1, 2, 3, 4],      # all right: plus the bonus token
                                      [5, -1, -1, -1],   # no drafts: the plain argmax
                                      [6, 7, -1, -1]]


def test_greedy_and_random_requests_in_one_batch():
    # Greedy requests (0, 1) get flat rows, where the random rule would mostly reject;
    # random requests near-one-hot rows, so their outcome is certain too:
    # p(draft) ~ 1 accepts, p(draft) = 0 (-inf logit) rejects.
    targets = [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5], [6]]
    drafts = [[1, 0], [1, 2], [4], [3], []]
    logits = one_hot_logits(sum(targets, []), V, high=40.0)
    logits[:6] = one_hot_logits(sum(targets[:2], []), V, high=0.3)
    cu = cu_of([len(d) for d in drafts])
    row = int(cu[3])  # request 3 verifies its draft (3) here: p(3) = 0, only token 0 left
    logits[row] = float("-inf")
    logits[row, 0] = 0.0
    ks = [len(d) for d in drafts]
    greedy = [True, True, False, False, False]
    out = RejectionSampler()(logits, cu, torch.tensor(sum(drafts, [])),
                             metadata(len(ks), temperature=0.7, greedy=greedy))
    assert out.num_accepted.tolist() == [1, 2, 1, 0, 0]
    assert out.token_ids.tolist() == [[1, 2, -1], [1, 2, 3], [4, 5, -1], [0, -1, -1],
                                      [6, -1, -1]]


# ---- seeded streams --------------------------------------------------------------------

def _clone(gens):
    return {r: torch.Generator().set_state(g.get_state()) for r, g in gens.items()}


def test_requests_without_drafts_draw_what_the_sampler_draws():
    ks = [0, 2, 0, 3, 0, 1, 0]
    n, vocab = len(ks), 50
    drafts = torch.randint(0, vocab, (sum(ks),), generator=torch.Generator().manual_seed(0))
    gens = {r: torch.Generator().manual_seed(100 + r) for r in range(n)}
    greedy = [False] * n
    greedy[4] = True
    md_kw = dict(temperature=[0.8, 1.0, 1.3, 0.9, 1.0, 1.1, 1.0], greedy=greedy,
                 top_k=[0, 5, 10, 0, 0, 0, 3], top_p=[1.0, 0.9, 1.0, 0.8, 1.0, 1.0, 0.95],
                 min_p=[0.0, 0.0, 0.05, 0.0, 0.0, 0.1, 0.0])
    cu = cu_of(ks)
    ref_gens = _clone(gens)
    for step in range(10):
        logits = torch.randn(int(cu[-1]), vocab, generator=torch.Generator().manual_seed(step))
        out = RejectionSampler()(logits, cu, drafts, metadata(n, generators=gens, **md_kw))
        ref = Sampler()(logits[cu[1:] - 1], metadata(n, generators=ref_gens, **md_kw))
        no_drafts = [i for i, k in enumerate(ks) if k == 0]
        assert out.token_ids[no_drafts, 0].tolist() == \
            ref.sampled_token_ids[no_drafts].tolist(), step
        for i in no_drafts:
            assert torch.equal(gens[i].get_state(), ref_gens[i].get_state())


def test_a_seeded_request_does_not_depend_on_the_batch():
    vocab = 12
    g = torch.Generator().manual_seed(1)
    mine = torch.randn(3, vocab, generator=g)  # k = 2
    my_drafts = torch.tensor([3, 7])
    alone_gen = {0: torch.Generator().manual_seed(7)}
    batch_gen = {2: torch.Generator().manual_seed(7), 0: torch.Generator().manual_seed(8)}
    alone, mixed = [], []
    for step in range(30):
        other = torch.randn(5, vocab, generator=g)
        out = RejectionSampler()(mine, torch.tensor([0, 3]), my_drafts,
                                 metadata(1, generators=alone_gen))
        alone.append(out.token_ids[0].tolist())
        # Ours is request 2, after a seeded request with 3 drafts and an unseeded one with 0.
        logits = torch.cat([other[:4], other[4:], mine])
        drafts = torch.cat([torch.tensor([1, 2, 3]), my_drafts])
        out = RejectionSampler()(logits, torch.tensor([0, 4, 5, 8]), drafts,
                                 metadata(3, temperature=[0.5, 2.0, 1.0],
                                          generators=batch_gen))
        mixed.append(out.token_ids[2, :3].tolist())
    assert alone == mixed
    assert len({tuple(t) for t in alone}) > 3  # really random


# ---- lossless ----------------------------------------------------------------------------

P = torch.tensor([[0.30, 0.25, 0.20, 0.12, 0.08, 0.05],
                  [0.05, 0.10, 0.40, 0.25, 0.15, 0.05],
                  [0.20, 0.20, 0.10, 0.10, 0.15, 0.25]])  # target at positions 0, 1, bonus
Q = torch.tensor([[0.05, 0.10, 0.15, 0.20, 0.25, 0.25],
                  [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]])  # draft at positions 0, 1
N_REQ = 40000


def _speculate(one_hot: bool, seed: int = 0):
    """N_REQ requests with two drafts drawn from Q, verified against P."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    drafts = torch.stack([torch.multinomial(Q[j], N_REQ, replacement=True, generator=g)
                          for j in range(2)], 1).reshape(-1)
    logits = P.log().repeat(N_REQ, 1)
    draft_probs = None if one_hot else Q.repeat(N_REQ, 1)
    out = RejectionSampler()(logits, torch.arange(N_REQ + 1) * 3, drafts,
                             metadata(N_REQ), draft_probs)
    return out, P.log().softmax(-1)  # the exact target, as the sampler computes it


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft_probs", "one_hot"])
def test_emitted_tokens_follow_the_target(one_hot):
    out, p = _speculate(one_hot)
    toks, acc = out.token_ids, out.num_accepted
    assert chi2(toks[:, 0], p[0]) < CHI2_CRIT[5]
    # Given the first draft was accepted, the second token follows position 1's target,
    # and given both were, the bonus token follows the bonus row's.
    assert chi2(toks[acc >= 1, 1], p[1]) < CHI2_CRIT[5]
    assert chi2(toks[acc == 2, 2], p[2]) < CHI2_CRIT[5]
    # Precondition: the drafts alone would fail the test (Q is far from P).
    assert chi2(torch.multinomial(Q[0], N_REQ, replacement=True), p[0]) > 10 * CHI2_CRIT[5]


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("wrong", ["always_accept", "resample_from_p"])
def test_a_wrong_rule_fails_the_same_check(monkeypatch, one_hot, wrong):
    if wrong == "always_accept":  # u = 0 < p / q whenever p(d) > 0
        monkeypatch.setattr(RejectionSampler, "_uniforms",
                            staticmethod(lambda n, *a: torch.zeros(n)))
    else:  # the classic bug: after a rejection, draw from p instead of max(p - q, 0)
        monkeypatch.setattr(rs, "recovery_probs", lambda p, d, q: p)
    out, p = _speculate(one_hot)
    assert chi2(out.token_ids[:, 0], p[0]) > 5 * CHI2_CRIT[5]


# ---- acceptance rates --------------------------------------------------------------------

def test_a_draft_equal_to_the_target_is_always_accepted():
    n, k, vocab = 500, 3, 20
    logits = torch.randn(n * (k + 1), vocab, generator=torch.Generator().manual_seed(3)) * 2
    temperature = 1.5
    probs = (logits / temperature).softmax(-1)
    draft_rows = torch.arange(n * (k + 1)).reshape(n, k + 1)[:, :k].reshape(-1)
    q = probs[draft_rows]
    drafts = torch.multinomial(q, 1, generator=torch.Generator().manual_seed(4)).squeeze(1)
    out = RejectionSampler()(logits, torch.arange(n + 1) * (k + 1), drafts,
                             metadata(n, temperature=temperature), q)
    # Expected acceptances per position: 1 - TV(p, q) = 1.
    assert (out.num_accepted == k).all()
    assert (out.num_emitted == k + 1).all()


def test_acceptance_rate_is_one_minus_total_variation():
    out, p = _speculate(one_hot=False, seed=5)
    rate = (out.num_accepted >= 1).float().mean()
    expect = 1 - 0.5 * (p[0] - Q[0]).abs().sum()
    assert abs(rate - expect) < 4 * (expect * (1 - expect) / N_REQ) ** 0.5 + 1e-3


def _one_hot_acceptance(logits_row, md_kw, n_per_token=4000):
    """Acceptance rate of each token as a single one-hot draft."""
    vocab = logits_row.numel()
    n = n_per_token * vocab
    drafts = torch.arange(n) % vocab
    logits = logits_row.repeat(2 * n, 1)
    out = RejectionSampler()(logits, torch.arange(n + 1) * 2, drafts, metadata(n, **md_kw))
    acc = out.num_accepted.float()
    return torch.stack([acc[drafts == t].mean() for t in range(vocab)]), out


def test_one_hot_acceptance_rate_is_the_target_probability():
    torch.manual_seed(6)
    row = torch.tensor([1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
    rate, _ = _one_hot_acceptance(row, {})
    assert (rate - row.softmax(-1)).abs().max() < 0.03, (rate, row.softmax(-1))


# ---- the target transform comes before verification ----------------------------------

def test_temperature_is_applied_before_verification():
    torch.manual_seed(7)
    row = torch.tensor([1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
    rate, _ = _one_hot_acceptance(row, {"temperature": 0.5})
    hot = (row / 0.5).softmax(-1)
    assert (rate - hot).abs().max() < 0.03
    assert (hot - row.softmax(-1)).abs().max() > 0.1  # the temperature matters


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft_probs", "one_hot"])
def test_a_draft_outside_top_k_is_always_rejected(one_hot):
    torch.manual_seed(8)
    row = torch.tensor([2.0, 1.9, 1.8, 1.7, 0.0, 0.0])
    n, vocab = 3000, row.numel()
    drafts = torch.full((n,), 2)  # the third most likely: outside top-2
    q = torch.zeros(n, vocab)
    q[:, 2] = 0.9
    q[:, 0] = 0.1
    out = RejectionSampler()(row.repeat(2 * n, 1), torch.arange(n + 1) * 2, drafts,
                             metadata(n, top_k=2), None if one_hot else q)
    assert (out.num_accepted == 0).all()
    emitted = out.token_ids[:, 0]
    assert set(emitted.tolist()) == {0, 1}
    # Without top-k the same draft is accepted most of the time.
    out = RejectionSampler()(row.repeat(2 * n, 1), torch.arange(n + 1) * 2, drafts,
                             metadata(n), None if one_hot else q)
    assert out.num_accepted.float().mean() > 0.2


# ---- input checks ------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["cu_start", "cu_end", "empty_request", "draft_count",
                                  "draft_probs", "md_rows", "generator"])
def test_inconsistent_inputs_raise(case):
    logits = torch.zeros(5, V)
    cu = torch.tensor([0, 3, 5])
    drafts = torch.tensor([1, 2, 3])
    md = metadata(2)
    draft_probs = None
    if case == "cu_start":
        cu = torch.tensor([1, 3, 5])
    elif case == "cu_end":
        cu = torch.tensor([0, 3, 4])
    elif case == "empty_request":
        cu, drafts = torch.tensor([0, 3, 3, 5]), torch.tensor([1, 2, 3])
        md = metadata(3)
    elif case == "draft_count":
        drafts = torch.tensor([1, 2])
    elif case == "draft_probs":
        draft_probs = torch.zeros(3, V + 1)
    elif case == "md_rows":
        md = metadata(5)
    elif case == "generator":
        md = metadata(2, generators={2: torch.Generator()})
    with pytest.raises(ValueError):
        RejectionSampler()(logits, cu, drafts, md, draft_probs)
    # The consistent version of the same call works.
    RejectionSampler()(torch.zeros(5, V), torch.tensor([0, 3, 5]), torch.tensor([1, 2, 3]),
                       metadata(2))


def test_empty_batch():
    out = RejectionSampler()(torch.zeros(0, V), torch.tensor([0]), torch.zeros(0, dtype=torch.long),
                             metadata(0))
    assert out.token_ids.shape == (0, 1) and out.num_accepted.shape == (0,)
