"""The model runner's draft-verification concern: a step whose rows carry drafts is
verified against the target's logits rows (greedy argmax, or the lossless rejection
sampler with the grammar mask and processors applied), the acceptance counted, and a
hybrid model's requests moved onto the state slot of their last accepted token; under
async scheduling, the runner's own drafts put into the step's draft slots. A mixin of
`ModelRunner` (worker/model_runner.py)."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from tokenmill.core.sched_output import SchedulerOutput
from tokenmill.sample.bitmask import apply_grammar_bitmask
from tokenmill.sample.sampler import apply_processors
from tokenmill.spec_decode.verify import verify_greedy


class DraftVerifyMixin:
    def _fill_spec_slots(self, so: SchedulerOutput) -> SchedulerOutput:
        """Async scheduling: the step as this runner runs it. Each row with draft slots
        takes the drafts proposed after its last step (kept in `_next_drafts`, valid
        while the request still has the tokens they follow), at most as many as its
        slots, and runs only its decode token and those: the slots past them are
        reserved but never written. `so` itself is left as the scheduler made it."""
        batch = self.input_batch
        num_sched = dict(so.num_scheduled_tokens)
        spec = dict(so.scheduled_spec_decode_tokens)
        for rid, slots in so.scheduled_spec_slots.items():
            num_sched[rid] -= slots
            kept = self._next_drafts.pop(rid, None)
            r = batch.req_id_to_index[rid]
            if kept is not None and kept[0] == int(batch.num_tokens_no_spec[r]) and kept[1]:
                spec[rid] = kept[1][:slots]
                num_sched[rid] += len(spec[rid])
        return dataclasses.replace(so, num_scheduled_tokens=num_sched,
                                   total_num_scheduled_tokens=sum(num_sched.values()),
                                   scheduled_spec_decode_tokens=spec, scheduled_spec_slots={})

    def _verify_greedy_small(self, n: int, logits: torch.Tensor | None,
                             sampled: torch.Tensor | None, discard: np.ndarray,
                             req_ids: list[str]) -> list[list[int]] | None:
        """The common verification of a small batch, on Python lists: every row plain
        greedy (the greedy head's ids `sampled`, or the argmax of `logits`: no logprobs,
        processors or grammar), none discarded, no NaN, no state slots (a hybrid model
        moves them), every id inside the vocabulary. Writes each row's emitted tokens
        into the batch and its request, counts the acceptance, and -> the tokens per
        row; None where any condition fails (nothing changed: `_verify_drafts` takes
        the step). The same result as that path, whose ~25 numpy calls after the
        forward cost ~150 us in cache misses at batch 1."""
        if self.state_slots is not None or True in discard.tolist():
            return None
        if sampled is not None:
            if self._pending_nonfinite_hidden is not None:
                return None
            vocab = self.greedy_head.lm_head.out_features
        else:
            if (not self.input_batch.all_plain_greedy() or self._grammar is not None
                    or bool(torch.isnan(logits.amax(dim=1)).any())):
                return None
            sampled, vocab = logits.argmax(dim=-1), logits.shape[1]
        target = sampled.tolist()
        if min(target) < 0 or max(target) >= vocab:
            return None
        step = self.last_step
        cu = step.cu_num_logits.tolist()
        num_drafts = step.num_drafts.tolist()
        batch = self.input_batch
        ids, counts = batch.token_ids_cpu, batch.num_tokens_no_spec
        requests = self.requests
        accepted = []
        for r in range(n):
            c, d, start = int(counts[r]), num_drafts[r], cu[r]
            # The drafts sit right after the row's real tokens (token_ids_cpu).
            drafts = ids[r, c:c + d].tolist()
            a = 0
            while a < d and drafts[a] == target[start + a]:
                a += 1
            accepted.append(a)
        # (before the batch advances, as _verify_drafts counts it)
        self.drafter.observe(req_ids, step.num_drafts, np.array(accepted, dtype=np.int64))
        out = []
        for r, a in enumerate(accepted):
            c, start = int(counts[r]), cu[r]
            emitted = target[start:start + a + 1]
            ids[r, c:c + a + 1] = emitted
            counts[r] = c + a + 1
            requests[req_ids[r]].output_token_ids.extend(emitted)
            out.append(emitted)
        return out

    def _verify_drafts(self, logits, sampled, discard):
        """A step with drafts: verify each row's drafts against the target's rows.

        Returns (tokens [n, 1 + max drafts]: row r emits tokens[r, :num_emitted[r]],
        num_emitted [n], (raw logprobs [T, V], top-k width) or None, per-row NaN flags,
        vocabulary size). Rows without drafts (and rows still
        in their prompt) sample their one token as the plain sampler would."""
        batch = self.input_batch
        step = self.last_step
        n = batch.num_reqs()
        cu = step.cu_num_logits
        num_drafts = step.num_drafts
        num_logits = int(cu[-1])
        # The drafts sit in token_ids_cpu right after each row's real tokens.
        draft_req = np.repeat(np.arange(n), num_drafts)
        draft_pos = (self._arange_upto(draft_req.size)
                     - np.repeat(cu[:-1] - np.arange(n), num_drafts))
        drafts = batch.token_ids_cpu[draft_req, batch.num_tokens_no_spec[draft_req] + draft_pos]
        drafts = drafts.astype(np.int64)
        logprobs = None
        md = None
        if sampled is not None:  # the greedy lm_head: argmax of every verified row
            target = sampled.to("cpu", dtype=torch.int64).numpy()
            nonfinite = self._pending_nonfinite_hidden
            nan_t = (np.zeros(sampled.shape[0], dtype=bool) if nonfinite is None
                     else nonfinite.to("cpu").numpy())
            vocab = self.greedy_head.lm_head.out_features
        else:
            nan_t = torch.isnan(logits.amax(dim=1)).to("cpu").numpy()
            vocab = logits.shape[1]
            md = self._sampling_metadata(discard, cu)
            if md.all_greedy and md.no_processors and md.grammar_bitmask is None \
                    and md.max_num_logprobs is None:
                target = logits.argmax(dim=-1).to("cpu", dtype=torch.int64).numpy()
                md = None
        if md is None:
            accepted = verify_greedy(target, drafts, cu)
            num_emitted = accepted + 1
            width = int(num_emitted.max())
            idx = np.minimum(cu[:-1, None] + np.arange(width), num_logits - 1)
            tokens = target[idx]
        else:
            logits = logits.float()
            raw = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
            # The grammar masks every verified position (its rows follow the drafts);
            # the processors act on each request's last row: a request with drafts has
            # none (the runner gives such requests no drafts).
            if md.grammar_bitmask is not None:
                logits = apply_grammar_bitmask(logits, *md.grammar_bitmask, self.platform.ops)
            if not md.no_processors:
                last = torch.from_numpy(cu[1:] - 1).to(self.device)
                logits = logits.clone()
                logits[last] = apply_processors(logits[last], md)
            result = self.rejection_sampler(
                logits, torch.from_numpy(cu).to(self.device),
                torch.from_numpy(drafts).to(self.device), md)
            tokens = result.token_ids.to("cpu").numpy()
            num_emitted = result.num_emitted.to("cpu").numpy().astype(np.int64)
            accepted = num_emitted - 1
            if raw is not None:  # gathered once the emitted tokens are final
                logprobs = (raw, md.max_num_logprobs)
        self.drafter.observe(batch.req_ids[:n], num_drafts, accepted)
        if self.state_slots is not None:  # each verifying row goes on from its accepted state
            for r in np.nonzero(num_drafts)[0].tolist():
                rid = batch.req_ids[r]
                self.state_slots.accept(rid, self._spec_write_slots[rid][int(accepted[r])])
        nan_rows = np.logical_or.reduceat(nan_t, cu[:-1]) if nan_t.size else nan_t
        return tokens, num_emitted, logprobs, nan_rows, vocab
