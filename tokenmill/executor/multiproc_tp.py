"""Tensor parallelism over processes: rank 0 is the engine's own runner, ranks
1..N-1 are spawned processes with a runner each, all joined by one gloo group.

Every step the engine's calls are sent to every rank first, then run on rank 0:
execute_model (the SchedulerOutput as its msgpack message, tokenmill/core/serial.py)
runs the forward on every rank, the layers' collectives keep them in lockstep; only
rank 0 samples, and sends the sampled ids to the others, whose batches need them
as the next step's input ids. Finished requests and the batch reset after a failed
step are sent too. Messages are one byte (the operation) + the msgpack of that
operation's named message (BODY_TYPES), over one pipe per worker; workers answer
only when ready and when they fail.

Failure: a worker that dies fails rank 0's pending collective at once (gloo sees the
connection close) or is seen by a watcher thread before the next step; either way
the engine dies with an EngineDeadError naming the rank and its exit code, and the
other workers are stopped. Any exception inside execute_model is fatal too: the
other ranks may be waiting in a collective rank 0 will never join. Shutdown (or
garbage collection of the executor, or the engine process exiting: the workers are
daemonic, and a worker whose pipe closes exits) stops the workers.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import threading
import time
import traceback
import weakref

import torch

from tokenmill.core import serial
from tokenmill.core.kv_cache_spec import KVCacheConfig, KVCacheGroup, MambaSpec
from tokenmill.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from tokenmill.errors import EngineDeadError
from tokenmill.executor.tp_group import TPGroup, free_port

logger = logging.getLogger(__name__)

# One-byte operations, then the msgpack body (BODY_TYPES; RESET and QUIT have none).
EXECUTE, SAMPLED, REMOVE, RESET, INIT_KV, QUIT = b"E", b"S", b"R", b"B", b"K", b"Q"
READY, FAILED = b"r", b"x"
STARTUP_TIMEOUT_S = 600.0


@dataclasses.dataclass(frozen=True)
class SampledTokens:
    """What rank 0 sampled: the other ranks' batches need it as the next step's input.
    Under async scheduling with speculation, also the drafts rank 0 keeps for each row's
    next step (ModelRunner._next_drafts: the token count they follow, then the drafts;
    [] for none): the next step's draft slots are filled from them on every rank, so
    all ranks run the same tokens (ModelRunner._fill_spec_slots)."""
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    next_draft_bases: list[int] | None = None
    next_drafts: list[list[int]] | None = None


@dataclasses.dataclass(frozen=True)
class RemoveRequests:
    """Finished requests: every rank drops them from its batch."""
    req_ids: list[str]


@dataclasses.dataclass(frozen=True)
class InitKVCache:
    """Rank 0's KV cache layout; each rank builds its own over its own specs (its heads),
    so only the sizes and the layers of each group cross."""
    num_blocks: int
    num_state_slots: int
    block_size: int
    group_layers: list[list[str]]  # per KV cache group, its layer names
    num_state_snapshots: int = 0


# The message each operation's body is (decoded as that type, not by position).
BODY_TYPES = {EXECUTE: SchedulerOutput, SAMPLED: SampledTokens, REMOVE: RemoveRequests,
              INIT_KV: InitKVCache}


def _build_runner(model_config, platform, group: TPGroup, runner_kwargs: dict,
                  speculative_config=None):
    """This rank's runner over its shard. `speculative_config` (every rank: a hybrid's
    state slots come in groups of 1 + k on each): rank 0 proposes and verifies; the
    other ranks run the drafts the scheduler sends as scheduled tokens and take the
    accepted ones (and, hybrids, the state slot of the last one) from rank 0's
    SampledTokens. A draft model (eagle3, dflash) is loaded whole on rank 0 only, with
    the target's embedding and lm_head gathered whole there (every rank joins the
    gather); its K/V pages exist on rank 0 only."""
    from tokenmill.models.loader import load_model
    from tokenmill.spec_decode.loading import load_rank_zero_draft_model
    from tokenmill.worker.model_runner import ModelRunner
    drafts = speculative_config is not None and speculative_config.method != "ngram"
    model = load_model(model_config.path, model_config.hf_config, model_config.dtype,
                       model_config.device, platform, tp_group=group,
                       quantization=model_config.quantization, whole_vocab_io=drafts)
    draft_model = None
    if drafts and group.rank == 0:
        draft_model = load_rank_zero_draft_model(speculative_config, model_config, model,
                                                 platform)
    return ModelRunner(model, dtype=model_config.dtype, device=model_config.device,
                       platform=platform, speculative_config=speculative_config,
                       draft_model=draft_model, **runner_kwargs)


def worker_main(rank: int, size: int, port: int, conn, model_config, platform,
                runner_kwargs: dict, threads: int, timeout_s: float,
                speculative_config=None) -> None:
    """A rank > 0: build its shard, then follow rank 0's calls until told to quit or
    its pipe closes (the engine is gone)."""
    torch.set_num_threads(threads)
    try:
        group = TPGroup(rank, size, port, timeout_s)
        runner = _build_runner(model_config, platform.in_this_process(), group, runner_kwargs,
                               speculative_config)
        decode = {op: serial.decoder(t) for op, t in BODY_TYPES.items()}
        conn.send_bytes(READY)
        with torch.inference_mode():
            while True:
                try:
                    msg = conn.recv_bytes()
                except (EOFError, OSError):
                    return
                op, body = msg[:1], memoryview(msg)[1:]
                if op == EXECUTE:
                    runner.execute_model(decode[EXECUTE](body))
                elif op == SAMPLED:
                    sampled = decode[SAMPLED](body)
                    runner.apply_sampled_tokens(sampled.req_ids, sampled.sampled_token_ids)
                    if sampled.next_drafts is not None:
                        runner.keep_peer_drafts(sampled.req_ids, sampled.next_draft_bases,
                                                sampled.next_drafts)
                elif op == REMOVE:
                    runner.remove_requests(decode[REMOVE](body).req_ids)
                elif op == RESET:
                    runner.reset_batch()
                elif op == INIT_KV:
                    runner.initialize_kv_cache(_rank_kv_cache_config(runner,
                                                                     decode[INIT_KV](body)))
                elif op == QUIT:
                    return
                else:
                    raise RuntimeError(f"unknown operation {op!r}")
    except BaseException:  # noqa: BLE001 - tell rank 0 why, then die (it sees the exit)
        logger.exception("tensor-parallel rank %d failed", rank)
        try:
            conn.send_bytes(FAILED + traceback.format_exc().encode())
        except Exception:  # noqa: BLE001 - the engine may be gone already
            pass
        raise SystemExit(1)


def _rank_kv_cache_config(runner, msg: InitKVCache) -> KVCacheConfig:
    """Rank 0's KV cache layout (blocks, slots, groups) over this rank's own specs
    (its heads only). Rank 0's draft layers (draft.*) are not here: a group of them
    alone keeps its place (the group ids of the scheduler's block ids) with no layers
    and this rank's attention spec (same block size)."""
    specs = runner.get_kv_cache_spec(msg.block_size)
    stand_in = next(s for n, s in specs.items() if not isinstance(s, MambaSpec))
    groups = []
    for names in msg.group_layers:
        mine = [n for n in names if n in specs]
        groups.append(KVCacheGroup(mine, specs[mine[0]] if mine else stand_in,
                                   is_draft=not mine))
    return KVCacheConfig(msg.num_blocks, groups, msg.num_state_slots, msg.num_state_snapshots)


def _stop_workers(procs, conns, timeout_s: float = 5.0) -> None:
    for conn in conns:
        try:
            conn.send_bytes(QUIT)
        except Exception:  # noqa: BLE001 - a dead worker's pipe
            pass
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    for conn in conns:
        conn.close()


def _exit_code(proc, timeout_s: float = 1.0):
    """The exit code of a process that exited (None if it did not within timeout_s).
    Another thread reaping it at the same moment makes one poll read None: retry."""
    deadline = time.monotonic() + timeout_s
    while True:
        proc.join(0.05)
        code = proc.exitcode
        if code is not None or time.monotonic() > deadline:
            return code


def _watch_workers(executor_ref, sentinels: dict[int, int]) -> None:
    """Notice a worker that exits, even while the engine is idle (sentinel -> rank)."""
    ready = mpc.wait(list(sentinels))
    executor = executor_ref()
    if executor is not None:
        executor._worker_exited(sentinels[ready[0]])


class MultiprocTPExecutor:
    """The runner interface EngineCore calls (execute_model, sample_tokens,
    get_kv_cache_spec, initialize_kv_cache, remove_requests, reset_batch), over
    `size` ranks. `runner` is rank 0's ModelRunner."""

    kv_connector = None  # the external KV tier is refused with tensor parallelism

    def __init__(self, model_config, platform, size: int, runner_kwargs: dict,
                 timeout_s: float = 300.0, speculative_config=None):
        self.size = size
        self.ranks_per_host = size  # every rank is a process here: the KV budget is shared
        self._dead: str | None = None
        self._closing = False
        self._reasons: dict[int, str] = {}
        ctx = mp.get_context("spawn")
        port = free_port()
        # The ranks share the cores: each takes its part of the engine's threads.
        threads = max(1, torch.get_num_threads() // size)
        torch.set_num_threads(threads)
        self._procs, self._conns = [], []
        bare = dataclasses.replace(platform, ops=None)  # a module does not cross processes
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, name=f"tokenmill-tp-rank{rank}", daemon=True,
                               args=(rank, size, port, child, model_config, bare,
                                     runner_kwargs, threads, timeout_s, speculative_config))
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns)
        try:
            self.group = self._start_group(port, timeout_s)
            self.runner = _build_runner(model_config, platform, self.group, runner_kwargs,
                                        speculative_config)
            self._wait_ready()
        except BaseException:
            self._finalizer()
            raise
        # (a weak reference: the thread must not keep a forgotten executor, and so its
        # workers, alive)
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs, start=1)}
        self._watcher = threading.Thread(target=_watch_workers,
                                         args=(weakref.ref(self), sentinels),
                                         name="tokenmill-tp-watch", daemon=True)
        self._watcher.start()
        logger.info("tensor parallel: %d ranks (rank 0 in the engine process, %d workers), "
                    "gloo on 127.0.0.1:%d, %d torch threads per rank", size, size - 1, port,
                    threads)

    # ---- start-up --------------------------------------------------------------------
    def _start_group(self, port: int, timeout_s: float) -> TPGroup:
        """Join the group on a helper thread, so that a worker dying during start-up
        is an error now rather than a rendezvous timeout."""
        result: dict = {}

        def join():
            try:
                result["group"] = TPGroup(0, self.size, port, timeout_s)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                result["error"] = e

        t = threading.Thread(target=join, name="tokenmill-tp-join", daemon=True)
        t.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while t.is_alive():
            t.join(0.1)
            self._raise_if_worker_died("while joining the tensor-parallel group")
            if time.monotonic() > deadline:
                raise EngineDeadError("tensor parallel: the workers did not join the group")
        if "error" in result:
            raise EngineDeadError(f"tensor parallel: joining the group failed: "
                                  f"{result['error']}") from result["error"]
        return result["group"]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank, conn in enumerate(self._conns, start=1):
            while not conn.poll(0.1):
                self._raise_if_worker_died("while loading the model")
                if time.monotonic() > deadline:
                    raise EngineDeadError(f"tensor parallel: rank {rank} did not start")
            msg = conn.recv_bytes()
            if msg[:1] != READY:
                raise EngineDeadError(f"tensor parallel: rank {rank} failed to start:\n"
                                      f"{msg[1:].decode(errors='replace')}")

    def _raise_if_worker_died(self, when: str) -> None:
        for rank, proc in enumerate(self._procs, start=1):
            if not proc.is_alive():
                raise EngineDeadError(f"tensor parallel: rank {rank} exited (code "
                                      f"{_exit_code(proc)}) {when}{self._reason(rank)}")

    def _reason(self, rank: int) -> str:
        """The traceback a failed rank sent, read once and kept ("" if none)."""
        if rank not in self._reasons:
            conn = self._conns[rank - 1]
            try:
                if conn.poll(0):
                    msg = conn.recv_bytes()
                    if msg[:1] == FAILED:
                        self._reasons[rank] = ":\n" + msg[1:].decode(errors="replace")
            except Exception:  # noqa: BLE001 - nothing to read from a broken pipe
                pass
        return self._reasons.get(rank, "")

    def _worker_exited(self, rank: int) -> None:
        if self._closing:
            return
        code = _exit_code(self._procs[rank - 1])
        self._dead = f"tensor-parallel rank {rank} exited (code {code}){self._reason(rank)}"
        logger.error("%s: the engine is dead", self._dead)

    # ---- per step ---------------------------------------------------------------------
    def _send(self, msg: bytes) -> None:
        if self._dead is not None:
            self._fail(None)
        try:
            for conn in self._conns:
                conn.send_bytes(msg)
        except (OSError, ValueError) as e:  # a worker's end is gone
            self._fail(e)

    def _fail(self, exc: BaseException | None):
        """The ranks are out of step or one is gone: stop them all and raise."""
        if self._dead is None:
            # A rank that died explains the error: give it a moment.
            codes = [_exit_code(p, 0.5) for p in self._procs]
            for rank, code in enumerate(codes, start=1):
                reason = self._reason(rank)
                if reason or code is not None:
                    self._dead = f"tensor-parallel rank {rank} failed (exit code {code}){reason}"
                    break
            else:
                self._dead = f"a tensor-parallel step failed on rank 0: {exc!r}"

        self.shutdown(timeout_s=1.0)  # a rank waiting in a collective will not quit
        raise EngineDeadError(f"the engine failed: {self._dead}") from exc

    def execute_model(self, so: SchedulerOutput) -> None:
        self._send(EXECUTE + serial.encode(so))
        try:
            return self.runner.execute_model(so)
        except Exception as e:  # noqa: BLE001 - the other ranks may wait in a collective
            self._fail(e)

    def sample_tokens(self, grammar: GrammarOutput | None = None) -> ModelRunnerOutput:
        out = self.runner.sample_tokens(grammar)
        bases = drafts = None
        if self.runner.keep_own_drafts:  # async + speculation: the next step's drafts
            bases, drafts = self.runner.kept_drafts(out.req_ids)
        self._send(SAMPLED + serial.encode(SampledTokens(out.req_ids, out.sampled_token_ids,
                                                         bases, drafts)))
        return out

    @property
    def step_drafts(self) -> dict[str, list[int]]:
        """The drafts rank 0 ran in the step executed last (every rank ran the same)."""
        return self.runner.step_drafts

    @property
    def keep_own_drafts(self) -> bool:
        return self.runner.keep_own_drafts

    @keep_own_drafts.setter
    def keep_own_drafts(self, keep: bool) -> None:
        """(EngineCore: async scheduling with speculation) rank 0 keeps the drafts it
        proposes for the next step and sends them with each step's sampled tokens."""
        self.runner.keep_own_drafts = keep

    @property
    def prefix_caching(self) -> bool:
        return self.runner.prefix_caching

    @prefix_caching.setter
    def prefix_caching(self, on: bool) -> None:
        """(EngineCore) rank 0 holds the draft model and the rows it keeps waiting."""
        self.runner.prefix_caching = on

    @property
    def max_num_batched_tokens(self) -> int:
        """(sizing a sliding-window group's blocks per sequence: one step's tokens)"""
        return self.runner.max_num_batched_tokens

    def get_kv_cache_spec(self, block_size: int):
        return self.runner.get_kv_cache_spec(block_size)  # every rank's: same heads each

    def initialize_kv_cache(self, config: KVCacheConfig, kv_connector=None) -> None:
        if kv_connector is not None:
            raise ValueError("the external KV tier (kv_connector) is not supported with "
                             "tensor_parallel_size > 1")
        attn = config.groups[config.attention_group_id].spec
        self._send(INIT_KV + serial.encode(InitKVCache(
            config.num_blocks, config.num_state_slots, attn.block_size,
            [g.layer_names for g in config.groups], config.num_state_snapshots)))
        self.runner.initialize_kv_cache(config)

    def remove_requests(self, req_ids) -> None:
        req_ids = list(req_ids)
        if req_ids:
            self._send(REMOVE + serial.encode(RemoveRequests(req_ids)))
        self.runner.remove_requests(req_ids)

    def reset_batch(self) -> None:
        self._send(RESET)
        self.runner.reset_batch()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Ask the workers to quit, terminate those still there after `timeout_s`."""
        self._closing = True
        stop = self._finalizer.detach()
        if stop is not None:
            _, fn, args, _ = stop
            fn(*args, timeout_s=timeout_s)
