"""The external KV stores (in-process CPU memory, disk, Redis) and the entry format.

A store maps a key (the block hash in hex) to bytes inside its namespace (model
identity + KV geometry, see config.kv_namespace). It knows nothing of blocks or
tensors. Every value is an entry:

    header: magic "TMKV", version, namespace digest (16 B), block hash (32 B),
            payload length (8 B), CRC-32 of the payload
    payload: for each attention layer in order, the block's K then V pages

`decode_entry` refuses an entry whose namespace, block hash, length or checksum
disagrees (another model or geometry, a torn or corrupted write): the worker
half recomputes that block instead. A store that cannot be reached raises
StoreUnavailable; the connector treats it as a miss (a lookup) or a load
failure (a read). `contains_many` is the cheap existence check the scheduler
half asks (a dict lookup, a stat, a pipeline of Redis EXISTS); `get_many` the
read the worker half does.
"""
from __future__ import annotations

import logging
import os
import struct
import tempfile
import threading
import time
import zlib
from collections import OrderedDict

from tokenmill.kv_connector.config import DEFAULT_DISK_BYTES

logger = logging.getLogger(__name__)

MAGIC = b"TMKV"
VERSION = 1
HEADER = struct.Struct("<4sB3x16s32sQI")


class EntryError(ValueError):
    """An entry that must not be loaded (the reason says why)."""


class StoreUnavailable(RuntimeError):
    """The store cannot be reached right now."""


def encode_entry(ns_digest: bytes, block_hash: bytes, payload) -> bytes:
    payload = memoryview(payload).cast("B")
    header = HEADER.pack(MAGIC, VERSION, ns_digest, block_hash, payload.nbytes,
                         zlib.crc32(payload))
    return b"".join((header, payload))


def decode_entry(data, ns_digest: bytes, block_hash: bytes, payload_bytes: int) -> memoryview:
    """The payload of a whole, matching entry, or EntryError."""
    if data is None:
        raise EntryError("missing")
    n = len(data)
    if n < HEADER.size:
        raise EntryError(f"torn: {n} bytes, shorter than the header")
    magic, version, ns, bh, length, crc = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise EntryError("not a tokenmill KV entry (magic/version)")
    if ns != ns_digest:
        raise EntryError("written for another model or KV geometry")
    if bh != block_hash:
        raise EntryError("holds another block")
    if length != payload_bytes:
        raise EntryError(f"payload is {length} bytes, this KV geometry needs {payload_bytes}")
    if n != HEADER.size + length:
        raise EntryError(f"torn: {n - HEADER.size} of {length} payload bytes")
    payload = memoryview(data)[HEADER.size:]
    if zlib.crc32(payload) != crc:
        raise EntryError("checksum mismatch (corrupted)")
    return payload


class KVStore:
    """Base: keys are block hashes in hex, values entry bytes."""

    kind = "?"
    # Whether a call can take long (I/O): the connector bounds those calls in time
    # (calls.StoreCaller); one that cannot is called directly.
    blocking = True

    def __init__(self, namespace: str):
        self.namespace = namespace

    @property
    def name(self) -> str:
        return self.kind

    def contains_many(self, keys: list[str]) -> list[bool]:
        raise NotImplementedError

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        raise NotImplementedError

    def put_many(self, items: list[tuple[str, bytes]]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class CPUStore(KVStore):
    """In-process memory with an LRU byte budget (lookups refresh an entry)."""

    kind = "cpu"
    blocking = False

    def __init__(self, namespace: str, max_bytes: int):
        super().__init__(namespace)
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_evictions = 0
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._data)

    def contains_many(self, keys):
        with self._lock:
            out = [k in self._data for k in keys]
            # Refresh from the last block to the first: a chain's head is evicted last
            # (without its head, the rest of a chain is useless).
            for k, hit in zip(reversed(keys), reversed(out)):
                if hit:
                    self._data.move_to_end(k)
            return out

    def get_many(self, keys):
        with self._lock:
            out = [self._data.get(k) for k in keys]
            for k, v in zip(reversed(keys), reversed(out)):
                if v is not None:
                    self._data.move_to_end(k)
            return out

    def put_many(self, items):
        with self._lock:
            for key, value in items:
                size = len(value)
                if size > self.max_bytes:
                    continue
                old = self._data.pop(key, None)
                if old is not None:
                    self.num_bytes -= len(old)
                while self._data and self.num_bytes + size > self.max_bytes:
                    _, evicted = self._data.popitem(last=False)
                    self.num_bytes -= len(evicted)
                    self.num_evictions += 1
                self._data[key] = value
                self.num_bytes += size

    def drop(self, key: str) -> None:
        with self._lock:
            v = self._data.pop(key, None)
            if v is not None:
                self.num_bytes -= len(v)


