"""DeferredRows (tokenmill/spec_decode/deferred.py): the decode rows a request keeps
while it proposes nothing, handed back in position order when it next must run them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.spec_decode.deferred import DeferredRows, holds


def hidden_at(positions, width=4):
    """A row per position whose values say which position it was."""
    return torch.tensor(positions, dtype=torch.float32)[:, None].repeat(1, width)


def step(d, req_ids, first_pos, counts, wait_ok):
    """One step whose rows are laid out request after request, hidden = position."""
    first_pos, counts = np.array(first_pos), np.array(counts)
    first_row = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    rows = [p + j for p, c in zip(first_pos, counts) for j in range(c)]
    return d.step(req_ids, first_pos, counts, np.array(wait_ok), hidden_at(rows or [0]),
                  np.minimum(first_row, max(len(rows) - 1, 0)))


def test_rows_wait_then_run_with_the_next_step_in_order():
    d = DeferredRows(max_rows=8)
    for pos in (10, 11, 12):
        waits, req, positions, earlier = step(d, ["a", "b"], [pos, 50 + pos], [1, 1],
                                              [True, False])
        assert waits.tolist() == [True, False] and req.size == 0 and earlier is None
    assert d.num_waiting("a") == 3 and d.num_waiting("b") == 0
    waits, req, positions, earlier = step(d, ["a", "b"], [13, 63], [1, 1], [False, False])
    assert not waits.any()
    assert req.tolist() == [0, 0, 0] and positions.tolist() == [10, 11, 12]
    assert earlier[:, 0].tolist() == [10.0, 11.0, 12.0]
    assert d.num_waiting("a") == 0


def test_a_prompt_chunk_or_accepted_verification_never_waits():
    d = DeferredRows()
    step(d, ["a"], [5], [1], [True])
    waits, req, positions, _ = step(d, ["a"], [6], [3], [True])  # 3 rows: run now
    assert not waits.any() and positions.tolist() == [5]
    step(d, ["a"], [9], [1], [True])
    # a verification of 2 drafts that accepted one keeps 2 rows: they run, with row 9
    first_pos, counts = np.array([10]), np.array([3])
    waits, req, positions, _ = d.step(["a"], first_pos, counts, np.array([True]),
                                      hidden_at([10, 11, 12]), np.array([0]), np.array([2]))
    assert not waits.any() and positions.tolist() == [9]


def test_a_verification_that_accepted_nothing_waits_with_its_one_kept_row():
    """Its rejected drafts' positions are computed again by the next steps: only the
    first row (the verified token's) waits, and the rows go on from it in order."""
    d = DeferredRows()
    step(d, ["a"], [5], [1], [True])
    waits, req, positions, _ = d.step(["a"], np.array([6]), np.array([3]), np.array([True]),
                                      hidden_at([6, 7, 8]), np.array([0]), np.array([1]))
    assert waits.all() and req.size == 0 and d.num_waiting("a") == 2
    step(d, ["a"], [7], [1], [True])  # the corrected token's row: contiguous
    waits, req, positions, earlier = step(d, ["a"], [8], [1], [False])
    assert not waits.any() and positions.tolist() == [5, 6, 7]
    assert earlier[:, 0].tolist() == [5.0, 6.0, 7.0]


def test_max_rows_then_the_rows_run():
    d = DeferredRows(max_rows=2)
    step(d, ["a"], [0], [1], [True])
    step(d, ["a"], [1], [1], [True])
    waits, req, positions, _ = step(d, ["a"], [2], [1], [True])
    assert not waits.any() and positions.tolist() == [0, 1]


def test_resumed_request_keeps_only_rows_before_its_new_first_position():
    """Preempted and resumed at position 12: rows 10 and 11 stand, 12.. are recomputed."""
    d = DeferredRows()
    for pos in range(10, 15):
        step(d, ["a"], [pos], [1], [True])
    waits, req, positions, earlier = step(d, ["a"], [12], [1], [True])
    assert not waits.any()  # not contiguous: the kept rows run now, with this one
    assert positions.tolist() == [10, 11] and earlier[:, 0].tolist() == [10.0, 11.0]
    waits, req, positions, _ = step(d, ["a"], [3], [4], [False])  # before them all
    assert req.size == 0 and d.num_waiting("a") == 0


def test_unscheduled_request_keeps_its_rows():
    d = DeferredRows()
    step(d, ["a", "b"], [7, 20], [1, 1], [True, True])
    first_row = np.array([0, 0])
    waits, req, _, _ = d.step(["a", "b"], np.array([0, 21]), np.array([0, 1]),
                              np.array([True, True]), hidden_at([21]), first_row)
    assert waits.tolist() == [False, True] and req.size == 0
    assert d.num_waiting("a") == 1 and d.num_waiting("b") == 2


@pytest.mark.parametrize("hold", [False, True], ids=["copied", "held"])
def test_wait_all_is_all_or_nothing(hold):
    d = DeferredRows(max_rows=2)
    assert d.wait_all(["a", "b"], np.array([4, 9]), hidden_at([4, 9]), hold)
    assert d.wait_all(["a", "b"], np.array([5, 10]), hidden_at([5, 10]), hold)
    assert not d.wait_all(["a", "b"], np.array([6, 11]), hidden_at([6, 11]), hold)  # full
    assert d.num_waiting("a") == d.num_waiting("b") == 2
    assert not d.wait_all(["c", "a"], np.array([0, 9]), hidden_at([0, 9]), hold)
    assert d.num_waiting("c") == 0
    waits, req, positions, earlier = step(d, ["a", "b"], [6, 11], [1, 1], [False, False])
    assert req.tolist() == [0, 0, 1, 1] and positions.tolist() == [4, 5, 9, 10]
    assert earlier[:, 0].tolist() == [4.0, 5.0, 9.0, 10.0]


def test_slots_are_reused_and_grow():
    d = DeferredRows()
    ids = [f"r{i}" for i in range(20)]  # more than the first allocation
    assert d.wait_all(ids, np.arange(20), hidden_at(list(range(20))))
    for rid in ids[:10]:
        d.remove(rid)
    assert d.wait_all([f"s{i}" for i in range(10)], np.arange(10), hidden_at(list(range(10))))
    assert d.start.size == 32 and d.buf.shape[0] == 32
    waits, req, positions, earlier = step(d, ids[10:], list(range(11, 21)), [1] * 10,
                                          [False] * 10)
    assert positions.tolist() == list(range(10, 20))
    assert earlier[:, 0].tolist() == [float(p) for p in range(10, 20)]


def test_a_wide_state_gathers_fewer_rows_per_slot():
    """Rows per slot follow the state's width: 64 (the longest back-off) for a narrow one,
    as many as fit SLOT_BYTES (at least 16) for a wide one, and those rows then run."""
    from tokenmill.spec_decode import deferred
    narrow = DeferredRows()
    assert narrow.wait_all(["a"], np.array([0]), hidden_at([0], width=64))
    assert narrow.max_rows == deferred.MAX_DEFERRED_ROWS == 64
    wide = DeferredRows()
    width = 2 * deferred.SLOT_BYTES // (4 * 16)  # fp32: 16 rows would take 2 x SLOT_BYTES
    for pos in range(16):
        assert wide.wait_all(["a"], np.array([pos]), hidden_at([pos], width=width))
    assert wide.max_rows == deferred.MIN_DEFERRED_ROWS == 16
    assert wide.buf.shape[1] == 16
    assert not wide.wait_all(["a"], np.array([16]), hidden_at([16], width=width))  # full
    middle = DeferredRows()
    width = deferred.SLOT_BYTES // (4 * 32)  # 32 rows fit exactly
    middle.wait_all(["a"], np.array([0]), hidden_at([0], width=width))
    assert middle.max_rows == 32


def test_held_rows_land_in_order_after_copied_ones_and_leave_with_their_request():
    """Rows held by reference (the CPU taps) join rows copied earlier in position order
    when the request's rows run, a resumed request keeps only those before its new
    first position, and a removed request's held rows go with it (its slot comes back
    empty for the next request)."""
    d = DeferredRows(max_rows=8)
    assert d.wait_all(["a", "b"], np.array([10, 30]), hidden_at([10, 30]))  # copied
    for pos in (11, 12, 13):
        assert d.wait_all(["a", "b"], np.array([pos, pos + 20]),
                          hidden_at([pos, pos + 20]), hold=True)
    assert d.num_waiting("a") == d.num_waiting("b") == 4
    waits, req, positions, earlier = step(d, ["a"], [14], [1], [False])
    assert positions.tolist() == [10, 11, 12, 13]
    assert earlier[:, 0].tolist() == [10.0, 11.0, 12.0, 13.0]
    waits, req, positions, earlier = step(d, ["b"], [32], [1], [False])  # resumed at 32
    assert positions.tolist() == [30, 31] and earlier[:, 0].tolist() == [30.0, 31.0]
    assert d.wait_all(["c"], np.array([5]), hidden_at([5]), hold=True)
    d.remove("c")
    assert d.wait_all(["e"], np.array([40]), hidden_at([40]), hold=True)
    waits, req, positions, earlier = step(d, ["e"], [41], [1], [False])
    assert positions.tolist() == [40] and earlier[:, 0].tolist() == [40.0]


def test_held_rows_of_inference_steps_mix_batch_sizes_and_survive_a_removal():
    """As the engine holds them: each step's taps an inference tensor, steps of one row
    (copied together) and of several (one index_put each) in one slot's order, a
    request removed outside inference mode (its held rows land in its freed rows)
    while another keeps its own, and a flush of one request handed back in order."""
    d = DeferredRows(max_rows=8)
    with torch.inference_mode():
        assert d.wait_all(["a"], np.array([0]), hidden_at([0]), hold=True)
        assert d.wait_all(["a", "b"], np.array([1, 20]), hidden_at([1, 20]), hold=True)
        assert d.wait_all(["a"], np.array([2]), hidden_at([2]), hold=True)
        assert d.wait_all(["b", "a"], np.array([21, 3]), hidden_at([21, 3]), hold=True)
    d.remove("b")
    with torch.inference_mode():
        assert d.wait_all(["c"], np.array([7]), hidden_at([7]), hold=True)
        waits, req, positions, earlier = step(d, ["a"], [4], [1], [False])
        assert positions.tolist() == [0, 1, 2, 3]
        assert earlier[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
        waits, req, positions, earlier = step(d, ["a", "c"], [5, 8], [1, 1],
                                              [False, False])
        assert req.tolist() == [1] and positions.tolist() == [7]
        assert earlier[:, 0].tolist() == [7.0]


def test_rows_are_held_by_reference_only_for_cpu_taps():
    """Decided once per proposer: the target's taps on the CPU are a fresh tensor every
    step; a CUDA graph's taps are rewritten by each replay, and a drafter reading the
    final hidden state (MTP) gets a buffer that may be reused."""
    assert holds(torch.device("cpu"), True)
    assert not holds(torch.device("cpu"), False)
    assert not holds(torch.device("cuda", 0), True)


@pytest.mark.parametrize("hold", [False, True])
def test_skipped_requests_rows_never_wait(hold):
    """`skip` (suspended requests): their rows are dropped, the others' wait and land in
    position order - held by reference too, where the waiting rows are not the step's
    first rows - and a step of skipped rows only keeps nothing."""
    d = DeferredRows(max_rows=8)
    with torch.inference_mode():
        for pos in (10, 11):  # s first: a's row is the step's second, b's its third
            assert d.wait_all(["s", "a", "b"], np.array([pos + 40, pos, pos + 20]),
                              hidden_at([pos + 40, pos, pos + 20]), hold, {"s"})
        assert d.wait_all(["s", "a"], np.array([52, 12]), hidden_at([52, 12]), hold, {"s"})
        assert d.wait_all(["s"], np.array([53]), hidden_at([53]), hold, {"s"})
        assert d.num_waiting("s") == 0 and "s" not in d._slot
        assert d.num_waiting("a") == 3 and d.num_waiting("b") == 2
        req, positions, earlier = d.take(["a", "b"], [0, 1])
    assert positions.tolist() == [10, 11, 12, 30, 31]
    assert earlier[:, 0].tolist() == [10.0, 11.0, 12.0, 30.0, 31.0]
