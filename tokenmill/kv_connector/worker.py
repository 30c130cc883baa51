"""The worker half of the KV connector: moves block KV between the cache and bytes.

`load_kv` runs before the forward: it copies the step's verified payloads into
their freshly allocated blocks (every attention layer). `save_kv` runs after
the forward: it copies the blocks the scheduler half listed (prompt blocks just
completed) to host memory - the one part that must happen before the blocks can
be reused - and queues them; a writer thread encodes them as entries and writes
them to the stores that lack them, off the step's critical path, so a slow store
(Redis across a network, a busy disk) delays no step. The queue is bounded
(MAX_PENDING_STORES batches): when the stores fall that far behind, a step's
blocks are dropped (counted as store failures) rather than waiting. `flush()`
waits for the queue to drain (the engine calls it when it goes idle, so an offline
generate() returns with its blocks stored). It refuses to start when the KV cache
it was given does not have the geometry the connector's keys name (the reference
runner's identity check).
"""
from __future__ import annotations

import logging
import queue
from collections import Counter
import threading
import time

import torch

from tokenmill.kv_connector.connector import KVConnector, KVConnectorMetadata
from tokenmill.kv_connector.stores import StoreUnavailable, encode_entry
from tokenmill.worker.kv_cache import TORCH_DTYPES, dtype_name

logger = logging.getLogger(__name__)

MAX_PENDING_STORES = 32  # steps' worth of blocks waiting for the writer thread


class KVConnectorWorker:
    def __init__(self, connector: KVConnector, kv_caches: dict[str, torch.Tensor],
                 layer_names: list[str]):
        g = connector.geometry
        layers = [kv_caches[n] for n in layer_names]
        want = (2, g.block_size, g.num_kv_heads, g.head_size)
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
        self._pending: queue.Queue = queue.Queue(MAX_PENDING_STORES)
        self._writer: threading.Thread | None = None

    @torch.inference_mode()
    def load_kv(self, meta: KVConnectorMetadata | None) -> None:
        if meta is None or not meta.loads:
            return
        n = len(meta.loads)
        size = self.connector.geometry.payload_bytes
        buf = bytearray(n * size)
        for j, (_, payload, _) in enumerate(meta.loads):
            buf[j * size:(j + 1) * size] = payload
        data = torch.frombuffer(buf, dtype=torch.uint8).view(self.dtype).view(n, *self.block_shape)
        device = self.layers[0].device
        data = data.to(device)
        ids = torch.tensor([b for b, _, _ in meta.loads], dtype=torch.long, device=device)
        for layer, cache in enumerate(self.layers):
            cache.index_copy_(0, ids, data[:, layer])
        stats, names = self.connector.stats, self.connector.store_names
        for _, _, si in meta.loads:
            stats.add(names[si], "bytes_loaded", size)

    @torch.inference_mode()
    def save_kv(self, meta: KVConnectorMetadata | None) -> None:
        if meta is None or not meta.stores:
            return
        conn = self.connector
        ids = torch.tensor([b for b, _, _ in meta.stores], dtype=torch.long,
                           device=self.layers[0].device)
        # [n, layers, 2, block_size, heads, head_size] -> host bytes, one row per block (a
        # copy: the blocks may be reused as soon as this step is over)
        blocks = torch.stack([cache.index_select(0, ids) for cache in self.layers], dim=1)
        raw = blocks.cpu().contiguous().view(torch.uint8).reshape(len(meta.stores), -1).numpy()
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                            name="tokenmill-kv-store")
            self._writer.start()
        try:
            self._pending.put_nowait((raw, list(meta.stores)))
        except queue.Full:  # the stores are that far behind: skip rather than wait
            dropped = Counter(si for _, _, targets in meta.stores for si in targets)
            for si, n in dropped.items():
                conn.stats.add(conn.store_names[si], "store_failures", n)
            logger.debug("KV connector: store queue full, %d blocks not stored",
                         len(meta.stores))

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
                self._write(*item)
            except Exception:  # noqa: BLE001 - a store's bug must not kill the writer
                logger.exception("KV connector: writing blocks failed")
            finally:
                self._pending.task_done()

    def _write(self, raw, stores) -> None:
        """Encode one step's blocks and write them to each store that should hold them."""
        conn = self.connector
        per_store: dict[int, list[tuple[str, bytes]]] = {}
        for j, (_, block_hash, targets) in enumerate(stores):
            entry = encode_entry(conn.ns_digest, block_hash, raw[j])
            key = block_hash.hex()
            for si in targets:
                per_store.setdefault(si, []).append((key, entry))
        for si, items in per_store.items():
            name = conn.store_names[si]
            try:
                conn.stores[si].put_many(items)
            except StoreUnavailable as e:
                conn.stats.add(name, "store_failures", len(items))
                logger.debug("KV connector: %s store failed: %s", name, e)
                continue
            conn.stats.add(name, "blocks_stored", len(items))
            conn.stats.add(name, "bytes_stored", len(items) * conn.geometry.payload_bytes)
