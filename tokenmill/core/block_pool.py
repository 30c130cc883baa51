"""The pool of KV block ids: a free list and reference counts.

Block 0 is the null block: it is never handed out, and padded block-table
entries point at it, so a stray read lands on memory no request owns.
"""
from __future__ import annotations

from collections import deque


class BlockPool:
    NULL_BLOCK = 0

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be at least 2 (got {num_blocks})")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.ref_cnt[self.NULL_BLOCK] = 1  # permanently held
        self._free = deque(range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self.ref_cnt[b] = 1
        return out

    def share(self, block_ids: list[int]) -> None:
        """Take one more reference on blocks someone already holds."""
        for b in block_ids:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"block {b} is free and cannot be shared")
            self.ref_cnt[b] += 1

    def free(self, block_ids: list[int]) -> None:
        # Freed in reverse so the tail of a sequence is reused first and the
        # head (likely shared later by prefix caching) stays longest.
        for b in reversed(block_ids):
            if b == self.NULL_BLOCK:
                continue
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] < 0:
                raise RuntimeError(f"block {b} freed twice")
            if self.ref_cnt[b] == 0:
                self._free.append(b)
