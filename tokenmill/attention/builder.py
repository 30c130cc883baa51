"""Attention metadata from block tables: the base builder every backend's builder extends.

The model runner builds a step's metadata per KV cache group through that group's
builder (the group's backend made it), and the draft proposers build their K/V-write
and decode metadata through the builder of the group their layers are in, so a
drafter's attention reads exactly the fields its implementation needs. A backend
whose kernels read more (Triton's flat slot mapping; the prompt chunks at once,
which `PromptBatchBuilder` adds for the CPU native and Triton prefill kernels)
extends `_fill_slots` / `step`.
"""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.attention.metadata import AttentionMetadata, PrefillChunk

# Decode-only steps of up to this many rows build their slots from Python ints.
SMALL_DECODE_ROWS = 8


class AttentionMetadataBuilder:
    # False: no shortcut for a few decode rows (the tests compare it with the general
    # path: tests/test_step_fast_paths_engine.py).
    fast_paths = True

    def __init__(self, device: torch.device):
        self.device = device
        self._on_cpu = torch.device(device).type == "cpu"

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        return t if self._on_cpu else t.to(self.device)  # (CPU: no no-op .to to dispatch)

    def _slots(self, table, block_ids: np.ndarray, positions: np.ndarray,
               num_decodes: int, offsets: np.ndarray | None = None) -> AttentionMetadata:
        """Where each token's K/V goes: its block id and the offset inside the block
        (`offsets`: positions % block_size, when the caller has it)."""
        bs = table.block_size
        block_ids = block_ids.astype(np.int64)
        if offsets is None:
            offsets = positions % bs
        meta = AttentionMetadata(num_decodes=num_decodes, slot_block=self._tensor(block_ids),
                                 slot_offset=self._tensor(offsets))
        self._fill_slots(meta, block_ids, offsets, bs)
        return meta

    def _fill_slots(self, meta: AttentionMetadata, block_ids: np.ndarray,
                    offsets: np.ndarray, block_size: int) -> None:
        """A backend's own per-token slot fields (none here)."""

    def write_only(self, table, req_rows: np.ndarray, positions: np.ndarray
                   ) -> AttentionMetadata:
        """K/V writes only (a drafter filling its cache): row req_rows[i]'s token at
        positions[i]."""
        bs = table.block_size
        return self._slots(table, table.block_table[req_rows, positions // bs], positions, 0)

    def decodes(self, table, rows: np.ndarray, positions: np.ndarray) -> AttentionMetadata:
        """One decode query per batch row rows[i], at positions[i] (its K/V written there,
        the cache up to it read)."""
        bs = table.block_size
        meta = self._slots(table, table.block_table[rows, positions // bs], positions,
                           rows.size)
        nb = int(positions.max()) // bs + 1
        meta.decode_block_table = self._tensor(table.block_table[rows, :nb].copy())
        meta.decode_seq_lens = self._tensor((positions + 1).astype(np.int32))
        return meta

    def step(self, table, window: int | None, req_indices: np.ndarray, positions: np.ndarray,
             seq_lens: np.ndarray, computed: np.ndarray, num_sched: np.ndarray,
             query_start_loc: np.ndarray, num_decode_rows: int, num_reqs: int
             ) -> AttentionMetadata:
        """A scheduled step's metadata for one KV cache group: its first num_decode_rows
        rows are decodes (one token, or one plus its drafts: each a query of its own
        length), the rest prompt chunks. `window`: the group's sliding window or None."""
        bs, nd = table.block_size, num_decode_rows
        if (self.fast_paths and nd == num_reqs == positions.size and nd <= SMALL_DECODE_ROWS
                and window is None):
            return self._small_decodes(table, positions, seq_lens)
        block_index, offsets = np.divmod(positions, bs)
        nd_tokens = int(query_start_loc[nd])
        meta = self._slots(table, table.block_table[req_indices, block_index], positions,
                           nd_tokens, offsets)
        if nd:
            nb = -(-int(seq_lens[:nd].max()) // bs)
            rows = table.block_table[:nd, :nb].copy()  # (a later step edits the table)
            if nd_tokens == nd:
                lens = seq_lens[:nd]
            else:
                rows = np.repeat(rows, num_sched[:nd], axis=0)
                lens = positions[:nd_tokens] + 1
            if window is not None:
                # Blocks before a row's window may be back in the pool (a stale id in
                # this table): the null block stands in, so nothing unowned is read.
                first = np.maximum(lens - window, 0) // bs  # (query at lens - 1)
                rows = np.where(np.arange(nb)[None, :] < first[:, None], 0, rows)
            meta.decode_block_table = self._tensor(rows)
            meta.decode_seq_lens = self._tensor(lens.astype(np.int32))
        for r in range(nd, num_reqs):
            nb = -(-int(seq_lens[r]) // bs)
            meta.prefills.append(PrefillChunk(
                int(query_start_loc[r]), int(query_start_loc[r + 1]), int(computed[r]),
                self._tensor(table.block_table[r, :nb].astype(np.int64))))
        return meta


    def _small_decodes(self, table, positions: np.ndarray, seq_lens: np.ndarray
                       ) -> AttentionMetadata:
        """step() for a few one-token decode rows (row r's token at positions[r]), no
        window: the same fields from Python ints (numpy arithmetic and fancy indexing
        cost cache misses per call after the forward streamed the weights)."""
        bs, bt = table.block_size, table.block_table
        pos = positions.tolist()
        block_ids = np.array([bt[r, p // bs] for r, p in enumerate(pos)], dtype=np.int64)
        offsets = np.array([p % bs for p in pos], dtype=np.int64)
        meta = AttentionMetadata(num_decodes=len(pos), slot_block=self._tensor(block_ids),
                                 slot_offset=self._tensor(offsets))
        self._fill_slots(meta, block_ids, offsets, bs)
        lens = seq_lens.tolist()
        nb = -(-max(lens) // bs)
        meta.decode_block_table = self._tensor(bt[:len(pos), :nb].copy())
        meta.decode_seq_lens = self._tensor(np.array(lens, dtype=np.int32))
        return meta


class PromptBatchBuilder(AttentionMetadataBuilder):
    """Adds every prompt chunk of the step at once (prefill_query_start_loc from the
    first chunk's first query, prefill_seq_lens, prefill_block_table int32,
    prefill_max_query_len): what one prefill kernel call over all chunks reads."""

    def step(self, table, window, req_indices, positions, seq_lens, computed, num_sched,
             query_start_loc, num_decode_rows, num_reqs) -> AttentionMetadata:
        meta = super().step(table, window, req_indices, positions, seq_lens, computed,
                            num_sched, query_start_loc, num_decode_rows, num_reqs)
        nd = num_decode_rows
        if num_reqs > nd:
            qsl = query_start_loc[nd:num_reqs + 1] - query_start_loc[nd]
            lens = seq_lens[nd:num_reqs]
            nb = -(-int(lens.max()) // table.block_size)
            meta.prefill_query_start_loc = self._tensor(qsl.astype(np.int64))
            meta.prefill_seq_lens = self._tensor(lens.astype(np.int32))
            meta.prefill_block_table = self._tensor(table.block_table[nd:num_reqs, :nb].copy())
            meta.prefill_max_query_len = int(np.diff(qsl).max())
        return meta
