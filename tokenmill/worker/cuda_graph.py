"""Pure-decode steps as CUDA graphs, captured once at start-up, replayed per step.

A decode step of n rows (one token each) is padded to the smallest capture size
B >= n and replays the graph captured for B: the step's inputs are copied into
static buffers (shared by every size: size B uses their first B rows) and the
graph runs the whole forward (embedding, layers, final norm) with no Python and
no kernel launches of its own. The pad rows n..B-1 are inert: slot_mapping -1
(their K/V is written nowhere), seq_len 0 and the null block in their block
table (decode attention reads nothing and returns zeros for them), token 0 at
position 0, and in a hybrid model the scratch state slot after the real ones
(allocated for them, never a request's); their hidden rows come out of the
graph and are never read (the runner keeps rows [:n]).

Steps verifying drafts replay the same graphs: the attention builder already
lays a verifying row's 1 + k tokens out as decode queries of their own (the
row's block table repeated, seq_len = position + 1: causal among the drafts),
so a verify step of T tokens is a decode step of T rows. With a drafter the
sizes go up to max_num_seqs x (1 + k), and the taps a drafter reads
(`model.aux_hidden`) are graph outputs too. A hybrid model's verify steps run
eagerly (their recurrent layers take the tokens of a row in order, each into a
state slot of its own: StateMetadata.decode_steps, host lists).

Prefill and mixed steps and batches above the largest size run eagerly; so does
every step where the platform says no (CPU, `enforce_eager`, no Triton). The
capture sizes follow vLLM's: 1, 2, 4, then every multiple of 8 up to 256, then
of 16, up to max_num_seqs (at most MAX_CAPTURE_SIZE). Capture goes largest first
into one memory pool: a replay's outputs are consumed (lm_head rows gathered,
the drafter's proposals made: both within the step) before the next replay, so
the graphs may share it.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch

from tokenmill.attention.metadata import AttentionMetadata, StateMetadata

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """The padded batch sizes to capture, ascending; the last covers max_num_seqs
    (up to `limit`)."""
    if max_num_seqs < 1 or limit < 1:
        raise ValueError(f"max_num_seqs and the capture limit must be >= 1, got "
                         f"{max_num_seqs}, {limit}")
    every = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, max(limit, 272) + 1, 16))
    every = [s for s in every if s <= limit]
    top = min(max_num_seqs, limit)
    cover = next((s for s in every if s >= top), every[-1])
    return [s for s in every if s <= cover]


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest capture size >= n (None: above the largest: run eagerly)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass
class GroupBuffers:
    """One KV cache group's static decode metadata (rows [:B] serve size B)."""

    slot_mapping: torch.Tensor  # [max] int64
    block_table: torch.Tensor   # [max, max_blocks_per_req] int32
    seq_lens: torch.Tensor      # [max] int32
    zeros: torch.Tensor         # [max] int64: slot_block / slot_offset (unused by Triton)


class DecodeGraphBuffers:
    """The static inputs every captured graph reads, and how a step fills them."""

    def __init__(self, max_size: int, blocks_per_req: dict[int, int], device,
                 pad_state_slot: int | None = None):
        """`blocks_per_req`: group id -> the width of its block table; `pad_state_slot`:
        the scratch recurrent-state slot of the pad rows (None: no recurrent layers)."""
        self.max_size = max_size
        self.input_ids = torch.zeros(max_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.long, device=device)
        self.groups = {
            gid: GroupBuffers(torch.full((max_size,), -1, dtype=torch.long, device=device),
                              torch.zeros(max_size, width, dtype=torch.int32, device=device),
                              torch.zeros(max_size, dtype=torch.int32, device=device),
                              torch.zeros(max_size, dtype=torch.long, device=device))
            for gid, width in blocks_per_req.items()}
        self.primary = next(iter(self.groups))
        self.pad_state_slot = pad_state_slot
        self.state_indices = (None if pad_state_slot is None else
                              torch.full((max_size,), pad_state_slot, dtype=torch.long,
                                         device=device))

    def metadata(self, size: int) -> AttentionMetadata:
        """The static AttentionMetadata a graph of `size` rows is captured with: the
        decode fields and the flat slot mapping the graphable backend (Triton) reads."""
        metas = {}
        for gid, g in self.groups.items():
            metas[gid] = AttentionMetadata(
                num_decodes=size, slot_block=g.zeros[:size], slot_offset=g.zeros[:size],
                decode_block_table=g.block_table[:size], decode_seq_lens=g.seq_lens[:size],
                slot_mapping=g.slot_mapping[:size])
        meta = metas[self.primary]
        if len(metas) > 1:
            meta.by_group = metas
        if self.state_indices is not None:
            meta.state = StateMetadata(size, self.state_indices[:size])
        return meta

    def fill(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor,
             meta: AttentionMetadata) -> None:
        """Copy a decode step of n = len(input_ids) rows into rows [:n] and make rows
        [n:size] inert pad rows."""
        n = input_ids.shape[0]
        if not 0 < n <= size <= self.max_size:
            raise ValueError(f"a decode step of {n} rows cannot be padded to {size} "
                             f"(capture sizes up to {self.max_size})")
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:size].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:size].zero_()
        for gid, g in self.groups.items():
            m = meta.for_group(gid) if meta.by_group is not None else meta
            g.slot_mapping[:n].copy_(m.slot_mapping)
            g.slot_mapping[n:size].fill_(-1)
            width = m.decode_block_table.shape[1]
            # Columns past `width` may hold an earlier step's ids: never read, since a
            # row reads only the blocks below its seq_len.
            g.block_table[:n, :width].copy_(m.decode_block_table)
            g.block_table[n:size].zero_()
            g.seq_lens[:n].copy_(m.decode_seq_lens)
            g.seq_lens[n:size].zero_()
        if self.state_indices is not None:
            self.state_indices[:n].copy_(meta.state.state_indices[:n])
            self.state_indices[n:size].fill_(self.pad_state_slot)

    def make_inert(self, size: int) -> None:
        """Every row a pad row (what the graphs are warmed up and captured with)."""
        self.input_ids[:size].zero_()
        self.positions[:size].zero_()
        for g in self.groups.values():
            g.slot_mapping[:size].fill_(-1)
            g.block_table[:size].zero_()
            g.seq_lens[:size].zero_()
        if self.state_indices is not None:
            self.state_indices[:size].fill_(self.pad_state_slot)


