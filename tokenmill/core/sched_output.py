"""The scheduler/runner contract: plain dataclasses and their parts.

They carry only ids, counts, sampling parameters and host arrays, so they travel
between processes as messages (tokenmill/core/serial.py: msgpack).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tokenmill.pooling.params import PoolingParams
from tokenmill.sampling_params import SamplingParams


@dataclass
class MultiModalFeature:
    """One image of a request: its preprocessed patches and where its placeholder
    tokens sit in the prompt (the encoder's output replaces them, one row each)."""

    hash: str  # hex digest of the patches and grid: the encoder cache's and prefix cache's key
    pixel_values: np.ndarray  # [num_patches, C * T * P * P] float32, the image processor's
    image_grid_thw: list[int]  # [t, h, w] in patches, before the spatial merge
    offset: int  # index of its first placeholder token in the prompt
    length: int  # placeholder tokens (= encoder output rows)


@dataclass
class NewRequestData:
    """A request the runner has not seen: everything it needs to run it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # one list per KV cache group
    num_computed_tokens: int
    # Tokens already generated (non-empty when a request is replayed).
    output_token_ids: list[int] = field(default_factory=list)
    # Images of a multimodal prompt, in prompt order (None: text only).
    mm_features: list[MultiModalFeature] | None = None
    # An embedding request: its rows pool and sample nothing (None: it generates).
    pooling_params: PoolingParams | None = None
    # Speculation: the scheduler runs it without drafts (spec_decode/drafter.py).
    drafts_suspended: bool = False


@dataclass
class CachedRequestData:
    """Diffs for requests the runner already holds."""

    req_ids: list[str] = field(default_factory=list)
    # True: the request was preempted and comes back; block_ids replace the old ones.
    resumed_from_preemption: list[bool] = field(default_factory=list)
    # Per request: None, or one list of block ids per group to append (or set, if resumed).
    new_block_ids: list[list[list[int]] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class KVLoad:
    """Blocks of one request that the external KV tier loads this step: ids only, the
    worker half reads and verifies the entries itself (tokenmill.kv_connector)."""

    req_id: str
    # Index, in the request's block list, of block_ids[0]: the request's first
    # block_ids[k] that does not load is where its recomputation starts.
    first_block: int
    block_ids: list[int]
    block_hashes: list[bytes]  # each block's chained hash: its key in every store
    # Per block: indices of the stores the lookup found it in, in search order (the
    # first is read; the next ones if it cannot be read whole).
    store_ids: list[list[int]]
    # Hybrid models: the snapshot slot (numbered from 0) the recurrent-state snapshot
    # after the last block is read into, its block's hash and the stores holding it
    # (None: no snapshot to load - an attention-only model, or one kept locally).
    state_slot: int | None = None
    state_hash: bytes | None = None
    state_store_ids: list[int] = field(default_factory=list)


@dataclass
class KVStoreBlock:
    """One block the external KV tier stores after this step (a prompt block that
    became complete and that some store lacks): ids only, the worker half copies the
    KV out of the cache itself (tokenmill.kv_connector)."""

    req_id: str
    block_id: int
    block_hash: bytes  # the block's chained hash: its key in every store
    store_ids: tuple[int, ...]  # indices of the stores to write it to
    # Hybrid models: the snapshot slot holding the recurrent state after this block, and
    # the stores to write it to (after the block: a snapshot is never there without it).
    state_slot: int | None = None
    state_store_ids: tuple[int, ...] = ()


@dataclass
class KVConnectorMetadata:
    """One step's connector work, built by the scheduler half (tokenmill.kv_connector)
    for the worker half: which blocks to load before the forward, which to store after
    it. Ids and hashes only, never KV bytes."""

    loads: list[KVLoad] = field(default_factory=list)
    stores: list[KVStoreBlock] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.stores)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's schedule. Final once schedule() returns (frozen): the runner's
    threads read it while the engine goes on; what is known only later (the grammar
    bitmask) is an argument of sample_tokens()."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that finished or were aborted since the last step: drop their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Requests preempted in this schedule call: drop them from the batch.
    preempted_req_ids: set[str] = field(default_factory=set)
    # The KV connector's work for this step (tokenmill.kv_connector): blocks to load
    # before the forward, blocks to store after it (ids and hashes). None without a
    # connector, or with nothing to do.
    kv_connector_metadata: KVConnectorMetadata | None = None
    # Speculative decoding: request id -> the draft tokens scheduled after its last
    # token this step (they count in num_scheduled_tokens); absent: none.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Async scheduling with speculation: request id -> draft slots reserved after its
    # decode token (counted in num_scheduled_tokens; the scheduler cannot know the
    # drafts yet). The runner fills at most that many with the drafts it proposed
    # after the step before, and runs only those: the count is an upper bound.
    scheduled_spec_slots: dict[str, int] = field(default_factory=dict)
    # Multimodal: request id -> indices (into its mm_features) of the images the runner
    # encodes this step (each one's output is cached by its hash until freed), and the
    # hashes whose encoder outputs it drops before that.
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_hashes: list[str] = field(default_factory=list)
    # Hybrid prefix caching (core/state_snapshots.py; snapshot slots numbered from 0):
    # request id -> the snapshot its recurrent state starts from (a cache hit), and
    # request id -> (token count, snapshot slot) pairs: its state after that many
    # tokens is copied out (a boundary inside or at the end of its chunk this step).
    state_restores: dict[str, int] = field(default_factory=dict)
    state_snapshots: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    @classmethod
    def make_empty(cls) -> "SchedulerOutput":
        return cls([], CachedRequestData(), {}, 0)


@dataclass(frozen=True)
class GrammarOutput:
    """Structured output's part of a step, known only once the tokens before it are
    accepted (tokenmill.structured_output): an argument of the runner's
    sample_tokens(), as in vLLM V1, not a field filled into the SchedulerOutput while
    the forward runs. The compact bitmask has a row per structured request of the step
    (more when it verifies drafts: one per position) ([R, ceil(vocab / 32)] int32; bit
    t % 32 of word t // 32 set = token t allowed); request id -> its first row."""

    structured_output_request_ids: dict[str, int]
    grammar_bitmask: np.ndarray


@dataclass
class LogprobsLists:
    """Logprobs of some positions, on the host: row i is one position.

    Column 0 holds the chosen token (sampled, or the next prompt token), the
    other columns the top-k tokens, most likely first. `ranks` is the chosen
    token's 1-based rank among the whole vocabulary.
    """

    token_ids: np.ndarray  # [P, 1 + k] int
    logprobs: np.ndarray  # [P, 1 + k] float32
    ranks: np.ndarray  # [P] int

    def slice(self, start: int, end: int) -> "LogprobsLists":
        return LogprobsLists(self.token_ids[start:end], self.logprobs[start:end],
                             self.ranks[start:end])


@dataclass
class ModelRunnerOutput:
    # Request ids in the runner's batch order, and the index of each.
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # Per request: the tokens it produced this step (empty while still in its prompt;
    # with speculative decoding, its accepted drafts and then one sampled token).
    sampled_token_ids: list[list[int]]
    # Logprobs of the produced tokens (None when no request asked), in request order:
    # request i owns max(1, len(sampled_token_ids[i])) rows (`logprobs_row_starts`).
    logprobs: LogprobsLists | None = None
    # Prompt logprobs of requests whose prompt finished this step (all positions but the first).
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Requests the runner could not sample for (NaN logits, an id outside the
    # vocabulary): request id -> (reason, message). They produced no token; the
    # scheduler finishes them with an error.
    errored: dict[str, tuple[str, str]] = field(default_factory=dict)
    # Speculative decoding: per request, the drafts proposed for its next step (None:
    # no drafter, or nothing proposed).
    spec_token_ids: list[list[int]] | None = None
    # The external KV tier: blocks of this step's loads that do not hold their KV (an
    # entry evicted, torn or corrupted since the lookup, a store down or too slow). The
    # requests owning them sampled nothing this step; the scheduler recomputes them from
    # their first such block (vLLM's invalid_block_ids).
    invalid_block_ids: set[int] = field(default_factory=set)
    # Per request, the drafts it verified this step (None: no drafts in the step). With
    # draft slots (async) fewer than were reserved: the acceptance counters read this.
    num_draft_tokens: list[int] | None = None
    # Pooling: the vector (float32 [hidden]) of each embedding request whose prompt
    # completed this step; the scheduler finishes it with that as its output.
    pooler_output: dict[str, np.ndarray] = field(default_factory=dict)
    # A draft model's acceptance record (spec_decode/drafter.py): whether recent
    # verifications accepted almost nothing; the scheduler suspends new requests' drafts
    # while it does. None: no such record (no draft model, or adaptive k off).
    draft_record_poor: bool | None = None
    # ... and whether they accepted enough that drafting pays for recomputing a request,
    # or are too few to judge (the scheduler resumes requests suspended by load only then).
    draft_record_promising: bool | None = None


def logprobs_row_starts(sampled_token_ids: list[list[int]]) -> list[int]:
    """The first logprobs row of each request (see ModelRunnerOutput.logprobs)."""
    starts, row = [], 0
    for ids in sampled_token_ids:
        starts.append(row)
        row += max(1, len(ids))
    return starts
