"""The runner's Drafter: adaptive k per request, back-off after rejected drafts, the
batch-size switch, and rows that must not get drafts."""
from __future__ import annotations

import numpy as np

from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.drafter import (GOOD_ACCEPTANCE, MAX_BACKOFF, MIN_RECORD_DRAFTS,
                                          POOR_ACCEPTANCE, RECORD_DRAFTS, Drafter)

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


def settle(d: Drafter, rid: str, hit: bool) -> None:
    """The step after `rid`'s shadow probe sampled its token: the draft (hit) or not."""
    index, draft = d._shadow[rid]
    tokens = np.zeros((1, index + 1), dtype=np.int32)
    tokens[0, index] = draft if hit else draft + 1
    d._settle_shadows({rid: 0}, tokens, np.array([index]))  # not sampled yet: waits
    assert rid in d._shadow
    d._settle_shadows({"other": 0}, tokens, np.array([index + 1]))  # not in the batch
    assert rid in d._shadow
    d._settle_shadows({rid: 0}, tokens, np.array([index + 1]))
    assert rid not in d._shadow


def steps_until_probe(d: Drafter, rid: str = "a") -> int:
    """Steps without drafts before `rid` probes (a shadow: no draft to verify); each
    asks once, counting one off its back-off."""
    n = 0
    while rid not in d._shadow:
        assert wanted(d, rid) == 0 and n <= MAX_BACKOFF  # (no endless loop if none comes)
        n += 1
    return n - 1  # (the probe's own step asked too)


def test_backoff_after_misses_then_retry():
    """A request that started under a good record: back-offs of 4, 16, then 64 steps,
    each ended by a verified probe of one draft."""
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
    assert not d._shadow
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


def skipped_after_miss(d: Drafter, rid: str) -> int:
    """Verify `rid`'s drafts as all rejected; -> the steps it then goes without."""
    d.observe([rid], np.array([wanted(d, rid)]), np.array([0]))
    n = 0
    while wanted(d, rid) == 0:
        n += 1
    return n