class DiskStore(KVStore):
    """One file per block under DIR/<namespace>/<hash[:2]>/<hash>.kvb, written to a
    temporary file in the same folder and renamed over the name (atomic: a reader
    sees the old entry, the new one or none, never half of one).

    Bounded: the .kvb files of the namespace stay within `max_bytes`, least recently
    read or written evicted first. The index (key -> size, in access order) is built
    at start from the files present, ordered by the later of atime and mtime (many
    filesystems mount noatime, so a read also sets both with os.utime: a restart
    keeps the order). Files another process writes into a shared directory are
    counted once this one reads them; one that vanished is dropped from the index."""

    kind = "disk"
    STALE_TMP_S = 60.0  # younger temp files may be another process' write in progress

    def __init__(self, namespace: str, root: str, max_bytes: int = DEFAULT_DISK_BYTES):
        super().__init__(namespace)
        self.root = root
        self.dir = os.path.join(root, namespace)
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_evictions = 0
        self.num_too_big = 0  # entries refused: larger than the whole budget
        self._index: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        os.makedirs(self.dir, exist_ok=True)
        self._scan()

    def __len__(self) -> int:
        return len(self._index)

    def path(self, key: str) -> str:
        return os.path.join(self.dir, key[:2], key + ".kvb")

    def _scan(self) -> None:
        """Index the entries present; remove temp files left by a crashed write."""
        found = []  # (access time, key, size)
        stale_before = time.time() - self.STALE_TMP_S
        with os.scandir(self.dir) as top:
            subdirs = [e.path for e in top if e.is_dir(follow_symlinks=False)]
        for sub in subdirs:
            with os.scandir(sub) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                        if e.name.endswith(".kvb"):
                            found.append((max(st.st_atime, st.st_mtime), e.name[:-4],
                                          st.st_size))
                        elif e.name.endswith(".tmp") and st.st_mtime < stale_before:
                            os.unlink(e.path)
                    except FileNotFoundError:
                        pass  # another process evicted or renamed it meanwhile
                    except OSError as err:
                        logger.warning("KV disk store: skipping %s: %s", e.path, err)
        found.sort()
        with self._lock:
            for _, key, size in found:
                self._index[key] = size
                self.num_bytes += size
            self._evict_to_fit(0)  # the budget may have been lowered since
        if found:
            logger.info("KV disk store %s: %d entries, %d bytes (budget %d)", self.dir,
                        len(self._index), self.num_bytes, self.max_bytes)

    def _evict_to_fit(self, size: int) -> None:
        """Under the lock: unlink least recently used entries until `size` more fits."""
        while self._index and self.num_bytes + size > self.max_bytes:
            key, old = self._index.popitem(last=False)
            self.num_bytes -= old
            self.num_evictions += 1
            try:
                os.unlink(self.path(key))
            except FileNotFoundError:
                pass
            except OSError as e:
                logger.warning("KV disk store: cannot evict %s: %s", self.path(key), e)

    def _touch(self, key: str, size: int) -> None:
        """Under the lock: `key` was just read whole; make it the most recent."""
        if key in self._index:
            self._index.move_to_end(key)
            return
        # Written by another process: count it (checking it is still there, since a
        # thread may have evicted it since we read it).
        try:
            size = os.stat(self.path(key)).st_size
        except OSError:
            return
        self._evict_to_fit(size)
        self._index[key] = size
        self.num_bytes += size

    def _forget(self, key: str) -> None:
        """Under the lock: the file was missing; drop it unless a put just wrote it."""
        if key in self._index and not os.path.exists(self.path(key)):
            self.num_bytes -= self._index.pop(key)

    def contains_many(self, keys):
        return [os.path.exists(self.path(k)) for k in keys]

    def get_many(self, keys):
        out = []
        for k in keys:
            try:
                with open(self.path(k), "rb") as f:
                    out.append(f.read())
            except FileNotFoundError:
                out.append(None)
            except OSError as e:
                logger.warning("KV disk store: cannot read %s: %s", self.path(k), e)
                out.append(None)
        # Refresh from the last block to the first: a chain's head is evicted last.
        hits = [(k, len(v)) for k, v in zip(reversed(keys), reversed(out)) if v is not None]
        with self._lock:
            for k, v in zip(keys, out):
                if v is None:
                    self._forget(k)
            for k, size in hits:
                self._touch(k, size)
        for k, _ in hits:
            try:
                os.utime(self.path(k))  # keeps the order across a restart
            except OSError:
                pass  # evicted meanwhile
        return out

    def put_many(self, items):
        too_big = 0
        for key, value in items:
            size = len(value)
            if size > self.max_bytes:
                too_big, big_size = too_big + 1, size
                continue
            final = self.path(key)
            folder = os.path.dirname(final)
            try:
                os.makedirs(folder, exist_ok=True)
                # Write outside the lock (the slow part), then make room and rename
                # under it, so the .kvb files never exceed the budget.
                fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=folder)
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(value)
                    with self._lock:
                        old = self._index.pop(key, None)
                        if old is not None:
                            self.num_bytes -= old
                        self._evict_to_fit(size)
                        os.replace(tmp, final)
                        self._index[key] = size
                        self.num_bytes += size
                except BaseException:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
                    raise
            except OSError as e:
                raise StoreUnavailable(f"disk store {self.dir}: {e}") from e
        if too_big:
            # All entries of a namespace have one size, so this is a budget below one
            # block: say so once, and count them as failed writes.
            with self._lock:
                first = self.num_too_big == 0
                self.num_too_big += too_big
            if first:
                logger.warning("KV disk store %s: an entry of %d bytes exceeds the whole "
                               "budget of %d bytes; such entries are not stored", self.dir,
                               big_size, self.max_bytes)
            raise StoreUnavailable(f"disk store {self.dir}: {too_big} entries larger than "
                                   f"the budget of {self.max_bytes} bytes")


