"""The runner's Drafter: adaptive k per request, back-off after rejected drafts, the
batch-size switch, and rows that must not get drafts."""
from __future__ import annotations

import numpy as np

from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.drafter import MAX_BACKOFF, Drafter

PERIODIC = np.tile(np.arange(3, dtype=np.int32), 20)[None, :]  # always a match


def drafter(**kw) -> Drafter:
    return Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                     prompt_lookup_min=1, prompt_lookup_max=3, **kw))


def wanted(d: Drafter, rid="a") -> int:
    return len(d.propose([rid], PERIODIC, np.array([30]), np.array([True]))[0])


def test_k_follows_acceptance():
    d = drafter()
    assert wanted(d) == 4
    d.observe(["a"], np.array([4]), np.array([1]))  # 1 of 4 accepted: ask for 2
    assert wanted(d) == 2
    d.observe(["a"], np.array([2]), np.array([2]))  # all accepted: one more
    assert wanted(d) == 3
    d.observe(["a"], np.array([3]), np.array([3]))
    d.observe(["a"], np.array([4]), np.array([4]))
    assert wanted(d) == 4  # never past k


def test_backoff_after_misses_then_retry():
    d = drafter()
    d.observe(["a"], np.array([4]), np.array([0]))
    assert wanted(d) == 1  # one miss: k shrinks, no back-off yet
    skipped = []
    for misses in range(2, 8):
        d.observe(["a"], np.array([1]), np.array([0]))
        n = 0
        while wanted(d) == 0:
            n += 1
        skipped.append(n)
    assert skipped == [4, 16, 64, 64, 64, 64] == [min(4 ** (m - 1), MAX_BACKOFF)
                                                  for m in range(2, 8)]
    d.observe(["a"], np.array([1]), np.array([1]))  # a hit resets the misses
    d.observe(["a"], np.array([2]), np.array([0]))
    assert wanted(d) == 1


def test_not_adaptive_keeps_k():
    d = drafter(adaptive=False)
    for _ in range(5):
        d.observe(["a"], np.array([4]), np.array([0]))
        assert wanted(d) == 4


def test_batch_size_switch_and_ineligible_rows():
    d = drafter(disable_by_batch_size=2)
    rows = np.repeat(PERIODIC, 2, axis=0)
    assert d.propose(["a", "b"], rows, np.array([30, 30]), np.array([True, True])) == [[], []]
    d = drafter()
    out = d.propose(["a", "b"], rows, np.array([30, 30]), np.array([False, True]))
    assert out[0] == [] and len(out[1]) == 4
    d.remove("b")
    assert "b" not in d._next_k


def test_row_budget_shares_the_free_rows():
    """Drafts fill the rows the batch leaves free under the row budget, shared by the
    rows that ask; a full batch gets none; not adaptive: no budget."""
    def drafts(d, n, eligible=None):
        rows = np.repeat(PERIODIC, n, axis=0)
        ok = np.ones(n, dtype=bool) if eligible is None else np.array(eligible)
        return [len(x) for x in d.propose([f"r{i}" for i in range(n)], rows,
                                          np.full(n, 30), ok)]
    d = Drafter(drafter().config, row_budget=8)
    assert drafts(d, 1) == [4]  # k: 1 + 4 rows
    assert drafts(d, 2) == [3, 3]  # 2 + 6
    assert drafts(d, 3) == [1, 1, 1]  # 3 + 3: (8 - 3) // 3
    assert drafts(d, 3, [True, False, False]) == [4, 0, 0]  # one asks: it takes k
    assert drafts(d, 8) == [0] * 8
    assert Drafter(drafter(adaptive=False).config, row_budget=8).row_budget is None
