"""Kernel time against the rest of an engine step, without the profiler.

torch.profiler inflates the host side of a step (each recorded op and range costs
microseconds) and does not see our native kernels, which are pybind functions rather
than aten ops. `KernelClock` measures the two sides separately instead:

* **wall time** of plain steps: only the step and its stages (scheduler, execute_model,
  input preparation, the model's forward, sample_tokens, the scheduler's update, the
  output processor) are timed, a perf_counter pair per stage (microseconds a step);
* **kernel time** of instrumented steps, interleaved with the plain ones: the time
  spent inside every function of the native kernels module (wrapped before the engine
  is built, so the references layers keep are the wrappers too) and inside every aten
  op (a TorchDispatchMode times each call; inside a native kernel it is switched off,
  so an op a kernel dispatches is not counted twice).

The step's non-kernel time is the plain step's wall time less the instrumented step's
kernel time: the instrumentation inflates only what lies outside the kernels, which
the plain steps do not pay. The same difference is also taken in the calling thread's
CPU time (`thread_time`, whole steps and kernels only): on a shared machine, time the
thread spends waiting for a core inflates wall times but not that one. What counts as kernel time: every native kernel call and
every aten op, glue included (an index, a copy, an `empty`): that is work a GPU would
run as a kernel too; a tiny aten op's count includes its dispatch from Python (about a
microsecond), so the kernel side is, if anything, slightly generous. The rest is
Python: the scheduler, the batch bookkeeping, numpy, module calls, the output path.

A third kind of step measures the rest directly, without subtracting two large
figures (on a busy machine the kernels' time varies by more than the rest amounts
to): in **host-only** steps the model's forward, its logits and the greedy head
return what they computed in the step before (the same shapes: the engine's stepping
of a decode batch is unchanged; the tokens they give are not the model's and are
thrown away, and the step's K/V is not written). Their wall time is everything but
the model: scheduling, inputs, sampling from the logits (at 128 rows its argmax, a
kernel outside the model, is part of it), the write-back and the outputs.

Only the calling thread's aten ops are seen (the mode is thread-local): the engine
must run steps synchronously (the CPU default).
"""
from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from time import perf_counter, thread_time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

STEP = "step"  # the root stage: LLMEngine.step


