"""Continuous batching with chunked prefill and preemption by recompute.

Each step spends a token budget: running requests first (oldest first), then
waiting ones. There is no prefill or decode phase: a request simply has
`num_tokens - num_computed_tokens` tokens left to compute, and a step computes
as many of them as the budget allows (a prompt chunk, or one decode token).

Longer than 500 lines on purpose: admission, preemption, the async placeholders and
the connector's loads all move the same request counters and block lists, and their
invariants (ARCHITECTURE.md "Contracts and invariants") read best side by side.
"""
from __future__ import annotations

import dataclasses

from collections import deque
from dataclasses import dataclass

import numpy as np

from tokenmill import faults
from tokenmill.core.encoder_cache_manager import EncoderCacheManager
from tokenmill.core.block_pool import BlockPool
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_cache_spec import KVCacheConfig
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched_output import (CachedRequestData, LogprobsLists, ModelRunnerOutput,
                                         NewRequestData, SchedulerOutput, logprobs_row_starts)
from tokenmill.spec_decode.drafter import SCOUT_EVERY
from tokenmill.spec_decode.metrics import SpecDecodingStats

# A request suspended by load is resumed (recomputed, to draft) only when it may still
# decode at least this many tokens, and half as many as it holds: the recompute is a
# prefill of all its tokens (on a CPU each ~1/10-1/40 of a decode step), drafting saves a
# share of the decode steps left.
RESUME_MIN_TOKENS = 32


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    # Speculative decoding: the most drafts a request verifies per step (0: off).
    num_speculative_tokens: int = 0
    # Slots past a request's tokens that a draft model writes K/V into while proposing.
    num_lookahead_tokens: int = 0
    # A draft model whose K/V at p read the token at p + 1 (EAGLE-3, MTP): prefix
    # hits end a confirmed block short (KVCacheManager).
    draft_reads_next_token: bool = False
    # A draft model with adaptive k (EAGLE-3, MTP, DFlash): under a poor acceptance record
    # most new requests run without drafts (spec_decode/drafter.py, "suspended").
    suspend_drafts: bool = False
    # With suspend_drafts: requests in a batch from which none of them drafts (the CPU's
    # row budget, disable_by_batch_size); a request taken in when that many are already
    # in is suspended by load, and resumed once the batch drains. None: no such limit.
    draft_batch_limit: int | None = None
    # Async scheduling (set by the engine core): with speculation, a decode step
    # reserves draft slots the runner fills with its own drafts (_num_spec_slots).
    async_scheduling: bool = False
    # Multimodal: image tokens the encoder may take per step (vLLM's
    # max_num_encoder_input_tokens), and encoder output rows the runner may keep.
    max_num_encoder_input_tokens: int = 2048
    encoder_cache_size: int = 8192
    # Hybrid models with prefix caching: a recurrent-state snapshot every this many
    # prompt tokens (rounded to whole blocks), besides chunk ends and the prompt's end.
    state_snapshot_interval: int = 256


