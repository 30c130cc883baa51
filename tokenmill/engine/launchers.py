"""Starting engine cores: local processes, or Ray actors.

A launcher's start() runs tokenmill.engine.core_proc.run_engine_core for one
replica and returns a handle (is_alive, exitcode, kill); stop_all() waits for
the cores to leave after they were told to shut down, then kills what is left.
"""
from __future__ import annotations

import logging
import multiprocessing
import os

from tokenmill.engine.engine_args import BACKENDS

logger = logging.getLogger(__name__)


def cpu_shares(num_replicas: int) -> list[tuple[list[int] | None, int | None]]:
    """(CPUs, intra-op threads) per replica: the CPUs this process may use, split in
    equal contiguous shares. One replica keeps everything (torch's own default);
    more replicas than CPUs share them all, one thread each."""
    if num_replicas == 1:
        return [(None, None)]
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        list(range(os.cpu_count() or 1))
    per = len(cpus) // num_replicas
    if per == 0:
        return [(None, 1)] * num_replicas
    return [(cpus[i * per:(i + 1) * per], per) for i in range(num_replicas)]


def make_launcher(backend: str, num_replicas: int):
    if backend == "mp":
        return ProcessLauncher(num_replicas)
    if backend == "ray":
        return RayLauncher(num_replicas)
    raise ValueError(f"distributed_executor_backend must be one of {', '.join(BACKENDS)}, "
                     f"got {backend!r}")


class _ProcessHandle:
    def __init__(self, proc):
        self.proc = proc

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def exitcode(self):
        return self.proc.exitcode

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)


class ProcessLauncher:
    def __init__(self, num_replicas: int):
        self.shares = cpu_shares(num_replicas)
        self.handles: list[_ProcessHandle] = []

    def start(self, index: int, args, input_addr: str, output_addr: str) -> _ProcessHandle:
        from tokenmill.engine.core_proc import run_engine_core
        cpus, threads = self.shares[index]
        # spawn: a fresh interpreter (fork would copy this process's threads and
        # torch state); not daemonic, so the core may start processes of its own.
        proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name=f"tokenmill-core-{index}",
            args=(args, input_addr, output_addr, index, cpus, threads))
        proc.start()
        handle = _ProcessHandle(proc)
        self.handles.append(handle)
        return handle

    def stop_all(self, timeout_s: float, graceful: bool = True) -> None:
        for h in self.handles:
            if graceful:
                h.proc.join(timeout_s)
            if h.proc.is_alive():
                h.proc.terminate()
                h.proc.join(2)
            if h.proc.is_alive():
                h.proc.kill()
                h.proc.join(2)
        self.handles = []


class _RayHandle:
    def __init__(self, actor, ref):
        self.actor, self.ref = actor, ref

    def is_alive(self) -> bool:
        import ray
        done, _ = ray.wait([self.ref], timeout=0)
        return not done

    def exitcode(self):
        return None

    def kill(self) -> None:
        import ray
        try:
            ray.kill(self.actor)
        except Exception:  # noqa: BLE001 - already gone
            pass


class RayLauncher:
    """Each replica a Ray actor reserving its share of CPUs. Uses the Ray runtime this
    process is connected to, else RAY_ADDRESS's cluster, else a local one started now."""

    def __init__(self, num_replicas: int):
        try:
            import ray
        except ImportError as e:
            raise ValueError("distributed_executor_backend='ray' needs ray "
                             "(pip install 'tokenmill[ray]')") from e
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False,
                     log_to_driver=True)
        total = int(ray.cluster_resources().get("CPU", 1))
        self.num_cpus = max(1, total // num_replicas)
        self.handles: list[_RayHandle] = []

        @ray.remote(num_cpus=self.num_cpus, max_restarts=0)
        class EngineCoreActor:
            def run(self, args, input_addr, output_addr, index, threads):
                from tokenmill.engine.core_proc import run_engine_core
                run_engine_core(args, input_addr, output_addr, index, None, threads,
                                watch_parent=False)

        self.actor_cls = EngineCoreActor

    def start(self, index: int, args, input_addr: str, output_addr: str) -> _RayHandle:
        actor = self.actor_cls.options(name=None).remote()
        ref = actor.run.remote(args, input_addr, output_addr, index, self.num_cpus)
        handle = _RayHandle(actor, ref)
        self.handles.append(handle)
        return handle

    def stop_all(self, timeout_s: float, graceful: bool = True) -> None:
        import ray
        if graceful and self.handles:
            ray.wait([h.ref for h in self.handles], num_returns=len(self.handles),
                     timeout=timeout_s)
        for h in self.handles:
            h.kill()
        self.handles = []
