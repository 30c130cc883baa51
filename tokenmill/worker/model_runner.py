"""The model runner: persistent batch -> flat step inputs -> forward -> sample.

One step is split in two, as in vLLM's GPU model runner: `execute_model`
updates the batch from the SchedulerOutput, reorders it decode-first, builds
the flat inputs and attention metadata, runs the forward and gathers the
logits of the rows that sample; `sample_tokens` samples on the device, writes
the ids back into the batch and returns the ModelRunnerOutput.

By concern: runner_kv_cache.py (specs, caches, backends, graphs), runner_inputs.py
(batch update, decode-first reorder, flat inputs, attention and state metadata),
runner_multimodal.py (M-RoPE, the encoder cache), runner_sampling.py (sample_tokens,
prompt logprobs, grammar rows), runner_spec.py (draft verification), runner_pooling.py
(embedding rows: pooled, never sampled), step_checks.py (fault sites, NaN / vocabulary
checks).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.builder import AttentionMetadataBuilder
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.core.kv_cache_spec import KVCacheConfig
from tokenmill.core.sched_output import GrammarOutput, LogprobsLists, SchedulerOutput
from tokenmill.models.layers.greedy_head import GreedyHead
from tokenmill.platforms import Platform
from tokenmill.sample.sampler import Sampler, nonfinite_rows
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.dflash_proposer import DFlashProposer
from tokenmill.spec_decode.drafter import Drafter
from tokenmill.spec_decode.eagle import EagleProposer
from tokenmill.spec_decode.rejection_sampler import RejectionSampler
from tokenmill.worker.input_batch import CachedRequestState, InputBatch
from tokenmill.worker.runner_inputs import InputPrepMixin, StepInputs, reorder_decodes_first
from tokenmill.worker.runner_kv_cache import KVCacheMixin
from tokenmill.worker.runner_multimodal import MultimodalMixin
from tokenmill.worker.runner_pooling import PoolingMixin
from tokenmill.worker.runner_sampling import SamplingMixin
from tokenmill.worker.runner_spec import DraftVerifyMixin
from tokenmill.worker.state_cache import StateSlots


class ModelRunner(KVCacheMixin, InputPrepMixin, MultimodalMixin, SamplingMixin,
                  DraftVerifyMixin, PoolingMixin):
    """Owns the step's tensors: the persistent batch, the KV caches and state slots, the
    forward and the sampling. Its concerns live in mixins, one module each (KV cache
    setup, input preparation and metadata, multimodal inputs, sampling, draft
    verification; the step's checks in step_checks.py); this file holds the state they
    share (set up here) and the step's two entry points."""

    # The decode step's shortcuts (one-token-a-row input prep, the sampling write-back
    # when every row keeps its token); False: every step takes the general path, which
    # the tests compare them with (tests/test_step_fast_paths_engine.py).
    fast_paths = True

    def __init__(self, model: nn.Module, *, dtype: torch.dtype, device: torch.device,
                 max_num_reqs: int, max_model_len: int, max_num_batched_tokens: int,
                 platform: Platform, kv_cache_dtype: str = "auto",
                 speculative_config: SpeculativeConfig | None = None, draft_model=None):
        """`platform`: the engine's kernel decisions (tokenmill/platforms; the model was
        prepared with it at load).
        `speculative_config`: propose drafts after each step and verify them in the
        next (tokenmill/spec_decode); None: no speculation. `draft_model`: the draft
        model of an eagle3 / mtp config (an EagleStyleDrafter) or of a dflash one."""
        self.model = model
        self.platform = platform
        self.dtype = dtype
        self.device = device
        self._on_cpu = torch.device(device).type == "cpu"
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_cache_dtype = kv_cache_dtype  # "auto" | "fp8" | "fp8_e4m3" (CacheConfig)
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler(platform.ops)
        self.input_batch: InputBatch | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.kv_cache_config: KVCacheConfig | None = None
        self.state_caches: dict[str, tuple[torch.Tensor, ...]] = {}
        self.state_slots: StateSlots | None = None
        self.attn_group_id = 0
        self.attn_group_ids: list[int] = [0]
        self.draft_group_id = 0
        self.draft_group_ids: list[int] = []
        self.state_group_id: int | None = None
        self.last_step: StepInputs | None = None
        # Hybrid models under speculation: per verifying request, the slot holding its
        # state after each of its step's tokens (StateSlots.write_slots).
        self._spec_write_slots: dict[str, list[int]] = {}
        # The drafts proposed after the last step, per request, with the token count they
        # follow: what an async step's draft slots are filled with (runner_spec.py).
        self._next_drafts: dict[str, tuple[int, list[int]]] = {}
        # Set by the engine core under async scheduling with speculation (synchronous
        # steps get their drafts from the scheduler: nothing to keep).
        self.keep_own_drafts = False
        # Set by the engine core: a finished or preempted request's blocks may stay
        # cached, so its draft model's waiting rows are written first (_write_drafter_rows).
        self.prefix_caching = False
        self.step_drafts: dict[str, list[int]] = {}  # the drafts of the step executed last
        self.last_attn_meta: AttentionMetadata | None = None
        # (logits, discard_mask, sampled ids or None) between execute_model and sample_tokens
        self._pending = None
        self._pending_nonfinite_hidden: torch.Tensor | None = None  # greedy-head steps
        self._grammar: GrammarOutput | None = None  # sample_tokens()' argument, while it runs
        self._prompt_logprobs_ready: dict[str, LogprobsLists] = {}
        self._prompt_logprobs_reqs: set[str] = set()  # asked and not yet sent
        # Embedding requests the runner holds, and the vectors of the step in progress.
        self._pooling_reqs: set[str] = set()
        self._pooled_ready: dict[str, torch.Tensor] = {}
        self._arange = np.arange(max(max_num_batched_tokens, max_model_len) + 1, dtype=np.int64)
        self._ones = np.ones(max_num_reqs, dtype=np.int64)  # (read only: see _ones_upto)
        self._all_rows = np.ones(max_num_reqs, dtype=bool)  # (every row may draft)
        self._all_rows.flags.writeable = False
        # Speculative decoding: the drafter and the verifier of its drafts.
        self.draft_model = draft_model
        proposer = None
        if draft_model is not None and speculative_config.method == "dflash":
            proposer = DFlashProposer(draft_model, device, max_model_len)
            # DFlash names the layers whose output it reads: the input of the next one
            # (the last layer's output is the final normed hidden state, as in HF).
            model.aux_layer_ids = tuple(i + 1 for i in draft_model.target_layer_ids)
        elif draft_model is not None:
            proposer = EagleProposer(draft_model, device, max_model_len)
            if draft_model.aux_layer_ids:
                model.aux_layer_ids = tuple(draft_model.aux_layer_ids)
        self.drafter = (Drafter(speculative_config, proposer,
                                row_budget=self.platform.fast_decode_rows)
                        if speculative_config is not None else None)
        self._step_hidden = None  # the target's hidden states and metadata, for the drafter
        self._step_meta = None
        # The layers the drafter taps (model.aux_layer_ids), and whether the step in
        # progress runs without them: every request's drafts suspended (Drafter.suspend).
        self._aux_layer_ids = getattr(model, "aux_layer_ids", ())
        self._drafter_off = False
        # A draft model's acceptance record goes to the scheduler with every step.
        self._reports_record = draft_model is not None and speculative_config.adaptive
        self.rejection_sampler = RejectionSampler(platform.ops)
        # Per attention KV cache group: the backend the platform chose for its spec and
        # the builder of its metadata, through which every attention metadata of a step
        # (the target's and the drafters') is built. Set in initialize_kv_cache.
        self.attn_backends: dict[int, AttentionBackend] = {}
        self.attn_builders: dict[int, AttentionMetadataBuilder] = {}
        # CUDA graphs of pure-decode steps (worker/cuda_graph.py), captured at
        # initialize_kv_cache where the platform says so; None: every step eager.
        self.cuda_graphs = None
        # The worker half of the KV connector (initialize_kv_cache), or None.
        self.kv_connector = None
        # This step's external loads that did not land (ModelRunnerOutput.invalid_block_ids).
        self._kv_invalid_block_ids: set[int] = set()
        # A draft model with K/V in the paged cache writes its rows of a step after
        # sampling: the step's stores to the external tier wait for it (one page holds
        # every layer's K/V). (kv connector metadata, failed requests) or None.
        self._kv_save_pending = None
        # All-greedy steps of up to greedy_head_max_rows sampling rows take their tokens
        # from the int8-screened lm_head (layers/greedy_head.py), where the platform says
        # so, for models whose logits are exactly lm_head(hidden) (`plain_lm_head`).
        self.greedy_head = None
        self.greedy_head_max_rows = 0
        # Multimodal models: each encoded image's output rows keyed on its hash (the
        # scheduler's EncoderCacheManager says which to drop), how many images the
        # encoder ran over, and whether positions are M-RoPE's three per token.
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.num_encoded_images = 0
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        self.has_encoder = hasattr(model, "encode_images")
        if self.platform.lm_head == "greedy_int8" and getattr(model, "plain_lm_head", False):
            self.greedy_head = GreedyHead.build(model.lm_head, self.platform.ops)
            if self.greedy_head is not None:
                self.greedy_head_max_rows = self.platform.greedy_head_max_rows

    def flush_kv_save(self) -> None:
        """The step's blocks to the external tier, once every layer's K/V is in them."""
        if self._kv_save_pending is not None:
            (kv_meta, kv_failed), self._kv_save_pending = self._kv_save_pending, None
            self.kv_connector.save_kv(kv_meta, kv_failed)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A numpy array as a tensor on the device (on CPU: the same memory, no copy and
        no dispatch of a no-op `.to`)."""
        t = torch.from_numpy(array)
        return t if self._on_cpu else t.to(self.device)

    def _to_host(self, t: torch.Tensor) -> np.ndarray:
        """A tensor's values as numpy (on CPU: its memory, no no-op `.to("cpu")`)."""
        return (t if self._on_cpu else t.cpu()).numpy()

    def _arange_upto(self, n: int) -> np.ndarray:
        if n > self._arange.size:
            self._arange = np.arange(n, dtype=np.int64)
        return self._arange[:n]

    def _ones_upto(self, n: int) -> np.ndarray:
        """n ones (a step's per-row token counts when every row has one), shared: read only."""
        if n > self._ones.size:
            self._ones = np.ones(n, dtype=np.int64)
        return self._ones[:n]

    def reset_batch(self) -> None:
        """After a failed step: empty the persistent batch (its rows may be half-updated).
        The scheduler sends every live request again as new (Scheduler.
        requeue_all_for_retry); the per-request states stay only for their generators."""
        batch = self.input_batch
        for rid in list(batch.req_id_to_index):
            batch.remove_request(rid)
        batch.condense()
        if self.state_slots is not None:
            for rid in list(self.requests):
                self.state_slots.release(rid)
        self._pending = None
        self._prompt_logprobs_ready = {}
        self._pooled_ready = {}
        self._grammar = None
        self._step_hidden = self._step_meta = None
        self._spec_write_slots = {}
        self._next_drafts = {}
        self._kv_invalid_block_ids = set()
        self._kv_save_pending = None  # (a failed step's blocks are not stored)

    def apply_sampled_tokens(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        """A rank that does not sample (tensor parallelism, tokenmill/executor): the
        tokens rank 0 sampled for the step this rank ran (the ModelRunnerOutput's rows;
        a verified row's accepted drafts and its next token), written into the batch as
        sample_tokens() writes its own: the next step's input ids read them."""
        self._pending = None
        self._prompt_logprobs_ready = {}
        if self.state_slots is not None and self._spec_write_slots:
            # A verified row goes on from the state after its last accepted token, as
            # rank 0's verification moved it (runner_spec.py).
            for rid, toks in zip(req_ids, sampled):
                write = self._spec_write_slots.get(rid)
                if write is not None and len(write) > 1 and toks:
                    self.state_slots.accept(rid, write[len(toks) - 1])
        counts = np.fromiter(map(len, sampled), dtype=np.int64, count=len(sampled))
        total = int(counts.sum())
        if not total:
            return
        batch = self.input_batch
        index = batch.req_id_to_index
        rows = np.fromiter((index[rid] for rid in req_ids), dtype=np.int64, count=len(req_ids))
        flat = np.fromiter((t for toks in sampled for t in toks), dtype=np.int64, count=total)
        each = np.repeat(rows, counts)
        j = self._arange_upto(total) - np.repeat(np.cumsum(counts) - counts, counts)
        batch.token_ids_cpu[each, batch.num_tokens_no_spec[each] + j] = flat
        batch.num_tokens_no_spec[rows] += counts.astype(batch.num_tokens_no_spec.dtype)
        for rid, toks in zip(req_ids, sampled):
            if toks:
                self.requests[rid].output_token_ids.extend(toks)

    def kept_drafts(self, req_ids: list[str]) -> tuple[list[int], list[list[int]]]:
        """The drafts kept for each row's next step (async scheduling with speculation):
        (the token count each follows, the drafts; 0 and [] where none)."""
        kept = [self._next_drafts.get(rid) for rid in req_ids]
        return ([k[0] if k else 0 for k in kept], [list(k[1]) if k else [] for k in kept])

    def keep_peer_drafts(self, req_ids: list[str], bases: list[int],
                         drafts: list[list[int]]) -> None:
        """A rank that does not propose (tensor parallelism under async scheduling):
        rank 0's drafts for each row's next step, kept as rank 0 keeps its own (the
        token count they follow, the drafts), so _fill_spec_slots fills the next step's
        draft slots here as it does there."""
        for rid, base, toks in zip(req_ids, bases, drafts):
            if toks:
                self._next_drafts[rid] = (int(base), list(toks))
            else:
                self._next_drafts.pop(rid, None)

    def _write_drafter_rows(self, req_ids) -> None:
        """Requests that finish or are preempted (still in the batch): with prefix
        caching their full blocks stay cached for later hits, so the rows their draft
        model kept waiting are written there now (spec_decode/deferred.py)."""
        if (req_ids and self.prefix_caching and self.drafter is not None
                and self.drafter.model_proposer is not None):
            # (a suspended request's blocks are hit only by suspended ones: no rows there)
            self.drafter.model_proposer.flush(self, self.drafter.not_suspended(req_ids))

    def _drafter_suspension(self) -> None:
        """Whether the step runs without the drafter: every request in it is suspended
        (Drafter.suspend); then the target taps no hidden states either."""
        batch = self.input_batch
        off = self._drafter_off = self.drafter.all_suspended(batch.req_ids[:batch.num_reqs()])
        ids = () if off else self._aux_layer_ids
        if getattr(self.model, "aux_layer_ids", ()) != ids:
            self.model.aux_layer_ids = ids

    def remove_requests(self, req_ids) -> None:
        """Drop finished requests when no further step will carry their ids."""
        self._write_drafter_rows(req_ids)
        for rid in req_ids:
            self.requests.pop(rid, None)
            self._prompt_logprobs_reqs.discard(rid)
            self._pooling_reqs.discard(rid)
            self._next_drafts.pop(rid, None)
            if self.drafter is not None:
                self.drafter.remove(rid)
            if self.state_slots is not None:
                self.state_slots.release(rid)
            self.input_batch.remove_request(rid)
        self.input_batch.condense()

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> None:
        """Forward for the scheduled tokens; logits wait for sample_tokens()."""
        kv_meta = so.kv_connector_metadata if self.kv_connector is not None else None
        self.flush_kv_save()  # (a step whose sampling did not run)
        self._kv_invalid_block_ids = set()
        if kv_meta is not None:  # external prefix hits: their reads start now
            self.kv_connector.start_load_kv(kv_meta)
        self._update_states(so)
        if so.scheduled_spec_slots:  # async: the drafts are this runner's own
            so = self._fill_spec_slots(so)
        # (async: the engine core builds a grammar request's bitmask over these)
        self.step_drafts = so.scheduled_spec_decode_tokens
        if so.total_num_scheduled_tokens == 0:
            self._pending = None
            return None
        reorder_decodes_first(self.input_batch, so.num_scheduled_tokens,
                              spec_tokens=so.scheduled_spec_decode_tokens)
        # A state snapshot the tier loads is in its slot before the inputs are prepared
        # (a one-token row copies its restored state in then); blocks alone can wait.
        early = kv_meta is not None and self.kv_connector.loads_state(kv_meta)
        if early:
            self._kv_invalid_block_ids = self.kv_connector.wait_for_load()
        input_ids, positions, logits_indices, meta, discard = self._prepare_inputs(so)
        if self.draft_model is not None:
            self._drafter_suspension()
        kv_failed = set()
        if kv_meta is not None:  # ... and are in their blocks before any layer reads them
            invalid = self._kv_invalid_block_ids = (
                self._kv_invalid_block_ids if early else self.kv_connector.wait_for_load())
            if invalid:  # a row over a block without its KV samples nothing this step
                batch, gid = self.input_batch, self.attn_group_id
                for r, rid in enumerate(batch.req_ids[:batch.num_reqs()]):
                    if not invalid.isdisjoint(self.requests[rid].block_ids[gid]):
                        discard[r] = True
                        kv_failed.add(rid)
        ids_t = self._to_device(input_ids.astype(np.int64))
        if self.uses_mrope:
            positions = self._mrope_positions(positions)
        pos_t = self._to_device(positions)
        embeds = self._multimodal_embeds(so, ids_t) if self.has_encoder else None
        if (embeds is None and self.cuda_graphs is not None
                and self.cuda_graphs.can_run(len(input_ids), meta)):
            hidden = self.cuda_graphs.run(ids_t, pos_t, meta)  # decode / verify queries only
            if meta.state is not None and meta.state.decode_snapshots:
                # (the graph copies no snapshot: the slots hold the step's end state)
                for tensors in self.state_caches.values():
                    for t in tensors:
                        for src, dst in meta.state.decode_snapshots:
                            t[dst] = t[src]
        else:
            hidden = self.model(ids_t, pos_t, meta,
                                **({"inputs_embeds": embeds} if embeds is not None else {}))
        if kv_meta is not None:  # prompt blocks this step completed, to the external stores
            self._kv_save_pending = (kv_meta, kv_failed)
            if self.drafter is None or self.drafter.model_proposer is None:
                self.flush_kv_save()  # (else once the drafter wrote its K/V: sample_tokens)
        if self.draft_model is not None:
            self._step_hidden, self._step_meta = hidden, meta
        if self._pool_step(hidden, discard):  # every row pools: no logits to compute
            self._pending = None
            return None
        # Only the rows that sample reach lm_head (a step of one token a row: all of them).
        if logits_indices.size == hidden.shape[0] and self.last_step.cu_num_logits is None:
            sample_hidden = hidden  # (n rows, n tokens: logits_indices is arange(n))
        else:
            sample_hidden = hidden[self._to_device(logits_indices)]
        if self._greedy_head_applies(so, sample_hidden.shape[0]):
            ids = self.greedy_head(sample_hidden)
            # No logits to look at: a non-finite hidden row is what makes NaN logits.
            # The screen shows when there is none (None: no row to fail), else a check.
            self._pending_nonfinite_hidden = (
                None if self.greedy_head.rows_surely_finite() else nonfinite_rows(sample_hidden))
            self._pending = (None, discard, ids)
        else:
            self._pending = (self.model.compute_logits(sample_hidden), discard, None)
        self._compute_prompt_logprobs(hidden, so)
        return None
