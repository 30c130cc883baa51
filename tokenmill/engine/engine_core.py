"""EngineCore: owns the scheduler and the runner, and runs one step at a time.

step() = schedule -> execute_model -> sample_tokens -> update_from_output.
"""
from __future__ import annotations

import concurrent.futures
import logging

import torch

from tokenmill.config import CacheConfig, ModelConfig
from tokenmill.core.kv_cache_manager import cdiv
from tokenmill.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, MambaSpec
from tokenmill.core.request import Request
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import EngineCoreOutput, Scheduler, SchedulerConfig
from tokenmill.models.loader import load_model
from tokenmill.worker.kv_cache import available_memory_bytes
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def make_kv_cache_config(runner: ModelRunner, cache: CacheConfig, max_num_seqs: int,
                         max_model_len: int, device: torch.device) -> KVCacheConfig:
    specs = runner.get_kv_cache_spec(cache.block_size)
    # Every attention layer has the same spec: one group, one block table. Recurrent
    # layers form a second group whose state lives in one slot per live sequence.
    attn = [n for n, s in specs.items() if isinstance(s, FullAttentionSpec)]
    state = [n for n, s in specs.items() if isinstance(s, MambaSpec)]
    groups = [KVCacheGroup(attn, specs[attn[0]])]
    if state:
        groups.append(KVCacheGroup(state, specs[state[0]]))
    config = KVCacheConfig(1, groups, num_state_slots=max_num_seqs if state else 0)
    per_block = config.bytes_per_block()
    # Enough for every sequence at full length, plus the null block: more is waste.
    useful = max_num_seqs * cdiv(max_model_len, cache.block_size) + 1
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
            budget = int(available_memory_bytes(device) * cache.memory_fraction)
        budget -= config.state_bytes()  # the recurrent state comes out of the same budget
        num_blocks = min(max(budget, 0) // per_block, useful)
    if num_blocks - 1 < cdiv(max_model_len, cache.block_size):
        raise ValueError(
            f"the KV cache holds {num_blocks - 1} blocks of {cache.block_size} tokens, fewer "
            f"than one sequence of max_model_len={max_model_len} needs; raise num_kv_blocks / "
            f"kv_cache_memory or lower max_model_len")
    config.num_blocks = num_blocks
    return config


class EngineCore:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, model=None, async_scheduling: bool = False):
        self.model_config = model_config
        self.async_scheduling = async_scheduling
        # One worker thread runs the steps in order when scheduling is async.
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenmill-step")
        self._in_flight: tuple[SchedulerOutput, concurrent.futures.Future] | None = None
        if model is None:
            model = load_model(model_config.path, model_config.hf_config, model_config.dtype,
                               model_config.device, model_config.gemm_dtype)
        self.runner = ModelRunner(
            model, dtype=model_config.dtype, device=model_config.device,
            max_num_reqs=scheduler_config.max_num_seqs,
            max_model_len=model_config.max_model_len,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens)
        self.kv_cache_config = make_kv_cache_config(
            self.runner, cache_config, scheduler_config.max_num_seqs,
            model_config.max_model_len, model_config.device)
        self.runner.initialize_kv_cache(self.kv_cache_config)
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_config)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", self.kv_cache_config.num_blocks,
                    cache_config.block_size,
                    self.kv_cache_config.num_blocks * self.kv_cache_config.bytes_per_block() / 2**20)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids) -> list[str]:
        aborted = self.scheduler.abort_requests(request_ids)
        self._flush_finished_if_idle()
        return aborted

    def finish_requests(self, request_ids, status, stop_reason=None) -> list[str]:
        finished = self.scheduler.finish_requests(request_ids, status, stop_reason)
        self._flush_finished_if_idle()
        return finished

    def _flush_finished_if_idle(self) -> None:
        # Finished ids normally ride on the next SchedulerOutput; when there is
        # no next step, hand them to the runner now so it holds no stale rows.
        if self.scheduler.has_unfinished_requests():
            return
        if self._in_flight is not None:
            # Every request is finished: the step in flight only computes tokens that
            # will be dropped. Let it end (the worker owns the runner until then).
            self._in_flight[1].result()
            self._in_flight = None
        self.runner.remove_requests(self.scheduler.take_finished_req_ids())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.runner.execute_model(so)
        return self.runner.sample_tokens()

    def step(self) -> list[EngineCoreOutput]:
        if self.async_scheduling:
            return self._step_async()
        so = self.scheduler.schedule()
        runner_output = self._execute(so)
        outputs = []
        if so.total_num_scheduled_tokens:
            outputs = self.scheduler.update_from_output(so, runner_output)
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
                launched = (so, self._worker.submit(self._execute, so))
        outputs = []
        if self._in_flight is not None:
            prev_so, future = self._in_flight
            self._in_flight = None
            runner_output = future.result()
            if prev_so.total_num_scheduled_tokens:
                outputs = self.scheduler.update_from_output(prev_so, runner_output)
        self._in_flight = launched
        self._flush_finished_if_idle()
        return outputs

    def shutdown(self) -> None:
        if self._in_flight is not None:
            self._in_flight[1].result()
            self._in_flight = None
        self._worker.shutdown(wait=True)