class RedisStore(KVStore):
    """A shared remote tier through redis-py: keys tokenmill:kv:<namespace>:<hash>.

    Any Redis error (down at start-up, gone mid-run, timeouts) logs one warning
    per outage and marks the store down for `retry_s` seconds; meanwhile every
    call raises StoreUnavailable at once (so the engine recomputes, never waits)."""

    kind = "redis"

    def __init__(self, namespace: str, url: str, timeout_s: float = 2.0, retry_s: float = 5.0,
                 ttl_s: int | None = None):
        super().__init__(namespace)
        import redis  # noqa: local: only a Redis store needs it

        self._errors = (redis.exceptions.RedisError, OSError)
        self.url = url
        self.retry_s = retry_s
        self.ttl_s = ttl_s
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                            socket_connect_timeout=timeout_s)
        self._prefix = f"tokenmill:kv:{namespace}:"
        self._down_until = 0.0
        self._down = False
        try:
            self._call(self._client.ping)
            logger.info("KV connector: Redis at %s is up", url)
        except StoreUnavailable:
            pass  # warned; the engine starts and recomputes until Redis answers

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _call(self, fn):
        now = time.monotonic()
        if now < self._down_until:
            raise StoreUnavailable(f"Redis at {self.url} is down")
        try:
            result = fn()
        except self._errors as e:
            self._down_until = time.monotonic() + self.retry_s
            if not self._down:
                logger.warning("KV connector: Redis at %s is unreachable (%s): its blocks are "
                               "recomputed and not stored; retrying every %.0f s",
                               self.url, e, self.retry_s)
            self._down = True
            raise StoreUnavailable(f"Redis at {self.url}: {e}") from e
        if self._down:
            logger.warning("KV connector: Redis at %s answers again", self.url)
            self._down = False
        return result

    def contains_many(self, keys):
        def run():
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._key(k))
            return [bool(x) for x in pipe.execute()]
        return self._call(run) if keys else []

    def get_many(self, keys):
        if not keys:
            return []
        return self._call(lambda: self._client.mget([self._key(k) for k in keys]))

    def put_many(self, items):
        if not items:
            return

        def run():
            pipe = self._client.pipeline(transaction=False)
            for k, v in items:
                pipe.set(self._key(k), v, ex=self.ttl_s)
            pipe.execute()
        self._call(run)

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:  # noqa: BLE001 - closing a dead connection
            pass


def make_store(spec: str, namespace: str, config) -> KVStore:
    from tokenmill.kv_connector.config import parse_store_spec
    kind, arg = parse_store_spec(spec)
    if kind == "cpu":
        return CPUStore(namespace, config.cpu_bytes)
    if kind == "disk":
        return DiskStore(namespace, arg, config.disk_bytes)
    return RedisStore(namespace, arg, config.redis_timeout_s, config.redis_retry_s,
                      config.redis_ttl_s)
