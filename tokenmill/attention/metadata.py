"""What one step tells the attention (and recurrent) layers: built once a step per KV
cache group by that group's backend builder (attention/builder.py), read by every
layer of the group.

The fields every backend reads (slot_block / slot_offset, the decode rows' block table
and lengths, the prompt chunks) are always filled; the flat fields below them
(slot_mapping: the Triton builder; the prefill_* ones: the Triton and CPU native
builders) only where kernels read them. No kernel handle travels here: each layer got
its implementation at bind.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunk:
    """A request computing more than one token this step."""

    query_start: int
    query_end: int
    context_len: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor  # [num_blocks_needed] block ids of this request


@dataclass
class StateMetadata:
    """Per-step inputs of the recurrent (Gated DeltaNet) layers; None for attention-only models.

    Rows follow the batch order (decodes first, one token each); row i's state
    lives in slot state_indices[i] of every recurrent layer.
    """

    num_decodes: int
    state_indices: torch.Tensor  # [num_reqs] long
    # Multi-token rows: (query_start, query_end, slot), as host ints. Hybrid prefix
    # caching cuts a row into consecutive pieces at its snapshot boundaries.
    prefills: list[tuple[int, int, int]] = field(default_factory=list)
    # Piece index -> the slot whose state is copied into the piece's slot before it runs
    # (a cache hit resuming from a snapshot), and -> the snapshot slot its state is copied
    # to after it. Pieces are ordered so that a snapshot is written before it is read.
    restore_before: dict[int, int] = field(default_factory=dict)
    snapshot_after: dict[int, int] = field(default_factory=dict)
    # (slot, snapshot slot) of one-token rows among the decodes whose token ends at a
    # snapshot boundary: copied after the decode step.
    decode_snapshots: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: the decode rows hold 1 + drafts tokens each, which must run
    # in order. Step j = (flat token rows [m], slots read [m], slots written [m]) for
    # token j of every row that has one; None: one token per decode row, in place.
    decode_steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    # Every row one sequence run in place (no speculation, no pieces): the rows' token
    # bounds [num_reqs + 1] (int64, host), so a native kernel takes the step in one
    # call (sequence i: these bounds, slot state_indices[i]); else None.
    query_start_loc: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step of one KV cache group."""

    num_decodes: int
    # Where each new token's K/V goes: block id and offset inside the block ([T] each).
    slot_block: torch.Tensor
    slot_offset: torch.Tensor
    # Decode rows: their block tables (int32) cut to the widest one, and their lengths.
    decode_block_table: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Triton only (its builder fills it): the flat slot of each token.
    slot_mapping: torch.Tensor | None = None  # [T] block id * block_size + offset (-1: pad)
    # Triton and CPU native (builder.PromptBatchBuilder): the prompt chunks at once,
    # query_start_loc [P + 1] from the first chunk's first query, seq_lens [P]
    # (cached + chunk), block_table [P, widest] int32.
    prefill_query_start_loc: torch.Tensor | None = None
    prefill_seq_lens: torch.Tensor | None = None
    prefill_block_table: torch.Tensor | None = None
    prefill_max_query_len: int = 0
    state: StateMetadata | None = None
    # Models with several KV cache groups: each group's own metadata (block tables and
    # slot mapping), by group id; a layer bound to group g reads by_group[g].
    by_group: dict[int, "AttentionMetadata"] | None = None
    _decode_mask: torch.Tensor | None = None

    def for_group(self, group_id: int | None) -> "AttentionMetadata":
        if self.by_group is None or group_id is None:
            return self
        return self.by_group[group_id]

    def decode_mask(self, block_size: int, window: int | None = None) -> torch.Tensor:
        """[nd, 1, 1, L] additive mask hiding each decode row's padded tail and, with a
        sliding `window`, the positions before it (the PyTorch decode path's; built once
        a step: one window per group)."""
        if self._decode_mask is None:
            width = self.decode_block_table.shape[1] * block_size
            pos = torch.arange(width, device=self.decode_seq_lens.device)
            visible = pos[None, :] < self.decode_seq_lens[:, None]
            if window is not None:
                visible &= pos[None, :] >= self.decode_seq_lens[:, None] - window
            mask = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
            self._decode_mask = mask.masked_fill_(~visible, float("-inf"))[:, None, None, :]
        return self._decode_mask