_WAIT = object()


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: LogprobsLists | None = None  # one row per new token
    prompt_logprobs: LogprobsLists | None = None  # once, when the prompt is done
    error: str | None = None  # finish_reason "error": what went wrong, for the client
    pooled: np.ndarray | None = None  # an embedding request's vector (float32), once

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_config: KVCacheConfig,
                 kv_connector=None):
        """`kv_connector`: the external KV tier's KVConnector (tokenmill.kv_connector),
        whose scheduler half this builds; None: no external tier."""
        self.config = config
        self.kv_cache_manager = KVCacheManager(kv_cache_config,
                                               bool(config.enable_prefix_caching),
                                               config.state_snapshot_interval,
                                               config.draft_reads_next_token)
        # The scheduler half of the KV connector: which blocks to load and store.
        self.connector = None
        if kv_connector is not None:
            from tokenmill.kv_connector.connector import KVConnectorScheduler
            self.connector = KVConnectorScheduler(kv_connector, kv_cache_config.block_size,
                                                  kv_cache_config.attention_group_id,
                                                  config.draft_reads_next_token)
            if self.kv_cache_manager.snapshots is not None:  # hybrids: states ride along
                self.connector.local_snapshot = self.kv_cache_manager.local_snapshot_slot
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished since the last schedule(): the runner drops their state.
        self._finished_req_ids: set[str] = set()
        # Requests whose state the runner holds (seen in an earlier step).
        self._known_to_runner: set[str] = set()
        self.num_preemptions = 0
        self.num_shared_prompt_blocks = 0
        # Requests failed outside update_from_output (their grammar, a fault in a step):
        # their final outputs, handed out with the next step's.
        self._failed_outputs: list[EngineCoreOutput] = []
        self.num_errors: dict[str, int] = {}  # requests failed, by reason
        self.num_aborted = 0
        # After a step failed: admit only the requests it put back (a retry), no new ones.
        # The engine core clears it once a step has run.
        self.admit_only_preempted = False
        # Known to the runner, but to be sent again as new (its batch was reset).
        self._resend_as_new: set[str] = set()
        self._has_state = kv_cache_config.state_group_id is not None
        self.spec_stats = (SpecDecodingStats(config.num_speculative_tokens)
                           if config.num_speculative_tokens else None)
        # The draft model's record as the runner last reported it, and the requests taken
        # in under a poor one (every SCOUT_EVERY-th of them still drafts).
        self._draft_record_poor = False
        self._draft_record_promising = False
        self._num_admitted_poor = 0
        self.num_draft_resumes = 0  # requests suspended by load, recomputed to draft
        self.encoder_cache = EncoderCacheManager(config.encoder_cache_size)

    # ---- requests in and out -------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _suspend_drafts(self, req: Request, others: int) -> None:
        """Decided once, when the scheduler first looks at a new request to take it in
        (before its first block hash, which marks it: spec_decode/drafter.py), with
        `others` requests running or waiting beside it: from draft_batch_limit of them
        (a batch none of whose requests drafts), or under a poor drafting record, most
        new requests go without drafts. Never a seeded sampling request (its draws
        follow its drafts: a rerun must draft the same); an n > 1 sibling follows the
        request whose prompt blocks it takes."""
        req.drafts_decided = True
        if not self.config.suspend_drafts or req.pooling_params is not None:
            return
        sp = req.sampling_params
        if sp.seed is not None and not sp.greedy:
            return
        donor = (self.requests.get(req.share_prompt_with)
                 if req.share_prompt_with is not None else None)
        if donor is not None:
            req.drafts_suspended = donor.drafts_suspended
            req.suspended_by_load = donor.suspended_by_load
            return
        limit = self.config.draft_batch_limit
        if limit is not None and others >= limit:
            req.drafts_suspended = req.suspended_by_load = True
            return
        if not self._draft_record_poor:
            return
        self._num_admitted_poor += 1
        req.drafts_suspended = self._num_admitted_poor % SCOUT_EVERY != 1

    def abort_requests(self, request_ids) -> list[str]:
        aborted = self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self.num_aborted += len(aborted)
        return aborted

    def finish_requests(self, request_ids, status: RequestStatus,
                        stop_reason: int | str | None = None) -> list[str]:
        """Finish live requests from outside (abort, a stop string found in the text)."""
        finished = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            self._remove_from_queues(req)
            req.stop_reason = stop_reason
            self._finish(req, status)
            finished.append(rid)
        return finished

    def fail_requests(self, failures: dict[str, tuple[str, str]], emit: bool = True) -> list[str]:
        """Finish live requests with an error: request id -> (reason, message). Their
        blocks are freed now; with `emit`, each gets a final output with finish_reason
        "error" (take_failed_outputs)."""
        failed = []
        for rid, (reason, message) in failures.items():
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            self._remove_from_queues(req)
            self._finish(req, RequestStatus.FINISHED_ERROR)
            self.num_errors[reason] = self.num_errors.get(reason, 0) + 1
            if emit:
                self._failed_outputs.append(EngineCoreOutput(rid, [], "error", error=message))
            failed.append(rid)
        return failed

    def take_failed_outputs(self) -> list[EngineCoreOutput]:
        outs, self._failed_outputs = self._failed_outputs, []
        return outs

    def requeue_all_for_retry(self, new_req_ids) -> list[str]:
        """After a step failed and its culprits were failed: every running request goes
        back to the front of the queue to be recomputed (preemption by recompute: the
        runner's state for them may be half-updated, a fresh start is always right).
        They are sent to the runner as new requests again (with their tokens so far), as
        are `new_req_ids`, which the failed step(s) may not have taken in. Tokens in
        flight are void."""
        requeued = [r.request_id for r in self.running]
        while self.running:
            self._preempt(self.running.pop())
        for req in self.requests.values():
            req.num_output_placeholders = 0
        if self.connector is not None:
            self.connector.forget_loads()  # (the failed steps' loads come back never)
        self._resend_as_new.update(r for r in requeued + list(new_req_ids) if r in self.requests)
        self.encoder_cache.reset()  # (a failed step may not have encoded what it was sent)
        self.kv_cache_manager.reset_state_snapshots()  # (nor written its state snapshots)
        self.admit_only_preempted = True
        return requeued

    def _remove_from_queues(self, req: Request) -> None:
        # Async scheduling: a request preempted while its last step was in flight
        # can finish from the waiting queue.
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.structured_output = None  # frees its grammar matcher
        self.kv_cache_manager.free(req)
        self._release_encoder(req)
        del self.requests[req.request_id]
        self._resend_as_new.discard(req.request_id)
        if req.request_id in self._known_to_runner:
            self._known_to_runner.discard(req.request_id)
            self._finished_req_ids.add(req.request_id)

    def take_finished_req_ids(self) -> set[str]:
        """Finished ids not yet passed to the runner (for flushing when idle)."""
        ids, self._finished_req_ids = self._finished_req_ids, set()
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ------------------------------------------------------------
    def _release_encoder(self, req: Request) -> None:
        if req.mm_features:  # (its entries stay cached while there is room)
            self.encoder_cache.release(req.request_id, [f.hash for f in req.mm_features])

    def _encoder_inputs(self, req: Request, start: int, num_new: int, budget: int):
        """The images the chunk [start, start + num_new) reads that are not encoded yet:
        (num_new, their indices, the encoder budget left). An image that does not fit
        the step's encoder budget (or the cache) ends the chunk before it (num_new 0:
        the request waits for a later step)."""
        inputs = []
        end = start + num_new
        cache = self.encoder_cache
        pending = 0  # rows of this chunk's new entries so far
        for i, f in enumerate(req.mm_features):
            if f.offset >= end:
                break
            if f.offset + f.length <= start or cache.has(f.hash) or \
                    any(req.mm_features[j].hash == f.hash for j in inputs):
                continue
            if f.length > budget or not cache.can_allocate(pending + f.length):
                # (without chunked prefill a prompt runs whole or waits)
                cut = max(0, f.offset - start) if self.config.enable_chunked_prefill else 0
                return cut, inputs, budget
            inputs.append(i)
            pending += f.length
            budget -= f.length
        return num_new, inputs, budget

    def _take_encoder_inputs(self, req: Request, start: int, end: int, inputs: list[int],
                             scheduled: dict[str, list[int]]) -> None:
        """The chunk is scheduled: its new images get cache entries, the cached ones a
        reference from this request."""
        cache = self.encoder_cache
        read = [f for f in req.mm_features if f.offset < end and start < f.offset + f.length]
        for f in read:  # references first: a new entry must not evict one this chunk reads
            if cache.has(f.hash):
                cache.add_ref(f.hash, req.request_id)
        for f in read:
            if not cache.has(f.hash):
                cache.allocate(f.hash, f.length, req.request_id)
        if inputs:
            scheduled[req.request_id] = inputs

    def _preempt(self, req: Request) -> None:
        self._requeue(req)
        req.num_preemptions += 1
        self.num_preemptions += 1

    def _requeue(self, req: Request) -> None:
        """Out of the running batch, its blocks freed: to be computed again from its first
        token, first in the queue."""
        self.kv_cache_manager.free(req)
        self._release_encoder(req)
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)

    def _resume_drafts(self, preempted: set[str]) -> None:
        """The batch has drained below draft_batch_limit under a promising record: a request
        suspended by load with a long enough budget left is computed again from its first
        token, now with the draft model's data (as a preemption recomputes, not counted
        as one), oldest first while the batch keeps a row for each drafting request's
        draft under the limit (the CPU's row budget: fewer, and none of them drafts).
        Sent to the runner as new, with its drafts on; rehashed without the suspended
        mark (its old blocks stay cached under it)."""
        n = len(self.running) + len(self.waiting)
        drafting = sum(not r.drafts_suspended for r in self.running) + sum(
            not r.drafts_suspended for r in self.waiting)
        for req in list(self.running):
            if n + drafting >= self.config.draft_batch_limit:
                return
            if not req.suspended_by_load or self._loading(req):
                continue
            out = len(req.output_token_ids)
            left = min(req.sampling_params.max_tokens - out,
                       self.config.max_model_len - req.num_tokens)
            # (its EOS unknown, expect it to decode about as many tokens as it has: a
            # long prompt with a short answer so far is not worth a recompute)
            if min(left, out) < max(RESUME_MIN_TOKENS, req.num_tokens // 2):
                continue
            self.running.remove(req)
            self._requeue(req)
            req.drafts_suspended = req.suspended_by_load = False
            req.block_hashes = []
            self._resend_as_new.add(req.request_id)
            preempted.add(req.request_id)
            self.num_draft_resumes += 1
            drafting += 1

    def _prompt_donor(self, req: Request):
        """The sibling whose prompt blocks `req` can take now, None to prefill
        alone, or _WAIT while that sibling's prompt is still being computed."""
        if req.share_prompt_with is None or req.num_computed_tokens or self._has_state:
            return None  # (a recurrent state cannot be shared: hybrids prefill each copy)
        if req.num_prompt_tokens - 1 < self.kv_cache_manager.block_size:
            return None  # not even one full block to share
        donor = self.requests.get(req.share_prompt_with)
        if donor is None or donor.is_finished:
            return None
        if self._loading(donor):
            return _WAIT  # its external blocks are not confirmed loaded yet
        # Its prompt KV is written once a step counted it computed and has run.
        if donor.status == RequestStatus.RUNNING and \
                donor.num_computed_tokens >= donor.num_prompt_tokens:
            return donor
        return _WAIT

    def _limit_reached_in_flight(self, req: Request) -> bool:
        """Its in-flight tokens already reach max_tokens or max_model_len: scheduling
        more would compute tokens past the end (the request finishes on update)."""
        if not req.num_output_placeholders:
            return False
        n = req.num_output_placeholders
        return (len(req.output_token_ids) + n >= req.sampling_params.max_tokens
                or req.num_tokens + n >= self.config.max_model_len)

    def _loading(self, req: Request) -> bool:
        """Blocks it holds are loaded by the external KV tier in a step that has not come
        back: it waits (async scheduling) - a failed load rolls it back, nothing may
        build on it."""
        return self.connector is not None and self.connector.is_loading(req.request_id)

    def _num_drafts(self, req: Request, num_new: int, budget: int) -> int:
        """How many of the request's drafts this step verifies: only with its one decode
        token, within the budget, and never so many that an all-accepted run would pass
        max_tokens or max_model_len (every accepted draft is emitted, plus one token)."""
        spec = req.spec_token_ids
        if not spec or num_new != 1 or req.num_output_placeholders:
            return 0
        room = min(req.sampling_params.max_tokens - len(req.output_token_ids),
                   self.config.max_model_len - req.num_tokens)
        return max(0, min(len(spec), budget - 1, room - 1))

    def _num_spec_slots(self, req: Request, num_new: int, budget: int) -> int:
        """Async scheduling: how many draft slots a decode step reserves. The step before
        may still be in flight, so neither its drafts nor its acceptance are known here:
        k slots are reserved (their KV blocks allocated, counted computed) and the
        runner, which runs steps in order, fills up to that many with the drafts it
        proposed after the step before (fewer, or none, is fine: an upper bound).
        Only the request's sampling token gets them, never so many that an
        all-accepted run, after every in-flight token, would pass max_tokens or
        max_model_len. A grammar request gets them too (its bitmask is built once the
        runner has filled them: EngineCore._grammar_bitmask_after_update); one whose
        logits processors leave it without drafts in the runner gets none."""
        if num_new != 1 or req.pooling_params is not None or req.drafts_suspended \
                or req.sampling_params.needs_processors:
            return 0
        n = req.num_output_placeholders
        if req.num_computed_tokens + 1 < req.num_tokens + n:
            return 0  # a prompt token that samples nothing
        if not n and not req.output_token_ids:
            return 0  # its prompt's last token: nothing was proposed yet
        room = min(req.sampling_params.max_tokens - len(req.output_token_ids) - n,
                   self.config.max_model_len - req.num_tokens - n)
        return max(0, min(self.config.num_speculative_tokens, budget - 1, room - 1))

    def _lookahead(self, req: Request, num_new: int) -> int:
        """Lookahead slots for a draft model, never past max_model_len."""
        n = self.config.num_lookahead_tokens
        if not n:
            return 0
        return max(0, min(n, self.config.max_model_len - req.num_computed_tokens - num_new))

    def _lookup_prefix(self, req: Request):
        """Prefix caching and the external KV tier, for a request with nothing computed:
        (cached blocks per group or None, their tokens, tokens the tier will load after them)."""
        kvm = self.kv_cache_manager
        if req.num_computed_tokens or not (kvm.enable_caching or self.connector is not None):
            return None, 0, 0
        if req.pooling_params is not None:
            # Mean and CLS pooling read every position's hidden state: computed from
            # scratch. Last-token pooling reads the last one only, which a prefix hit
            # (never the whole prompt) leaves to compute; the external tier is skipped
            # (a failed load would have to void a vector already pooled).
            if req.pooling_params.pooling_type != "LAST" or not kvm.enable_caching:
                return None, 0, 0
            hit, num_hit = kvm.get_computed_blocks(req)
            return hit, num_hit, 0
        hit, num_hit = kvm.get_computed_blocks(req)
        num_ext = 0
        if self.connector is not None:
            num_ext = self.connector.get_num_new_matched_tokens(req, num_hit)
            if num_ext and kvm.snapshots is not None and \
                    not kvm.external_restore_ok(req, num_hit + num_ext):
                num_ext = 0  # no snapshot slot to resume the recurrent state from now
        return hit, num_hit, num_ext

    def _take_prefix(self, req: Request, num_hit: int, num_ext: int) -> None:
        """After allocate_slots took them: the cached and loaded tokens count as computed
        (an n > 1 sibling's cache hit on its sibling's prompt counts as shared below)."""
        req.num_computed_tokens += num_hit + num_ext
        if self.connector is not None:
            kvm = self.kv_cache_manager
            block_ids = kvm.get_block_ids(req.request_id)
            self.connector.update_state_after_alloc(req, block_ids, num_hit, num_ext,
                                                    kvm.take_state_load(req.request_id))
            blocks, bs = block_ids[kvm.first_block_group], kvm.block_size
            if kvm.holds_loading(blocks[:num_hit // bs]):
                self.connector.mark_loading(req.request_id)  # it hit blocks this step loads
            kvm.mark_loading([b for b in blocks[num_hit // bs:(num_hit + num_ext) // bs]
                              if b != BlockPool.NULL_BLOCK])  # (a window's skipped blocks)

    @staticmethod
    def _grammar_ready(req: Request) -> bool:
        """Structured output: a request waits (others run) until its grammar is compiled."""
        return req.structured_output is None or req.structured_output.ready()

    def _undo_share(self, req: Request) -> None:
        if req.num_computed_tokens:
            self.kv_cache_manager.free(req)
            req.num_computed_tokens = 0

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted: set[str] = set()
        spec_tokens: dict[str, list[int]] = {}
        spec_slots: dict[str, int] = {}
        encoder_budget = self.config.max_num_encoder_input_tokens
        encoder_inputs: dict[str, list[int]] = {}
        limit = self.config.draft_batch_limit
        if limit is not None and self._draft_record_promising and \
                len(self.running) + len(self.waiting) < limit:
            self._resume_drafts(preempted)

        # 1. Running requests, oldest first; preempt the newest when blocks run out.
        async_spec = self.config.async_scheduling and self.config.num_speculative_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens + req.num_output_placeholders - req.num_computed_tokens,
                          budget)
            if num_new <= 0 or self._limit_reached_in_flight(req) or self._loading(req):
                i += 1
                continue
            num_new = self.kv_cache_manager.align_chunk(req, req.num_computed_tokens, num_new)
            enc = []
            if req.mm_features and req.num_computed_tokens < req.num_prompt_tokens:
                num_new, enc, enc_budget = self._encoder_inputs(
                    req, req.num_computed_tokens, num_new, encoder_budget)
                if num_new <= 0:
                    i += 1
                    continue
            num_drafts = (self._num_spec_slots(req, num_new, budget) if async_spec
                          else self._num_drafts(req, num_new, budget))
            num_new += num_drafts
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(
                    req, num_new, num_lookahead_tokens=self._lookahead(req, num_new))
                if new_blocks is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is req:
                    break
            if new_blocks is None:
                break
            if req.mm_features and req.num_computed_tokens < req.num_prompt_tokens:
                encoder_budget = enc_budget
                self._take_encoder_inputs(req, req.num_computed_tokens,
                                          req.num_computed_tokens + num_new, enc, encoder_inputs)
            if num_drafts and async_spec:
                spec_slots[req.request_id] = num_drafts
            elif num_drafts:
                spec_tokens[req.request_id] = req.spec_token_ids[:num_drafts]
            req.spec_token_ids = []  # verified now, or stale after this step
            cached.req_ids.append(req.request_id)
            cached.resumed_from_preemption.append(False)
            cached.new_block_ids.append(new_blocks if any(new_blocks) else None)
            cached.num_computed_tokens.append(req.num_computed_tokens)
            num_scheduled[req.request_id] = num_new
            budget -= num_new
            i += 1

        # 2. Waiting requests, in order, while nothing was preempted this step.
        # A request whose prompt a sibling is still prefilling is skipped, not waited on.
        w = 0
        while (not preempted and w < len(self.waiting) and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[w]
            if req.num_output_placeholders:  # preempted while its last step is in flight
                w += 1
                continue
            if self.admit_only_preempted and req.status != RequestStatus.PREEMPTED:
                w += 1
                continue
            if not req.drafts_decided:
                self._suspend_drafts(req, len(self.running) + len(self.waiting) - 1)
            if req.structured_output is not None and req.structured_output.ready() and \
                    req.structured_output.failed:  # never run it unconstrained
                self.fail_requests({req.request_id: ("grammar",
                                                     req.structured_output.failed)})
                continue
            donor = self._prompt_donor(req)
            if donor is _WAIT or not self._grammar_ready(req):
                w += 1
                continue
            if donor is not None and not self.kv_cache_manager.enable_caching:
                num_blocks = (req.num_prompt_tokens - 1) // self.kv_cache_manager.block_size
                req.num_computed_tokens = self.kv_cache_manager.share_prefix(
                    req, donor.request_id, num_blocks)
            hit, num_hit, num_ext = self._lookup_prefix(req)
            num_new = req.num_tokens - req.num_computed_tokens - num_hit - num_ext
            if num_new > budget and not self.config.enable_chunked_prefill:
                self._undo_share(req)
                break
            if num_hit and budget == 1 < num_new and \
                    self.kv_cache_manager.hit_snapshot_written_now(req, num_hit):
                # A one-token chunk runs with the decode rows, before the prompt row that
                # writes the snapshot it would resume from: it waits for a larger budget.
                self._undo_share(req)
                break
            num_new = min(num_new, budget)
            start = req.num_computed_tokens + num_hit + num_ext
            num_new = self.kv_cache_manager.align_chunk(req, start, num_new)
            enc = []
            if req.mm_features and start < req.num_prompt_tokens:
                num_new, enc, enc_budget = self._encoder_inputs(req, start, num_new,
                                                                encoder_budget)
                if num_new <= 0:  # its next image waits for a step with encoder budget
                    self._undo_share(req)
                    w += 1
                    continue
            new_blocks = self.kv_cache_manager.allocate_slots(
                req, num_new, hit, num_hit, num_ext,
                self._lookahead(req, num_hit + num_ext + num_new))
            if new_blocks is None:
                self._undo_share(req)
                break
            if hit is not None:
                self._take_prefix(req, num_hit, num_ext)
            if req.mm_features and start < req.num_prompt_tokens:
                encoder_budget = enc_budget
                self._take_encoder_inputs(req, start, start + num_new, enc, encoder_inputs)
            del self.waiting[w]
            if donor is not None:  # counted once the share holds (it is undone above if not)
                self.num_shared_prompt_blocks += (req.num_computed_tokens
                                                  // self.kv_cache_manager.block_size)
            resumed = req.status == RequestStatus.PREEMPTED
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.request_id in self._known_to_runner and \
                    req.request_id not in self._resend_as_new:
                cached.req_ids.append(req.request_id)
                cached.resumed_from_preemption.append(resumed)
                cached.new_block_ids.append(self.kv_cache_manager.get_block_ids(req.request_id))
                cached.num_computed_tokens.append(req.num_computed_tokens)
            else:
                new_reqs.append(NewRequestData(
                    req_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                    sampling_params=req.sampling_params,
                    block_ids=self.kv_cache_manager.get_block_ids(req.request_id),
                    num_computed_tokens=req.num_computed_tokens,
                    output_token_ids=list(req.output_token_ids),
                    mm_features=req.mm_features, pooling_params=req.pooling_params,
                    drafts_suspended=req.drafts_suspended))
                self._known_to_runner.add(req.request_id)
                self._resend_as_new.discard(req.request_id)
            num_scheduled[req.request_id] = num_new
            budget -= num_new

        restores, snapshots = self.kv_cache_manager.take_state_ops()
        out = SchedulerOutput(
            state_restores=restores, state_snapshots=snapshots,
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self._finished_req_ids, preempted_req_ids=preempted,
            scheduled_spec_decode_tokens=spec_tokens, scheduled_spec_slots=spec_slots,
            scheduled_encoder_inputs=encoder_inputs,
            free_encoder_hashes=self.encoder_cache.take_freed())
        self._finished_req_ids = set()
        # The tokens are now scheduled: count them as computed (vLLM V1 does the same).
        # A request whose chunk reaches its last token samples one: a placeholder until
        # update_from_output appends it (at once when synchronous, a step later when async);
        # with d drafts (or draft slots) it may emit up to 1 + d: as many placeholders.
        for rid, n in num_scheduled.items():
            req = self.requests[rid]
            req.num_computed_tokens += n
            if req.pooling_params is not None:
                continue  # samples nothing: no placeholder, never scheduled past its prompt
            if req.num_computed_tokens >= req.num_tokens + req.num_output_placeholders:
                req.num_output_placeholders = req.num_computed_tokens - req.num_tokens + 1
        if self.connector is not None:  # the one field known only now; then out is final
            out = dataclasses.replace(
                out, kv_connector_metadata=self.connector.build_connector_meta(out, self))
            self.kv_cache_manager.loading_scheduled()
        return out

    def _finish_kv_loads(self, so: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """The step's external loads came back. A block that did not load
        (`invalid_block_ids`) leaves the prefix cache, and each request of the step
        holding it (its loader, and those that hit it in the same schedule call) is
        computed again from that block: the runner sampled nothing for it, it keeps its
        blocks, and it was scheduled in no later step (`_loading`)."""
        kvm = self.kv_cache_manager
        invalid = runner_output.invalid_block_ids
        waited = self.connector.loads_returned(so)  # its loaders, and who hit their blocks
        redo: dict[str, int] = {}
        if invalid:
            for rid in waited:
                i = kvm.first_block_among(rid, invalid)
                if i is not None:
                    redo[rid] = i * kvm.block_size
            self.connector.loads_failed(so.kv_connector_metadata, invalid, redo)
        kvm.loads_done([b for load in so.kv_connector_metadata.loads for b in load.block_ids],
                       invalid)
        if self._has_state:
            kvm.state_loads_done(so.kv_connector_metadata.loads, invalid)
        for rid in waited:
            req = self.requests.get(rid)
            if req is None:
                continue
            idx = runner_output.req_id_to_index.get(rid)
            if idx is None or not runner_output.sampled_token_ids[idx]:
                # No token from this step, its only one in flight: a placeholder is void.
                req.num_output_placeholders = 0
            if rid in redo:
                req.spec_token_ids = []
                if self._has_state:
                    # Its blocks (and state snapshots) past the failure were computed
                    # over it: out of the prefix cache.
                    kvm.uncache_from(req, redo[rid])
                    kvm.drop_written_snapshots(req, so.state_snapshots.get(rid, ()), redo[rid])
                if (self._has_state or not kvm.window_intact(rid, redo[rid])) and \
                        req.status == RequestStatus.RUNNING:
                    # A sliding window's hit skipped blocks the recomputation would read,
                    # or a recurrent state cannot go back to the failed block: start
                    # over (preemption by recompute; its next lookup misses there).
                    self.running.remove(req)
                    self._preempt(req)
                    continue
                req.num_computed_tokens = min(req.num_computed_tokens, redo[rid])
                kvm.rollback(req, redo[rid])

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        if self.connector is not None and scheduler_output.kv_connector_metadata is not None:
            self._finish_kv_loads(scheduler_output, runner_output)
        if runner_output.errored:
            self.fail_requests(runner_output.errored)
        if runner_output.draft_record_poor is not None:
            self._draft_record_poor = runner_output.draft_record_poor
            self._draft_record_promising = bool(runner_output.draft_record_promising)
        outputs = []  # (the failed ones: take_failed_outputs, by the engine core)
        for rid, vector in runner_output.pooler_output.items():
            req = self.requests.get(rid)  # (aborted meanwhile: None)
            if req is not None and not req.is_finished:
                self._remove_from_queues(req)
                self._finish(req, RequestStatus.FINISHED_STOPPED)  # its blocks go back
                outputs.append(EngineCoreOutput(rid, [], req.finish_reason, pooled=vector))
        max_len = self.config.max_model_len
        logprobs = runner_output.logprobs
        row_starts = (logprobs_row_starts(runner_output.sampled_token_ids)
                      if logprobs is not None else None)
        prompt_logprobs = runner_output.prompt_logprobs
        spec_scheduled = scheduler_output.scheduled_spec_decode_tokens
        spec_slots = scheduler_output.scheduled_spec_slots
        # Async scheduling: the drafts come from the runner, which sends none here.
        next_drafts = None if self.config.async_scheduling else runner_output.spec_token_ids
        verified = runner_output.num_draft_tokens
        for rid, idx in runner_output.req_id_to_index.items():
            req = self.requests.get(rid)
            new_ids = runner_output.sampled_token_ids[idx]
            if req is None or req.is_finished or not new_ids:
                continue
            # The drafts (or draft slots) this step counted computed for the request.
            num_slots = len(spec_scheduled.get(rid, ())) or spec_slots.get(rid, 0)
            num_accepted = len(new_ids) - 1
            if num_slots and req.status == RequestStatus.RUNNING:
                # The rejected drafts' (and unused slots') KV hold garbage: they are simply
                # written over later, as computed tokens roll back to the accepted length.
                # (A request preempted meanwhile starts over from 0: nothing to roll back.)
                req.num_computed_tokens -= num_slots - num_accepted
            # (draft slots the runner had no drafts for were not verified)
            num_verified = (verified[idx] if verified is not None
                            else len(spec_scheduled.get(rid, ())))
            if num_verified and self.spec_stats is not None:
                self.spec_stats.observe(num_verified, num_accepted)
            # The step's placeholders: 1 + its drafts (or slots), all resolved now.
            req.num_output_placeholders = max(0, req.num_output_placeholders - 1 - num_slots)
            sp = req.sampling_params
            status = None
            appended = []
            grammar_error = None
            for tok in new_ids:
                req.output_token_ids.append(tok)
                appended.append(tok)
                if req.structured_output is not None:
                    try:
                        if faults.ARMED and faults.fires("grammar", rid, req.prompt_token_ids):
                            raise faults.InjectedFault(f"grammar matcher of {rid}")
                        if req.structured_output.advance(tok):
                            status = RequestStatus.FINISHED_STOPPED  # its grammar is complete
                    except Exception as e:  # noqa: BLE001 - this request's matcher only
                        grammar_error = f"its grammar matcher failed ({type(e).__name__})"
                        break
                num_out = len(req.output_token_ids)
                if num_out >= sp.min_tokens:  # before min_tokens nothing but length stops
                    if not sp.ignore_eos and tok in req.eos_token_ids:
                        status = RequestStatus.FINISHED_STOPPED
                    elif tok in sp.stop_token_ids_set:
                        status = RequestStatus.FINISHED_STOPPED
                        req.stop_reason = tok
                if status is None and (num_out >= sp.max_tokens or req.num_tokens >= max_len):
                    status = RequestStatus.FINISHED_LENGTH
                if status is not None:
                    break
            if grammar_error is not None:
                self.fail_requests({rid: ("grammar", grammar_error)})
                continue
            if status is not None:
                self._remove_from_queues(req)
                self._finish(req, status)
            elif next_drafts is not None:
                req.spec_token_ids = next_drafts[idx]
            outputs.append(EngineCoreOutput(
                rid, appended, req.finish_reason, req.stop_reason,
                logprobs.slice(row_starts[idx], row_starts[idx] + len(appended))
                if logprobs is not None and sp.logprobs is not None else None,
                prompt_logprobs.get(rid)))
        return outputs
