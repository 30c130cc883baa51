"""The model runner's sampling concern: prompt logprobs, the compact grammar bitmask
mapped onto the batch's rows, `sample_tokens` (on-device sampling or the greedy
head's ids, the step's checks, the write-back into the batch, the drafter's proposals)
and the sampling metadata. A mixin of `ModelRunner` (worker/model_runner.py), whose
constructor sets the attributes it reads; draft verification is runner_spec.py's."""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.core.sched_output import (GrammarOutput, LogprobsLists, ModelRunnerOutput,
                                         SchedulerOutput)
from tokenmill.sample.sampler import gather_logprobs, greedy_argmax
from tokenmill.worker import step_checks


# Up to this many rows the one-token write-back stores element by element.
WRITE_BACK_LOOP_ROWS = 8


class SamplingMixin:
    def _greedy_head_applies(self, so: SchedulerOutput, num_rows: int) -> bool:
        """Whether argmax of the raw logits is all this step samples, at a size where
        the screened lm_head pays and gives the packed kernel's logits (layers/linear_methods/)."""
        return (self.greedy_head is not None
                and num_rows <= self.greedy_head_max_rows
                and self.input_batch.all_plain_greedy())

    def _compute_prompt_logprobs(self, hidden: torch.Tensor, so: SchedulerOutput) -> None:
        """Logprobs of each prompt token given the tokens before it, for the requests
        that asked, over the prompt positions of this step's chunk."""
        self._prompt_logprobs_ready = {}
        if not self._prompt_logprobs_reqs:
            return
        batch = self.input_batch
        step = self.last_step
        for rid in list(self._prompt_logprobs_reqs):
            r = batch.req_id_to_index.get(rid)
            if r is None:  # not scheduled this step
                continue
            state = self.requests[rid]
            k = state.sampling_params.prompt_logprobs
            num_prompt = len(state.prompt_token_ids)
            start = int(step.seq_lens[r]) - so.num_scheduled_tokens[rid]
            end = int(step.seq_lens[r])
            if state.prompt_logprobs is None:
                state.prompt_logprobs = (np.zeros((num_prompt - 1, 1 + k), dtype=np.int64),
                                         np.zeros((num_prompt - 1, 1 + k), dtype=np.float32),
                                         np.zeros(num_prompt - 1, dtype=np.int64))
            # Position p predicts prompt token p + 1.
            lo, hi = start, min(end, num_prompt - 1)
            if hi > lo:
                flat = int(step.query_start_loc[r]) + self._arange_upto(hi - start)[lo - start:]
                logits = self.model.compute_logits(hidden[torch.from_numpy(flat).to(self.device)])
                targets = torch.tensor(state.prompt_token_ids[lo + 1:hi + 1], device=self.device)
                got = gather_logprobs(logits.float().log_softmax(dim=-1), k, targets,
                                      self.platform.ops)
                ids, lps, ranks = state.prompt_logprobs
                ids[lo:hi] = got.token_ids.cpu().numpy()
                lps[lo:hi] = got.logprobs.cpu().numpy()
                ranks[lo:hi] = got.ranks.cpu().numpy()
            if end >= num_prompt:
                self._prompt_logprobs_ready[rid] = LogprobsLists(*state.prompt_logprobs)
                state.prompt_logprobs, state.prompt_logprobs_sent = None, True
                self._prompt_logprobs_reqs.discard(rid)

    # ---- structured output -------------------------------------------------------
    def _grammar_bitmask_rows(self, cu_num_logits: np.ndarray | None = None):
        """The step's compact grammar bitmask (the GrammarOutput sample_tokens() got) and,
        per row, its row in the batch (the reference's struct_out_req_batch_indices), on
        the device; None without one. With `cu_num_logits` (a step verifying drafts) a
        request's rows map onto its logits rows instead: one per verified position
        (StructuredOutputManager)."""
        grammar = self._grammar
        if grammar is None or not grammar.structured_output_request_ids:
            return None
        index = self.input_batch.req_id_to_index
        compact, dense = [], []
        for rid, row in grammar.structured_output_request_ids.items():
            r = index.get(rid)
            if r is None:
                continue
            if cu_num_logits is None:
                compact.append(row)
                dense.append(r)
            else:
                start, num = int(cu_num_logits[r]), int(cu_num_logits[r + 1] - cu_num_logits[r])
                compact += range(row, row + num)
                dense += range(start, start + num)
        if not dense:
            return None
        bitmask = grammar.grammar_bitmask
        if compact != list(range(bitmask.shape[0])):
            bitmask = bitmask[compact]
        dev = self.device
        return (torch.tensor(dense, dtype=torch.long, device=dev),
                torch.from_numpy(np.ascontiguousarray(bitmask)).to(dev))

    # ---- step, part 2 ------------------------------------------------------------
    @torch.inference_mode()
    def sample_tokens(self, grammar: GrammarOutput | None = None) -> ModelRunnerOutput:
        """Sample the step execute_model() ran; `grammar`: its grammar bitmask, built by
        the engine once the tokens before it were accepted (None: no structured request)."""
        self._grammar = grammar
        try:
            return self._attach_pooled(self._sample_tokens())
        finally:
            self._grammar = None
            self.flush_kv_save()  # (after the drafter wrote its rows of the step)

    def _sample_tokens(self) -> ModelRunnerOutput:
        batch = self.input_batch
        n = batch.num_reqs()
        req_ids = list(batch.req_ids[:n])
        req_id_to_index = {rid: i for i, rid in enumerate(req_ids)}
        if self._pending is None:
            return ModelRunnerOutput(req_ids, req_id_to_index, [[] for _ in range(n)])
        prompt_logprobs, self._prompt_logprobs_ready = self._prompt_logprobs_ready, {}
        logits, discard, sampled = self._pending
        self._pending = None
        step_checks.sampler_fault(req_ids, self.requests)
        step = self.last_step
        # The one-token-a-row step where every row keeps its token (no error to report:
        # the checks' conditions tested directly) takes the write-back without the masks.
        # Its tests run on Python lists: after the forward streamed the weights, each
        # numpy reduction costs tens of microseconds in cache misses, a list a few.
        fast = self.fast_paths and n and step.cu_num_logits is None
        if fast and sampled is not None and self._pending_nonfinite_hidden is None:
            # The greedy head's ids, its rows surely finite: no numpy at all.
            flat_list = sampled.tolist()
            if (min(flat_list) >= 0 and max(flat_list) < self.greedy_head.lm_head.out_features
                    and True not in discard.tolist()):
                out = self._write_back_one(n, None, flat_list, req_ids)
                return self._runner_output(req_ids, req_id_to_index, out, None,
                                           prompt_logprobs, {}, None)
        if step.cu_num_logits is not None:
            if self.fast_paths and 0 < n <= WRITE_BACK_LOOP_ROWS:
                out = self._verify_greedy_small(n, logits, sampled, discard, req_ids)
                if out is not None:
                    return self._runner_output(req_ids, req_id_to_index, out, None,
                                               prompt_logprobs, {}, None)
            tokens, num_emitted, logprobs, nan_rows, vocab = self._verify_drafts(
                logits, sampled, discard)
        else:
            tokens, logprobs, nan_rows, vocab = self._sample_one(logits, sampled, discard)
            flat_list = tokens[:, 0].tolist()
            if (fast and min(flat_list) >= 0 and max(flat_list) < vocab
                    and True not in discard.tolist()
                    and (nan_rows is None or True not in nan_rows.tolist())):
                out = self._write_back_one(n, tokens[:, 0], flat_list, req_ids)
                return self._runner_output(req_ids, req_id_to_index, out, logprobs,
                                           prompt_logprobs, {}, None)
            num_emitted = self._ones_upto(n)
        errored = step_checks.check_sampled(req_ids, discard, nan_rows, tokens, num_emitted, vocab)
        keep = ~discard
        if errored:
            keep &= ~np.isin(np.arange(n), [req_id_to_index[rid] for rid in errored])
        num_emitted = np.where(keep, num_emitted, 0)
        if step.cu_num_logits is not None and logprobs is not None:
            logprobs = self._emitted_logprobs(logprobs, tokens, num_emitted)
        # Write back into the batch, vectorised over the rows that keep their tokens.
        if step.cu_num_logits is None and keep.all():  # one token each, every row keeps it
            out = self._write_back_one(n, tokens[:, 0], tokens[:, 0].tolist(), req_ids)
        else:
            total = int(num_emitted.sum())
            rows = np.repeat(np.arange(n), num_emitted)
            j = self._arange_upto(total) - np.repeat(np.cumsum(num_emitted) - num_emitted,
                                                     num_emitted)
            flat = tokens[rows, j]
            batch.token_ids_cpu[rows, batch.num_tokens_no_spec[rows] + j] = flat
            batch.num_tokens_no_spec[:n] += num_emitted.astype(batch.num_tokens_no_spec.dtype)
            out = [[] for _ in range(n)]
            flat_list = flat.tolist()
            pos = 0
            for r in np.nonzero(num_emitted)[0].tolist():
                e = int(num_emitted[r])
                out[r] = flat_list[pos:pos + e]
                pos += e
                self.requests[req_ids[r]].output_token_ids.extend(out[r])
        return self._runner_output(req_ids, req_id_to_index, out, logprobs, prompt_logprobs,
                                   errored, keep)

    def _write_back_one(self, n: int, flat: np.ndarray | None, flat_list: list[int],
                        req_ids: list[str]) -> list[list[int]]:
        """Row r's one sampled token flat_list[r] (`flat`: the same as an array, or None)
        appended to its row of the batch (every row keeps its token); the per-row token
        lists of the output."""
        batch = self.input_batch
        if n <= WRITE_BACK_LOOP_ROWS:  # a few element stores beat two numpy calls' misses
            ids, counts = batch.token_ids_cpu, batch.num_tokens_no_spec
            for r, t in enumerate(flat_list):
                c = int(counts[r])
                ids[r, c] = t
                counts[r] = c + 1
        else:
            batch.token_ids_cpu[self._arange_upto(n), batch.num_tokens_no_spec[:n]] = (
                flat if flat is not None else flat_list)
            batch.num_tokens_no_spec[:n] += 1
        out = [[t] for t in flat_list]
        requests = self.requests
        for rid, toks in zip(req_ids, out):
            requests[rid].output_token_ids += toks
        return out

    def _runner_output(self, req_ids, req_id_to_index, out, logprobs, prompt_logprobs,
                       errored, keep: np.ndarray | None) -> ModelRunnerOutput:
        """The step's ModelRunnerOutput, after the drafter proposed for the rows that
        `keep` their tokens (None: every row)."""
        batch = self.input_batch
        n = len(req_ids)
        step = self.last_step
        spec_token_ids = None
        if self._drafter_off:  # every request's drafts suspended: nothing to propose
            spec_token_ids = [[] for _ in range(n)]
            self._step_hidden = self._step_meta = None
        elif self.drafter is not None:
            # Processors read the tokens before each position; verifying drafts would
            # need them per position: such requests go without drafts.
            if keep is None and batch.all_plain_greedy():
                eligible = self._all_rows[:n]  # (the cached answer: numpy costs us here)
            else:
                eligible = ~batch.needs_processors[:n]
                if keep is not None:
                    eligible &= keep
            if self.drafter.model_proposer is not None:
                spec_token_ids = self.drafter.propose_with_model(
                    self, self._step_hidden, self._step_meta, req_ids, eligible)
                self._step_hidden = self._step_meta = None
            else:
                spec_token_ids = self.drafter.propose(req_ids, batch.token_ids_cpu,
                                                      batch.num_tokens_no_spec[:n], eligible,
                                                      batch.req_id_to_index)
            if self.keep_own_drafts:  # for an async step's draft slots (the scheduler
                for r, drafts in enumerate(spec_token_ids):  # never sees them)
                    if drafts:
                        self._next_drafts[req_ids[r]] = (int(batch.num_tokens_no_spec[r]),
                                                         drafts)
                    else:
                        self._next_drafts.pop(req_ids[r], None)
        return ModelRunnerOutput(
            req_ids, req_id_to_index, out, logprobs, prompt_logprobs, errored, spec_token_ids,
            self._kv_invalid_block_ids,
            step.num_drafts.tolist() if step.cu_num_logits is not None else None,
            draft_record_poor=self.drafter.poor_record() if self._reports_record else None,
            draft_record_promising=(self.drafter.promising_record() if self._reports_record
                                    else None))

    def _emitted_logprobs(self, pending, tokens: np.ndarray,
                          num_emitted: np.ndarray) -> LogprobsLists:
        """Logprobs of each row's emitted tokens (row r's token j was chosen at its logits
        row cu[r] + j); a row that emits nothing gets one row, as without speculation."""
        raw, k = pending
        cu = self.last_step.cu_num_logits
        counts = np.maximum(num_emitted, 1)
        total = int(counts.sum())
        req = np.repeat(np.arange(counts.size), counts)
        j = self._arange_upto(total) - np.repeat(np.cumsum(counts) - counts, counts)
        dev = self.device
        # (clipped: an errored row's garbage id must not index past the vocabulary)
        chosen = np.clip(tokens[req, j], 0, raw.shape[1] - 1)
        got = gather_logprobs(raw[torch.from_numpy(cu[:-1][req] + j).to(dev)], k,
                              torch.from_numpy(chosen).to(dev), self.platform.ops)
        return LogprobsLists(got.token_ids.cpu().numpy(), got.logprobs.cpu().numpy(),
                             got.ranks.cpu().numpy())

    def _sample_one(self, logits, sampled, discard):
        """One token per row: (tokens [n, 1], logprobs, NaN rows or None (none),
        vocabulary size)."""
        logprobs = None
        if sampled is not None:  # the greedy lm_head sampled already
            nonfinite = self._pending_nonfinite_hidden
            nan_rows = None if nonfinite is None else self._to_host(nonfinite)  # (None: none)
            vocab = self.greedy_head.lm_head.out_features
            sampled_np = self._to_host(sampled if sampled.dtype == torch.int64
                                       else sampled.to(torch.int64))
        else:
            # A row whose logits hold NaN (an overflow in this request's activations)
            # samples garbage: that request is failed, never given token 0.
            vocab = logits.shape[1]
            sampler_out = None
            if logits.device.type == "cpu" and self.input_batch.all_plain_greedy():
                # Argmax of the raw logits is all this step samples: one pass in their
                # own dtype gives it and the NaN rows (no widened copy).
                ids, nan_rows = greedy_argmax(logits, self.platform.ops)
            else:
                # (amax propagates NaN: one vectorised pass, a tenth of isnan().any())
                nan_rows = torch.isnan(logits.amax(dim=1))
                md = self._sampling_metadata(discard)
                sampler_out = self.sampler(logits.float(), md)
                ids = sampler_out.sampled_token_ids
            ids = ids.to(torch.int64)
            if ids.device.type != "cpu":  # one device -> host copy for the ids and flags
                both = torch.stack([ids.view(-1), nan_rows.to(torch.int64)]).cpu().numpy()
                ids, nan_rows = torch.from_numpy(both[0]), torch.from_numpy(both[1] != 0)
            sampled_np = ids.numpy()
            if sampler_out is not None and sampler_out.logprobs is not None:
                lt = sampler_out.logprobs
                logprobs = LogprobsLists(lt.token_ids.cpu().numpy(), lt.logprobs.cpu().numpy(),
                                         lt.ranks.cpu().numpy())
            nan_rows = self._to_host(nan_rows)
        return sampled_np.reshape(-1, 1), logprobs, nan_rows, vocab

    def _sampling_metadata(self, discard: np.ndarray, cu_num_logits: np.ndarray | None = None):
        md = self.input_batch.make_sampling_metadata()
        md.grammar_bitmask = self._grammar_bitmask_rows(cu_num_logits)
        # A row still in its prompt samples nothing: its seeded generator must not advance.
        for r in np.nonzero(discard)[0].tolist():
            md.generators.pop(r, None)
        return md
