"""Block hashes for prefix caching: one chained hash per full block of tokens.

The hash of block i covers block i's token ids, the hash of block i - 1 (so it
names the whole prefix up to the end of block i, not just one block), on block 0
only, the request's extra keys (its `cache_salt`, and a mark when its drafts are
suspended), so requests with different keys never share a block, and the hashes of
the images whose placeholder tokens it holds (the same placeholder ids stand for any
image). It is SHA-256 over a compact, explicit encoding: the same tokens give the
same 32 bytes in every process and on every machine (Python's hash() is salted per
process, so it cannot name KV that outlives the process, as the external KV tier's
entries do).

Only tokens the scheduler knows are hashed (prompt and sampled outputs, never
a placeholder for a token still being sampled), and only full blocks.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.core.request import Request

BlockHash = bytes  # 32 bytes

# The parent of block 0: a constant that also versions the encoding.
ROOT_HASH: BlockHash = hashlib.sha256(b"tokenmill-prefix-cache-v1").digest()


def _encode_extra(extra_keys: Sequence[object]) -> bytes:
    out = bytearray()
    for key in extra_keys:
        if isinstance(key, str):
            raw = key.encode("utf-8")
            out += b"s" + struct.pack("<I", len(raw)) + raw
        elif isinstance(key, bytes):
            out += b"b" + struct.pack("<I", len(key)) + key
        elif isinstance(key, int) and not isinstance(key, bool):
            out += b"i" + struct.pack("<q", key)
        else:
            raise TypeError(f"unsupported extra hash key {key!r}")
    return bytes(out)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int],
               extra_keys: Sequence[object] | None = None) -> BlockHash:
    """sha256(parent | count | int32 LE tokens | extra keys) -> 32 bytes."""
    h = hashlib.sha256(parent if parent is not None else ROOT_HASH)
    h.update(struct.pack(f"<I{len(token_ids)}i", len(token_ids), *token_ids))
    if extra_keys:
        h.update(b"x")
        h.update(_encode_extra(extra_keys))
    return h.digest()


def hash_token_blocks(token_ids: Sequence[int], block_size: int,
                      extra_keys: Sequence[object] | None = None) -> list[BlockHash]:
    """The chained hashes of every full block of `token_ids`."""
    out: list[BlockHash] = []
    parent = None
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size],
                            extra_keys if i == 0 else None)
        out.append(parent)
    return out


# Block 0's extra key of a request whose drafts are suspended: its blocks lack the draft
# model's K/V (or DFlash context), so they are shared only with other such requests.
NO_DRAFTS_KEY = "tokenmill:no-drafts"


def request_extra_keys(request: "Request") -> tuple:
    salt = getattr(request, "cache_salt", None)
    keys = (salt,) if salt is not None else ()
    return keys + (NO_DRAFTS_KEY,) if getattr(request, "drafts_suspended", False) else keys


def image_keys(request: "Request", start: int, end: int) -> tuple:
    """The hashes of the images whose placeholder runs overlap tokens [start, end): a
    block of placeholders holds the image's KV, which its token ids do not name."""
    feats = getattr(request, "mm_features", None)
    if not feats:
        return ()
    return tuple(f.hash for f in feats if f.offset < end and start < f.offset + f.length)


def _token_slice(request: "Request", start: int, end: int) -> list[int]:
    prompt = request.prompt_token_ids
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return request.output_token_ids[start - n:end - n]
    return prompt[start:] + request.output_token_ids[:end - n]


def request_block_hashes(request: "Request", block_size: int) -> list[BlockHash]:
    """The hashes of the request's full blocks, extended as tokens arrive (kept on
    the request: one block size per engine)."""
    hashes: list[BlockHash] = request.block_hashes
    num_full = request.num_tokens // block_size
    if len(hashes) < num_full:
        extra = request_extra_keys(request)
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full):
            keys = (extra if i == 0 else ()) + image_keys(request, i * block_size,
                                                          (i + 1) * block_size)
            parent = hash_block(parent, _token_slice(request, i * block_size,
                                                     (i + 1) * block_size), keys or None)
            hashes.append(parent)
    return hashes


class PrefixCacheStats:
    """Counted once per admission of a request that looked the cache up."""

    def __init__(self):
        self.queries = 0  # tokens looked up
        self.hits = 0  # of those, tokens found cached
        self.requests = 0
        self.hit_requests = 0

    def record(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_tokens
        self.hits += num_hit_tokens
        self.requests += 1
        self.hit_requests += num_hit_tokens > 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