class KernelClock:
    """Stage wall times of every step; kernel times of the steps run under `kernels()`."""

    def __init__(self):
        self.timing_kernels = False
        self._stack: list[str] = []
        self._reset_step()
        self.host_only = False  # a host-only step runs: cached_model's calls replay
        self.plain_steps: list[dict] = []   # per plain step: stage -> self wall seconds
        self.timed_steps: list[dict] = []   # per timed step: the kernel side (see end_step)
        self.host_steps: list[dict] = []    # per host-only step: as plain ones

    # ---- instrumentation -----------------------------------------------------------
    def wrap_native(self, ops) -> None:
        """Time every kernel function of the native module `ops` (before the engine is
        built: layers keep references to the module's kernel functions)."""
        for name in dir(ops):
            fn = getattr(ops, name)
            if not name.startswith("_") and type(fn).__name__ == "builtin_function_or_method":
                setattr(ops, name, self._timed_native(name, fn))

    def _timed_native(self, name: str, fn):
        clock = self

        def timed(*a, **kw):
            if not clock.timing_kernels:
                return fn(*a, **kw)
            with torch._C._DisableTorchDispatch():  # its inner aten ops are its own time
                c0, t0 = thread_time(), perf_counter()
                out = fn(*a, **kw)
                dt, dc = perf_counter() - t0, thread_time() - c0
            clock._kernel(("native", name), dt, dc)
            return out
        timed.__wrapped__ = fn
        return timed

    def wrap_stage(self, obj, method: str, label: str) -> None:
        """Time `obj.method` as a stage (an instance attribute shadowing the method)."""
        inner = getattr(obj, method)
        clock = self
        if label == STEP:  # the root: its CPU time too
            def step(*a, **kw):
                c0 = thread_time()
                try:
                    return staged(*a, **kw)
                finally:
                    clock._step_cpu += thread_time() - c0

        def staged(*a, **kw):
            stack = clock._stack
            stack.append(label)
            t0 = perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                dt = perf_counter() - t0
                stack.pop()
                clock._wall[label] += dt
                clock._child[stack[-1] if stack else None] += dt
        setattr(obj, method, step if label == STEP else staged)

    def cached(self, fn):
        """`fn`, whose result a host-only step replays from the last other step (when
        its first argument has as many rows as that result: the batch is the same)."""
        clock, last = self, []

        def call(*a, **kw):
            if clock.host_only and last and a and len(a[0]) == len(last[0]):
                return last[0]
            out = fn(*a, **kw)
            last[:] = [out]
            return out
        return call

    def _kernel(self, key: tuple[str, str], dt: float, cpu: float) -> None:
        self._kernel_time[key] += dt
        self._kernel_calls[key] += 1
        self._kernel_cpu += cpu
        self._stage_kernel[self._stack[-1] if self._stack else STEP] += dt

    def kernels(self) -> _AtenTimer:
        """A context under which native kernels and aten ops are timed."""
        return _AtenTimer(self)

    # ---- per step ----------------------------------------------------------------
    def _reset_step(self) -> None:
        self._wall: dict[str, float] = defaultdict(float)
        self._child: dict[str | None, float] = defaultdict(float)
        self._stage_kernel: dict[str, float] = defaultdict(float)
        self._kernel_time: dict[tuple[str, str], float] = defaultdict(float)
        self._kernel_calls: Counter = Counter()
        self._kernel_cpu = 0.0
        self._step_cpu = 0.0

    def end_step(self, kind: str) -> None:
        """Close the step just run ("plain", "timed" or "host"; its root stage `STEP`
        wrapped by `wrap_stage`)."""
        own = {s: self._wall[s] - self._child[s] for s in self._wall}
        if kind == "host":
            self.host_steps.append({"stages": own, "cpu": self._step_cpu})
        elif kind == "timed":
            self.timed_steps.append({"stage_kernel": dict(self._stage_kernel),
                                     "kernel_time": dict(self._kernel_time),
                                     "kernel_calls": dict(self._kernel_calls),
                                     "kernel_cpu": self._kernel_cpu})
        else:
            self.plain_steps.append({"stages": own, "cpu": self._step_cpu})
        self._reset_step()

    # ---- report ------------------------------------------------------------------
    def summary(self) -> dict:
        """Means per step in ms: each stage's own wall time (plain steps), its kernel
        time (timed steps) and the difference; kernels by name; the step's totals."""
        n_plain, n_timed = len(self.plain_steps), len(self.timed_steps)
        if not n_plain or not n_timed:
            raise ValueError("summary needs plain and timed steps")
        stages = list(dict.fromkeys(s for step in self.plain_steps for s in step["stages"]))
        wall = {s: 1e3 * sum(step["stages"].get(s, 0.0) for step in self.plain_steps) / n_plain
                for s in stages}
        kern = defaultdict(float)
        by_kernel, calls = defaultdict(float), Counter()
        for step in self.timed_steps:
            for s, t in step["stage_kernel"].items():
                kern[s] += 1e3 * t / n_timed
            for k, t in step["kernel_time"].items():
                by_kernel[k] += 1e3 * t / n_timed
            calls.update(step["kernel_calls"])
        step_ms = [1e3 * sum(step["stages"].values()) for step in self.plain_steps]
        n_host = len(self.host_steps)
        host_ms = [1e3 * sum(step["stages"].values()) for step in self.host_steps]
        # (medians: host-only steps are short, and one preempted step would swing a mean)
        host_wall = {s: 1e3 * statistics.median([step["stages"].get(s, 0.0)
                                                 for step in self.host_steps])
                     if n_host else 0.0 for s in stages}
        step_cpu = 1e3 * sum(step["cpu"] for step in self.plain_steps) / n_plain
        kernel_cpu = 1e3 * sum(step["kernel_cpu"] for step in self.timed_steps) / n_timed
        total = sum(wall.values())
        kernel_total = sum(kern.values())
        native = sum(t for (kind, _), t in by_kernel.items() if kind == "native")
        return {
            "plain_steps": n_plain, "timed_steps": n_timed,
            "step_ms": total, "step_ms_median": statistics.median(step_ms),
            "kernel_ms": kernel_total, "native_kernel_ms": native,
            "aten_ms": kernel_total - native,
            "non_kernel_ms": total - kernel_total,
            "non_kernel_share": (total - kernel_total) / total if total else 0.0,
            # the calling thread's CPU time: the step's, the kernels', the rest
            "step_cpu_ms": step_cpu, "kernel_cpu_ms": kernel_cpu,
            "non_kernel_cpu_ms": step_cpu - kernel_cpu,
            "non_kernel_cpu_share": (step_cpu - kernel_cpu) / step_cpu if step_cpu else 0.0,
            "host_only_steps": n_host,
            "host_only_ms": statistics.mean(host_ms) if host_ms else None,
            "host_only_ms_median": statistics.median(host_ms) if host_ms else None,
            "host_only_cpu_ms": (1e3 * sum(step["cpu"] for step in self.host_steps) / n_host
                                 if n_host else None),
            "host_only_share": (statistics.median(host_ms) / statistics.median(step_ms)
                                if host_ms else None),
            "stages": {s: {"wall_ms": wall[s], "kernel_ms": kern.get(s, 0.0),
                           "non_kernel_ms": wall[s] - kern.get(s, 0.0),
                           "host_only_ms": host_wall[s]} for s in stages},
            # aten names carry their namespace ("aten::mm", "onednn::..."); native ones get one
            "kernels": {(name if kind == "aten" else f"native::{name}"):
                        {"kind": kind, "ms": t, "calls_per_step": calls[(kind, name)] / n_timed}
                        for (kind, name), t in sorted(by_kernel.items(), key=lambda kv: -kv[1])},
        }


