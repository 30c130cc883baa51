"""Drafts from a DFlash block-diffusion draft model (tokenmill/models/dflash.py).

After each step, the rows whose tokens the target kept (a prompt chunk's rows, a
verify step's last token and accepted drafts) write their context K/V (from the
tapped target hidden states) into the draft layers' paged KV cache, at the
request's slots; then one bidirectional block [last emitted token, mask x k] per
proposing request yields k drafts at once. The context is the cache: a request
that comes back from preemption rewrites its rows as it recomputes them, and one
whose prompt hit the prefix cache (or the external tier) finds the cached
prefix's context in the hit blocks, as a cold run wrote it. A request that
proposes nothing this step keeps its decode row waiting (spec_decode/deferred.py):
the row is written with the step it next proposes from.
"""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.spec_decode.deferred import DeferredRows, holds
from tokenmill.spec_decode.draft_model import target_greedy_head
from tokenmill.spec_decode.drafter import rows_in


class DFlashProposer:
    def __init__(self, model, device: torch.device, max_model_len: int):
        self.model = model
        self.device = device
        self.max_model_len = max_model_len
        self.max_k = model.config.block_size - 1
        self.deferred = DeferredRows()
        self.hold = holds(device, True)  # (its rows are always the target's taps)
        # Per request: the position after its last written context row. A block is
        # drafted only from a context that reaches its first position.
        self.context_end: dict[str, int] = {}

    def wait(self, runner, hidden: torch.Tensor, req_ids: list[str],
             skip: set[str] | None = None) -> list[list[int]] | None:
        """A step from which no request proposes: its decode rows wait (DeferredRows.
        wait_decodes; the rows of requests in `skip` are dropped); None: not such a
        step, and `propose` runs it."""
        return self.deferred.wait_decodes(runner, req_ids, runner.model.aux_hidden, self.hold,
                                          skip)

    @torch.inference_mode()
    def propose(self, runner, hidden: torch.Tensor, meta, max_drafts: np.ndarray,
                skip: set[str] | None = None) -> list[list[int]]:
        """As EagleProposer.propose: `skip` the requests whose rows are dropped."""
        batch = runner.input_batch
        step = runner.last_step
        n = batch.num_reqs()
        qsl = step.query_start_loc
        counts = np.diff(qsl[:n + 1])
        positions = step.positions
        aux = runner.model.aux_hidden
        if not max_drafts.any() and (counts == 1).all():
            # A decode-only step that proposes nothing: each request's one row (kept:
            # its successor was just sampled) waits, as cheaply as can be.
            if self.deferred.wait_all(batch.req_ids[:n], positions, aux, self.hold, skip):
                return [[] for _ in range(n)]
        req = np.repeat(np.arange(n), counts)
        num_tokens = batch.num_tokens_no_spec[:n].astype(np.int64)
        # Kept rows: every position before the request's last token (whose successor
        # the target has not produced yet).
        kept = positions <= num_tokens[req] - 2
        req_ids = batch.req_ids[:n]
        last_pos = num_tokens - 1
        cap = np.minimum(np.minimum(max_drafts, self.max_k), self.max_model_len - 1 - last_pos)
        first_row = np.minimum(qsl[:n], positions.size - 1)
        # A request's one kept row (a decode row, or a verification that accepted
        # nothing) waits unless it proposes now.
        num_kept = np.clip(num_tokens - 1 - positions[first_row], 0, counts)
        dropped = rows_in(req_ids, skip)
        waits, e_req, e_pos, e_hidden = self.deferred.step(
            req_ids, positions[first_row], counts if dropped is None else
            np.where(dropped, 0, counts), cap <= 0, aux, first_row, num_kept)
        rows = np.nonzero(kept & ~(waits if dropped is None else waits | dropped)[req])[0]
        # The rows whose context is written now: each request's earlier (waiting) rows,
        # then its kept rows of this step.
        all_req = np.concatenate([e_req, req[rows]])
        all_pos = np.concatenate([e_pos, positions[rows]]).astype(np.int64)
        if all_req.size:
            step_hidden = aux[torch.from_numpy(rows).to(self.device)]
            src = step_hidden if e_hidden is None else torch.cat([e_hidden, step_hidden])
            meta = _by_draft_group(runner, lambda builder, table: {
                None: builder.write_only(table, all_req, all_pos)})[None]
            self.model.write_context(src, torch.from_numpy(all_pos).to(self.device), meta)
            end = np.full(n, -1, dtype=np.int64)
            np.maximum.at(end, all_req, all_pos + 1)
            for r in np.nonzero(end >= 0)[0].tolist():
                self.context_end[req_ids[r]] = int(end[r])
        drafts: list[list[int]] = [[] for _ in range(n)]
        ready = [r for r in np.nonzero(cap > 0)[0].tolist()
                 if self.context_end.get(req_ids[r]) == last_pos[r]]
        if not ready:
            return drafts
        rows = np.array(ready)
        last_ids = batch.token_ids_cpu[rows, last_pos[rows]].astype(np.int64)
        k = int(cap[rows].max())
        metas = self._block_metas(runner, rows, last_pos[rows], k)
        head = target_greedy_head(runner, self.model, rows.size * k)
        if head is not None:
            h = self.model.draft_hidden(last_ids, last_pos[rows], k, metas)
            out = head(h).long().view(rows.size, k).to("cpu").tolist()
        else:
            out = self.model.propose(last_ids, last_pos[rows], k, metas).to("cpu").tolist()
        for r, d in zip(ready, out):
            drafts[r] = d[:int(cap[r])]
        return drafts

    def _block_metas(self, runner, rows: np.ndarray, positions: np.ndarray, k: int):
        """The blocks' metadata (batch rows `rows`, first positions `positions`), built by
        the builders of the draft layers' KV cache groups."""
        return _by_draft_group(runner, lambda builder, table: self.model.block_metas(
            builder, table, rows, positions, k))

    @torch.inference_mode()
    def flush(self, runner, req_ids: list[str]) -> None:
        """Write the context of these requests' waiting rows in full blocks now: they
        finish or are preempted, and with prefix caching their blocks may be hit
        (DeferredRows.take_cached). A preempted request's context is rebuilt as it
        recomputes: its end is forgotten."""
        req, pos, hidden = self.deferred.take_cached(runner, req_ids)
        for rid in req_ids:
            self.context_end.pop(rid, None)
        if hidden is None:
            return
        meta = _by_draft_group(runner, lambda builder, table: {
            None: builder.write_only(table, req, pos)})[None]
        self.model.write_context(hidden, torch.from_numpy(pos).to(self.device), meta)

    def remove(self, req_id: str) -> None:
        """The context lives in the paged cache; only the bookkeeping and waiting rows."""
        self.context_end.pop(req_id, None)
        self.deferred.remove(req_id)


def _by_draft_group(runner, build) -> dict:
    """build(builder, block table) -> {key: metadata} for each KV cache group the draft
    layers are in, each by its group's builder and block table; -> {key: metadata}
    that each layer reads its own group's from (AttentionMetadata.by_group). One group
    unless the draft layers' spec differs from the target's (their own groups, cut to
    the smallest group's size: tensor parallelism, where rank 0's drafter is whole)."""
    gids = runner.draft_group_ids or [runner.draft_group_id]
    per = {gid: build(runner.attn_builders[gid], runner.input_batch.block_tables[gid])
           for gid in gids}
    out = per[gids[0]]
    if len(gids) > 1:
        for key, meta in out.items():
            meta.by_group = {gid: per[gid][key] for gid in gids}
    return out
