"""Attention metadata from block tables: one builder for every path that runs attention.

The model runner builds a step's metadata here (per KV cache group), and so do the draft
proposers for their own K/V writes and decode steps; each gets the same kernel handles
(native CPU ops, or Triton's with the flat slot mapping its kernels read), so a drafter
runs the attention implementation the platform chose for the target, not whichever
fields it happened to fill.
"""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.models.layers.attention import AttentionMetadata, PrefillChunk


class AttentionMetadataBuilder:
    def __init__(self, device: torch.device, native_ops=None, triton_ops=None):
        self.device = device
        self.native_ops = native_ops  # tokenmill.kernels' ops, or None (PyTorch path)
        self.triton_ops = triton_ops  # tokenmill.ops.triton_attention, or None

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device)

    def _slots(self, table, block_ids: np.ndarray, positions: np.ndarray,
               num_decodes: int) -> AttentionMetadata:
        """Where each token's K/V goes (block id and offset; Triton: the flat slot)."""
        bs = table.block_size
        block_ids = block_ids.astype(np.int64)
        meta = AttentionMetadata(num_decodes=num_decodes, slot_block=self._tensor(block_ids),
                                 slot_offset=self._tensor(positions % bs),
                                 native_ops=self.native_ops)
        if self.triton_ops is not None:
            meta.triton_ops = self.triton_ops
            meta.slot_mapping = self._tensor(block_ids * bs + positions % bs)
        return meta

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
        block_ids = table.block_table.reshape(-1)[
            req_indices * table.max_num_blocks_per_req + positions // bs]
        nd_tokens = int(query_start_loc[nd])
        meta = self._slots(table, block_ids, positions, nd_tokens)
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
        if self.triton_ops is not None and num_reqs > nd:
            # Every prompt chunk at once, for the Triton prefill kernel.
            qsl = query_start_loc[nd:num_reqs + 1] - query_start_loc[nd]
            lens = seq_lens[nd:num_reqs]
            nb = -(-int(lens.max()) // bs)
            meta.prefill_query_start_loc = self._tensor(qsl.astype(np.int64))
            meta.prefill_seq_lens = self._tensor(lens.astype(np.int32))
            meta.prefill_block_table = self._tensor(table.block_table[nd:num_reqs, :nb].copy())
            meta.prefill_max_query_len = int(np.diff(qsl).max())
        return meta
