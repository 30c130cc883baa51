"""The KV connector: the external KV tier behind the prefix cache. No torch here.

Two halves, as in vLLM's KVConnectorBase_V1 (and the reference runner's
ConnectorLoadExternalKv / ConnectorStorePromptKv):

* Scheduler half (`KVConnectorScheduler`), called by the Scheduler when it
  admits a request with nothing computed, after the local prefix-cache lookup:
  `get_num_new_matched_tokens` says how many prompt tokens after the local hit
  the external tier holds - an existence lookup only (a dict lookup, a stat, a
  pipeline of Redis EXISTS), bounded in time (`lookup_timeout_s`: a store that
  has not answered by then answers as a miss, see calls.py) - and
  `update_state_after_alloc` records the blocks allocated for them as loads.
  `build_connector_meta` attaches this step's work to the SchedulerOutput as
  `KVConnectorMetadata`, ids and hashes only: the loads (request, block ids,
  block hashes, the stores holding each), and the prompt blocks that become
  complete with this step and that some store lacks (each block once).
* Worker half (`worker.KVConnectorWorker`, torch): `start_load_kv` reads the
  loads' entries and verifies them (header, length, checksum, geometry) on the
  stores' loader threads; `wait_for_load` (before the forward) waits for them
  (`load_timeout_s`), copies the whole ones into the KV cache and reports the
  blocks that did not load (ModelRunnerOutput.invalid_block_ids); `save_kv`
  queues the stores for its writer thread after the forward.

An entry the lookup found may be gone or damaged by the time it is read
(evicted, torn, corrupted, the store down or too slow: `load_timeout_s`). Such a
block is never used: the runner samples nothing for any request whose blocks
include it that step (the forward ran over a block without its KV), and the
scheduler rolls those requests back to the start of it (`loads_returned`,
`loads_failed`, Scheduler._finish_kv_loads). Until a step's loads come back,
their blocks may be hit only by admissions of the same schedule call, and the
requests holding them are not scheduled again (an async step in flight must not
build on them). The failure is counted, the entry is a miss for later lookups
until this process writes it again, and nothing the failed requests computed in
that step is stored.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from tokenmill.core.block_pool import BlockPool
from tokenmill.core.kv_cache_utils import request_block_hashes
from tokenmill.core.sched_output import KVConnectorMetadata, KVLoad, KVStoreBlock
from tokenmill.kv_connector.calls import StoreCaller
from tokenmill.kv_connector.config import (KVConnectorConfig, KVGeometry, StateGeometry,
                                           kv_namespace, namespace_digest, state_key)
from tokenmill.kv_connector.stores import KVStore, StoreUnavailable, make_store

logger = logging.getLogger(__name__)

# Keys whose presence in each store this process knows (lookups and its own writes),
# and entries known to be unreadable (a failed load) until written again.
RECENT_KEYS = 1 << 16
NULL_BLOCK = BlockPool.NULL_BLOCK


STORE_COUNTERS = ("hit_blocks", "hit_tokens", "bytes_loaded", "blocks_stored", "bytes_stored",
                  "load_failures", "store_failures", "snapshots_loaded", "snapshots_stored")


class ConnectorStats:
    """Counters per store (thread-safe: the worker half may run on another thread).
    A hit is a block loaded into the KV cache and used (counted by the worker half)."""

    def __init__(self, store_names: list[str]):
        self._lock = threading.Lock()
        self.per_store = {name: dict.fromkeys(STORE_COUNTERS, 0) for name in store_names}
        self.lookups = 0  # admissions that asked the tier
        self.lookup_tokens = 0  # prompt tokens past the local hit that were asked for

    def add(self, store: str, counter: str, n: int = 1) -> None:
        with self._lock:
            self.per_store[store][counter] += n

    def snapshot(self) -> dict:
        with self._lock:
            per_store = {k: dict(v) for k, v in self.per_store.items()}
            out = {"lookups": self.lookups, "lookup_tokens": self.lookup_tokens,
                   "stores": per_store}
        for c in STORE_COUNTERS:
            out[c] = sum(s[c] for s in per_store.values())
        return out


class KVConnector:
    """What both halves share: the stores, the namespace, the geometry, the stats, and
    the threads that bound store calls in time."""

    def __init__(self, config: KVConnectorConfig, model_id: str, geometry: KVGeometry,
                 stores: list[KVStore] | None = None,
                 state_geometry: StateGeometry | None = None):
        self.config = config
        self.model_id = model_id
        self.geometry = geometry
        # Hybrid models: the recurrent-state snapshots ride along (their own digest, which
        # names the state geometry: a snapshot of another shape or dtype never decodes).
        self.state_geometry = state_geometry
        self.namespace = kv_namespace(model_id, geometry)
        self.ns_digest = namespace_digest(self.namespace)
        self.state_ns_digest = (namespace_digest(f"{self.namespace}/{state_geometry.tag}")
                                if state_geometry is not None else None)
        self.stores = stores if stores is not None else [
            make_store(spec, self.namespace, config) for spec in config.stores]
        names = []
        for s in self.stores:
            name = s.name
            k = 2
            while name in names:
                name, k = f"{s.name}{k}", k + 1
            names.append(name)
        self.store_names = names
        self.stats = ConnectorStats(names)
        self._callers: dict[tuple[str, int], StoreCaller] = {}
        logger.info("KV connector: stores %s, namespace %s", ", ".join(names), self.namespace)

    def caller(self, purpose: str, si: int) -> StoreCaller:
        """The thread that runs store `si`'s calls for `purpose` ("lookup", "load")."""
        c = self._callers.get((purpose, si))
        if c is None:
            c = self._callers[(purpose, si)] = StoreCaller(
                f"tokenmill-kv-{purpose}-{self.store_names[si]}",
                blocking=getattr(self.stores[si], "blocking", True))
        return c

    def close(self) -> None:
        for c in self._callers.values():
            c.close()
        for s in self.stores:
            s.close()


