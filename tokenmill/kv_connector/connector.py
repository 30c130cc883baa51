"""The KV connector: the external KV tier behind the prefix cache. No torch here.

Two halves, as in vLLM's KVConnectorBase_V1 (and the reference runner's
ConnectorLoadExternalKv / ConnectorStorePromptKv):

* Scheduler half (`KVConnectorScheduler`), called by the Scheduler when it
  admits a request with nothing computed, after the local prefix-cache lookup:
  `get_num_new_matched_tokens` says how many prompt tokens after the local hit
  the external tier holds, `update_state_after_alloc` records the blocks
  allocated for them as loads, and `build_connector_meta` attaches this step's
  work to the SchedulerOutput: the loads, and the prompt blocks that become
  complete with this step and that some store lacks (each block once).
* Worker half (`worker.KVConnectorWorker`, torch): copies the loads into the
  KV cache before the forward, and writes the stores after it.

The lookup reads and verifies the entries it counts as hits (header, length,
checksum) before the scheduler commits to them, so an entry that the stores
list but that cannot be read whole (evicted, torn, corrupted, written for
another geometry) shortens the hit: those tokens are recomputed, never loaded
wrong, and the failure is counted. The verified bytes travel to the worker
half in the metadata. A store that is down (Redis) answers as a miss.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from tokenmill.core.kv_cache_utils import request_block_hashes
from tokenmill.core.sched_output import KVConnectorMetadata  # noqa: F401 (the contract's)
from tokenmill.kv_connector.config import (KVConnectorConfig, KVGeometry, kv_namespace,
                                           namespace_digest)
from tokenmill.kv_connector.stores import (EntryError, KVStore, StoreUnavailable, decode_entry,
                                           make_store)

logger = logging.getLogger(__name__)

# Keys whose presence in each store this process knows (lookups and its own writes).
RECENT_KEYS = 1 << 16


STORE_COUNTERS = ("hit_blocks", "hit_tokens", "bytes_loaded", "blocks_stored", "bytes_stored",
                  "load_failures", "store_failures")


class ConnectorStats:
    """Counters per store (thread-safe: the worker half may run on another thread)."""

    def __init__(self, store_names: list[str]):
        self._lock = threading.Lock()
        self.per_store = {name: dict.fromkeys(STORE_COUNTERS, 0) for name in store_names}
        self.lookups = 0  # admissions that asked the tier
        self.lookup_tokens = 0  # prompt tokens past the local hit that were asked for
        self.hit_tokens = 0

    def add(self, store: str, counter: str, n: int = 1) -> None:
        with self._lock:
            self.per_store[store][counter] += n

    def snapshot(self) -> dict:
        with self._lock:
            per_store = {k: dict(v) for k, v in self.per_store.items()}
            out = {"lookups": self.lookups, "lookup_tokens": self.lookup_tokens,
                   "hit_tokens": self.hit_tokens, "stores": per_store}
        for c in STORE_COUNTERS:
            out[c] = sum(s[c] for s in per_store.values())
        return out


class KVConnector:
    """What both halves share: the stores, the namespace, the geometry, the stats."""

    def __init__(self, config: KVConnectorConfig, model_id: str, geometry: KVGeometry,
                 stores: list[KVStore] | None = None):
        self.config = config
        self.model_id = model_id
        self.geometry = geometry
        self.namespace = kv_namespace(model_id, geometry)
        self.ns_digest = namespace_digest(self.namespace)
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
        logger.info("KV connector: stores %s, namespace %s", ", ".join(names), self.namespace)

    def close(self) -> None:
        for s in self.stores:
            s.close()


@dataclass
class _ReqState:
    stored_upto: int = 0  # prompt blocks handed to the store pass
    # Verified payloads for blocks [staged_start, staged_start + len) and their stores,
    # kept while the request waits for blocks (not fetched again each step).
    staged_start: int = -1
    staged: list[tuple[memoryview, int]] = field(default_factory=list)


class KVConnectorScheduler:
    def __init__(self, connector: KVConnector, block_size: int, group_id: int):
        self.connector = connector
        self.block_size = block_size
        self.group_id = group_id
        self._reqs: dict[str, _ReqState] = {}
        self._pending_loads: list[tuple[int, memoryview, int]] = []
        # block hash -> indices of stores known to hold it (bounded LRU)
        self._known: OrderedDict[bytes, set[int]] = OrderedDict()

    # ---- what this process knows is stored ------------------------------------------
    def _known_set(self, block_hash: bytes) -> set[int]:
        s = self._known.get(block_hash)
        if s is None:
            s = self._known[block_hash] = set()
            if len(self._known) > RECENT_KEYS:
                self._known.popitem(last=False)
        else:
            self._known.move_to_end(block_hash)
        return s

    # ---- admission --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_local_tokens: int) -> int:
        """Prompt tokens after the local hit whose verified KV the tier holds (whole
        blocks; never the last token of the request, which is always computed)."""
        rid = request.request_id
        state = self._reqs[rid] = self._reqs.get(rid) or _ReqState()
        state.stored_upto = 0
        if request.sampling_params.prompt_logprobs is not None:
            return 0  # every prompt position is computed (its logprobs are asked for)
        bs = self.block_size
        hashes = request_block_hashes(request, bs)
        num_prompt_blocks = min(request.num_prompt_tokens // bs, len(hashes))
        max_load = min(num_prompt_blocks, (request.num_tokens - 1) // bs)
        start = num_local_tokens // bs
        if state.staged_start == start and state.staged:
            return len(state.staged) * bs  # verified on an earlier try
        state.staged_start, state.staged = -1, []
        if num_prompt_blocks == 0:
            return 0
        conn = self.connector
        stats = conn.stats
        keys = [h.hex() for h in hashes[:num_prompt_blocks]]
        present = []
        for si, store in enumerate(conn.stores):
            try:
                found = store.contains_many(keys)
            except StoreUnavailable:
                found = [False] * len(keys)
            present.append(found)
            for i, hit in enumerate(found):
                known = self._known_set(hashes[i])
                if hit:
                    known.add(si)
                else:
                    known.discard(si)
        if start >= max_load:
            return 0
        stats.lookups += 1
        stats.lookup_tokens += (max_load - start) * bs
        end = start
        while end < max_load and any(p[end] for p in present):
            end += 1
        # A chain entry missing while a later one is there was lost (evicted, deleted).
        if end < max_load:
            for si, found in enumerate(present):
                if not found[end] and any(found[end + 1:num_prompt_blocks]):
                    stats.add(conn.store_names[si], "load_failures")
        staged = self._fetch(hashes, present, start, end)
        if staged:
            state.staged_start, state.staged = start, staged
        return len(staged) * bs

    def _fetch(self, hashes, present, start: int, end: int) -> list[tuple[memoryview, int]]:
        """Read and verify blocks [start, end) from the first store holding each;
        stop at the first block no store can give whole."""
        conn = self.connector
        first = {}
        for i in range(start, end):
            first[i] = next(si for si, p in enumerate(present) if p[i])
        fetched: dict[int, bytes | None] = {}
        for si, store in enumerate(conn.stores):
            idx = [i for i in range(start, end) if first[i] == si]
            if not idx:
                continue
            try:
                values = store.get_many([hashes[i].hex() for i in idx])
            except StoreUnavailable:
                values = [None] * len(idx)
            fetched.update(zip(idx, values))
        out = []
        payload_bytes = conn.geometry.payload_bytes
        for i in range(start, end):
            candidates = [first[i]] + [si for si, p in enumerate(present)
                                       if p[i] and si != first[i]]
            payload = None
            for si in candidates:
                data = fetched.get(i) if si == first[i] else self._get_one(si, hashes[i])
                try:
                    payload = decode_entry(data, conn.ns_digest, hashes[i], payload_bytes)
                except EntryError as e:
                    name = conn.store_names[si]
                    conn.stats.add(name, "load_failures")
                    self._known_set(hashes[i]).discard(si)  # re-stored once recomputed
                    logger.warning("KV connector: %s entry %s… not loaded (%s); recomputing",
                                   name, hashes[i].hex()[:16], e)
                    continue
                out.append((payload, si))
                break
            if payload is None:
                break
        return out

    def _get_one(self, si: int, block_hash: bytes):
        try:
            return self.connector.stores[si].get_many([block_hash.hex()])[0]
        except StoreUnavailable:
            return None

    def update_state_after_alloc(self, request, block_ids: list[list[int]],
                                 num_local_tokens: int, num_external_tokens: int) -> None:
        """The request is admitted: its external blocks are allocated; load them."""
        state = self._reqs.get(request.request_id)
        if state is None:
            return
        n = num_external_tokens // self.block_size
        if n:
            start = num_local_tokens // self.block_size
            assert state.staged_start == start and len(state.staged) >= n
            ids = block_ids[self.group_id][start:start + n]
            stats = self.connector.stats
            for b, (payload, si) in zip(ids, state.staged[:n]):
                self._pending_loads.append((b, payload, si))
                name = self.connector.store_names[si]
                stats.add(name, "hit_blocks")
                stats.add(name, "hit_tokens", self.block_size)
            stats.hit_tokens += n * self.block_size
        state.staged_start, state.staged = -1, []

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
                known = self._known_set(hashes[i])
                targets = tuple(sorted(all_stores - known))
                if targets:
                    meta.stores.append((blocks[i], hashes[i], targets))
                    known.update(targets)
            state.stored_upto = complete
        return meta if meta else None
