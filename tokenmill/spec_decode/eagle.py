"""Drafts from a draft model that reads the target's hidden states (EAGLE-3, MTP).

After a step is sampled, the drafter writes its K/V for every token of that step
(each position p takes the token at p + 1 and the target's hidden state at p; the
K/V go into the target's paged cache, as extra layers of its group), runs its full
forward at each proposing request's last position, then k - 1 more times over one
row per proposing request, each feeding back its previous draft and output hidden
state at the next position. A request that proposes nothing this step keeps its
decode row waiting (spec_decode/deferred.py): its K/V are written with the step it
next proposes from. A drafter without `write_kv` runs its full forward over every
token instead. Drafts are greedy: the draft
distribution is one-hot, so the rejection sampler verifies them losslessly as it
does n-gram drafts.
"""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.spec_decode.deferred import DeferredRows, holds
from tokenmill.spec_decode.draft_model import target_greedy_head
from tokenmill.spec_decode.drafter import rows_in


class EagleProposer:
    def __init__(self, model, device: torch.device, max_model_len: int):
        self.model = model  # an EagleStyleDrafter (tokenmill/spec_decode/draft_model.py)
        self.device = device
        self.max_model_len = max_model_len
        self.deferred = DeferredRows()
        # Rows wait by reference where they are the target's taps, on the CPU.
        self.hold = holds(device, bool(model.aux_layer_ids))

    def _draft_ids(self, runner, out: torch.Tensor) -> torch.Tensor:
        """Greedy drafts; through the runner's int8-screened greedy head (the same
        argmax, fewer bytes read) when the drafter uses the target's lm_head."""
        head = target_greedy_head(runner, self.model, out.shape[0])
        return head(out).long() if head is not None else self.model.draft_token_ids(out)

    def wait(self, runner, hidden: torch.Tensor, req_ids: list[str],
             skip: set[str] | None = None) -> list[list[int]] | None:
        """A step from which no request proposes: its decode rows wait (DeferredRows.
        wait_decodes; the rows of requests in `skip` are dropped); None: not such a
        step, or a drafter without write_kv (every token runs its full forward), and
        `propose` runs it."""
        model = self.model
        if not hasattr(model, "write_kv"):
            return None
        target = runner.model.aux_hidden if model.aux_layer_ids else hidden
        return self.deferred.wait_decodes(runner, req_ids, target, self.hold, skip)

    @torch.inference_mode()
    def propose(self, runner, hidden: torch.Tensor, meta: AttentionMetadata,
                max_drafts: np.ndarray, skip: set[str] | None = None) -> list[list[int]]:
        """hidden: the target's output of the step; meta: its attention metadata;
        max_drafts[r]: drafts wanted for batch row r (0: none); skip: requests whose
        rows are dropped, neither written nor kept (their drafts are suspended: they
        want none). The batch already holds the step's emitted tokens
        (num_tokens_no_spec counts them)."""
        batch = runner.input_batch
        step = runner.last_step
        n = batch.num_reqs()
        dev = self.device
        qsl = step.query_start_loc
        model = self.model
        target = runner.model.aux_hidden if model.aux_layer_ids else hidden
        counts = np.diff(qsl[:n + 1])
        if hasattr(model, "write_kv") and not max_drafts.any() and (counts == 1).all():
            # A decode-only step that proposes nothing (requests backing off, or a
            # batch too large to speculate): the rows wait, as cheaply as can be.
            if self.deferred.wait_all(batch.req_ids[:n], step.positions, target, self.hold,
                                      skip):
                return [[] for _ in range(n)]
        req = np.repeat(np.arange(n), counts)
        positions = step.positions
        last_col = batch.token_ids_cpu.shape[1] - 1
        next_ids = batch.token_ids_cpu[req, np.minimum(positions + 1, last_col)]
        ids_t = torch.from_numpy(next_ids.astype(np.int64)).to(dev)
        pos_t = torch.from_numpy(positions).to(dev)

        # The row of each proposing request's last emitted token's predecessor: its
        # input pairs (the emitted token, the target's state before it).
        num_tokens = batch.num_tokens_no_spec[:n].astype(np.int64)
        last_pos = num_tokens - 2
        first_row = np.minimum(qsl[:n], positions.size - 1)
        first_pos = positions[first_row]
        offset = last_pos - first_pos
        # Never a position past max_model_len - 1 (the block table ends there).
        cap = np.minimum(max_drafts, self.max_model_len - 1 - last_pos)
        rows = np.nonzero((cap > 0) & (offset >= 0) & (offset < counts))[0]
        drafts: list[list[int]] = [[] for _ in range(n)]
        flat_np = qsl[rows] + offset[rows]
        if hasattr(model, "write_kv"):
            # Every token's K/V (later drafts attend to them; a request that does not
            # propose now writes them later), the full forward only at the rows drafts
            # start from, as one decode query each.
            proposing = np.zeros(n, dtype=bool)
            proposing[rows] = True
            # (a verification that accepted nothing keeps one row: it may wait)
            kept = np.clip(offset + 1, 0, counts)
            dropped = rows_in(batch.req_ids[:n], skip)
            waits, e_req, e_pos, e_hidden = self.deferred.step(
                batch.req_ids[:n], first_pos, counts if dropped is None else
                np.where(dropped, 0, counts), ~proposing, target, first_row, kept)
            done = waits if dropped is None else waits | dropped  # (not to write now)
            if rows.size == 0 and e_req.size == 0 and done[req].all():
                return drafts  # every row waits: nothing to run now
            if not done.any() and e_req.size == 0:  # the whole step, as it is
                combined = model.combine_target_hidden(target)
                model.write_kv(ids_t, pos_t, combined, meta)
                flat = torch.from_numpy(flat_np).to(dev)
            else:
                ids_t, pos_t, combined, flat = self._write_kv_now(
                    runner, ~done[req], req, positions, next_ids, target,
                    e_req, e_pos, e_hidden, flat_np)
            if rows.size == 0:
                return drafts
            out, h = model(ids_t[flat], pos_t[flat], combined[flat],
                           self._decode_meta(runner, rows, last_pos[rows]))
            tokens = [self._draft_ids(runner, out)]
        else:
            flat = torch.from_numpy(flat_np).to(dev)
            combined = model.combine_target_hidden(target)
            out, next_hidden = model(ids_t, pos_t, combined, meta)
            if rows.size == 0:
                return drafts
            tokens = [self._draft_ids(runner, out[flat])]
            h = next_hidden[flat]
        pos = last_pos[rows]
        active = np.arange(rows.size)
        prev = tokens[0]  # the drafts of the active rows, fed back as the next inputs
        for j in range(1, int(cap[rows].max())):
            keep = np.nonzero(cap[rows[active]] > j)[0]
            keep_t = torch.from_numpy(keep).to(dev)
            active, h, ids = active[keep], h[keep_t], prev[keep_t]
            pos_j = pos[active] + j
            out, h = model(ids, torch.from_numpy(pos_j).to(dev), h,
                           self._decode_meta(runner, rows[active], pos_j))
            prev = self._draft_ids(runner, out)
            tokens.append((active, prev))
        first = tokens[0].to("cpu").tolist()
        for i, r in enumerate(rows.tolist()):
            drafts[r] = [first[i]]
        for act, ids in tokens[1:]:
            for i, t in zip(act.tolist(), ids.to("cpu").tolist()):
                drafts[int(rows[i])].append(t)
        return drafts

    def _write_kv_now(self, runner, run_now: np.ndarray, req: np.ndarray,
                      positions: np.ndarray, next_ids: np.ndarray, target: torch.Tensor,
                      e_req: np.ndarray, e_pos: np.ndarray, e_hidden: torch.Tensor | None,
                      flat: np.ndarray):
        """The K/V of the step rows that do not wait (run_now [T]) and of the earlier rows
        that waited (request e_req[i] at position e_pos[i], target state e_hidden[i]).
        -> (ids, positions, combined hidden) of those rows, earlier rows first, and the
        index there of each step row in `flat` (rows that propose never wait)."""
        dev = self.device
        step_rows = np.nonzero(run_now)[0]
        last_col = runner.input_batch.token_ids_cpu.shape[1] - 1
        e_ids = runner.input_batch.token_ids_cpu[e_req, np.minimum(e_pos + 1, last_col)]
        all_req = np.concatenate([e_req, req[step_rows]])
        all_pos = np.concatenate([e_pos, positions[step_rows]]).astype(np.int64)
        ids = torch.from_numpy(np.concatenate([e_ids, next_ids[step_rows]]).astype(np.int64)
                               ).to(dev)
        pos = torch.from_numpy(all_pos).to(dev)
        index = torch.from_numpy(e_req.size + np.searchsorted(step_rows, flat)).to(dev)
        rows_t = target[torch.from_numpy(step_rows).to(dev)]
        hidden = rows_t if e_hidden is None else torch.cat([e_hidden, rows_t])
        combined = self.model.combine_target_hidden(hidden)
        gid = runner.draft_group_id
        meta = runner.attn_builders[gid].write_only(runner.input_batch.block_tables[gid],
                                                    all_req, all_pos)
        self.model.write_kv(ids, pos, combined, meta)
        return ids, pos, combined, index

    @torch.inference_mode()
    def flush(self, runner, req_ids: list[str]) -> None:
        """Write the K/V of these requests' waiting rows in full blocks now: they finish
        or are preempted, and with prefix caching their blocks may be hit
        (DeferredRows.take_cached)."""
        req, pos, hidden = self.deferred.take_cached(runner, req_ids)
        if hidden is None:
            return
        dev = self.device
        batch = runner.input_batch
        ids = batch.token_ids_cpu[req, pos + 1].astype(np.int64)  # (pos + 1 was sampled)
        gid = runner.draft_group_id
        meta = runner.attn_builders[gid].write_only(batch.block_tables[gid], req, pos)
        self.model.write_kv(torch.from_numpy(ids).to(dev), torch.from_numpy(pos).to(dev),
                            self.model.combine_target_hidden(hidden), meta)

    def remove(self, req_id: str) -> None:
        """The drafter's K/V lives in the target's paged cache; only the rows that wait."""
        self.deferred.remove(req_id)

    def _decode_meta(self, runner, rows: np.ndarray, positions: np.ndarray) -> AttentionMetadata:
        """One decode query per row at `positions` (a draft step's own K/V slot), built
        by the builder of the drafter's KV cache group (its layers' backend's)."""
        gid = runner.draft_group_id
        return runner.attn_builders[gid].decodes(runner.input_batch.block_tables[gid], rows,
                                                 positions)

