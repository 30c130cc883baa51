"""Drafts from a draft model that reads the target's hidden states (EAGLE-3, MTP).

After a step is sampled, the drafter writes its K/V for every token of that step
(each position p takes the token at p + 1 and the target's hidden state at p; the
K/V go into the target's paged cache, as extra layers of its group), runs its full
forward at each proposing request's last position, then k - 1 more times over one
row per proposing request, each feeding back its previous draft and output hidden
state at the next position. A drafter without `write_kv` runs its full forward
over every token instead. Drafts are greedy: the draft
distribution is one-hot, so the rejection sampler verifies them losslessly as it
does n-gram drafts.
"""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.models.layers.attention import AttentionMetadata


class EagleProposer:
    def __init__(self, model, device: torch.device, max_model_len: int):
        self.model = model  # an EagleStyleDrafter (tokenmill/spec_decode/draft_model.py)
        self.device = device
        self.max_model_len = max_model_len

    def _draft_ids(self, runner, out: torch.Tensor) -> torch.Tensor:
        """Greedy drafts; through the runner's int8-screened greedy head (the same
        argmax, fewer bytes read) when the drafter uses the target's lm_head."""
        head = runner.greedy_head
        if (head is not None and getattr(self.model, "shares_target_lm_head", False)
                and out.shape[0] <= runner.greedy_head_max_rows):
            return head(out).long()
        return self.model.draft_token_ids(out)

    @torch.inference_mode()
    def propose(self, runner, hidden: torch.Tensor, meta: AttentionMetadata,
                max_drafts: np.ndarray) -> list[list[int]]:
        """hidden: the target's output of the step; meta: its attention metadata;
        max_drafts[r]: drafts wanted for batch row r (0: none). The batch already holds
        the step's emitted tokens (num_tokens_no_spec counts them)."""
        batch = runner.input_batch
        step = runner.last_step
        n = batch.num_reqs()
        dev = self.device
        qsl = step.query_start_loc
        counts = np.diff(qsl[:n + 1])
        req = np.repeat(np.arange(n), counts)
        positions = step.positions
        last_col = batch.token_ids_cpu.shape[1] - 1
        next_ids = batch.token_ids_cpu[req, np.minimum(positions + 1, last_col)]
        model = self.model
        target = runner.model.aux_hidden if model.aux_layer_ids else hidden
        ids_t = torch.from_numpy(next_ids.astype(np.int64)).to(dev)
        pos_t = torch.from_numpy(positions).to(dev)
        combined = model.combine_target_hidden(target)

        # The row of each proposing request's last emitted token's predecessor: its
        # input pairs (the emitted token, the target's state before it).
        num_tokens = batch.num_tokens_no_spec[:n].astype(np.int64)
        last_pos = num_tokens - 2
        first_pos = positions[np.minimum(qsl[:n], positions.size - 1)]
        offset = last_pos - first_pos
        # Never a position past max_model_len - 1 (the block table ends there).
        cap = np.minimum(max_drafts, self.max_model_len - 1 - last_pos)
        rows = np.nonzero((cap > 0) & (offset >= 0) & (offset < counts))[0]
        drafts: list[list[int]] = [[] for _ in range(n)]
        flat = torch.from_numpy(qsl[rows] + offset[rows]).to(dev)
        if hasattr(model, "write_kv"):
            # Every token's K/V (later drafts attend to them), the full forward only at
            # the rows drafts start from, as one decode query each.
            model.write_kv(ids_t, pos_t, combined, meta)
            if rows.size == 0:
                return drafts
            out, h = model(ids_t[flat], pos_t[flat], combined[flat],
                           self._decode_meta(runner, rows, last_pos[rows]))
            tokens = [self._draft_ids(runner, out)]
        else:
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

    def remove(self, req_id: str) -> None:
        """Nothing per request: the drafter's K/V lives in the target's paged cache."""

    def _decode_meta(self, runner, rows: np.ndarray, positions: np.ndarray) -> AttentionMetadata:
        """One decode query per row at `positions` (a draft step's own K/V slot)."""
        table = runner.input_batch.block_tables[runner.attn_group_id]
        bs = table.block_size
        dev = self.device
        block_ids = table.block_table[rows, positions // bs].astype(np.int64)
        nb = int(positions.max()) // bs + 1
        return AttentionMetadata(
            num_decodes=rows.size,
            slot_block=torch.from_numpy(block_ids).to(dev),
            slot_offset=torch.from_numpy(positions % bs).to(dev),
            native_ops=runner.native_ops,
            decode_block_table=torch.from_numpy(table.block_table[rows, :nb].copy()).to(dev),
            decode_seq_lens=torch.from_numpy((positions + 1).astype(np.int32)).to(dev))
