"""Drafts from a DFlash block-diffusion draft model (tokenmill/models/dflash.py).

After each step, the rows whose tokens the target kept (a prompt chunk's rows, a
verify step's last token and accepted drafts) append their tapped target hidden
states to the request's DFlash context; then one bidirectional block
[last emitted token, mask x k] per proposing request yields k drafts at once. The
context follows the request's accepted tokens only: a request that comes back
from preemption (its positions start over) is cut back to where it resumes. A
request that proposes nothing this step keeps its decode row waiting
(spec_decode/deferred.py): the row joins its context with the step it next
proposes from.
"""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.models.dflash import DFlashContext
from tokenmill.spec_decode.deferred import DeferredRows
from tokenmill.spec_decode.draft_model import target_greedy_head


class DFlashProposer:
    def __init__(self, model, device: torch.device, max_model_len: int):
        self.model = model
        self.context = DFlashContext(model)
        self.device = device
        self.max_model_len = max_model_len
        self.max_k = model.config.block_size - 1
        self.deferred = DeferredRows()

    @torch.inference_mode()
    def propose(self, runner, hidden: torch.Tensor, meta, max_drafts: np.ndarray
                ) -> list[list[int]]:
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
            if self.deferred.wait_all(batch.req_ids[:n], positions, aux):
                return [[] for _ in range(n)]
        req = np.repeat(np.arange(n), counts)
        num_tokens = batch.num_tokens_no_spec[:n].astype(np.int64)
        # Kept rows: every position before the request's last token (whose successor
        # the target has not produced yet).
        kept = positions <= num_tokens[req] - 2
        ctx = self.context
        req_ids = batch.req_ids[:n]
        last_pos = num_tokens - 1
        cap = np.minimum(np.minimum(max_drafts, self.max_k), self.max_model_len - 1 - last_pos)
        first_row = np.minimum(qsl[:n], positions.size - 1)
        # A request's one kept decode row waits unless it proposes now.
        one_kept = (counts == 1) & kept[first_row]
        waits, e_req, e_pos, e_hidden = self.deferred.step(
            req_ids, positions[first_row], counts, one_kept & (cap <= 0), aux, first_row)
        run = kept & ~waits[req]
        rows = np.nonzero(run)[0]
        # The rows joining the contexts now: each request's earlier (waiting) rows, then
        # its kept rows of this step, grouped by request.
        all_req = np.concatenate([e_req, req[rows]])
        all_pos = np.concatenate([e_pos, positions[rows]]).astype(np.int64)
        if all_req.size:
            order = np.lexsort((all_pos, all_req))
            all_req, all_pos = all_req[order], all_pos[order]
            step_hidden = aux[torch.from_numpy(rows).to(self.device)]
            src = step_hidden if e_hidden is None else torch.cat([e_hidden, step_hidden])
            num_kept = np.bincount(all_req, minlength=n)
            firsts = np.cumsum(num_kept) - num_kept
            for r in np.nonzero(num_kept)[0].tolist():
                end, first = ctx.end(req_ids[r]), int(all_pos[firsts[r]])
                if end is not None and end != first:  # resumed, or a gap (a prefix-cache hit)
                    if end > first:
                        ctx.truncate(req_ids[r], first)
                    else:
                        ctx.remove(req_ids[r])
            ctx.append_batch(req_ids, num_kept.tolist(), all_pos,
                             src[torch.from_numpy(order).to(self.device)])
        drafts: list[list[int]] = [[] for _ in range(n)]
        ready = [r for r in np.nonzero(cap > 0)[0].tolist() if ctx.end(req_ids[r]) == last_pos[r]]
        if not ready:
            return drafts
        rows = np.array(ready)
        last_ids = batch.token_ids_cpu[rows, last_pos[rows]].astype(np.int64)
        k = int(cap[rows].max())
        head = target_greedy_head(runner, self.model, rows.size * k)
        if head is not None:
            h = self.model.draft_hidden(ctx, [req_ids[r] for r in ready], last_ids,
                                        last_pos[rows], k)
            out = head(h).long().view(rows.size, k).to("cpu").tolist()
        else:
            out = self.model.propose(ctx, [req_ids[r] for r in ready], last_ids,
                                     last_pos[rows], k).to("cpu").tolist()
        for r, d in zip(ready, out):
            drafts[r] = d[:int(cap[r])]
        return drafts

    def remove(self, req_id: str) -> None:
        self.context.remove(req_id)
        self.deferred.remove(req_id)
