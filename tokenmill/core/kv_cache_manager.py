"""KV block bookkeeping per request: which block ids each request holds, per group.

Longer than 500 lines on purpose: the prefix-cache lookup, the sliding windows, the
hybrid state snapshots and the external tier's loads all act on the same per-request
block lists in one allocation, and splitting them would spread one invariant (what a
request holds) over several files."""
from __future__ import annotations

from tokenmill.core.block_pool import BlockPool
from tokenmill.core.kv_cache_spec import KVCacheConfig, SlidingWindowSpec
from tokenmill.core.kv_cache_utils import PrefixCacheStats, request_block_hashes
from tokenmill.core.request import Request
from tokenmill.core.state_snapshots import StateSnapshotCache


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _token_at(request: Request, j: int) -> int:
    """The request's token at index j (prompt, then output)."""
    prompt = request.prompt_token_ids
    return prompt[j] if j < len(prompt) else request.output_token_ids[j - len(prompt)]


class KVCacheManager:
    """Attention groups: each request holds a growing list of blocks per group, entry i
    for its positions [i * block_size, (i + 1) * block_size).

    All groups draw from one pool (a block id indexes the same page in every
    layer of its group, and groups never share ids). A recurrent-state
    (MambaSpec) group takes no blocks: its list stays empty, the runner keeps
    the state in a slot keyed on the request id.

    Sliding-window groups give back, whenever a request is scheduled, the blocks
    that lie entirely before the window of its next token (they become the null
    block in its list; indices keep their meaning), so a running request holds
    about window / block_size + 1 blocks there, plus its step's new tokens.

    With `enable_caching`, full blocks are registered in the pool's prefix
    cache under (group, chained block hash) as soon as the step that writes
    them is scheduled, and a request admitted with nothing computed first takes
    the longest cached prefix of its tokens (`get_computed_blocks`), leaving at
    least its last token to compute. Requests asking for prompt logprobs skip
    the lookup (they need every prompt position computed).

    Blocks the external KV tier loads are registered like computed ones, but they
    are *loading* until the step that loads them comes back (`loads_done`): the
    schedule call that loads them may hand them to other requests (the runner
    loads before the forward, and samples nothing for any row over a block that
    did not load), later ones may not (a step already scheduled could not be
    undone). A block that did not load leaves the cache; its holders recompute it.

    Hybrid models (a recurrent-state group) cache prefixes only where a state
    snapshot exists (core/state_snapshots.py): a hit ends at the longest cached
    prefix whose last block has one, and the request's state starts from a copy of
    it (`state_restores` of the step). Each step snapshots its chunks at their due
    boundaries (`state_snapshots`), and `align_chunk` ends a prompt chunk cut by the
    budget at a block boundary ("align": every boundary a cold run splits its
    recurrent computation at holds a snapshot, so a hit resumes from exactly the
    state the cold run went on from).
    """

    def __init__(self, kv_cache_config: KVCacheConfig, enable_caching: bool = False,
                 state_snapshot_interval: int = 256, draft_reads_next_token: bool = False):
        """`draft_reads_next_token`: a draft model (EAGLE-3, MTP) keeps K/V in these
        blocks that it made at each position p from the token at p + 1, so a cached
        block's last position holds what the request that wrote it had after the
        block. A hit's last block counts only where the token after it is the one its
        writer had: the cached block after it matches too (its hash covers that token),
        or the token recorded with it (`_next_token`, the writer's, once known) is the
        new request's. Else the hit ends a block earlier (vLLM drops the last hit block
        for EAGLE unconditionally)."""
        self.config = kv_cache_config
        self.draft_reads_next_token = draft_reads_next_token
        # Per block id: the token after the block in the request that registered it
        # (None: not known yet); per request: its registered blocks still waiting for
        # that token ((block index, ids in each group)).
        self._next_token: list[int | None] | None = (
            [None] * kv_cache_config.num_blocks if draft_reads_next_token else None)
        self._unconfirmed: dict[str, tuple[int, list[int]]] = {}
        self.block_size = kv_cache_config.block_size
        self.num_groups = len(kv_cache_config.groups)
        self.block_groups = [i for i, g in enumerate(kv_cache_config.groups) if g.is_attention]
        self.first_block_group = self.block_groups[0]
        # group id -> its SlidingWindowSpec, for the sliding groups.
        self.sliding = {i: g.spec for i, g in enumerate(kv_cache_config.groups)
                        if isinstance(g.spec, SlidingWindowSpec)}
        if any(kv_cache_config.groups[i].spec.block_size != self.block_size
               for i in self.block_groups):
            raise ValueError("every attention group needs the same block size (one pool)")
        self.enable_caching = enable_caching
        self.pool = BlockPool(kv_cache_config.num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[list[int]]] = {}
        # Per request: how many of its leading blocks are registered in the cache.
        self.num_cached_blocks: dict[str, int] = {}
        # External loads not confirmed: those of the schedule call under way, and those
        # of steps in flight.
        self._loading_now: set[int] = set()
        self._loading: set[int] = set()
        self.prefix_cache_stats = PrefixCacheStats()
        self.snapshots: StateSnapshotCache | None = None
        if enable_caching and kv_cache_config.state_group_id is not None:
            interval = max(1, state_snapshot_interval // self.block_size) * self.block_size
            self.snapshots = StateSnapshotCache(kv_cache_config.num_state_snapshots,
                                                self.block_size, interval)
            self.pool.on_evict = self.snapshots.drop  # a snapshot lives as long as its block
        # This schedule call's state operations (hybrids): request -> snapshot it starts
        # from; request -> [(boundary, snapshot slot)] it writes.
        self._state_restores: dict[str, int] = {}
        self._state_writes: dict[str, list[tuple[int, int]]] = {}
        self._written_now: set[int] = set()
        # Request -> the snapshot slot an external hit's state is loaded into (the
        # connector's KVLoad.state_slot), taken by allocate_slots.
        self._state_loads: dict[str, int] = {}
        # Snapshot slots loaded by steps in flight (slot -> its key): restored by their
        # loader only, until the step comes back (`state_loads_done`).
        self._loading_slots: dict[int, object] = {}
        self._loads_now: dict[int, object] = {}  # the same, of this schedule call
        # Request -> where its cached blocks end, past the snapshot its hit resumes
        # from: the point where its prompt leaves one cached before (a shared system
        # prompt's end). It snapshots there, so the next request sharing that prefix
        # resumes from it instead of recomputing the same blocks.
        self._match_end: dict[str, int] = {}

    @property
    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """A copy: a SchedulerOutput may be read after later steps changed the lists
        (async scheduling runs a step while the next one is scheduled)."""
        blocks = self.req_to_blocks.get(request_id)
        return [list(g) for g in blocks] if blocks else [[] for _ in range(self.num_groups)]

    @property
    def num_cached_blocks_total(self) -> int:
        return self.pool.num_cached_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[list[int]], int]:
        """The longest cached prefix of `request`'s tokens: (block ids per group,
        number of tokens). Nothing is taken yet (allocate_slots does that)."""
        empty = [[] for _ in range(self.num_groups)]
        if (not self.enable_caching or request.num_computed_tokens
                or request.sampling_params.prompt_logprobs is not None):
            return empty, 0
        hashes = request_block_hashes(request, self.block_size)
        # The last token is always computed: its logits give the next token.
        max_blocks = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        ids = {gid: [] for gid in self.block_groups}
        # (a draft model reading the next token: one block further, to confirm the last)
        num = len(hashes) if self.draft_reads_next_token else max_blocks
        # Full groups: the longest run of cached blocks from the start (each group
        # can only shorten it).
        for gid in self.block_groups:
            if gid in self.sliding:
                continue
            for i in range(num):
                b = self.pool.get_cached_block((gid, hashes[i]))
                if b is None or b in self._loading:
                    break
                ids[gid].append(b)
            num = len(ids[gid])
        if self.draft_reads_next_token and num:
            # (past max_blocks the next block matched: its hash covers the token)
            if num <= max_blocks and any(
                    self._next_token[ids[gid][num - 1]] != _token_at(request, num * self.block_size)
                    for gid in self.block_groups if gid not in self.sliding):
                num -= 1
            num = min(num, max_blocks)
        # Sliding groups need only the blocks inside the window of the first token
        # to compute. The rule: a hit of n blocks needs, in each sliding group, blocks
        # first_needed_block(n * block_size) .. n - 1 cached (those before stay null);
        # the hit is the largest n, no longer than the full groups', that every
        # sliding group can serve.
        valid = [True] * (num + 1)
        for gid, spec in self.sliding.items():
            found = [self.pool.get_cached_block((gid, hashes[i])) for i in range(num)]
            run = 0  # cached blocks ending at block i
            for i, b in enumerate(found):
                run = run + 1 if b is not None else 0
                if i + 1 - run > spec.first_needed_block((i + 1) * self.block_size):
                    valid[i + 1] = False
            ids[gid] = [BlockPool.NULL_BLOCK if b is None else b for b in found]
        matched = max(n for n in range(num + 1) if valid[n])
        # A hybrid resumes only where its recurrent state was snapshotted.
        num = max(n for n in range(num + 1)
                  if valid[n] and (n == 0 or self.snapshots is None
                                   or self._snapshot_usable(request, hashes, n)))
        if self.snapshots is not None:
            if matched > num:
                self._match_end[request.request_id] = matched * self.block_size
            else:
                self._match_end.pop(request.request_id, None)
        hits = [[] for _ in range(self.num_groups)]
        for gid in self.block_groups:
            group = ids[gid][:num]
            if gid in self.sliding:
                first = self.sliding[gid].first_needed_block(num * self.block_size)
                group[:first] = [BlockPool.NULL_BLOCK] * first
            hits[gid] = group
        return hits, num * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[list[int]] | None = None,
                       num_new_computed_tokens: int = 0,
                       num_external_tokens: int = 0,
                       num_lookahead_tokens: int = 0) -> list[list[int]] | None:
        """Make room for `num_new_tokens` more tokens of `request`.

        On admission, `new_computed_blocks` / `num_new_computed_tokens` are the
        cached prefix from get_computed_blocks (taken here) and
        `num_external_tokens` the tokens after it that the external KV tier will
        load into freshly allocated blocks; they count as computed.

        `num_lookahead_tokens` more slots are made room for without counting as
        tokens: a draft model writes its K/V there while it proposes the next
        step's drafts (speculative decoding).

        Returns the newly allocated block ids per group ([] lists when none were
        needed), or None when the pool cannot provide them (nothing changes then).
        """
        if (new_computed_blocks is None and not num_external_tokens and not self.sliding
                and self.snapshots is None):
            # A running request's step inside the blocks it holds (most decode steps):
            # what the general path below does then, without its per-group work.
            blocks = self.req_to_blocks.get(request.request_id)
            num_tokens = (request.num_computed_tokens + num_new_computed_tokens
                          + num_new_tokens)
            if blocks is not None and -(-(num_tokens + num_lookahead_tokens)
                                         // self.block_size) <= len(blocks[self.first_block_group]):
                if self.enable_caching:
                    self._cache_full_blocks(request, blocks, min(num_tokens, request.num_tokens))
                return [[] for _ in range(self.num_groups)]
        blocks = self.req_to_blocks.setdefault(request.request_id,
                                               [[] for _ in range(self.num_groups)])
        num_tokens = (request.num_computed_tokens + num_new_computed_tokens
                      + num_external_tokens + num_new_tokens)
        # Blocks before the window of the step's first token are not read again.
        self._free_outside_window(blocks, request.num_computed_tokens)
        needed_per_group = cdiv(num_tokens + num_lookahead_tokens, self.block_size)
        have = len(blocks[self.first_block_group])
        num_touch_free = 0
        if new_computed_blocks is not None:
            have += len(new_computed_blocks[self.first_block_group])
            num_touch_free = sum(self.pool.num_free_among(ids) for ids in new_computed_blocks)
        num_new = max(0, needed_per_group - have)
        # A sliding group need not allocate the new blocks its window has already left
        # (a long cached prefix): those entries are the null block.
        # Nor those before the window of an external hit's end (the tier loads only the
        # blocks inside it).
        num_local = request.num_computed_tokens + num_new_computed_tokens + num_external_tokens
        skip = {gid: min(num_new, max(0, spec.first_needed_block(num_local) - have))
                for gid, spec in self.sliding.items()}
        total_new = num_new * len(self.block_groups) - sum(skip.values())
        if total_new + num_touch_free > self.pool.num_free_blocks:
            if not any(blocks):
                del self.req_to_blocks[request.request_id]
            return None
        if new_computed_blocks is not None:
            if self.enable_caching:  # once per admission (a waiting request looks up again)
                self.prefix_cache_stats.record(request.num_tokens, num_new_computed_tokens)
            for group_blocks, ids in zip(blocks, new_computed_blocks):
                self.pool.touch(ids)  # before allocating: allocation must not evict them
                group_blocks.extend(ids)
            if self.snapshots is not None and num_new_computed_tokens and \
                    not num_external_tokens:
                self._take_restore(request, num_new_computed_tokens)
        new_ids = [[] for _ in range(self.num_groups)]
        for gid in self.block_groups:
            k = skip.get(gid, 0)
            new_ids[gid] = [BlockPool.NULL_BLOCK] * k + self.pool.allocate(num_new - k)
            blocks[gid].extend(new_ids[gid])
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, min(num_tokens, request.num_tokens))
            if self.snapshots is not None and num_external_tokens:
                # The state resumes after the external hit: from a snapshot kept here,
                # or one the tier loads into a slot taken now (its block is cached by
                # now: the allocation above cannot evict the key).
                self._take_external_restore(request, num_local)
            if self.snapshots is not None:
                self._take_snapshots(request, num_tokens - num_new_tokens, num_tokens)
        return new_ids

    # ---- recurrent-state snapshots (hybrid models) -------------------------------------
    def _snapshot_key(self, hashes, num_blocks: int):
        """The key a state snapshot after `num_blocks` blocks is kept under: that of
        its last block (first attention group)."""
        return (self.first_block_group, hashes[num_blocks - 1])

    def _snapshot_usable(self, request: Request, hashes, num_blocks: int) -> bool:
        """A snapshot after `num_blocks` blocks exists; one this schedule call writes only
        if the request then computes more than one token: a one-token row runs with the
        decode rows, before the prompt rows that write snapshots in every layer."""
        slot = self.snapshots.slot_of.get(self._snapshot_key(hashes, num_blocks))
        if slot is None or self._slot_loading(slot):
            return False
        return (slot not in self._written_now
                or num_blocks * self.block_size < request.num_tokens - 1)

    def hit_snapshot_written_now(self, request: Request, num_hit: int) -> bool:
        return self.snapshots is not None and self.snapshots.slot_of.get(self._snapshot_key(
            request_block_hashes(request, self.block_size), num_hit // self.block_size)) \
            in self._written_now

    def _take_restore(self, request: Request, num_hit: int) -> None:
        hashes = request_block_hashes(request, self.block_size)
        slot = self.snapshots.get(self._snapshot_key(hashes, num_hit // self.block_size))
        if slot is None:  # get_computed_blocks only returns hits that have one
            raise RuntimeError(f"prefix hit of {request.request_id} has no state snapshot")
        self.snapshots.pin(slot)
        self._state_restores[request.request_id] = slot

    def _take_external_restore(self, request: Request, num_hit: int) -> None:
        hashes = request_block_hashes(request, self.block_size)
        key = self._snapshot_key(hashes, num_hit // self.block_size)
        slot = self.snapshots.get(key)
        if slot is None:
            slot = self.snapshots.take(key)  # pinned; filled by the step's load
            if slot is None:  # can_load_snapshot said there was one
                raise RuntimeError(f"no snapshot slot for the external hit of "
                                   f"{request.request_id}")
            self._written_now.add(slot)
            self._state_loads[request.request_id] = slot
            self._loads_now[slot] = key
        self.snapshots.pin(slot)
        self._state_restores[request.request_id] = slot

    def _slot_loading(self, slot: int) -> bool:
        """The external tier loads this snapshot slot in this call or a step in flight:
        only its loader may restore from it (the load may fail)."""
        return slot in self._loading_slots or slot in self._loads_now

    def state_loads_done(self, loads, invalid: set[int]) -> None:
        """The step loading snapshots into the slots of `loads` (KVLoad) came back: a load
        whose last block is `invalid` did not bring its snapshot (or its block), so the
        snapshot is dropped (only its loader restored from it; it starts over)."""
        for load in loads:
            if load.state_slot is None:
                continue
            key = self._loading_slots.pop(load.state_slot, None)
            if key is not None and load.block_ids[-1] in invalid and \
                    self.snapshots.slot_of.get(key) == load.state_slot:
                self.snapshots.drop(key)

    def drop_written_snapshots(self, request: Request, writes, num_tokens: int) -> None:
        """A step's snapshot `writes` ((boundary, slot)) of `request` past `num_tokens`
        were computed over a failed load: dropped (their key may name another
        request's block, which stays cached)."""
        hashes = request_block_hashes(request, self.block_size)
        for boundary, slot in writes:
            if boundary > num_tokens:
                key = self._snapshot_key(hashes, boundary // self.block_size)
                if self.snapshots.slot_of.get(key) == slot:
                    self.snapshots.drop(key)

    def external_restore_ok(self, request: Request, num_hit: int) -> bool:
        """Whether a hybrid's external hit of `num_hit` tokens can resume its state: from
        the snapshot kept here (one this schedule call writes only for a row of more than
        one token, as _snapshot_usable), or from one the tier loads into a slot taken
        now (a free one, or one to evict)."""
        hashes = request_block_hashes(request, self.block_size)
        if self.snapshots.has(self._snapshot_key(hashes, num_hit // self.block_size)):
            return self._snapshot_usable(request, hashes, num_hit // self.block_size)

        return self.snapshots.can_take()

    def take_state_load(self, request_id: str) -> int | None:
        """The snapshot slot allocate_slots took for `request_id`'s external hit to load
        its state into (None: none, its snapshot is kept here)."""
        return self._state_loads.pop(request_id, None)

    def local_snapshot_slot(self, block_hash, pin: bool = False) -> int | None:
        """The slot of the snapshot after the block `block_hash` (first attention group),
        or None. pin=True (an admission's lookup): only one written before this schedule
        call (a one-token row restores before the prompt rows write), kept for it."""
        slot = self.snapshots.slot_of.get((self.first_block_group, block_hash))
        if slot is None or not pin:
            return slot
        if slot in self._written_now or self._slot_loading(slot):
            return None
        self.snapshots.pin(slot)
        return slot

    def uncache_from(self, request: Request, num_tokens: int) -> None:
        """The request's KV (and recurrent state) past `num_tokens` is not what its keys
        say (computed over a failed external load): its blocks from there leave the
        prefix cache, with their state snapshots."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        for gid in self.block_groups:
            for b in blocks[gid][num_tokens // self.block_size:]:
                if b != BlockPool.NULL_BLOCK:
                    self.pool.uncache_block(b)

    def _take_snapshots(self, request: Request, start: int, end: int) -> None:
        """Snapshot slots for the due boundaries of the chunk [start, end) whose block
        is cached and has none yet (an identical prefix computed twice keeps one)."""
        due = self.snapshots.due_boundaries(start, end, request.num_tokens,
                                            self._match_end.get(request.request_id))
        if not due:
            return
        hashes = request_block_hashes(request, self.block_size)
        for b in due:
            key = self._snapshot_key(hashes, b // self.block_size)
            if self.pool.get_cached_block(key) is None or self.snapshots.has(key):
                continue
            slot = self.snapshots.take(key)
            if slot is not None:
                self._state_writes.setdefault(request.request_id, []).append((b, slot))
                self._written_now.add(slot)

    def align_chunk(self, request: Request, start: int, num_new: int) -> int:
        """Hybrids with prefix caching: a chunk [start, start + num_new) that stops short
        of the request's known tokens ends at a block boundary instead, which the step
        snapshots (kept as is when that leaves nothing: a budget under one block)."""
        if self.snapshots is None or start + num_new >= request.num_tokens:
            return num_new
        end = (start + num_new) // self.block_size * self.block_size
        return end - start if end > start else num_new

    def take_state_ops(self) -> tuple[dict[str, int], dict[str, list[tuple[int, int]]]]:
        """The schedule call is over: its restores and snapshot writes, for the step."""
        ops = self._state_restores, self._state_writes
        self._state_restores, self._state_writes = {}, {}
        self._written_now = set()
        self._loading_slots.update(self._loads_now)  # in flight now, until state_loads_done
        self._loads_now = {}
        self._state_loads = {}
        if self.snapshots is not None:
            self.snapshots.schedule_done()
        return ops

    def reset_state_snapshots(self) -> None:
        """Forget every snapshot (the steps that wrote them may not have run)."""
        if self.snapshots is not None:
            self.snapshots.reset()
        self._loading_slots, self._loads_now = {}, {}

    def _free_outside_window(self, blocks: list[list[int]], num_computed: int) -> None:
        """Give back each sliding group's blocks that lie entirely before the window of
        the token at `num_computed` (the next one computed); their entries become the
        null block. A cached one keeps its key in the free queue (a later hit may use it)."""
        for gid, spec in self.sliding.items():
            group = blocks[gid]
            first = min(spec.first_needed_block(num_computed), len(group))
            gone = [b for b in group[:first] if b != BlockPool.NULL_BLOCK]
            if gone:
                self.pool.free(gone)
                group[:first] = [BlockPool.NULL_BLOCK] * first

    def num_blocks_held(self, request_id: str, group_id: int) -> int:
        """Blocks `request_id` holds in a group (null entries not counted)."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return 0
        return sum(1 for b in blocks[group_id] if b != BlockPool.NULL_BLOCK)

    def _cache_full_blocks(self, request: Request, blocks: list[list[int]],
                           num_tokens: int) -> None:
        """Register the request's full blocks up to `num_tokens` (written by the
        step being scheduled, or earlier) that are not registered yet."""
        rid = request.request_id
        if rid in self._unconfirmed:
            self._record_next_token(request)
        start = self.num_cached_blocks.get(rid, 0)
        if num_tokens // self.block_size <= start:
            return
        hashes = request_block_hashes(request, self.block_size)
        end = min(num_tokens // self.block_size, len(hashes))
        for gid in self.block_groups:
            group_blocks = blocks[gid]
            for i in range(start, end):
                if group_blocks[i] != BlockPool.NULL_BLOCK:  # (a window left it unwritten)
                    if self.pool.cache_block(group_blocks[i], (gid, hashes[i])) and \
                            self._next_token is not None:
                        self._note_next_token(request, i, group_blocks[i])
        self.num_cached_blocks[rid] = end

    def _note_next_token(self, request: Request, i: int, block: int) -> None:
        """Block `block` (index i of `request`) was registered: the token after it, or
        (not sampled yet) a note to record it when it is."""
        j = (i + 1) * self.block_size
        if j < request.num_tokens:
            self._next_token[block] = _token_at(request, j)
            return
        self._next_token[block] = None
        rid = request.request_id
        index, ids = self._unconfirmed.get(rid, (i, []))
        self._unconfirmed[rid] = (i, (ids if index == i else []) + [block])

    def _record_next_token(self, request: Request) -> None:
        """The token after the request's last registered block, if sampled since (the
        drafter wrote that block's last K/V from it)."""
        i, ids = self._unconfirmed[request.request_id]
        j = (i + 1) * self.block_size
        if j < request.num_tokens:
            token = _token_at(request, j)
            for b in ids:
                self._next_token[b] = token
            del self._unconfirmed[request.request_id]

    # ---- external loads (tokenmill.kv_connector) --------------------------------------
    def mark_loading(self, block_ids: list[int]) -> None:
        """The external tier loads these (freshly allocated) blocks in this step."""
        self._loading_now.update(block_ids)

    def holds_loading(self, block_ids: list[int]) -> bool:
        """Whether these blocks (a cache hit) include one this step loads."""
        return bool(self._loading_now) and not self._loading_now.isdisjoint(block_ids)

    def loading_scheduled(self) -> None:
        """The schedule call is over: its loads are in flight, hit by no later call."""
        if self._loading_now:
            self._loading |= self._loading_now
            self._loading_now = set()

    def loads_done(self, block_ids: list[int], invalid: set[int]) -> None:
        """The step loading `block_ids` came back; `invalid`: those that do not hold their
        KV, dropped from the prefix cache (their holders recompute them: `rollback`)."""
        for b in block_ids:
            if b in self._loading:
                self._loading.discard(b)
                if b in invalid:
                    self.pool.uncache_block(b)

    def first_block_among(self, request_id: str, block_ids: set[int]) -> int | None:
        """Index of the request's first block (first attention group) in `block_ids`."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return None
        return next((i for i, b in enumerate(blocks[self.first_block_group])
                     if b in block_ids), None)

    def window_intact(self, request_id: str, num_tokens: int) -> bool:
        """Whether every sliding group still holds the blocks the token at `num_tokens`
        reads (a failed external load rolls back there; an earlier hit may have left
        them the null block)."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return True
        end = num_tokens // self.block_size
        return all(BlockPool.NULL_BLOCK not in blocks[gid][spec.first_needed_block(num_tokens):end]
                   for gid, spec in self.sliding.items())

    def rollback(self, request: Request, num_tokens: int) -> None:
        """The request's KV ends at `num_tokens` (a load failed): its blocks from there are
        registered again once recomputed."""
        rid = request.request_id
        if rid in self.num_cached_blocks:
            self.num_cached_blocks[rid] = min(self.num_cached_blocks[rid],
                                              num_tokens // self.block_size)

    def _forget_loading(self, block_ids: list[int]) -> None:
        """Blocks freed while their load is unconfirmed (the step may never come back:
        aborted, preempted, a failed step): out of the cache, to be safe - and so are
        the request's blocks after the first of them, computed over it in the same step
        (with the state snapshots after them, a hybrid's)."""
        after = False
        for b in block_ids:
            if b in self._loading or b in self._loading_now:
                self._loading.discard(b)
                self._loading_now.discard(b)
                self.pool.uncache_block(b)
                after = True
            elif after and b != BlockPool.NULL_BLOCK:
                self.pool.uncache_block(b)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (the benchmark's cold runs); returns how many."""
        return self.pool.reset_prefix_cache()

    def share_prefix(self, request: Request, donor_id: str, num_blocks: int) -> int:
        """Give `request` the first `num_blocks` blocks of `donor_id` (per group) and
        return the number of tokens they hold. The caller marks them computed."""
        assert not any(self.req_to_blocks.get(request.request_id, [])), "request holds blocks"
        donor = self.req_to_blocks.get(donor_id)
        if not donor or len(donor[self.first_block_group]) < num_blocks or num_blocks <= 0:
            return 0
        shared = [list(group[:num_blocks]) for group in donor]
        for gid, spec in self.sliding.items():
            # The donor went on past the prompt: its window may have left blocks this
            # request's next token still reads. Then it prefills alone.
            first = spec.first_needed_block(num_blocks * self.block_size)
            if BlockPool.NULL_BLOCK in shared[gid][first:]:
                return 0
            shared[gid][:first] = [BlockPool.NULL_BLOCK] * first
        for ids in shared:
            self.pool.share(ids)
        self.req_to_blocks[request.request_id] = shared
        return num_blocks * self.block_size

    def free(self, request: Request) -> None:
        if request.request_id in self._unconfirmed:  # (its last token may follow a block)
            self._record_next_token(request)
            self._unconfirmed.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self._match_end.pop(request.request_id, None)
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            for group_blocks in blocks:
                if self._loading or self._loading_now:
                    self._forget_loading(group_blocks)
                self.pool.free(group_blocks)
