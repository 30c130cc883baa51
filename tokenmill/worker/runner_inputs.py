"""The model runner's input concern: the persistent batch updated from a SchedulerOutput,
reordered decode-first, and turned into the step's flat inputs (numpy, vectorised: ids,
positions, query_start_loc, logits indices), each KV cache group's attention metadata
(through its backend's builder) and the recurrent layers' state slots. A mixin of
`ModelRunner` (worker/model_runner.py), whose constructor sets the attributes it reads."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.attention.metadata import StateMetadata
from tokenmill.core.sched_output import SchedulerOutput
from tokenmill.worker import step_checks
from tokenmill.worker.input_batch import CachedRequestState, InputBatch

# Rows scheduling at most this many tokens count as decodes in the reorder.
DECODE_THRESHOLD = 1
# Decode-only steps of up to this many rows build their inputs from Python lists.
SMALL_DECODE_ROWS = 8


@dataclass
class StepInputs:
    """The flat inputs of the last step, kept for inspection and tests."""

    input_ids: np.ndarray
    positions: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    req_indices: np.ndarray  # each token's row
    logits_indices: np.ndarray
    discard_mask: np.ndarray  # rows still consuming their prompt: they sample nothing
    block_table: np.ndarray  # group 0, rows [0, num_reqs)
    block_size: int  # group 0's
    # Speculative decoding: logits rows of request i are cu_num_logits[i]..[i+1]-1
    # (its drafts' positions, then one more); num_drafts[i] = that count - 1.
    cu_num_logits: np.ndarray | None = None
    num_drafts: np.ndarray | None = None

    @property
    def slot_mapping(self) -> np.ndarray:
        """Group 0's flat slot of each token (block id * block_size + offset); computed
        when asked: the kernels read the builders' metadata, not this."""
        bs = self.block_size
        return (self.block_table[self.req_indices, self.positions // bs].astype(np.int64) * bs
                + self.positions % bs)


def reorder_decodes_first(batch: InputBatch, num_scheduled: dict[str, int],
                          decode_threshold: int = DECODE_THRESHOLD,
                          spec_tokens: dict[str, list[int]] | None = None) -> bool:
    """Order rows decode -> short extend -> long extend -> prefill, with few swaps.

    A row verifying drafts (`spec_tokens`) is a decode: its tokens beyond the one
    decode token are its drafts. Only rows that sit in the wrong region move; each
    follows its swap chain. Returns whether anything moved.
    """
    n = batch.num_reqs()
    if n <= 1:
        return False
    sched = np.fromiter(map(num_scheduled.__getitem__, batch.req_ids[:n]), np.int64, n)
    if spec_tokens:
        sched -= np.fromiter((len(spec_tokens.get(rid, ())) for rid in batch.req_ids[:n]),
                             np.int64, n)
    computed = batch.num_computed_tokens_cpu[:n]
    prompt = batch.num_prompt_tokens[:n]
    region = np.where(computed == 0, 3,
                      np.where(sched > decode_threshold, 2,
                               np.where(computed < prompt, 1, 0)))
    target = np.sort(region, kind="stable")
    wrong = np.nonzero(region != target)[0]
    if wrong.size == 0:
        return False
    sources = wrong[np.argsort(region[wrong], kind="stable")]
    dest = {int(s): int(d) for s, d in zip(sources, wrong)}
    for src in sources.tolist():
        dst = dest[src]
        while src != dst:
            batch.swap_states(src, dst)
            nxt = dest.get(dst, dst)
            dest[dst] = dst
            dst = nxt
    return True


class InputPrepMixin:
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for h in so.free_encoder_hashes:
            self.encoder_cache.pop(h, None)
        if so.finished_req_ids or so.preempted_req_ids:
            self._write_drafter_rows([*so.finished_req_ids, *so.preempted_req_ids])
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self._prompt_logprobs_reqs.discard(rid)
            self._pooling_reqs.discard(rid)
            self._next_drafts.pop(rid, None)
            batch.remove_request(rid)
            if self.drafter is not None:
                self.drafter.remove(rid)
            if self.state_slots is not None:
                self.state_slots.release(rid)
        for rid in so.preempted_req_ids:
            self._next_drafts.pop(rid, None)
            if self.state_slots is not None:  # resumed later from 0: a fresh state then
                self.state_slots.release(rid)
        # Preempted or simply not scheduled: out of the batch, state kept.
        if not batch.req_id_to_index.keys() <= so.num_scheduled_tokens.keys():
            for rid in list(batch.req_id_to_index):
                if rid not in so.num_scheduled_tokens:
                    batch.remove_request(rid)
        for new in so.scheduled_new_reqs:
            step_checks.input_fault(new.req_id, new.prompt_token_ids)
            sp = new.sampling_params
            old = self.requests.get(new.req_id)
            if old is not None and old.generator is not None:
                # Sent again after a failed step (reset_batch): its seeded stream goes on.
                gen = old.generator
            elif sp.seed is not None and not sp.greedy:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(sp.seed)
            else:
                gen = None
            state = CachedRequestState(new.req_id, list(new.prompt_token_ids), sp, gen,
                                       [list(b) for b in new.block_ids],
                                       new.num_computed_tokens, list(new.output_token_ids),
                                       mm_features=new.mm_features or None,
                                       pooling_params=new.pooling_params)
            if state.mm_features and self.uses_mrope:
                state.mrope_positions, state.mrope_delta = self.model.mrope_positions(
                    len(state.prompt_token_ids),
                    [(f.offset, f.length, tuple(f.image_grid_thw)) for f in state.mm_features])
            self.requests[new.req_id] = state
            batch.add_request(state)
            if gen is not None and self.drafter is not None:
                self.drafter.add_seeded(new.req_id)
            if new.drafts_suspended and self.drafter is not None:
                self.drafter.suspend(new.req_id)
            elif self.drafter is not None:  # (sent again, resumed: scheduler._resume_drafts)
                self.drafter.resume(new.req_id)
            if sp.prompt_logprobs is not None:
                self._prompt_logprobs_reqs.add(new.req_id)
            if new.pooling_params is not None:
                self._pooling_reqs.add(new.req_id)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self.requests[rid]
            # Never past the request's last token: with async speculation the scheduler
            # counted the step before's draft slots computed before knowing how many were
            # accepted; the tokens this runner kept say where the request really is.
            state.num_computed_tokens = min(cached.num_computed_tokens[i], state.num_tokens - 1)
            new_blocks = cached.new_block_ids[i]
            resumed = cached.resumed_from_preemption[i]
            if resumed:
                state.block_ids = [list(b) for b in new_blocks]
            elif new_blocks is not None:
                for group_ids, ids in zip(state.block_ids, new_blocks):
                    group_ids.extend(ids)
            row = batch.req_id_to_index.get(rid)
            if row is None:
                batch.add_request(state)
                continue
            batch.num_computed_tokens_cpu[row] = state.num_computed_tokens
            if resumed:
                for table, ids in zip(batch.block_tables, state.block_ids):
                    table.add_row(ids, row)
            elif new_blocks is not None:
                for table, ids in zip(batch.block_tables, new_blocks):
                    table.append_row(ids, row)
        batch.condense()

    def _prepare_inputs(self, so: SchedulerOutput):
        batch = self.input_batch
        n = batch.num_reqs()
        spec = so.scheduled_spec_decode_tokens
        if so.total_num_scheduled_tokens == n and not spec and self.fast_paths:
            return self._prepare_decodes(so, n)  # every row one token
        if spec and n <= SMALL_DECODE_ROWS and self.fast_paths:
            out = self._prepare_verifies(so, n, spec)  # every row one token and its drafts
            if out is not None:
                return out
        num_sched = np.fromiter(map(so.num_scheduled_tokens.__getitem__,
                                    batch.req_ids[:n]), np.int64, n)
        num_drafts = None
        if spec:
            # The drafts follow the row's real tokens; they are inputs like any other.
            num_drafts = np.zeros(n, dtype=np.int64)
            for rid, drafts in spec.items():
                r = batch.req_id_to_index[rid]
                num_drafts[r] = len(drafts)
                start = int(batch.num_tokens_no_spec[r])
                batch.token_ids_cpu[r, start:start + len(drafts)] = drafts
        cu = np.cumsum(num_sched)
        total = int(cu[-1])
        query_start_loc = np.zeros(n + 1, dtype=np.int64)
        query_start_loc[1:] = cu
        computed = batch.num_computed_tokens_cpu[:n].astype(np.int64)
        if total == n:  # one token a row (decodes): row i's token is token i
            req_indices = self._arange_upto(n)
            positions = computed.copy()
        else:
            req_indices = np.repeat(np.arange(n), num_sched)
            # Offset of each token inside its request's chunk.
            offsets = self._arange_upto(total) - np.repeat(query_start_loc[:-1], num_sched)
            positions = computed[req_indices] + offsets
        input_ids = batch.token_ids_cpu.reshape(-1)[req_indices * batch.max_model_len + positions]
        seq_lens = computed + num_sched
        discard = seq_lens < batch.num_tokens_no_spec[:n]
        cu_num_logits = None
        if num_drafts is None:
            logits_indices = cu - 1
        else:
            # A verifying row samples at its last token and at every draft.
            num_logits = num_drafts + 1
            cu_num_logits = np.zeros(n + 1, dtype=np.int64)
            cu_num_logits[1:] = np.cumsum(num_logits)
            logits_indices = (np.repeat(cu - num_logits, num_logits)
                              + self._arange_upto(int(cu_num_logits[-1]))
                              - np.repeat(cu_num_logits[:-1], num_logits))

        # Leading decode rows (one token, or one plus its drafts) share one batched
        # decode call: each of their tokens is a query row that sees the cache up to
        # itself (every token's K/V is written before attention runs).
        if total == n:  # decodes only
            nd = n
        else:
            single = num_sched == 1 if num_drafts is None else num_sched - num_drafts == 1
            not_single = np.nonzero(~single)[0]
            nd = int(not_single[0]) if not_single.size else n
        return self._step_metadata(so, n, nd, input_ids, positions, query_start_loc, seq_lens,
                                   req_indices, logits_indices, discard, computed, num_sched,
                                   num_drafts, cu_num_logits)

    def _prepare_decodes(self, so: SchedulerOutput, n: int):
        """_prepare_inputs for a step of one token a row (no drafts): the same arrays,
        with the fewest numpy calls (each costs microseconds at batch 1, most of them
        in cache misses after the forward streamed the weights): the counts, offsets
        and indices are views of one preallocated arange and ones."""
        batch = self.input_batch
        arange = self._arange_upto(n + 1)
        req_indices = arange[:n]
        if n <= SMALL_DECODE_ROWS:
            # A few rows: Python ints, arrays built from lists (array construction stays
            # warm; numpy arithmetic and fancy indexing pay cache misses per call).
            computed_l = batch.num_computed_tokens_cpu[:n].tolist()
            num_tokens_l = batch.num_tokens_no_spec[:n].tolist()
            token_ids = batch.token_ids_cpu
            computed = np.array(computed_l, dtype=np.int64)
            positions = np.array(computed_l, dtype=np.int64)
            input_ids = np.array([token_ids[r, c] for r, c in enumerate(computed_l)],
                                 dtype=token_ids.dtype)
            seq_lens = np.array([c + 1 for c in computed_l], dtype=np.int64)
            discard = np.array([c + 1 < t for c, t in zip(computed_l, num_tokens_l)],
                               dtype=bool)
        else:
            computed = batch.num_computed_tokens_cpu[:n].astype(np.int64)
            positions = computed.copy()
            input_ids = batch.token_ids_cpu[req_indices, positions]
            seq_lens = computed + 1
            discard = seq_lens < batch.num_tokens_no_spec[:n]
        return self._step_metadata(so, n, n, input_ids, positions, arange, seq_lens,
                                   req_indices, req_indices, discard, computed,
                                   self._ones_upto(n), None, None)

    def _prepare_verifies(self, so: SchedulerOutput, n: int, spec: dict):
        """_prepare_inputs for a few rows that each run one token and its drafts (a
        speculative decode step; None: some row runs a prompt chunk): the same arrays,
        built from Python lists, as _prepare_decodes does for plain decodes. Every
        token of such a step samples, so the logits rows are all of them and
        cu_num_logits is the query start locations."""
        batch = self.input_batch
        req_ids = batch.req_ids[:n]
        num_sched_l = [so.num_scheduled_tokens[rid] for rid in req_ids]
        drafts_l = [spec.get(rid, ()) for rid in req_ids]
        if any(s != len(d) + 1 for s, d in zip(num_sched_l, drafts_l)):
            return None
        token_ids = batch.token_ids_cpu
        computed_l = batch.num_computed_tokens_cpu[:n].tolist()
        num_tokens_l = batch.num_tokens_no_spec[:n].tolist()
        qsl, req_l, pos_l = [0], [], []
        for r, (c, s, d) in enumerate(zip(computed_l, num_sched_l, drafts_l)):
            if d:  # the drafts follow the row's real tokens; inputs like any other
                token_ids[r, num_tokens_l[r]:num_tokens_l[r] + len(d)] = d
            qsl.append(qsl[-1] + s)
            req_l += [r] * s
            pos_l += range(c, c + s)
        total = qsl[-1]
        seq_l = [c + s for c, s in zip(computed_l, num_sched_l)]
        query_start_loc = np.array(qsl, dtype=np.int64)
        return self._step_metadata(
            so, n, n, np.array([token_ids[r, p] for r, p in zip(req_l, pos_l)],
                               dtype=token_ids.dtype),
            np.array(pos_l, dtype=np.int64), query_start_loc,
            np.array(seq_l, dtype=np.int64), np.array(req_l, dtype=np.int64),
            self._arange_upto(total).copy(),
            np.array([q < t for q, t in zip(seq_l, num_tokens_l)], dtype=bool),
            np.array(computed_l, dtype=np.int64), np.array(num_sched_l, dtype=np.int64),
            np.array([s - 1 for s in num_sched_l], dtype=np.int64), query_start_loc.copy())

    def _step_metadata(self, so, n, nd, input_ids, positions, query_start_loc, seq_lens,
                       req_indices, logits_indices, discard, computed, num_sched,
                       num_drafts, cu_num_logits):
        """Each KV cache group's attention metadata and the state slots of a step whose
        flat inputs are made (its first `nd` rows decodes); kept as `last_step`."""
        batch = self.input_batch
        groups = {gid: self.attn_builders[gid].step(
                      batch.block_tables[gid], self.kv_cache_config.groups[gid].sliding_window,
                      req_indices, positions, seq_lens, computed, num_sched, query_start_loc,
                      nd, n)
                  for gid in self.attn_group_ids}
        meta = groups[self.attn_group_id]
        if len(groups) > 1:
            meta.by_group = groups
        table = batch.block_tables[self.attn_group_id]
        if self.state_slots is not None:
            meta.state = self._state_metadata(nd, query_start_loc, computed, num_drafts,
                                              so.state_restores, so.state_snapshots)
        self.last_step = StepInputs(
            input_ids=input_ids, positions=positions, query_start_loc=query_start_loc,
            seq_lens=seq_lens, req_indices=req_indices,
            logits_indices=logits_indices, discard_mask=discard,
            block_table=table.block_table[:n].copy(), block_size=table.block_size,
            cu_num_logits=cu_num_logits,
            num_drafts=num_drafts)
        self.last_attn_meta = meta
        return input_ids, positions, logits_indices, meta, discard

    def _state_metadata(self, num_decodes: int, query_start_loc: np.ndarray,
                        computed: np.ndarray, num_drafts: np.ndarray | None = None,
                        restores: dict[str, int] | None = None,
                        snapshots: dict[str, list[tuple[int, int]]] | None = None
                        ) -> StateMetadata:
        """Each row's state slot; a request seen for the first time gets a zeroed one.

        `num_decodes` rows lead the batch; with drafts (`num_drafts`) each of them has
        1 + drafts tokens, run as decode steps in order, each leaving its state in
        the next slot of the request's group (StateSlots.write_slots)."""
        batch = self.input_batch
        n = batch.num_reqs()
        slots = np.empty(n, dtype=np.int64)
        fresh = []
        for r in range(n):
            slot, new = self.state_slots.get_or_allocate(batch.req_ids[r])
            slots[r] = slot
            if new:
                fresh.append(slot)
            if computed[r] == 0 and not new:
                # Back from the start with a slot still held (not preempted): reset it.
                fresh.append(slot)
        if fresh:
            idx = torch.tensor(fresh, dtype=torch.long, device=self.device)
            for tensors in self.state_caches.values():
                for t in tensors:
                    t.index_fill_(0, idx, 0)
        # A one-token row resuming from a snapshot (a hit leaving one token): it runs
        # with the decode rows, so its state is copied in now (never a snapshot this
        # step writes: the scheduler does not hand those to such rows).
        early = [(int(slots[r]), self.snapshot_base + restores[batch.req_ids[r]])
                 for r in range(num_decodes) if restores and batch.req_ids[r] in restores]
        if early:
            dst = torch.tensor([d for d, _ in early], dtype=torch.long, device=self.device)
            src = torch.tensor([s for _, s in early], dtype=torch.long, device=self.device)
            for tensors in self.state_caches.values():
                for t in tensors:
                    t[dst] = t[src]
        self._spec_write_slots = {}
        nd_tokens = int(query_start_loc[num_decodes])
        meta = StateMetadata(nd_tokens, torch.from_numpy(slots).to(self.device))
        if nd_tokens > num_decodes:
            meta.decode_steps = self._state_decode_steps(num_decodes, query_start_loc, slots)
        for r in range(num_decodes) if snapshots else ():
            for _, snap in snapshots.get(batch.req_ids[r], ()):  # a one-token chunk's end
                meta.decode_snapshots.append((int(slots[r]), self.snapshot_base + snap))
        if restores or snapshots:
            self._state_pieces(meta, num_decodes, query_start_loc, computed, slots,
                               restores or {}, snapshots or {})
            return meta
        for r in range(num_decodes, n):
            meta.prefills.append((int(query_start_loc[r]), int(query_start_loc[r + 1]),
                                  int(slots[r])))
        if meta.decode_steps is None:
            meta.query_start_loc = torch.from_numpy(query_start_loc[:n + 1].astype(np.int64))
        return meta

    def _state_pieces(self, meta: StateMetadata, num_decodes: int, query_start_loc,
                      computed, slots, restores: dict[str, int],
                      snapshots: dict[str, list[tuple[int, int]]]) -> None:
        """Hybrid prefix caching: each prompt row cut at its snapshot boundaries into
        pieces, the state copied out after a piece that ends at one and copied in from
        the snapshot a cache hit resumes from. A row that restores a snapshot another
        row of this step writes (a hit on blocks scheduled in the same call) runs after
        that row in every layer."""
        batch = self.input_batch
        base = self.snapshot_base
        rows = list(range(num_decodes, batch.num_reqs()))
        writer = {snap: r for r in rows for _, snap in snapshots.get(batch.req_ids[r], ())}
        order, seen = [], set()

        def visit(r):  # depth first: the writer of a row's snapshot goes before it
            if r in seen:
                return
            seen.add(r)
            src = restores.get(batch.req_ids[r])
            if src is not None and writer.get(src, r) != r:
                visit(writer[src])
            order.append(r)

        for r in rows:
            visit(r)
        for r in order:
            rid = batch.req_ids[r]
            start, end, slot = int(query_start_loc[r]), int(query_start_loc[r + 1]), int(slots[r])
            src = restores.get(rid)
            if src is not None:
                meta.restore_before[len(meta.prefills)] = base + src
            row_start = start
            for boundary, snap in sorted(snapshots.get(rid, ())):
                cut = row_start + boundary - int(computed[r])
                if not start < cut <= end:
                    raise RuntimeError(f"snapshot boundary {boundary} of {rid} is outside "
                                       f"its chunk this step")
                meta.prefills.append((start, cut, slot))
                meta.snapshot_after[len(meta.prefills) - 1] = base + snap
                start = cut
            if end > start:
                meta.prefills.append((start, end, slot))

    def _state_decode_steps(self, nd: int, query_start_loc: np.ndarray, slots: np.ndarray):
        """Step j reads each row's state after its token j - 1 and writes the state after
        token j; which one the request keeps is decided by its accepted drafts."""
        batch = self.input_batch
        counts = np.diff(query_start_loc[:nd + 1])
        write = {}
        for r in range(nd):
            rid = batch.req_ids[r]
            write[rid] = self.state_slots.write_slots(rid, int(counts[r]))
        self._spec_write_slots = write
        dev = self.device
        steps = []
        for j in range(int(counts.max())):
            rows = np.nonzero(counts > j)[0]
            ws = [write[batch.req_ids[r]] for r in rows.tolist()]
            read = [int(slots[r]) if j == 0 else w[j - 1] for r, w in zip(rows.tolist(), ws)]
            steps.append((torch.from_numpy(query_start_loc[rows] + j).to(dev),
                          torch.tensor(read, dtype=torch.long, device=dev),
                          torch.tensor([w[j] for w in ws], dtype=torch.long, device=dev)))
        return steps
