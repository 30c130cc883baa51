"""Drafts from a DFlash block-diffusion draft model (tokenmill/models/dflash.py).

After each step, the rows whose tokens the target kept (a prompt chunk's rows, a
verify step's last token and accepted drafts) append their tapped target hidden
states to the request's DFlash context; then one bidirectional block
[last emitted token, mask x k] per proposing request yields k drafts at once. The
context follows the request's accepted tokens only: a request that comes back
from preemption (its positions start over) is cut back to where it resumes.
"""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.models.dflash import DFlashContext


class DFlashProposer:
    def __init__(self, model, device: torch.device, max_model_len: int):
        self.model = model
        self.context = DFlashContext(model)
        self.device = device
        self.max_model_len = max_model_len
        self.max_k = model.config.block_size - 1

    @torch.inference_mode()
    def propose(self, runner, hidden: torch.Tensor, meta, max_drafts: np.ndarray
                ) -> list[list[int]]:
        batch = runner.input_batch
        step = runner.last_step
        n = batch.num_reqs()
        qsl = step.query_start_loc
        counts = np.diff(qsl[:n + 1])
        req = np.repeat(np.arange(n), counts)
        positions = step.positions
        num_tokens = batch.num_tokens_no_spec[:n].astype(np.int64)
        # Kept rows: every position before the request's last token (whose successor
        # the target has not produced yet). They lead each request's rows.
        kept = positions <= num_tokens[req] - 2
        num_kept = np.bincount(req[kept], minlength=n)
        ctx = self.context
        req_ids = [batch.req_ids[r] for r in range(n)]
        for r in np.nonzero(num_kept)[0].tolist():
            end, first = ctx.end(req_ids[r]), int(positions[qsl[r]])
            if end is not None and end != first:  # resumed, or a gap (a prefix-cache hit)
                if end > first:
                    ctx.truncate(req_ids[r], first)
                else:
                    ctx.remove(req_ids[r])
        if kept.any():
            rows = np.nonzero(kept)[0]
            ctx.append_batch(req_ids, num_kept.tolist(), positions[rows],
                             runner.model.aux_hidden[torch.from_numpy(rows).to(self.device)])
        drafts: list[list[int]] = [[] for _ in range(n)]
        last_pos = num_tokens - 1
        cap = np.minimum(np.minimum(max_drafts, self.max_k), self.max_model_len - 1 - last_pos)
        ready = [r for r in np.nonzero(cap > 0)[0].tolist() if ctx.end(req_ids[r]) == last_pos[r]]
        if not ready:
            return drafts
        rows = np.array(ready)
        last_ids = batch.token_ids_cpu[rows, last_pos[rows]].astype(np.int64)
        out = self.model.propose(ctx, [req_ids[r] for r in ready], last_ids, last_pos[rows],
                                 int(cap[rows].max())).to("cpu").tolist()
        for r, d in zip(ready, out):
            drafts[r] = d[:int(cap[r])]
        return drafts

    def remove(self, req_id: str) -> None:
        self.context.remove(req_id)