class DecodeGraphRunner:
    """The captured graphs by size and their outputs."""

    def __init__(self, model, buffers: DecodeGraphBuffers, sizes: list[int]):
        self.model = model
        self.buffers = buffers
        self.sizes = sizes
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # size -> the drafter's taps the graph writes ([size, width]); empty: no taps
        self.taps: dict[int, torch.Tensor] = {}
        self.metas = {}

    @classmethod
    def build(cls, runner) -> "DecodeGraphRunner | None":
        """Graphs for `runner`'s model at every capture size up to its max_num_reqs;
        None (every step eager, said in a warning) where capturing fails, e.g. a kernel
        of an optional library that syncs with the host."""
        batch = runner.input_batch
        widths = {gid: batch.block_tables[gid].max_num_blocks_per_req
                  for gid in runner.attn_group_ids}
        # A verify step's rows are its tokens: up to 1 + k a request.
        per_req = 1 + (runner.drafter.k if runner.drafter is not None else 0)
        sizes = capture_sizes(runner.max_num_reqs * per_req)
        # (the scratch slot allocate_state_caches added after the config's slots)
        pad_slot = runner.kv_cache_config.num_state_slots if runner.state_caches else None
        buffers = DecodeGraphBuffers(sizes[-1], widths, runner.device, pad_slot)
        graphs = cls(runner.model, buffers, sizes)
        try:
            graphs.capture()
        except Exception as e:  # noqa: BLE001 (any failure: eager is always correct)
            logger.warning("CUDA graph capture failed, decode steps run eagerly: %s: %s",
                           type(e).__name__, e)
            torch.cuda.synchronize()
            return None
        return graphs

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        from tqdm.auto import tqdm
        pool = None
        buf = self.buffers
        for size in tqdm(sorted(self.sizes, reverse=True), desc="Capturing CUDA graphs",
                         unit="graph", disable=not progress):
            meta = buf.metadata(size)
            buf.make_inert(size)
            ids, pos = buf.input_ids[:size], buf.positions[:size]
            for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels
                self.model(ids, pos, meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(ids, pos, meta)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = (graph, out)
            self.record_taps(size)
            self.metas[size] = meta
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs for decode steps of 1 to %d rows",
                    len(self.graphs), self.sizes[-1])

    def record_taps(self, size: int) -> None:
        """After the forward a graph of `size` was captured with: the taps it wrote
        (model.aux_hidden, in the graph's memory) are what each replay rewrites."""
        if getattr(self.model, "aux_layer_ids", ()):
            self.taps[size] = self.model.aux_hidden

    def can_run(self, num_rows: int, meta: AttentionMetadata) -> bool:
        """A step of `num_rows` decode queries (one token a row, or a verifying row's
        tokens each a query) fits a graph; a hybrid's verify step does not."""
        if meta.prefills or (meta.state is not None and meta.state.decode_steps is not None):
            return False
        return padded_size(num_rows, self.sizes) is not None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states of a decode step's n rows ([n, hidden]; a view of the
        graph's output, valid until the next replay)."""
        n = input_ids.shape[0]
        size = padded_size(n, self.sizes)
        self.buffers.fill(size, input_ids, positions, meta)
        graph, out = self.graphs[size]
        graph.replay()
        taps = self.taps.get(size)
        if taps is not None:  # what the drafter reads, as an eager forward leaves it
            self.model.aux_hidden = taps[:n]
        return out[:n]
