"""Recurrent-state snapshots for prefix caching of hybrid (Gated DeltaNet) models.

A cached block gives a later request its K/V, but the recurrent layers carry one
state per sequence, not per position: to resume after a cached prefix the request
also needs the conv and SSM state at the end of it. So while a prompt is computed
the runner copies its state, at some block boundaries, into a snapshot slot, and a
later request whose cached prefix ends at such a boundary starts from a copy of it.

Snapshots live in a side table keyed by the cache key of the block that ends at the
boundary, not in a KV cache group of their own: a group's block id costs a page in
every group, and one snapshot (every recurrent layer's whole state) weighs as much
as tens of KV blocks, so giving each block one would either waste most of the
memory or force huge blocks. Here a small pool of snapshot slots is shared by the
few boundaries that get one (every `interval` tokens, every block-aligned chunk
end, the last block boundary before a prompt's last token, and where a prompt's
cached blocks end past the snapshot it resumed from: there it parts from an earlier
prompt, so a third one sharing that prefix resumes there), and the block pool
drops a key's snapshot when it evicts or uncaches that key (`drop`).

Slots here are numbers 0..num_snapshots-1; the runner keeps them after its live
request slots. This module knows no tensors.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class StateSnapshotCache:
    def __init__(self, num_snapshots: int, block_size: int, interval: int):
        if num_snapshots < 1:
            raise ValueError(f"num_state_snapshots must be >= 1, got {num_snapshots}")
        if interval < block_size or interval % block_size:
            raise ValueError(f"the state snapshot interval ({interval}) must be a multiple "
                             f"of the block size ({block_size})")
        self.num_snapshots = num_snapshots
        self.block_size = block_size
        self.interval = interval
        # key -> slot, least recently used first.
        self.slot_of: OrderedDict[Hashable, int] = OrderedDict()
        self._free = list(range(num_snapshots - 1, -1, -1))  # pop() hands out 0 first
        # Slots the schedule call under way writes or restores: not evicted before the
        # call ends (the step would read or write a slot given to another key).
        self._pinned: set[int] = set()
        self.num_taken = 0
        self.num_evicted = 0

    @property
    def num_used(self) -> int:
        return len(self.slot_of)

    def get(self, key: Hashable) -> int | None:
        """The key's snapshot slot (marked recently used), or None."""
        slot = self.slot_of.get(key)
        if slot is not None:
            self.slot_of.move_to_end(key)
        return slot

    def has(self, key: Hashable) -> bool:
        return key in self.slot_of

    def pin(self, slot: int) -> None:
        self._pinned.add(slot)

    def can_take(self) -> bool:
        """take() would find a slot (free, or an unpinned one to evict)."""
        return bool(self._free) or any(s not in self._pinned for s in self.slot_of.values())

    def take(self, key: Hashable) -> int | None:
        """A slot for a new snapshot of `key` (pinned), evicting the least recently used
        unpinned one when none is free; None when every slot is pinned."""
        if key in self.slot_of:
            raise ValueError(f"state snapshot for {key!r} already exists")
        if not self._free:
            victim = next((k for k, s in self.slot_of.items() if s not in self._pinned), None)
            if victim is None:
                return None
            self.drop(victim)
            self.num_evicted += 1
        slot = self._free.pop()
        self.slot_of[key] = slot
        self._pinned.add(slot)
        self.num_taken += 1
        return slot

    def drop(self, key: Hashable) -> None:
        """The key's block left the prefix cache: its snapshot goes with it."""
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def reset(self) -> None:
        self._free.extend(self.slot_of.values())
        self.slot_of.clear()

    def schedule_done(self) -> None:
        self._pinned.clear()

    def due_boundaries(self, start: int, end: int, num_tokens: int,
                       match_end: int | None = None) -> list[int]:
        """Block boundaries in (start, end] whose state a chunk computing tokens
        [start, end) of a sequence of `num_tokens` known tokens snapshots: every
        `interval`-th one, the chunk's end when it is one, the last one before the
        last token (a lookup leaves that token to compute: the longest possible hit),
        and `match_end`, where the sequence's cached blocks end past the snapshot it
        resumed from (where it parts from a cached prompt). Never past that last one."""
        bs = self.block_size
        last = (num_tokens - 1) // bs * bs
        end = min(end, last)
        if end <= start:
            return []
        first = (start // self.interval + 1) * self.interval
        due = list(range(first, end + 1, self.interval))
        for b in (end, last, match_end):
            if b is not None and b % bs == 0 and start < b <= end and b not in due:
                due.append(b)
        return sorted(due)