class _LRUSets:
    """block hash -> set of store indices, bounded (least recently used dropped)."""

    def __init__(self, limit: int = RECENT_KEYS):
        self.limit = limit
        self._d: OrderedDict[bytes, set[int]] = OrderedDict()

    def get(self, block_hash: bytes) -> set[int]:
        """The set (created empty), marked recently used."""
        s = self._d.get(block_hash)
        if s is None:
            s = self._d[block_hash] = set()
            if len(self._d) > self.limit:
                self._d.popitem(last=False)
        else:
            self._d.move_to_end(block_hash)
        return s

    def peek(self, block_hash: bytes) -> set[int]:
        return self._d.get(block_hash) or set()

    def __len__(self) -> int:
        return len(self._d)


@dataclass
class _ReqState:
    stored_upto: int = 0  # prompt blocks handed to the store pass
    # The lookup's answer for blocks [found_start, found_start + len(found)): per block
    # the stores holding it; kept while the request waits for blocks (not asked again).
    found_start: int = -1
    found: list[list[int]] = field(default_factory=list)
    # Its loads are in a step whose output has not come back: not scheduled meanwhile.
    loading: bool = False
    # Hybrids: where the state snapshot after the found blocks is - the stores holding
    # it, or this process' snapshot table (`state_local`).
    state_stores: list[int] = field(default_factory=list)
    state_local: bool = False


