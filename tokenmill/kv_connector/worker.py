"""The worker half of the KV connector: moves block KV between the cache and bytes.

Loads (vLLM's start_load_kv / wait_for_layer_load, here one wait for all layers):
`start_load_kv` submits the step's reads to the stores' loader threads (one per
store, calls.StoreCaller) as soon as the runner takes the step; each thread reads
its blocks (one get_many per store) and verifies every entry (magic, version,
namespace digest - the model and the KV geometry -, block hash, length, CRC-32).
`wait_for_load`, before the forward, waits for them up to `load_timeout_s` after
the start, tries the next store that holds a block whose entry failed (and has
the writer thread put it back where it failed), copies
each request's blocks into the KV cache up to its first block that did not load,
and returns what did not: those block ids (ModelRunnerOutput.invalid_block_ids)
and their requests, whose rows the runner samples nothing for (the forward ran
over a block without its KV). Each entry that failed is counted as a load
failure of its store, with a warning naming why (missing, torn, corrupted,
foreign, the store down or too slow).

Stores (vLLM's save_kv_layer / wait_for_save): `save_kv` runs after the
forward (and after a draft model wrote its layers' K/V of the step): it copies the blocks the scheduler half listed (prompt blocks just
completed; none of a request whose load failed this step) to host memory - the
one part that must happen before the blocks can be reused - and queues them; a
writer thread encodes them as entries and writes them to the stores that lack
them, off the step's critical path, so a slow store (Redis across a network, a
busy disk) delays no step. The queue is bounded (MAX_PENDING_STORES batches):
when the stores fall that far behind, a step's blocks are dropped (counted as
store failures) rather than waiting. `flush()` waits for the queue to drain (the
engine calls it when it goes idle, so an offline generate() returns with its
blocks stored).

It refuses to start when the KV cache it was given does not have the geometry
the connector's keys name (the reference runner's identity check).
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass

import torch

from tokenmill.core.sched_output import KVStoreBlock
from tokenmill.kv_connector.config import state_key
from tokenmill.kv_connector.connector import KVConnector, KVConnectorMetadata
from tokenmill.kv_connector.stores import (EntryError, StoreUnavailable, decode_entry,
                                           encode_entry)
from tokenmill.worker.kv_cache import TORCH_DTYPES, dtype_name

logger = logging.getLogger(__name__)

MAX_PENDING_STORES = 32  # steps' worth of blocks waiting for the writer thread
STATE = -1  # a load's item index for its state snapshot (its blocks are 0, 1, ...)


@dataclass(frozen=True)
class _StoreBatch:
    """One step's blocks, handed to the writer thread: payloads[j] is the KV of blocks[j]
    (an [n, payload_bytes] uint8 array copied off the cache, or the memoryviews of
    entries read back for a repair); hybrids: state_payloads[j] the state snapshot
    after state_blocks[j], written after the blocks."""
    payloads: object
    blocks: list[KVStoreBlock]
    state_payloads: object = None
    state_blocks: tuple = ()


class _LoadJob:
    """One step's reads: per block (load index, block index), the store tried now and
    the outcome of every try; futures of the reads in flight."""

    def __init__(self, meta: KVConnectorMetadata, deadline: float):
        self.loads = meta.loads
        self.deadline = deadline
        self.next_try = {(j, k): 0 for j, load in enumerate(self.loads)
                         for k in range(len(load.block_ids))}
        # (j, STATE): the state snapshot after load j's last block (hybrids)
        self.next_try.update({(j, STATE): 0 for j, load in enumerate(self.loads)
                              if load.state_slot is not None})
        # (j, k) -> payload (memoryview) or the reason it failed, for the store tried now
        self.result: dict[tuple[int, int], object] = {}
        self.inflight: list[tuple[concurrent.futures.Future, int, list[tuple[int, int]]]] = []


class KVConnectorWorker:
    def __init__(self, connector: KVConnector, kv_caches: dict[str, torch.Tensor],
                 layer_names: list[str]):
        g = connector.geometry
        layers = [kv_caches[n] for n in layer_names]
        want = g.layer_block_shape
        bad = [n for n, t in zip(layer_names, layers)
               if tuple(t.shape[1:]) != want or dtype_name(t.dtype) != g.dtype]
        if len(layers) != g.num_layers or bad:
            raise ValueError(
                f"KV connector geometry {g.tag} disagrees with the KV cache "
                f"({len(layers)} layers; mismatching: {bad[:3]}): refusing to move KV")
        self.connector = connector
        self.layers = layers
        self.dtype = TORCH_DTYPES[g.dtype]
        self.block_shape = (g.num_layers,) + want
        self._pending: queue.Queue = queue.Queue(MAX_PENDING_STORES)  # _StoreBatch; None: stop
        self._writer: threading.Thread | None = None
        self._job: _LoadJob | None = None
        # Hybrids (bind_state): every recurrent layer's state tensors, in the state
        # geometry's order, and the index of snapshot slot 0 in them.
        self.state_tensors: list[torch.Tensor] = []
        self.snapshot_base = 0

    def bind_state(self, state_caches: dict[str, tuple[torch.Tensor, ...]],
                   layer_names: list[str], snapshot_base: int) -> None:
        """The recurrent layers' state tensors ([num_slots, *shape] each), whose snapshot
        slots the tier's state snapshots are read into and copied out of."""
        g = self.connector.state_geometry
        tensors = [t for n in layer_names for t in state_caches[n]]
        want = [(shape, dtype) for _ in range(g.num_layers)
                for shape, dtype in zip(g.shapes, g.dtypes)]
        got = [(tuple(t.shape[1:]), dtype_name(t.dtype)) for t in tensors]
        if got != want:
            raise ValueError(f"KV connector state geometry {g.tag} disagrees with the state "
                             f"caches: refusing to move state snapshots")
        self.state_tensors = tensors
        self.snapshot_base = snapshot_base

    def loads_state(self, meta: KVConnectorMetadata | None) -> bool:
        """This step loads a state snapshot: wait_for_load must run before the inputs
        are prepared (a one-token row copies its restored state in then)."""
        return meta is not None and any(load.state_slot is not None for load in meta.loads)

    # ---- loads -------------------------------------------------------------------------
    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        """Start reading this step's loads (the stores' loader threads); wait_for_load
        finishes them before the forward."""
        self._job = None
        if meta is None or not meta.loads:
            return
        job = _LoadJob(meta, time.monotonic() + self.connector.config.load_timeout_s)
        self._job = job
        self._submit(job, list(job.next_try))

    def _submit(self, job: _LoadJob, blocks: list[tuple[int, int]]) -> None:
        """Read `blocks`, each from the store it tries now: one call per store."""
        conn = self.connector
        per_store: dict[int, list[tuple[int, int]]] = {}
        for j, k in blocks:
            load = job.loads[j]
            stores = load.state_store_ids if k == STATE else load.store_ids[k]
            if job.next_try[(j, k)] >= len(stores):  # (a snapshot no store holds)
                job.result[(j, k)] = "missing in every store"
                continue
            si = stores[job.next_try[(j, k)]]
            per_store.setdefault(si, []).append((j, k))
        for si, items in per_store.items():
            hashes = [(job.loads[j].state_hash, True) if k == STATE
                      else (job.loads[j].block_hashes[k], False) for j, k in items]
            try:
                fut = conn.caller("load", si).submit(lambda si=si, h=hashes: self._read(si, h))
            except StoreUnavailable as e:  # still busy with a read it gave up on
                for key in items:
                    job.result[key] = str(e)
                continue
            job.inflight.append((fut, si, items))

    def _read(self, si: int, items: list[tuple[bytes, bool]]) -> list:
        """On store si's loader thread: each entry's verified payload, or why not
        (items: (block hash, whether the state snapshot after it is meant))."""
        conn = self.connector
        values = conn.stores[si].get_many([state_key(h) if is_state else h.hex()
                                           for h, is_state in items])
        out = []
        for (h, is_state), data in zip(items, values):
            try:
                if is_state:
                    out.append(decode_entry(data, conn.state_ns_digest, h,
                                            conn.state_geometry.payload_bytes))
                else:
                    out.append(decode_entry(data, conn.ns_digest, h,
                                            conn.geometry.payload_bytes))
            except EntryError as e:
                out.append(str(e))
        return out

    def _collect(self, job: _LoadJob) -> None:
        """Wait for the reads in flight, until the deadline; a read still running then
        failed (it is left to finish on its thread)."""
        futures = [f for f, _, _ in job.inflight]
        done, _ = concurrent.futures.wait(futures, max(0.0, job.deadline - time.monotonic()))
        timeout = self.connector.config.load_timeout_s
        for fut, si, items in job.inflight:
            if fut in done:
                try:
                    values = fut.result()
                except StoreUnavailable as e:
                    values = [str(e)] * len(items)
                except Exception as e:  # noqa: BLE001 - a store's bug fails its blocks only
                    logger.exception("KV connector: reading from %s failed",
                                     self.connector.store_names[si])
                    values = [f"{type(e).__name__}: {e}"] * len(items)
            else:
                values = [f"no answer within {timeout:g} s"] * len(items)
            job.result.update(zip(items, values))
        job.inflight = []

    @torch.inference_mode()
    def wait_for_load(self) -> set[int]:
        """Finish the loads start_load_kv started: copy each request's blocks up to its
        first one that did not load into the KV cache. Returns the ids of the blocks
        that do not hold their KV (from each request's first failure on)."""
        job, self._job = self._job, None
        invalid: set[int] = set()
        if job is None:
            return invalid
        conn, bs = self.connector, self.connector.geometry.block_size
        names, stats = conn.store_names, conn.stats
        pos = [0] * len(job.loads)  # per load: its blocks before this one are read whole
        open_ = set(range(len(job.loads)))  # loads not settled yet
        state_failed: set[int] = set()  # loads whose state snapshot could not be read
        while True:
            self._collect(job)
            retry = []
            for j in sorted(open_):
                load = job.loads[j]
                while pos[j] < len(load.block_ids):
                    key = (j, pos[j])
                    got = job.result[key]
                    if isinstance(got, memoryview):
                        pos[j] += 1
                        continue
                    k = pos[j]
                    si = load.store_ids[k][job.next_try[key]]
                    stats.add(names[si], "load_failures")
                    logger.warning("KV connector: %s entry %s… of request %s not loaded (%s); "
                                   "recomputing from its block %d", names[si],
                                   load.block_hashes[k].hex()[:16], load.req_id, got,
                                   load.first_block + k)
                    job.next_try[key] += 1
                    if job.next_try[key] < len(load.store_ids[k]) and \
                            time.monotonic() < job.deadline:
                        retry.append(key)  # another store holds it: read it there
                    else:
                        open_.discard(j)
                    break
                else:
                    if load.state_slot is not None and not self._state_read(job, j, retry):
                        continue  # another store is tried
                    if load.state_slot is not None and \
                            not isinstance(job.result[(j, STATE)], memoryview):
                        state_failed.add(j)
                    open_.discard(j)
            if not retry:
                break
            self._submit(job, retry)
        for j in state_failed:
            # No state to resume from after the last block: it counts as not loaded, so
            # the request starts over and its next lookup misses there.
            pos[j] = min(pos[j], len(job.loads[j].block_ids) - 1)
        copies = []  # (block id, payload, store index)
        repairs = []  # (payload, block hash, stores whose entry failed)
        for j, load in enumerate(job.loads):
            for k in range(pos[j]):
                tried = job.next_try[(j, k)]
                copies.append((load.block_ids[k], job.result[(j, k)], load.store_ids[k][tried]))
                if tried:  # read from a later store: write it back where it failed
                    repairs.append((job.result[(j, k)], load.block_hashes[k],
                                    tuple(load.store_ids[k][:tried])))
            invalid.update(load.block_ids[pos[j]:])
        if repairs:
            # (the writer needs only the hash and the stores: no request, no block id)
            self._queue([p for p, _, _ in repairs],
                        [KVStoreBlock("", 0, h, targets) for _, h, targets in repairs])
        states = [(job.loads[j].state_slot, job.result[(j, STATE)],
                   job.loads[j].state_store_ids[job.next_try[(j, STATE)]])
                  for j, load in enumerate(job.loads)
                  if load.state_slot is not None and pos[j] == len(load.block_ids)]
        if states:
            self._copy_states_in(states)
        if copies:
            self._copy_in(copies)
            size = conn.geometry.payload_bytes
            for _, _, si in copies:
                stats.add(names[si], "hit_blocks")
                stats.add(names[si], "hit_tokens", bs)
                stats.add(names[si], "bytes_loaded", size)
        return invalid

    def _state_read(self, job: _LoadJob, j: int, retry: list) -> bool:
        """Load j's blocks are read whole: is its state snapshot settled (read, or failed
        in every store that holds it)? False: it is tried at the next store (`retry`)."""
        key = (j, STATE)
        got = job.result[key]
        if isinstance(got, memoryview):
            return True
        load, conn = job.loads[j], self.connector
        stores = load.state_store_ids
        tried = job.next_try[key]
        name = conn.store_names[stores[tried]] if tried < len(stores) else "every store"
        if tried < len(stores):
            conn.stats.add(name, "load_failures")
        logger.warning("KV connector: %s state snapshot after %s… of request %s not loaded "
                       "(%s); its prefix is a miss from block %d", name,
                       load.state_hash.hex()[:16], load.req_id, got,
                       load.first_block + len(load.block_ids) - 1)
        job.next_try[key] += 1
        if job.next_try[key] < len(stores) and time.monotonic() < job.deadline:
            retry.append(key)
            return False
        return True

    def _copy_states_in(self, states: list[tuple[int, memoryview, int]]) -> None:
        """Each (snapshot slot, payload, store index): the snapshot into that slot of every
        recurrent layer's state tensors (the payload holds them in the same order)."""
        conn = self.connector
        for slot, payload, si in states:
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            off = 0
            for t in self.state_tensors:
                row = t[self.snapshot_base + slot]
                n = row.numel() * row.element_size()
                row.copy_(buf[off:off + n].view(t.dtype).view(row.shape))
                off += n
            conn.stats.add(conn.store_names[si], "snapshots_loaded")

    def _copy_in(self, copies: list[tuple[int, memoryview, int]]) -> None:
        n = len(copies)
        size = self.connector.geometry.payload_bytes
        buf = bytearray(n * size)
        for j, (_, payload, _) in enumerate(copies):
            buf[j * size:(j + 1) * size] = payload
        data = torch.frombuffer(buf, dtype=torch.uint8).view(self.dtype).view(n, *self.block_shape)
        device = self.layers[0].device
        data = data.to(device)
        ids = torch.tensor([b for b, _, _ in copies], dtype=torch.long, device=device)
        for layer, cache in enumerate(self.layers):
            if cache.dtype == torch.float8_e4m3fn:  # (no fp8 index_copy_ on CPU: its bytes)
                cache.view(torch.uint8).index_copy_(0, ids, data[:, layer].view(torch.uint8))
            else:
                cache.index_copy_(0, ids, data[:, layer])

    # ---- stores ------------------------------------------------------------------------
    @torch.inference_mode()
    def save_kv(self, meta: KVConnectorMetadata | None, skip_req_ids=()) -> None:
        """Queue the blocks `meta` lists for the writer thread, but none of the requests in
        `skip_req_ids` (their load failed this step: what they computed over it is wrong)."""
        if meta is None or not meta.stores:
            return
        listed = [s for s in meta.stores if s.req_id not in skip_req_ids] if skip_req_ids \
            else list(meta.stores)
        stores = [s for s in listed if s.store_ids]
        raw = None
        if stores:
            ids = torch.tensor([s.block_id for s in stores], dtype=torch.long,
                               device=self.layers[0].device)
            # [n, layers, *layer_block_shape] -> host bytes, one row per block (a
            # copy: the blocks may be reused as soon as this step is over)
            blocks = torch.stack([cache.index_select(0, ids) for cache in self.layers], dim=1)
            raw = blocks.cpu().contiguous().view(torch.uint8).reshape(len(stores), -1).numpy()
        # Hybrids: the state snapshots after blocks (written by this step's forward, or
        # earlier), copied out now too: their slots may be reused after this step.
        with_state = [s for s in listed if s.state_slot is not None and s.state_store_ids]
        state_raw = None
        if with_state and self.state_tensors:
            dev = self.state_tensors[0].device
            idx = torch.tensor([self.snapshot_base + s.state_slot for s in with_state],
                               dtype=torch.long, device=dev)
            n = len(with_state)
            state_raw = torch.cat([t.index_select(0, idx).cpu().contiguous()
                                   .view(torch.uint8).reshape(n, -1)
                                   for t in self.state_tensors], dim=1).numpy()
        else:
            with_state = []
        if stores or with_state:
            self._queue(raw, stores, state_raw, with_state)

    def _queue(self, raw, stores: list[KVStoreBlock], state_raw=None,
               state_blocks: list[KVStoreBlock] = ()) -> None:
        """Hand blocks (`raw[j]`: the payload of `stores[j]`) to the writer thread."""
        conn = self.connector
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                            name="tokenmill-kv-store")
            self._writer.start()
        try:
            self._pending.put_nowait(_StoreBatch(raw, stores, state_raw, tuple(state_blocks)))
        except queue.Full:  # the stores are that far behind: skip rather than wait
            dropped = Counter(si for s in stores for si in s.store_ids)
            dropped.update(si for s in state_blocks for si in s.state_store_ids)
            for si, n in dropped.items():
                conn.stats.add(conn.store_names[si], "store_failures", n)
            logger.debug("KV connector: store queue full, %d blocks not stored", len(stores))

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued block is written (or `timeout_s` passed): -> drained."""
        deadline = time.monotonic() + timeout_s
        q = self._pending
        with q.all_tasks_done:  # Queue.join(), with a deadline
            while q.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                q.all_tasks_done.wait(left)
        return True

    def close(self) -> None:
        """Write what is queued (bounded wait), then stop the writer thread."""
        self._job = None
        if self._writer is not None:
            self.flush()
            try:
                self._pending.put(None, timeout=1.0)
                self._writer.join(timeout=5.0)
            except queue.Full:  # a store that never answers: leave the (daemon) thread
                pass
            self._writer = None

    def _write_loop(self) -> None:
        while True:
            item = self._pending.get()
            try:
                if item is None:
                    return
                self._write(item)
            except Exception:  # noqa: BLE001 - a store's bug must not kill the writer
                logger.exception("KV connector: writing blocks failed")
            finally:
                self._pending.task_done()

    def _write(self, batch: _StoreBatch) -> None:
        """Encode one step's blocks and write them to each store that should hold them."""
        conn = self.connector
        per_store: dict[int, list[tuple[str, bytes]]] = {}
        for j, block in enumerate(batch.blocks):
            entry = encode_entry(conn.ns_digest, block.block_hash, batch.payloads[j])
            key = block.block_hash.hex()
            for si in block.store_ids:
                per_store.setdefault(si, []).append((key, entry))
        num_blocks = {si: len(items) for si, items in per_store.items()}
        # State snapshots go after the blocks, in the same call to each store (a Redis
        # pipeline runs in order): a reader never finds a snapshot its blocks lack.
        for j, block in enumerate(batch.state_blocks):
            entry = encode_entry(conn.state_ns_digest, block.block_hash, batch.state_payloads[j])
            for si in block.state_store_ids:
                per_store.setdefault(si, []).append((state_key(block.block_hash), entry))
        for si, items in per_store.items():
            name = conn.store_names[si]
            try:
                conn.stores[si].put_many(items)
            except StoreUnavailable as e:
                conn.stats.add(name, "store_failures", len(items))
                logger.debug("KV connector: %s store failed: %s", name, e)
                continue
            nb = num_blocks.get(si, 0)
            conn.stats.add(name, "blocks_stored", nb)
            conn.stats.add(name, "bytes_stored", nb * conn.geometry.payload_bytes)
            conn.stats.add(name, "snapshots_stored", len(items) - nb)
