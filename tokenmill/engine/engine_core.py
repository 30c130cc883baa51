"""EngineCore: owns the scheduler and the runner, and runs one step at a time.

step() = schedule -> execute_model -> sample_tokens -> update_from_output.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os

import torch

from tokenmill.config import CacheConfig, ModelConfig
from tokenmill.core.kv_cache_manager import cdiv
from tokenmill.core.kv_cache_spec import (KVCacheConfig, MambaSpec, SlidingWindowSpec,
                                         group_layer_specs)
from tokenmill.core.request import Request
from tokenmill.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import EngineCoreOutput, Scheduler, SchedulerConfig
from tokenmill.platforms import Platform
from tokenmill.engine.core_messages import CoreInfo, CoreStats
from tokenmill.errors import EngineDeadError, RequestFault
from tokenmill.kv_connector.setup import kv_cache_stats, make_kv_connector, resolve_prefix_caching
from tokenmill.models.loader import load_model
from tokenmill.spec_decode.loading import load_draft_model
from tokenmill.worker.kv_cache import available_memory_bytes
from tokenmill.executor import make_executor
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineStepError(EngineDeadError):
    """A step failed in a way no request can be blamed for: the engine is dead."""


def make_kv_cache_config(runner: ModelRunner, cache: CacheConfig, max_num_seqs: int,
                         max_model_len: int, device: torch.device,
                         state_slots_per_seq: int = 1,
                         state_snapshots: bool = False,
                         prefix_caching: bool = False) -> KVCacheConfig:
    """`state_slots_per_seq`: recurrent-state slots each sequence owns (1 + the drafts
    of a step under speculative decoding: one state after each verified token).
    `state_snapshots`: a hybrid with prefix caching: slots for its state snapshots too
    (`cache.num_state_snapshots`, or by default 4 per sequence, at most a quarter of the
    budget), out of the same budget. `prefix_caching`: room for cached blocks beside
    the running sequences' (see below)."""
    specs = runner.get_kv_cache_spec(cache.block_size)
    # Layers with equal specs share a group and its block table (full attention,
    # each sliding window, the recurrent state: kv_cache_spec.group_layer_specs).
    groups = group_layer_specs(specs)
    state = any(isinstance(g.spec, MambaSpec) for g in groups)
    config = KVCacheConfig(1, groups,
                           num_state_slots=max_num_seqs * state_slots_per_seq if state else 0)
    if state and state_snapshots:
        n = cache.num_state_snapshots
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ValueError(f"num_state_snapshots must be an int >= 1, got {n!r}")
        config.num_state_snapshots = n if n is not None else 4 * max_num_seqs
    per_block = config.bytes_per_block()
    # Blocks one sequence of max_model_len holds at once, over every group: all of its
    # positions in a full-attention group; in a sliding group the window before the
    # step's first token plus the step's tokens (the blocks before are given back).
    full_len = cdiv(max_model_len, cache.block_size)
    per_seq = sum(
        min(full_len, cdiv(g.spec.sliding_window - 1 + runner.max_num_batched_tokens,
                           cache.block_size) + 1)
        if isinstance(g.spec, SlidingWindowSpec) else full_len
        for g in groups if g.is_attention)
    # Enough for every sequence at full length, plus the null block; with prefix caching
    # as much again, where finished requests' blocks stay cached (else every block is
    # in use by a full batch, and a lone request at max_model_len evicts the prompt
    # blocks its successor would hit: a speculative engine's lookahead slots did).
    useful = (2 if prefix_caching else 1) * max_num_seqs * per_seq + 1
    if cache.num_kv_blocks is not None:
        num_blocks = cache.num_kv_blocks
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be an int >= 2, got {num_blocks!r}")
    else:
        if cache.kv_cache_memory is not None:
            budget = cache.kv_cache_memory
            if not isinstance(budget, int) or budget <= 0:
                raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {budget!r}")
        else:
            # Tensor-parallel ranks on this host share its memory: each takes its part.
            budget = (int(available_memory_bytes(device) * cache.memory_fraction)
                      // getattr(runner, "ranks_per_host", 1))
        if state and state_snapshots and cache.num_state_snapshots is None:
            config.num_state_snapshots = max(1, min(
                4 * max_num_seqs, budget // 4 // max(1, config.state_slot_bytes())))
        budget -= config.state_bytes()  # the recurrent state comes out of the same budget
        num_blocks = min(max(budget, 0) // per_block, useful)
    if num_blocks - 1 < per_seq:
        raise ValueError(
            f"the KV cache holds {num_blocks - 1} blocks of {cache.block_size} tokens, fewer "
            f"than one sequence of max_model_len={max_model_len} needs ({per_seq}); raise "
            f"num_kv_blocks / kv_cache_memory or lower max_model_len")
    config.num_blocks = num_blocks
    return config


class EngineCore:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, platform: Platform, model=None,
                 async_scheduling: bool = False, kv_connector_config=None,
                 speculative_config=None, structured_output=None,
                 tensor_parallel_size: int = 1):
        """`structured_output`: the StructuredOutputManager (None: no grammars).
        `tensor_parallel_size` > 1: the model sharded over that many ranks
        (tokenmill/executor); `self.runner` is then their executor."""
        self.model_config = model_config
        # Which kernels run (tokenmill/platforms): decided once, by whoever built the engine.
        self.platform = platform
        self.async_scheduling = async_scheduling
        # One worker thread runs the steps in order when scheduling is async.
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenmill-step")
        self._in_flight: tuple[SchedulerOutput, concurrent.futures.Future] | None = None
        self.num_steps = 0
        draft_model = None
        if tensor_parallel_size == 1:  # (with more ranks, each loads its own shard)
            if model is None:
                model = load_model(model_config.path, model_config.hf_config,
                                   model_config.dtype, model_config.device, self.platform,
                                   quantization=model_config.quantization)
            draft_model = load_draft_model(speculative_config, model_config, model,
                                           self.platform)
        # The ModelRunner (one rank) or the executor over the ranks: the same calls.
        self.runner = make_executor(
            model_config, self.platform,
            dict(max_num_reqs=scheduler_config.max_num_seqs,
                 max_model_len=model_config.max_model_len,
                 max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
                 kv_cache_dtype=cache_config.cache_dtype),
            tensor_parallel_size, model, speculative_config, draft_model)
        self.kv_cache_config = make_kv_cache_config(
            self.runner, cache_config, scheduler_config.max_num_seqs,
            model_config.max_model_len, model_config.device,
            1 + (speculative_config.num_speculative_tokens if speculative_config else 0),
            state_snapshots=scheduler_config.enable_prefix_caching is not False,
            prefix_caching=scheduler_config.enable_prefix_caching is not False)
        # The external KV tier (tokenmill.kv_connector): its stores, shared by the
        # scheduler's half and the runner's.
        self.kv_connector = make_kv_connector(kv_connector_config, model_config,
                                              self.kv_cache_config,
                                              gemm_dtype=self.platform.widen_to)
        self.runner.initialize_kv_cache(self.kv_cache_config, self.kv_connector)
        if speculative_config is not None:
            logger.info("speculative decoding: %s", speculative_config.describe())
        # Prefix caching (None: on unless hybrid).
        scheduler_config.enable_prefix_caching = resolve_prefix_caching(
            scheduler_config.enable_prefix_caching, self.kv_cache_config)
        self.runner.prefix_caching = bool(scheduler_config.enable_prefix_caching)
        # With speculation, async steps reserve draft slots the runner fills.
        scheduler_config.async_scheduling = async_scheduling
        if async_scheduling and speculative_config is not None:  # (TP: rank 0 sends them)
            self.runner.keep_own_drafts = True
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_config, self.kv_connector)
        # Grammars (tokenmill.structured_output), or None.
        self.structured_output = structured_output
        attn = self.kv_cache_config.groups[self.kv_cache_config.attention_group_id].spec
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB, %s)",
                    self.kv_cache_config.num_blocks, cache_config.block_size,
                    self.kv_cache_config.num_blocks * self.kv_cache_config.bytes_per_block() / 2**20,
                    attn.dtype)
        if self.scheduler.kv_cache_manager.snapshots is not None:
            cfg = self.kv_cache_config
            logger.info("prefix caching of the recurrent state: %d snapshot slots (%.1f MiB)",
                        cfg.num_state_snapshots,
                        cfg.num_state_snapshots * cfg.state_slot_bytes() / 2**20)

    def add_request(self, request: Request) -> None:
        self._attach_grammar(request)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids) -> list[str]:
        aborted = self.scheduler.abort_requests(request_ids)
        self._flush_finished_if_idle()
        return aborted

    def finish_requests(self, request_ids, status, stop_reason=None) -> list[str]:
        finished = self.scheduler.finish_requests(request_ids, status, stop_reason)
        self._flush_finished_if_idle()
        return finished

    def fail_requests(self, failures: dict[str, tuple[str, str]], emit: bool = True) -> list[str]:
        """Finish requests with an error (request id -> (reason, message)); with emit,
        their final outputs come with the next step's."""
        failed = self.scheduler.fail_requests(failures, emit)
        self._flush_finished_if_idle()
        return failed

    def _flush_finished_if_idle(self) -> None:
        # Finished ids normally ride on the next SchedulerOutput; when there is
        # no next step, hand them to the runner now so it holds no stale rows.
        if self.scheduler.has_unfinished_requests():
            return
        if self._in_flight is not None:
            # Every request is finished: the step in flight only computes tokens that
            # will be dropped. Let it end (the worker owns the runner until then).
            try:
                self._in_flight[1].result()
            except Exception:  # noqa: BLE001 - nobody is left to blame: start clean
                logger.exception("a step failed after its requests finished")
                self.runner.reset_batch()
            self._in_flight = None
        self.runner.remove_requests(self.scheduler.take_finished_req_ids())
        if self.runner.kv_connector is not None:  # idle: let the queued stores land
            self.runner.kv_connector.flush(timeout_s=1.0)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        drafts = None
        try:
            self.runner.execute_model(so)
            drafts = self.runner.step_drafts
        finally:
            if self.async_scheduling and self.structured_output is not None:
                self.structured_output.drafts_ready(so, drafts)  # (None: it failed)
        return self.runner.sample_tokens(self._grammar_before_sampling(so))

    def step(self) -> list[EngineCoreOutput]:
        """One step; the outputs include requests that failed (finish_reason "error")."""
        self.num_steps += 1
        if self.async_scheduling:
            return self._step_async()
        so = self.scheduler.schedule()
        try:
            runner_output = self._execute(so)
        except Exception as e:  # noqa: BLE001 - blame requests, or die (EngineStepError)
            self._recover([so], e)
            return self._finish_step([])
        self.scheduler.admit_only_preempted = False  # a step ran: any retry is over
        outputs = []
        if so.total_num_scheduled_tokens:
            outputs = self.scheduler.update_from_output(so, runner_output)
        return self._finish_step(outputs)

    def _finish_step(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        outputs += self.scheduler.take_failed_outputs()
        self._flush_finished_if_idle()
        return outputs

    def _step_async(self) -> list[EngineCoreOutput]:
        """Schedule and launch step N+1, then collect step N.

        Step N+1 is scheduled before step N's tokens are known: each request that
        samples in N holds a placeholder, so N+1 already schedules its next token.
        The worker thread runs steps in order, and the runner writes every sampled
        token into its batch before the next step reads it, so N+1's inputs are
        complete. The host work of the caller (this update, detokenizing, the
        next schedule) overlaps the forward of the step in flight. A request that
        N finishes may have been scheduled in N+1: that token is dropped.
        """
        launched = None
        if self.scheduler.has_unfinished_requests():
            so = self.scheduler.schedule()
            if so.total_num_scheduled_tokens or so.finished_req_ids or so.preempted_req_ids:
                self._expect_grammar_bitmask(so)
                launched = (so, self._worker.submit(self._execute, so))
            elif self._in_flight is None:
                # Nothing to run and nothing in flight: a retry after a failed step has
                # nothing left to retry (the synchronous path clears it on its empty step).
                self.scheduler.admit_only_preempted = False
        outputs = []
        if self._in_flight is not None:
            prev_so, future = self._in_flight
            self._in_flight = None
            try:
                runner_output = future.result()
            except Exception as e:  # noqa: BLE001 - step N failed: N+1 is void too
                failed = [prev_so]
                if launched is not None:
                    failed.append(launched[0])
                    self._drain(launched)
                self._recover(failed, e)
                return self._finish_step([])
            self.scheduler.admit_only_preempted = False
            if prev_so.total_num_scheduled_tokens:
                outputs = self.scheduler.update_from_output(prev_so, runner_output)
        self._grammar_bitmask_after_update(launched)
        self._in_flight = launched
        return self._finish_step(outputs)

    def _drain(self, launched) -> None:
        """Let a launched step end and drop whatever it computed."""
        so, future = launched
        som = self.structured_output
        if som is not None and som.is_expected(so):
            som.bitmask_ready(so)  # its sampling waits for a bitmask nobody will fill
        try:
            future.result()
        except Exception:  # noqa: BLE001 - its results are void either way
            pass

    # ---- fault isolation -------------------------------------------------------------
    def _recover(self, failed: list[SchedulerOutput], exc: BaseException) -> None:
        """A step raised. A RequestFault names its requests; any other exception is
        blamed on the requests that entered the batch in the failed step(s). Those are
        failed (finish_reason "error", blocks freed); every other running request is
        recomputed from a clean batch, and the retry step admits nothing new. With
        nobody to blame, or when the retry fails too, the engine is dead."""
        if isinstance(exc, EngineDeadError):  # e.g. a tensor-parallel rank died
            raise exc
        sched = self.scheduler
        if isinstance(exc, RequestFault):
            culprits = [r for r in exc.request_ids if r in sched.requests]
            reason = "fault"
        else:
            culprits = [r for so in failed for r in _entrants(so) if r in sched.requests]
            reason = "step_fault"
        retrying = sched.admit_only_preempted  # this was the retry of a failed step
        # A RequestFault whose requests finished meanwhile blames nobody alive: retry once.
        if (not culprits and (reason == "step_fault" or retrying)) or \
                (reason == "step_fault" and retrying):
            logger.error("engine step failed and no request can be blamed", exc_info=exc)
            raise EngineStepError("the engine failed") from exc
        logger.error("engine step failed; failing requests %s and retrying the rest",
                     ", ".join(culprits), exc_info=exc)
        message = ("this request failed inside the engine" if reason == "fault" else
                   "the engine step that took this request in failed")
        sched.fail_requests({rid: (reason, message) for rid in culprits})
        new_ids = [n.req_id for so in failed for n in so.scheduled_new_reqs]
        sched.requeue_all_for_retry(new_ids)
        self.runner.reset_batch()
        self.runner.remove_requests(sched.take_finished_req_ids())

    def shutdown(self) -> None:
        if self._worker is None:
            return
        if self._in_flight is not None:
            self._in_flight[1].result()
            self._in_flight = None
        self._worker.shutdown(wait=True)
        stop_ranks = getattr(self.runner, "shutdown", None)  # tensor parallel: the workers
        if stop_ranks is not None:
            stop_ranks()
        self._worker = None
        if self.runner.kv_connector is not None:
            self.runner.kv_connector.close()
        if self.kv_connector is not None:
            self.kv_connector.close()

    def kv_cache_stats(self) -> dict:
        """Prefix-cache and external-KV counters (see tokenmill.kv_connector.setup)."""
        return kv_cache_stats(self.scheduler, self.kv_connector)

    # ---- what the front end reads (the same surface as an engine-core client) -------
    def has_request(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache_config.num_blocks

    @property
    def enable_prefix_caching(self) -> bool:
        return bool(self.scheduler.config.enable_prefix_caching)

    def stats(self) -> CoreStats:
        """Gauges and cumulative counters, as the front end's stats show them."""
        sched = self.scheduler
        kv = sched.kv_cache_manager
        return CoreStats(
            num_running=sched.num_running, num_waiting=sched.num_waiting,
            num_preemptions=sched.num_preemptions, num_draft_resumes=sched.num_draft_resumes,
            num_steps=self.num_steps,
            kv_cache_usage=kv.usage,
            num_used_blocks=kv.num_used_blocks, num_kv_blocks=kv.pool.num_usable_blocks,
            prefix_cache_queries=kv.prefix_cache_stats.queries,
            prefix_cache_hits=kv.prefix_cache_stats.hits,
            num_cached_blocks=kv.pool.num_cached_blocks, num_errors=dict(sched.num_errors),
            num_aborted=sched.num_aborted,
            spec_decoding=sched.spec_stats.as_dict() if sched.spec_stats is not None else None,
            external_kv=(self.kv_connector.stats.snapshot()["stores"]
                         if self.kv_connector is not None else None))

    def info(self) -> CoreInfo:
        return CoreInfo(self.kv_cache_config.num_blocks, self.kv_cache_config.bytes_per_block(),
                        self.async_scheduling, self.enable_prefix_caching,
                        self.platform.describe(), os.getpid())

    # ---- structured output (tokenmill.structured_output) ---------------------------
    def _attach_grammar(self, request: Request) -> None:
        """A request with structured_outputs gets its matcher (compiled off the step)."""
        sop = getattr(request.sampling_params, "structured_outputs", None)
        if sop is not None and self.structured_output is not None:
            request.structured_output = self.structured_output.new_request(
                request.request_id, sop, request.prompt_token_ids)

    def _grammar_output(self, so: SchedulerOutput, drafts=None) -> GrammarOutput | None:
        """The grammar bitmask of `so`, from its requests' matchers as they are now, over
        `drafts` (default: its scheduled ones)."""
        ids, bitmask = self.structured_output.grammar_bitmask(
            self.scheduler.requests, so.num_scheduled_tokens,
            so.scheduled_spec_decode_tokens if drafts is None else drafts)
        return GrammarOutput(ids, bitmask) if bitmask is not None else None

    def _grammar_before_sampling(self, so: SchedulerOutput) -> GrammarOutput | None:
        """Between the forward and the sampling of `so` (on the thread running it): what
        sample_tokens() gets. `so` itself is never changed after schedule().

        Synchronous: every earlier token is accepted, so build the bitmask now. Async:
        the step before is collected on the caller's thread, which builds it after
        accepting its tokens (_grammar_bitmask_after_update); wait for that."""
        som = self.structured_output
        if som is None:
            return None
        if not self.async_scheduling:
            if so.total_num_scheduled_tokens:
                return self._grammar_output(so)
            if self.scheduler.num_waiting:
                som.wait_for_grammars(0.05)  # nothing ran: maybe all wait for a grammar
            return None
        return som.wait_bitmask(so)

    def _expect_grammar_bitmask(self, so: SchedulerOutput) -> None:
        """Async, before launching `so`: its structured requests need a bitmask that only
        the caller's thread can fill, once the step in flight is collected."""
        if self.structured_output is not None:
            reqs = self.scheduler.requests
            structured = [rid for rid in so.num_scheduled_tokens
                          if rid in reqs and reqs[rid].structured_output is not None]
            if structured:
                slots = so.scheduled_spec_slots
                self.structured_output.expect_bitmask(
                    so, with_drafts=any(rid in slots for rid in structured))

    def _grammar_bitmask_after_update(self, launched) -> None:
        """Async, after collecting the step in flight: fill the launched step's bitmask."""
        som = self.structured_output
        if som is None:
            return
        if launched is None:
            if self.scheduler.num_waiting:
                som.wait_for_grammars(0.05)
            return
        so = launched[0]
        if som.is_expected(so):
            grammar = None
            try:
                # (a grammar request's draft slots: the drafts the runner put in them)
                drafts = som.wait_drafts(so)
                if drafts is not None:  # (None: the step failed, nothing samples)
                    grammar = self._grammar_output(so, drafts)
            finally:
                som.bitmask_ready(so, grammar)


def _entrants(so: SchedulerOutput) -> list[str]:
    """The requests that entered the runner's batch in this step."""
    cached = so.scheduled_cached_reqs
    return ([n.req_id for n in so.scheduled_new_reqs]
            + [rid for rid, resumed in zip(cached.req_ids, cached.resumed_from_preemption)
               if resumed])
