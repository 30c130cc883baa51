"""A request as the scheduler sees it: token ids, progress counters, status."""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.pooling.params import PoolingParams
    from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # The engine failed this one request (NaN logits, a fault in its sampling, its
    # grammar, its detokenization); the rest of the batch goes on.
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: "SamplingParams", eos_token_ids: frozenset[int] = frozenset(),
                 arrival_time: float | None = None, share_prompt_with: str | None = None,
                 cache_salt: str | None = None, mm_features: list | None = None,
                 pooling_params: "PoolingParams | None" = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        # Tokens whose KV is in the cache (or scheduled to be, this step).
        self.num_computed_tokens = 0
        # Tokens sampled by steps still in flight (async scheduling): scheduled
        # past, not yet appended. The runner knows them; the scheduler not yet.
        self.num_output_placeholders = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # A sibling of the same n > 1 request that prefills the shared prompt:
        # this one waits for it and then takes its full prompt blocks.
        self.share_prompt_with = share_prompt_with
        # Prefix caching: salts block 0's hash (requests with different salts never
        # share KV); the chained hashes of its full blocks, extended as tokens arrive.
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []
        # Structured output: the request's grammar matcher, set by the engine core
        # (tokenmill.structured_output.StructuredOutputRequest; used here only through
        # ready() and advance(token)). None: unconstrained.
        self.structured_output = None
        # Speculative decoding: drafts proposed after the last step, verified in the next.
        self.spec_token_ids: list[int] = []
        # Set by the scheduler when it takes the request in: it runs without drafts and
        # its draft model keeps no data for it (spec_decode/drafter.py, "suspended").
        self.drafts_suspended = False
        # ... because the batch it joined was already too large to draft in (not for its
        # record): the scheduler may resume its drafts once the batch has drained.
        self.suspended_by_load = False
        self.drafts_decided = False  # (both decided when the scheduler first looks at it)
        # Multimodal: its images (sched_output.MultiModalFeature, in prompt order), or None.
        self.mm_features = mm_features or None
        # Pooling (an embedding request): prefill only, finished on its pooled vector;
        # its sampling_params are pooling_sampling_params()'s, never sampled. None: generate.
        self.pooling_params = pooling_params

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None
