"""The pool of KV block ids: free blocks, reference counts, and the prefix cache.

Block 0 is the null block: it is never handed out, and padded block-table
entries point at it, so a stray read lands on memory no request owns.

Prefix caching (when enabled): a full block whose KV is written (or scheduled
to be, this step) can be registered under its cache key (group, chained block
hash). A cached block keeps its key and contents after its last reference is
dropped: it sits in the free queue, still findable, and is only evicted (its
key dropped) when the allocator hands it out again. The free queue is one LRU:
allocation takes from the head; a freed block that holds a cached prefix goes
to the tail (so it is evicted last), a freed block without one goes to the head
(it is worth nothing). Taking a cached block that sits in the free queue
(`touch`) removes it from the queue.

Without prefix caching freed blocks simply go to the tail, as before.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable


class BlockPool:
    NULL_BLOCK = 0

    def __init__(self, num_blocks: int, enable_caching: bool = False):
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be at least 2 (got {num_blocks})")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.ref_cnt[self.NULL_BLOCK] = 1  # permanently held
        # Free block ids in eviction order (head first); values unused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        # Prefix cache: key -> block id, and each block's key (None: not cached).
        self.cached: dict[Hashable, int] = {}
        self.block_key: list[Hashable | None] = [None] * num_blocks
        self.num_evictions = 0
        # Called with each key that leaves the cache (evicted, uncached, reset): what is
        # tied to a cached block goes with it (a hybrid's state snapshots).
        self.on_evict: Callable[[Hashable], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones among them: they are evictable)."""
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_used_blocks(self) -> int:
        """Blocks some request holds (0 when idle, whatever the cache keeps)."""
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, held or free."""
        return len(self.cached)

    @property
    def num_evictable_cached_blocks(self) -> int:
        """Cached blocks no request holds: free, their contents kept until evicted."""
        return sum(1 for b in self.cached.values() if self.ref_cnt[b] == 0)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._evict(b)
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def _evict(self, b: int) -> None:
        key = self.block_key[b]
        if key is not None:
            self.block_key[b] = None
            if self.cached.get(key) == b:
                del self.cached[key]
                if self.on_evict is not None:
                    self.on_evict(key)
            self.num_evictions += 1

    def share(self, block_ids: list[int]) -> None:
        """Take one more reference on blocks someone already holds."""
        for b in block_ids:
            if b == self.NULL_BLOCK:
                continue
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"block {b} is free and cannot be shared")
            self.ref_cnt[b] += 1

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks, held or free (a free one leaves the queue)."""
        for b in block_ids:
            if b == self.NULL_BLOCK:  # (a sliding group's entry before its window)
                continue
            if self.ref_cnt[b] == 0:
                del self._free[b]
            self.ref_cnt[b] += 1

    def num_free_among(self, block_ids: list[int]) -> int:
        """How many of these blocks sit in the free queue (touching them takes them out)."""
        return sum(1 for b in block_ids if self.ref_cnt[b] == 0)

    def free(self, block_ids: list[int]) -> None:
        # Freed in reverse so the tail of a sequence is evicted first and the
        # head (the prefix most likely to be shared) stays longest.
        for b in reversed(block_ids):
            if b == self.NULL_BLOCK:
                continue
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] < 0:
                raise RuntimeError(f"block {b} freed twice")
            if self.ref_cnt[b] == 0:
                self._free[b] = None
                if self.enable_caching and self.block_key[b] is None:
                    self._free.move_to_end(b, last=False)  # nothing cached: reuse first

    # ---- the prefix cache -------------------------------------------------------
    def get_cached_block(self, key: Hashable) -> int | None:
        return self.cached.get(key)

    def cache_block(self, block_id: int, key: Hashable) -> bool:
        """Register a held block under `key`; False when the key already names a
        block (an identical block computed twice stays uncached) or it has a key."""
        if key in self.cached or self.block_key[block_id] is not None:
            return False
        self.cached[key] = block_id
        self.block_key[block_id] = key
        return True

    def uncache_block(self, block_id: int) -> None:
        """Drop the block's key (its contents are not what the key says); held or free."""
        key = self.block_key[block_id]
        if key is not None:
            self.block_key[block_id] = None
            if self.cached.get(key) == block_id:
                del self.cached[key]
                if self.on_evict is not None:
                    self.on_evict(key)
            if self.ref_cnt[block_id] == 0 and self.enable_caching:
                self._free.move_to_end(block_id, last=False)  # worth nothing: reuse first

    def reset_prefix_cache(self) -> int:
        """Forget every cached key (blocks in use keep working, unshared). Returns
        how many were dropped."""
        n = len(self.cached)
        for key, b in self.cached.items():
            self.block_key[b] = None
            if self.on_evict is not None:
                self.on_evict(key)
        self.cached.clear()
        return n