class KVConnectorScheduler:
    def __init__(self, connector: KVConnector, block_size: int, group_id: int,
                 confirm_last_block: bool = False):
        """`confirm_last_block`: a draft model's K/V at a block's last position read the
        token after the block (EAGLE-3, MTP: KVCacheManager's draft_reads_next_token),
        so a hit's last block counts only where the tier holds the block after it."""
        self.connector = connector
        self.block_size = block_size
        self.group_id = group_id
        self.confirm_last_block = confirm_last_block
        self._reqs: dict[str, _ReqState] = {}
        self._pending_loads: list[KVLoad] = []
        # block hash -> indices of stores known to hold it
        self._known = _LRUSets()
        # block hash -> indices of stores whose entry failed to load: a miss for the
        # lookup until this process writes the block there again
        self._bad = _LRUSets()
        # The same for the state snapshots after blocks (hybrid models).
        self._known_state = _LRUSets()
        self._bad_state = _LRUSets()
        # Hybrids: the local snapshot table's slot for the snapshot after a block (by
        # its hash; pin=True keeps it for the schedule call), or None. Set by the
        # Scheduler (KVCacheManager.local_snapshot_slot).
        self.local_snapshot = None

    # ---- admission --------------------------------------------------------------------
    def is_loading(self, request_id: str) -> bool:
        """Its external blocks are loading in a step not yet come back: do not schedule
        it (nor share its blocks) until loads_returned."""
        state = self._reqs.get(request_id)
        return state is not None and state.loading

    def forget_loads(self) -> None:
        """Every step in flight was void (a failed step, a reset batch): none comes back."""
        for state in self._reqs.values():
            state.loading = False

    def _lookup(self, hashes: list[bytes], state_hashes: list[bytes] = ()
                ) -> tuple[list[list[bool]], list[list[bool]], list[list[bool]]]:
        """Per store, which of `hashes` it holds usable entries of, which it holds at
        all, and which of `state_hashes` it holds a usable state snapshot after: one
        existence call per store, waiting at most lookup_timeout_s; a store down, busy
        or slower answers as a miss. An entry that failed to load is not usable until
        this process writes it again."""
        conn = self.connector
        keys = [h.hex() for h in hashes] + [state_key(h) for h in state_hashes]
        nb = len(hashes)
        timeout = conn.config.lookup_timeout_s
        usable, held, states = [], [], []
        for si, store in enumerate(conn.stores):
            try:
                found = conn.caller("lookup", si).call(lambda s=store: s.contains_many(keys),
                                                       timeout)
            except StoreUnavailable as e:
                logger.debug("KV connector: %s lookup: %s", conn.store_names[si], e)
                # No answer: what it holds is unknown (not absent), and nothing is used.
                usable.append([False] * nb)
                held.append([False] * nb)
                states.append([False] * len(state_hashes))
                continue
            ok = self._usable(si, hashes, found[:nb], self._known, self._bad)
            usable.append(ok)
            held.append(list(found[:nb]))
            states.append(self._usable(si, state_hashes, found[nb:], self._known_state,
                                       self._bad_state))
        return usable, held, states

    @staticmethod
    def _usable(si: int, hashes, found, known_sets: _LRUSets, bad: _LRUSets) -> list[bool]:
        ok = [hit and si not in bad.peek(h) for h, hit in zip(hashes, found)]
        for h, good in zip(hashes, ok):
            known = known_sets.get(h)
            if good:
                known.add(si)
            else:
                known.discard(si)  # (a bad entry is written again when recomputed)
        return ok

    def get_num_new_matched_tokens(self, request, num_local_tokens: int) -> int:
        """Prompt tokens after the local hit that the tier holds (whole blocks; never the
        last token of the request, which is always computed)."""
        rid = request.request_id
        state = self._reqs[rid] = self._reqs.get(rid) or _ReqState()
        state.stored_upto = 0
        state.loading = False
        if request.sampling_params.prompt_logprobs is not None:
            return 0  # every prompt position is computed (its logprobs are asked for)
        bs = self.block_size
        hashes = request_block_hashes(request, bs)
        num_prompt_blocks = min(request.num_prompt_tokens // bs, len(hashes))
        max_load = min(num_prompt_blocks, (request.num_tokens - 1) // bs)
        start = num_local_tokens // bs
        hybrid = self.connector.state_geometry is not None
        if state.found_start == start and state.found and not (
                state.state_local and not self._local_snapshot(hashes[start + len(state.found) - 1])):
            return len(state.found) * bs  # looked up on an earlier try
        state.found_start, state.found = -1, []
        state.state_stores, state.state_local = [], False
        if num_prompt_blocks == 0:
            return 0
        present, held, state_present = self._lookup(
            hashes[:num_prompt_blocks], hashes[start:max_load] if hybrid else ())
        if start >= max_load:
            return 0
        stats = self.connector.stats
        stats.lookups += 1
        stats.lookup_tokens += (max_load - start) * bs
        geometry = self.connector.geometry
        confirm = self.confirm_last_block
        if geometry.sliding_window is None:
            end = start
            limit = num_prompt_blocks if confirm else max_load
            while end < limit and any(p[end] for p in present):
                end += 1
            if confirm:  # (the block after the last: held, or the last is dropped)
                end = max(start, min(max_load, end - 1))
            load_start = start
        else:
            end, load_start = self._sliding_hit(present, start, max_load)
            if confirm:  # (no block past max_load is looked at here: drop the last)
                end = end - 1 if end - 1 > load_start else start
        # A chain entry missing while a later one is there was lost (evicted, deleted).
        if end < max_load:
            for si, found in enumerate(held):
                if not found[end] and any(found[end + 1:num_prompt_blocks]):
                    stats.add(self.connector.store_names[si], "load_failures")
        if hybrid and end > start:
            end = self._state_hit(state, hashes, state_present, start, end)
        # Blocks before load_start lie outside the window of the hit's end: not loaded
        # (no stores listed; the KV cache manager leaves them the null block).
        found = [[si for si, p in enumerate(present) if p[i]] if i >= load_start else []
                 for i in range(start, end)]
        if found:
            state.found_start, state.found = start, found
        return len(found) * bs

    def _local_snapshot(self, block_hash: bytes) -> bool:
        return self.local_snapshot is not None and \
            self.local_snapshot(block_hash, pin=True) is not None

    def _state_hit(self, state: _ReqState, hashes: list[bytes],
                   state_present: list[list[bool]], start: int, end: int) -> int:
        """Hybrids: a hit resumes the recurrent state from a snapshot, so it ends at the
        last of blocks start..end - 1 after which one exists - in this process' table
        (nothing to load) or in a store. -> its end (start: none)."""
        for n in range(end, start, -1):
            if self._local_snapshot(hashes[n - 1]):
                state.state_local = True
                return n
            stores = [si for si, p in enumerate(state_present) if p[n - 1 - start]]
            if stores:
                state.state_stores = stores
                return n
        if end > start:
            logger.debug("KV connector: %d blocks found but no state snapshot after any of "
                         "them: computed", end - start)
        return start

    def _sliding_hit(self, present: list[list[bool]], start: int,
                     max_load: int) -> tuple[int, int]:
        """Sliding-window layers: a hit ending at block `end` needs only the blocks inside
        the window of its end's token, first_needed_block(end * bs) .. end - 1 (those
        from `start` on; the local hit holds the ones before). -> (the largest such
        end, the first block to load)."""
        g = self.connector.geometry
        best, best_start = start, start
        run = 0  # blocks present in some store, ending at block i
        for i in range(start, max_load):
            run = run + 1 if any(p[i] for p in present) else 0
            first = max(start, g.first_needed_block((i + 1) * self.block_size))
            if run and i + 1 - run <= first:
                best, best_start = i + 1, first
        return best, best_start

    def update_state_after_alloc(self, request, block_ids: list[list[int]],
                                 num_local_tokens: int, num_external_tokens: int,
                                 state_slot: int | None = None) -> None:
        """The request is admitted: its external blocks are allocated; load them, and
        (hybrids, `state_slot`: a snapshot slot the KV cache manager took) the state
        snapshot after the last of them."""
        state = self._reqs.get(request.request_id)
        if state is None:
            return
        n = num_external_tokens // self.block_size
        if n:
            start = num_local_tokens // self.block_size
            assert state.found_start == start and len(state.found) == n
            # (a sliding window's hit leaves its first blocks unloaded: no stores listed)
            skip = next(k for k, stores in enumerate(state.found) if stores)
            first = start + skip
            hashes = request_block_hashes(request, self.block_size)
            load = KVLoad(
                request.request_id, first, list(block_ids[self.group_id][first:start + n]),
                list(hashes[first:start + n]), [list(s) for s in state.found[skip:]])
            if state_slot is not None:
                # (no stores when the local snapshot vanished since the lookup: the load
                # fails and the request starts over - never a wrong state)
                load.state_slot, load.state_hash = state_slot, hashes[start + n - 1]
                load.state_store_ids = list(state.state_stores)
            self._pending_loads.append(load)
            state.loading = True
        state.found_start, state.found = -1, []
        state.state_stores, state.state_local = [], False

    # ---- each step ---------------------------------------------------------------------
    def build_connector_meta(self, so, scheduler) -> KVConnectorMetadata | None:
        """This step's loads, and the prompt blocks complete after it that a store lacks."""
        meta = KVConnectorMetadata(self._pending_loads)
        self._pending_loads = []
        requests = scheduler.requests
        for rid in [r for r in self._reqs if r not in requests]:
            del self._reqs[rid]  # finished or aborted
        bs = self.block_size
        all_stores = set(range(len(self.connector.stores)))
        kvm = scheduler.kv_cache_manager
        for rid in so.num_scheduled_tokens:
            state = self._reqs.get(rid)
            req = requests.get(rid)
            if state is None or req is None:
                continue
            complete = min(req.num_computed_tokens, req.num_prompt_tokens) // bs
            if complete <= state.stored_upto:
                continue
            hashes = request_block_hashes(req, bs)
            blocks = kvm.req_to_blocks[rid][self.group_id]
            complete = min(complete, len(hashes), len(blocks))
            for i in range(state.stored_upto, complete):
                if blocks[i] == NULL_BLOCK:
                    continue  # a window left it unwritten here (a hit skipped it)
                known = self._known.get(hashes[i])
                targets = tuple(sorted(all_stores - known))
                # Hybrids: the snapshot after this block, if this process has one (the
                # step writes it before the worker half copies it out).
                slot = (self.local_snapshot(hashes[i]) if self.local_snapshot is not None
                        else None)
                state_targets = ()
                if slot is not None:
                    state_targets = tuple(sorted(all_stores - self._known_state.get(hashes[i])))
                if targets or state_targets:
                    meta.stores.append(KVStoreBlock(
                        rid, blocks[i], hashes[i], targets,
                        slot if state_targets else None, state_targets))
                    known.update(targets)
                    self._bad.peek(hashes[i]).difference_update(targets)  # written anew
                    if state_targets:
                        self._known_state.get(hashes[i]).update(state_targets)
                        self._bad_state.peek(hashes[i]).difference_update(state_targets)
            state.stored_upto = complete
        return meta if meta else None

    def mark_loading(self, request_id: str) -> None:
        """It hit blocks that this step loads: it waits for them like their loader."""
        state = self._reqs.get(request_id)
        if state is not None:
            state.loading = True

    def loads_returned(self, so) -> set[str]:
        """The step `so` came back: the requests that were waiting for its loads (their
        loaders, and those that hit their blocks) may be scheduled again."""
        waited = set()
        for rid in so.num_scheduled_tokens:
            state = self._reqs.get(rid)
            if state is not None and state.loading:
                state.loading = False
                waited.add(rid)
        return waited

    def loads_failed(self, meta: KVConnectorMetadata, invalid_block_ids: set[int],
                     redo: dict[str, int]) -> None:
        """Blocks of `meta`'s loads did not load (ModelRunnerOutput.invalid_block_ids), and
        the scheduler computes the requests in `redo` again from there (request id ->
        tokens that keep their KV). Each failed entry is a miss until written again;
        nothing was stored for a request in `redo` this step (the worker half skipped it:
        its KV was computed over the failed block)."""
        for load in meta.loads:
            k = next((k for k, b in enumerate(load.block_ids) if b in invalid_block_ids), None)
            if k is None:
                continue
            # Its entries could not be read whole: not used until written again (the
            # recomputed block is stored there).
            h, where = load.block_hashes[k], load.store_ids[k]
            if load.state_slot is not None and k == len(load.block_ids) - 1:
                # The last block or the snapshot after it failed (the runner reports
                # blocks only): neither is used until written again.
                self._bad_state.get(h).update(load.state_store_ids)
                self._known_state.get(h).difference_update(load.state_store_ids)
            self._bad.get(h).update(where)
            self._known.get(h).difference_update(where)
        for rid in redo:
            state = self._reqs.get(rid)
            if state is not None:
                state.stored_upto = 0  # listed again against what the stores hold
        for store in meta.stores:
            if store.req_id in redo:  # not written: the stores lack them
                self._known.get(store.block_hash).difference_update(store.store_ids)
                self._known_state.get(store.block_hash).difference_update(
                    store.state_store_ids)