def test_new_requests_start_from_the_server_record():
    """Once the recent verifications of all requests accepted almost nothing, a new
    request starts backed off: 16 steps without drafts (its prompt's step the first),
    then a probe, and its first miss skips 64 steps (not: k drafts at once, a retry at
    one, then 4); requests already running keep their state; a hit resets the new
    request as usual. Its probes are shadows (the draft kept, not verified; the next
    sampled token says hit or miss, into the record) until one hits; then verified."""
    d = drafter()
    assert wanted(d, "old") == 4
    d.observe(["old"], np.array([4]), np.array([2]))  # running, at k 3: it stays there
    for i in range(MIN_RECORD_DRAFTS // 4):
        assert not d.poor_record() and wanted(d, f"r{i}") == 4  # cold: k
        d.observe([f"r{i}"], np.array([4]), np.array([0]))
    assert d.poor_record()
    assert wanted(d, "old") == 3
    assert steps_until_probe(d, "new") == 16
    assert d._shadow["new"] == (30, int(PERIODIC[0, 30]))  # the draft, for token 30
    drafted = d._drafted
    settle(d, "new", hit=False)
    assert d._drafted == drafted + 1 and d._misses["new"] == 4
    assert steps_until_probe(d, "new") == MAX_BACKOFF
    d.remove("new")
    assert "new" not in d._shadow and "new" not in d._doubted
    d.add_seeded("seeded")  # its random draws follow its drafts: no record for it
    assert wanted(d, "seeded") == 4
    d.remove("seeded")
    assert "seeded" not in d._seeded
    assert steps_until_probe(d, "lucky") == 16
    settle(d, "lucky", hit=True)  # a hit: k grows, no back-off
    assert wanted(d, "lucky") == 2
    assert skipped_after_miss(d, "lucky") == 0  # one miss: a retry, as for any request
    assert skipped_after_miss(d, "lucky") == 4  # two: backs off, then a verified probe
    assert "lucky" not in d._shadow


def test_record_needs_evidence_and_forgets():
    """No judgement before MIN_RECORD_DRAFTS drafts; the record halves past
    RECORD_DRAFTS, so a run of accepted drafts turns it good again; acceptance at the
    threshold is not poor; adaptive off keeps no record."""
    d = drafter()
    d.observe(["a"], np.array([MIN_RECORD_DRAFTS - 1]), np.array([0]))
    assert not d.poor_record() and wanted(d, "b") == 4
    d.observe(["a"], np.array([1]), np.array([0]))
    assert d.poor_record()
    for _ in range(4 * RECORD_DRAFTS // 4):
        d.observe(["a"], np.array([4]), np.array([4]))
    assert d._drafted <= RECORD_DRAFTS and not d.poor_record()
    assert wanted(d, "c") == 4
    d = drafter()
    d.observe(["a"], np.array([64]), np.array([int(64 * POOR_ACCEPTANCE)]))
    assert not d.poor_record()
    d = drafter(adaptive=False)
    d.observe(["a"], np.array([64]), np.array([0]))
    assert not d.poor_record() and wanted(d, "b") == 4


def test_promising_record_is_unjudged_or_a_quarter_accepted():
    """promising_record (the scheduler resumes requests suspended by load only under
    it): before MIN_RECORD_DRAFTS every record is, then GOOD_ACCEPTANCE of the drafts
    accepted (at the threshold: promising); a poor record never is."""
    d = drafter()
    assert d.promising_record()
    d.observe(["a"], np.array([MIN_RECORD_DRAFTS - 1]), np.array([0]))
    assert d.promising_record()
    d.observe(["a"], np.array([1]), np.array([0]))
    assert not d.promising_record() and d.poor_record()
    d = drafter()
    d.observe(["a"], np.array([64]), np.array([int(64 * GOOD_ACCEPTANCE)]))
    assert d.promising_record()
    d = drafter()
    d.observe(["a"], np.array([64]), np.array([int(64 * GOOD_ACCEPTANCE) - 1]))
    assert not d.promising_record() and not d.poor_record()


def test_none_proposes_counts_the_eligible_rows_only():
    """A step from which nobody proposes: every eligible row backs off, each counts one
    step off; an ineligible row is not counted; one eligible row not backing off means
    the step proposes and nothing is counted. Small (Python lists) and large batches."""
    from tokenmill.spec_decode.drafter import SMALL_BATCH
    for n in (3, SMALL_BATCH + 3):
        d = drafter()
        ids = [f"r{i}" for i in range(n)]
        assert not d._none_proposes(ids, np.ones(n, dtype=bool))  # nobody backs off
        eligible = np.ones(n, dtype=bool)
        eligible[1] = False
        for i in range(n):
            if i != 1:
                d._skip[ids[i]] = 2
        assert d._none_proposes(ids, eligible)
        assert [d._skip.get(r) for r in ids] == [1, None] + [1] * (n - 2)
        d._skip[ids[-1]] = 0  # its back-off is over: it proposes this step
        assert not d._none_proposes(ids, eligible)
        assert [d._skip.get(r) for r in ids] == [1, None] + [1] * (n - 3) + [0]
        assert d._none_proposes(ids, np.zeros(n, dtype=bool))  # nobody eligible


def test_none_proposes_where_the_row_budget_is_full():
    """A batch that fills the row budget gets no drafts: the short path takes the step,
    and each eligible request's k and back-off move as _max_drafts would move them
    (a first step sets k, or under a poor record the back-off; a back-off counts a step
    off); the ineligible row is left alone."""
    from tokenmill.spec_decode.drafter import PRIOR_MISSES, backoff
    for n in (4, 12):
        d = Drafter(drafter().config, row_budget=4)
        ids = [f"r{i}" for i in range(n)]
        eligible = np.ones(n, dtype=bool)
        eligible[1] = False
        d._skip[ids[2]] = 3
        assert d._none_proposes(ids, eligible)
        assert d._next_k.get(ids[0]) == 4 and ids[1] not in d._next_k
        assert d._skip[ids[2]] == 2
        d.poor_record = lambda: True
        d.remove(ids[0])
        assert d._none_proposes(ids, eligible)
        assert d._misses[ids[0]] == PRIOR_MISSES
        assert d._skip[ids[0]] == backoff(PRIOR_MISSES) - 1
        fresh = Drafter(drafter().config, row_budget=4)  # rows left: drafts may come
        assert not fresh._none_proposes(ids[:3], np.ones(3, dtype=bool))