class _AtenTimer(TorchDispatchMode):
    """Times each aten op the calling thread runs (the op itself: the mode is off
    inside it) and adds it to the clock's kernel time."""

    def __init__(self, clock: KernelClock):
        super().__init__()
        self.clock = clock

    def __enter__(self):
        self.clock.timing_kernels = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.clock.timing_kernels = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c0, t0 = thread_time(), perf_counter()
        out = func(*args, **(kwargs or {}))
        self.clock._kernel(("aten", func.name()), perf_counter() - t0, thread_time() - c0)
        return out


def format_summary(s: dict, top: int = 12) -> str:
    """The summary as a text table: stages (own time; nested stages are not part of
    their parent's row), then the kernels that took the most time."""
    host = s["host_only_ms"] is not None
    lines = [f"{'stage (own time, ms per step: means;':<40}{'wall':>9}{'kernel':>9}{'other':>9}"
             + (f"{'host-only':>11}" if host else ""),
             "  host-only: medians)"]
    for name, st in s["stages"].items():
        lines.append(f"{name:<40}{st['wall_ms']:>9.3f}{st['kernel_ms']:>9.3f}"
                     f"{st['non_kernel_ms']:>9.3f}"
                     + (f"{st['host_only_ms']:>11.3f}" if host else ""))
    lines.append(f"{'whole step':<40}{s['step_ms']:>9.3f}{s['kernel_ms']:>9.3f}"
                 f"{s['non_kernel_ms']:>9.3f}"
                 + (f"{s['host_only_ms_median']:>11.3f}" if host else ""))
    lines.append(f"step {s['step_ms']:.3f} ms (median {s['step_ms_median']:.3f}); kernels "
                 f"{s['kernel_ms']:.3f} ms (native {s['native_kernel_ms']:.3f}, aten "
                 f"{s['aten_ms']:.3f}); not kernel {s['non_kernel_ms']:.3f} ms = "
                 f"{100 * s['non_kernel_share']:.1f}% of the step")
    if host:
        lines.append(f"host-only step (the model's calls replayed): {s['host_only_ms']:.3f} "
                     f"ms (median {s['host_only_ms_median']:.3f}; CPU "
                     f"{s['host_only_cpu_ms']:.3f}) = {100 * s['host_only_share']:.1f}% of "
                     f"the median step")
    lines.append(f"calling thread's CPU time: step {s['step_cpu_ms']:.3f} ms, kernels "
                 f"{s['kernel_cpu_ms']:.3f} ms, not kernel {s['non_kernel_cpu_ms']:.3f} ms = "
                 f"{100 * s['non_kernel_cpu_share']:.1f}%")
    n_aten = sum(k["calls_per_step"] for k in s["kernels"].values() if k["kind"] == "aten")
    lines.append(f"top kernels (ms per step, calls per step; {n_aten:.0f} aten calls a step):")
    for name, k in list(s["kernels"].items())[:top]:
        lines.append(f"  {name:<42}{k['ms']:>9.3f}{k['calls_per_step']:>9.1f}")
    return "\n".join(lines)
