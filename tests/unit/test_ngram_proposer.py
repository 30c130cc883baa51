"""The n-gram ("prompt lookup") draft proposer (spec_decode/ngram.py).

The proposer keeps an incremental per-request index; every answer is checked
against a brute-force reference that rescans the whole sequence each time.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from tokenmill.spec_decode import ngram
from tokenmill.spec_decode.ngram import NgramProposer


def reference(seq: list[int], k: int, min_n: int, max_n: int, cap: int) -> list[int]:
    """Longest suffix n-gram (n in [min_n, max_n]) that occurred earlier, its most recent
    earlier occurrence, then up to min(k, cap) tokens copied from after it (LZ77 style:
    past the end, the copy reads the drafts already made)."""
    length = len(seq)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = seq[length - n:]
        for start in range(length - n - 1, -1, -1):
            if seq[start:start + n] == suffix:
                out = list(seq)
                for i in range(min(k, cap)):
                    out.append(out[start + n + i])
                return out[length:]
    return []


def ngram_count(length: int, min_n: int, max_n: int) -> int:
    """n-grams that end before `length`: what the index holds after one call at `length`."""
    return sum(max(0, length - n) for n in range(min_n, max_n + 1))


def propose_one(proposer, req_id, seq, cap=None, width=None):
    buf = np.zeros((1, width or max(len(seq), 1)), dtype=np.int32)
    buf[0, :len(seq)] = seq
    cap = proposer.k if cap is None else cap
    return proposer.propose([req_id], buf, np.array([len(seq)]), np.array([cap]))[0]


@pytest.mark.parametrize("k,min_n,max_n", [(1, 1, 1), (3, 1, 3), (5, 2, 4), (4, 3, 3),
                                           (8, 1, 5), (2, 2, 6)])
def test_matches_reference_on_random_sequences(k, min_n, max_n):
    """Several requests per call, fed in random chunks (0 to past the vectorised path's
    threshold), with random caps; requests change rows every call, spare rows exist, and
    the columns past num_tokens hold garbage the proposer must not read."""
    rng = np.random.default_rng(1000 * k + 10 * min_n + max_n)
    width = 200
    proposer = NgramProposer(k, min_n, max_n)
    num_reqs = 10
    for round_ in range(3):  # fresh requests each round, under new ids
        ids = [f"r{round_}-{j}" for j in range(num_reqs)]
        seqs = {}
        for rid in ids:
            vocab = int(rng.choice([2, 4, 5, 6]))
            seqs[rid] = rng.integers(0, vocab, size=int(rng.integers(1, width + 1))).tolist()
        fed = {rid: 0 for rid in ids}
        checked = 0
        while any(fed[rid] < len(seqs[rid]) for rid in ids):
            batch = [rid for rid in ids if fed[rid] < len(seqs[rid])]
            rng.shuffle(batch)
            for rid in batch:
                step = int(rng.choice([0, 1, 1, 2, 3, int(rng.integers(4, 80))]))
                if fed[rid] == 0:
                    step = max(1, int(rng.integers(1, 120)))  # the prompt
                fed[rid] = min(len(seqs[rid]), fed[rid] + step)
            buf = rng.integers(0, 6, size=(len(batch) + 2, width), dtype=np.int32)
            for row, rid in enumerate(batch):
                buf[row, :fed[rid]] = seqs[rid][:fed[rid]]
            caps = rng.integers(0, k + 3, size=len(batch))
            got = proposer.propose(batch, buf, np.array([fed[rid] for rid in batch]), caps)
            assert len(got) == len(batch)
            for rid, drafts, cap in zip(batch, got, caps):
                want = reference(seqs[rid][:fed[rid]], k, min_n, max_n, int(cap))
                assert drafts == want, (rid, fed[rid], int(cap), seqs[rid][:fed[rid]])
                assert all(type(t) is int for t in drafts)
                checked += bool(want)
        assert checked > 0  # the comparison saw real drafts, not only []
        for rid in ids:
            proposer.remove(rid)


@pytest.mark.parametrize("period,k", [(1, 5), (3, 8), (4, 4), (7, 3), (10, 2)])
@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 5)])
def test_periodic_sequence_gives_k_drafts_continuing_the_period(period, k, min_n, max_n):
    pattern = [100 + 7 * i for i in range(period)]  # distinct tokens within a period
    proposer = NgramProposer(k, min_n, max_n)
    seq = []
    for length in range(1, 5 * period + max_n + 3):
        seq.append(pattern[(length - 1) % period])
        drafts = propose_one(proposer, "p", seq)
        if length >= period + min_n:  # one full period before the suffix: a match exists
            assert drafts == [pattern[(length + j) % period] for j in range(k)], length
        else:
            assert drafts == []


def test_no_match_gives_no_drafts():
    proposer = NgramProposer(4, 1, 3)
    seq = []
    for tok in range(60):  # all distinct: no suffix ever occurred before
        seq.append(tok)
        assert propose_one(proposer, "a", seq) == []
    # Too short to hold a suffix and an earlier occurrence.
    proposer = NgramProposer(4, 2, 3)
    assert propose_one(proposer, "b", [5]) == []
    assert propose_one(proposer, "c", [5, 5]) == []
    assert propose_one(proposer, "c", [5, 5, 5]) == [5, 5, 5, 5]
    assert propose_one(proposer, "d", []) == []


def test_max_drafts_caps_the_drafts():
    seq = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    full = [4, 5, 6, 7, 8]
    for cap, want in [(5, full), (9, full), (2, full[:2]), (1, full[:1]), (0, [])]:
        proposer = NgramProposer(5, 1, 3)
        assert propose_one(proposer, "a", seq, cap=cap) == want
    # Different caps for requests in the same call.
    proposer = NgramProposer(5, 1, 3)
    buf = np.array([seq, seq, seq], dtype=np.int32)
    got = proposer.propose(["a", "b", "c"], buf, np.array([12, 12, 12]), np.array([0, 3, 7]))
    assert got == [[], full[:3], full]


def test_max_drafts_zero_still_indexes():
    """A step that proposes nothing (cap 0) still indexes its new tokens, so the next step
    with a cap finds matches in them."""
    rng = np.random.default_rng(7)
    seq = rng.integers(0, 4, size=150).tolist()
    proposer = NgramProposer(3, 1, 4)
    for length in range(1, 120):
        assert propose_one(proposer, "a", seq[:length], cap=0, width=150) == []
    assert proposer.ngrams_indexed == ngram_count(119, 1, 4)
    for length in range(120, 151):
        assert propose_one(proposer, "a", seq[:length], width=150) == \
            reference(seq[:length], 3, 1, 4, 3)


def test_shrunk_request_is_reindexed():
    """num_tokens below what was indexed (preempted and restarted, or the id reused with a
    new sequence): the old index must go."""
    proposer = NgramProposer(3, 2, 2)
    old = [9, 9, 9, 7, 8, 4, 4, 4] + [9] * 40
    assert propose_one(proposer, "a", old, width=64) == [9, 9, 9]
    indexed = proposer.ngrams_indexed
    # "7 8" was followed by 4 in the old sequence; it never occurred before in the new one.
    new = [1, 2, 3, 7, 8]
    assert propose_one(proposer, "a", new, width=64) == []
    assert proposer.ngrams_indexed == indexed + ngram_count(len(new), 2, 2)
    # And it keeps matching the new sequence as it grows.
    new += [5, 7, 8]
    assert propose_one(proposer, "a", new, width=64) == [5, 7, 8]
    # Restarted with the same tokens (a preempted request): the same answer as before.
    assert propose_one(proposer, "a", new[:5], width=64) == []
    assert propose_one(proposer, "a", new, width=64) == [5, 7, 8]


def test_requests_are_keyed_by_id_not_row():
    proposer = NgramProposer(2, 1, 2)
    a = [1, 2, 3, 1, 2]
    b = [5, 6, 5]
    buf = np.zeros((2, 8), dtype=np.int32)
    buf[0, :5], buf[1, :3] = a, b
    assert proposer.propose(["a", "b"], buf, np.array([5, 3]), np.array([2, 2])) == \
        [[3, 1], [6, 5]]
    a, b = a + [3], b + [6]
    buf[:] = 0
    buf[1, :6], buf[0, :4] = a, b  # swapped rows
    assert proposer.propose(["b", "a"], buf, np.array([4, 6]), np.array([2, 2])) == \
        [[5, 6], [1, 2]]


def test_remove_forgets_the_request():
    proposer = NgramProposer(3, 1, 3)
    propose_one(proposer, "a", [0] * 30, width=40)
    proposer.remove("a")
    proposer.remove("a")  # unknown id: nothing to forget
    proposer.remove("never-seen")
    # A new request under the same id, longer than the old one: a kept index would have
    # the old zeros and miss this sequence's early "1 2 3".
    new = list(range(1, 38)) + [1, 2, 3]
    assert propose_one(proposer, "a", new, width=40) == [4, 5, 6]


def test_index_work_grows_with_new_tokens_only():
    """Each step indexes only the n-grams its new tokens end, never the whole sequence."""
    proposer = NgramProposer(4, 2, 4)
    rng = np.random.default_rng(3)
    seq = rng.integers(0, 5, size=3000).astype(np.int32)
    buf = seq[None, :]
    for length in range(1, 3001):
        before = proposer.ngrams_indexed
        proposer.propose(["a"], buf, np.array([length]), np.array([4]))
        # The n-grams ending at length-1 (one per n that fits).
        assert proposer.ngrams_indexed - before == sum(1 for n in range(2, 5) if n <= length - 1)
    assert proposer.ngrams_indexed == ngram_count(3000, 2, 4)


def test_long_sequence_step_time_does_not_grow():
    """20k tokens appended one at a time: the last 1000 steps take about as long as the
    first 1000 (a rescan would make them ~10x slower or worse). Medians, not means, and a
    5x margin: the machine is shared, so single steps can stall."""
    total = 20_000
    rng = np.random.default_rng(5)
    seq = rng.integers(0, 6, size=total).astype(np.int32)
    buf = seq[None, :]
    proposer = NgramProposer(5, 1, 4)
    cap = np.array([5])
    times = np.empty(total)
    for length in range(1, total + 1):
        t0 = time.perf_counter()
        proposer.propose(["a"], buf, np.array([length]), cap)
        times[length - 1] = time.perf_counter() - t0
    first, last = np.median(times[100:1100]), np.median(times[-1000:])
    assert last < 5 * first, (first, last)
    # And the answer at the end is still right.
    assert propose_one(proposer, "a", seq.tolist()) == reference(seq.tolist(), 5, 1, 4, 5)


def test_prompt_longer_than_vectorise_threshold_matches_loop():
    """A whole prompt indexed at once (numpy path) and the same tokens one at a time
    (Python loop) give the same index."""
    rng = np.random.default_rng(11)
    seq = rng.integers(0, 50, size=4 * ngram._VECTORISE_FROM).astype(np.int32)
    at_once, one_by_one = NgramProposer(3, 1, 3), NgramProposer(3, 1, 3)
    at_once.propose(["a"], seq[None, :], np.array([len(seq)]), np.array([0]))
    for length in range(1, len(seq) + 1):
        one_by_one.propose(["a"], seq[None, :], np.array([length]), np.array([0]))
    assert at_once._indices["a"].latest_end == one_by_one._indices["a"].latest_end
    assert len(at_once._indices["a"].latest_end) > 0


@pytest.mark.parametrize("args,field", [
    ((0, 1, 2), "num_speculative_tokens"), ((-1, 1, 2), "num_speculative_tokens"),
    ((2.0, 1, 2), "num_speculative_tokens"), ((True, 1, 2), "num_speculative_tokens"),
    ((3, 0, 2), "prompt_lookup_min"), ((3, "1", 2), "prompt_lookup_min"),
    ((3, 3, 2), "prompt_lookup_max"), ((3, 1, None), "prompt_lookup_max"),
])
def test_constructor_rejects_bad_args(args, field):
    with pytest.raises(ValueError, match=field):
        NgramProposer(*args)


def test_num_tokens_past_the_row_is_rejected():
    proposer = NgramProposer(2, 1, 2)
    with pytest.raises(ValueError, match="num_tokens"):
        proposer.propose(["a"], np.zeros((1, 4), np.int32), np.array([5]), np.array([2]))
