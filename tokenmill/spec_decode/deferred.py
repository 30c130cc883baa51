"""Decode rows whose drafter pass waits until the request next proposes.

A draft model keeps per-position data of its own for every token of a request (an
EAGLE / MTP drafter its K/V, DFlash its context), computed from the target's
hidden state at that position. A request that proposes nothing this step (it backs
off after rejected drafts, or speculation is off for a large batch) has no use for
that data yet, so its decode row's target hidden state is kept here instead, and
the rows it gathered are run through the drafter in one pass with the step it next
proposes from, or once MAX_DEFERRED_ROWS have gathered. At batch 1 that pass over
a handful of rows costs what one row costs (it reads the same weights); run every
step it is most of what a rejected draft costs.

On the CPU a waiting row is kept by reference to the step's tapped hidden states (the
tensor the layer loop allocates afresh each step) and copied into the buffer only when
its rows run: read right after the forward, a row costs ~20 us (the forward wrote it
before streaming its later layers), read later with the others ~1 us.

Only a step that keeps one row of the request waits: a decode row, or a verification
whose drafts were all rejected (its one kept row is the verified token's; the rejected
rows' positions are computed again by later steps). A prompt chunk, or a verification
that accepted drafts, runs at once.
With prefix caching, a request that finishes or is preempted has its waiting rows
in full blocks written at once (`take_cached`): those blocks stay cached, and a
later request that hits them reads the drafter's data there as a cold run wrote it.
A request whose positions do not continue its waiting rows (resumed after
preemption, a prefix-cache hit) keeps the rows before its new first position; those
run at once, the rest are dropped (the step recomputes them).
"""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.spec_decode.drafter import MAX_BACKOFF

# Rows a request may gather: the drafter's longest back-off, so a request backing off
# runs its rows once, with the step it next proposes from. A pass over 16 rows of a
# small drafter costs about what one over 64 does (measured: ~0.95 ms against ~1.1 ms
# more in the proposing step, bench-qwen3-512's random EAGLE-3), so a 16-row cap made
# one such pass every 16 steps; the price is the buffer: slots x 64 x tapped width.
MAX_DEFERRED_ROWS = MAX_BACKOFF
# ... unless a slot of that many rows would pass SLOT_BYTES (a wide tapped state: an
# 8B EAGLE-3 head's 3 x 4096 bf16 is 1.5 MB at 64 rows, times every request slot);
# then as many rows as fit, at least MIN_DEFERRED_ROWS (where a big target's step
# makes the extra drafter passes cheap beside it).
SLOT_BYTES = 256 << 10
MIN_DEFERRED_ROWS = 16
_NONE = np.zeros(0, dtype=np.int64)


def holds(device: torch.device, taps: bool) -> bool:
    """Whether a step's rows may wait by reference: the target's taps (`taps`: the rows
    are runner.model.aux_hidden's) on the CPU, which run_layers allocates afresh every
    step (a CUDA graph's replays rewrite theirs; other hidden states may be reused
    buffers). Decided once per proposer: asked each step, after the forward, the test
    cost ~8 us in cache misses."""
    return device.type == "cpu" and taps


class DeferredRows:
    def __init__(self, max_rows: int = MAX_DEFERRED_ROWS):
        self.max_rows = max_rows
        self._slot: dict[str, int] = {}
        self._free: list[int] = []
        self.start = np.zeros(0, dtype=np.int64)  # per slot: position of the first row
        self.count = np.zeros(0, dtype=np.int64)  # per slot: rows waiting
        self.buf: torch.Tensor | None = None  # [slots, max_rows, width] target hidden
        self._rows: list[torch.Tensor] | None = None  # buf's rows, as views (wait_all)
        self._rows1: list[torch.Tensor] | None = None  # ... as [1, width] views (_settle)
        # Rows held by reference, not yet in buf (wait_all with hold): per step, its
        # tapped hidden states (every row waits) and each row's index in buf's rows.
        self._held: list[tuple[torch.Tensor, list[int]]] = []

    def _allocate(self, hidden: torch.Tensor) -> None:
        """The buffer, at the first row that waits (no slot holds rows yet): its rows per
        slot cut to SLOT_BYTES for a wide state."""
        row_bytes = hidden.shape[1] * hidden.element_size()
        fit = max(MIN_DEFERRED_ROWS, SLOT_BYTES // max(1, row_bytes))
        self.max_rows = min(self.max_rows, fit)
        self.buf = hidden.new_empty(self.start.size, self.max_rows, hidden.shape[1])

    def num_waiting(self, req_id: str) -> int:
        slot = self._slot.get(req_id)
        return 0 if slot is None else int(self.count[slot])

    def _slot_of(self, rid: str) -> int:
        """The request's slot (a new, empty one at its first step)."""
        s = self._slot.get(rid)
        if s is None:
            if not self._free:
                self._grow()
            s = self._slot[rid] = self._free.pop()
            self.count[s] = 0
        return s

    def _slots(self, req_ids: list[str]) -> np.ndarray:
        return np.fromiter((self._slot_of(rid) for rid in req_ids), dtype=np.int64,
                           count=len(req_ids))

    def _grow(self) -> None:
        old = self.start.size
        new = max(8, 2 * old)
        self.start = np.concatenate([self.start, np.zeros(new - old, dtype=np.int64)])
        self.count = np.concatenate([self.count, np.zeros(new - old, dtype=np.int64)])
        if self.buf is not None:
            self.buf = torch.cat([self.buf, self.buf.new_empty(new - old, *self.buf.shape[1:])])
            self._rows = self._rows1 = None
        self._free.extend(range(new - 1, old - 1, -1))

    def wait_all(self, req_ids: list[str], positions: np.ndarray, hidden: torch.Tensor,
                 hold: bool = False, skip: set[str] | None = None) -> bool:
        """The common step of a request that backs off: a decode-only step (row i is
        request i's one row, at positions[i]) from which nothing is proposed. Every row
        waits if every request can keep one more contiguous row; -> False (nothing
        changed) otherwise, and the caller takes `step`. A loop over requests in plain
        Python: at batch 1 a fraction of the numpy calls `step` makes. `hold`: keep the
        rows as references to `hidden` (see `holds`), which nobody may change. `skip`:
        requests whose rows are dropped, never kept (suspended: spec_decode/drafter.py)."""
        count, start, max_rows = self.count, self.start, self.max_rows
        slots = []
        for i, (rid, pos) in enumerate(zip(req_ids, positions.tolist())):
            if skip is not None and rid in skip:
                continue
            s = self._slot.get(rid)
            if s is None:  # (a new slot may grow the arrays)
                s = self._slot_of(rid)
                count, start = self.count, self.start
            c = count.item(s)  # (a Python int: no numpy scalar)
            if c >= max_rows or (c and start.item(s) + c != pos):
                return False
            slots.append((s, c, pos, i))
        if not slots:
            return True
        if self.buf is None:
            self._allocate(hidden)
        if hold:
            per_slot = self.buf.shape[1]
            # (the step rows that wait: None for all of them, in order)
            rows = None if len(slots) == len(req_ids) else [i for _, _, _, i in slots]
            self._held.append((hidden, [s * per_slot + c for s, c, _, _ in slots], rows))
            for s, c, pos, _ in slots:
                if c == 0:
                    start[s] = pos
                count[s] = c + 1
            return True
        if self._rows is None:  # each row's view, made once: indexing costs more than the copy
            self._rows = list(self.buf.view(-1, hidden.shape[1]).unbind(0))
        rows, per_slot = self._rows, self.buf.shape[1]
        for s, c, pos, i in slots:
            rows[s * per_slot + c].copy_(hidden[i])
            if c == 0:
                start[s] = pos
            count[s] = c + 1
        return True

    def _settle(self) -> None:
        """Copy the rows held by reference into the buffer. One-row steps (batch 1, the
        common case) in one _foreach_copy_ (64 rows ~25 us; indexing and stacking them
        one at a time cost ~3 us a row, a cat of 64 tensors ~90 us); a step of n rows
        in one index_put."""
        buf = self.buf
        if self._rows1 is None:
            self._rows1 = list(buf.view(-1, 1, buf.shape[2]).unbind(0))
        rows1, dst, src = self._rows1, [], []
        for t, flat, rows in self._held:
            if len(flat) == 1:
                dst.append(rows1[flat[0]])
                r = 0 if rows is None else rows[0]
                src.append(t if t.shape[0] == 1 else t[r:r + 1])
            else:  # (a step's rows are its requests', in order; a padded step has more)
                index = torch.tensor(flat, device=buf.device)
                buf.view(-1, buf.shape[2])[index] = (
                    t[:len(flat)] if rows is None else t[torch.tensor(rows, device=t.device)])
        if dst:
            torch._foreach_copy_(dst, src)
        self._held.clear()

    def wait_decodes(self, runner, req_ids: list[str], hidden: torch.Tensor, hold: bool,
                     skip: set[str] | None = None) -> list[list[int]] | None:
        """A proposer's step that proposes nothing: if it was decode-only (one row per
        request, row i request i's), every row waits (wait_all; `hold`, `skip`: as its
        own) and -> no drafts for each; None (nothing changed) otherwise, and the
        proposer takes its full path."""
        step = runner.last_step
        n = len(req_ids)
        positions = step.positions
        if positions.size != n or (n > 1 and not (np.diff(step.query_start_loc[:n + 1])
                                                  == 1).all()):
            return None
        if not self.wait_all(req_ids, positions, hidden, hold, skip):
            return None
        return [[] for _ in range(n)]

    def step(self, req_ids: list[str], first_pos: np.ndarray, counts: np.ndarray,
             wait_ok: np.ndarray, hidden: torch.Tensor, first_row: np.ndarray,
             kept: np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, torch.Tensor | None]:
        """One step of n requests: request i has counts[i] rows from position
        first_pos[i], the first at row first_row[i] of the step's target hidden states
        `hidden` [T, W]; wait_ok[i]: its row may wait (no proposal from it this step);
        kept[i] (default counts): how many of its rows, from the first, continue its
        sequence (the rest held rejected drafts); it waits only with exactly one.

        -> (waits [n] bool: requests whose step row was kept here, not to be run now;
            req [m], positions [m], hidden [m, W]: earlier rows to run now, before the
            step's rows of the same request; possibly a view of the buffer, valid until
            the next call)."""
        if self._held:
            self._settle()
        slots = self._slots(req_ids)
        st, cnt = self.start[slots], self.count[slots]
        active = counts > 0
        contiguous = (cnt == 0) | (st + cnt == first_pos)
        if not contiguous.all():  # keep the rows before the new first position (run now)
            cut = np.minimum(np.maximum(first_pos - st, 0), cnt)
            cnt = np.where(active & ~contiguous, cut, cnt)
        waits = (active & wait_ok & ((counts if kept is None else kept) == 1) & contiguous
                 & (cnt < self.max_rows))
        flush = active & ~waits & (cnt > 0)
        dev = hidden.device
        req, positions, earlier = _NONE, _NONE, None
        if flush.any():
            f = np.nonzero(flush)[0]
            req, positions, earlier = self._rows_of(slots[f], cnt[f], f)
        self.count[slots[active & ~waits]] = 0
        w = np.nonzero(waits)[0]
        if w.size:
            if self.buf is None:
                self._allocate(hidden)
            if w.size == 1:  # a plain copy: a few us less than an index_put at batch 1
                i = int(w[0])
                self.buf[int(slots[i]), int(cnt[i])].copy_(hidden[int(first_row[i])])
            else:
                self.buf[torch.from_numpy(slots[w]).to(dev), torch.from_numpy(cnt[w]).to(dev)] = \
                    hidden[torch.from_numpy(first_row[w]).to(dev)]
            self.start[slots[w]] = np.where(cnt[w] == 0, first_pos[w], st[w])
            self.count[slots[w]] = cnt[w] + 1
        return waits, req, positions, earlier

    def _rows_of(self, slots: np.ndarray, counts: np.ndarray, owners: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
        """The first counts[i] waiting rows of slot slots[i] (settled): (owners[i] for each
        row, positions, hidden [m, W]); one slot's rows lie together: a view of the
        buffer, not a gather (valid until the buffer is next written)."""
        req = np.repeat(owners, counts)
        within = np.arange(req.size) - np.repeat(np.cumsum(counts) - counts, counts)
        positions = np.repeat(self.start[slots], counts) + within
        if slots.size == 1:
            return req, positions, self.buf[int(slots[0]), :int(counts[0])]
        dev = self.buf.device
        return req, positions, self.buf[torch.from_numpy(np.repeat(slots, counts)).to(dev),
                                        torch.from_numpy(within).to(dev)]

    def take(self, req_ids: list[str], rows: list[int]
             ) -> tuple[np.ndarray, np.ndarray, torch.Tensor | None]:
        """Every waiting row of these requests (batch rows `rows`), no longer waiting:
        (req [m]: their batch rows, positions [m], hidden [m, W]; None: none wait)."""
        if self._held:
            self._settle()
        got = [(self._slot[rid], r) for rid, r in zip(req_ids, rows)
               if rid in self._slot and self.count[self._slot[rid]]]
        if not got:
            return _NONE, _NONE, None
        slots = np.array([s for s, _ in got], dtype=np.int64)
        out = self._rows_of(slots, self.count[slots], np.array([r for _, r in got]))
        self.count[slots] = 0
        return out

    def take_cached(self, runner, req_ids: list[str]
                    ) -> tuple[np.ndarray, np.ndarray, torch.Tensor | None]:
        """`take` for requests that finish or are preempted with prefix caching on: their
        full blocks stay cached, and a later request (the next turn of a conversation)
        may hit them, so the drafter's rows there must be written first; the rows of a
        last, partial block (never cached) are dropped. Requests still in the batch."""
        batch = runner.input_batch
        index = batch.req_id_to_index
        ids = [rid for rid in req_ids if rid in index and self.num_waiting(rid)]
        if not ids:
            return _NONE, _NONE, None
        req, positions, hidden = self.take(ids, [index[rid] for rid in ids])
        bs = runner.kv_cache_config.block_size
        # (the target computed every position before the request's last token)
        full = (batch.num_tokens_no_spec[req].astype(np.int64) - 1) // bs * bs
        keep = positions < full
        if keep.all():
            return req, positions, hidden
        if not keep.any():
            return _NONE, _NONE, None
        rows = np.nonzero(keep)[0]
        return req[rows], positions[rows], hidden[torch.from_numpy(rows).to(hidden.device)]

    def remove(self, req_id: str) -> None:
        slot = self._slot.pop(req_id, None)
        if slot is not None:
            if self._held:  # into its rows, now unused (the slot's next owner starts
                with torch.inference_mode():  # from count 0): no held row outlives its
                    self._settle()  # slot (called outside the step's inference mode)
            self.count[slot] = 0
            self._free.append(slot)
