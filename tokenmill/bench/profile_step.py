"""Profile whole engine steps (scheduler, input prep, forward, sampling, output
processing) under torch.profiler and print the top ops.

    .venv/bin/python -m tokenmill.bench.profile_step                  # 32 decode steps, batch 32
    .venv/bin/python -m tokenmill.bench.profile_step --batch-size 1   # single stream
    .venv/bin/python -m tokenmill.bench.profile_step --phase prefill --trace /tmp/prefill.json

decode: --batch-size requests with --input-len-token random prompts are prefilled
and stepped --warmup-steps times untimed, then --steps decode steps (every request
samples one token each) run under the profiler. prefill: the profiled steps are
those that compute the prompts (chunked by --max-num-batched-tokens), until every
request has its first token. Each step is one `record_function("engine.step")`
range; the table is `key_averages()` sorted by --sort-by. `--trace` also writes a
Chrome trace (chrome://tracing, https://ui.perfetto.dev). The profiler adds
overhead: the printed ms per step is for comparing runs of this script, not a
benchmark (use `tokenmill bench latency` / `throughput` for those).

`--host-time` runs no profiler: it measures how much of a decode step is kernel time
and how much is the rest (the Python between the kernels), per stage
(bench/kernel_clock.py says how): after the warm-up, rounds of --round-steps plain
steps (wall time per stage) alternate with as many instrumented ones (time inside
every native kernel and aten op) and as many host-only ones (the model's forward,
logits and greedy head replay the step before's results: the rest, measured
directly), --steps of each in all. `--json PATH` writes the figures.

    .venv/bin/python -m tokenmill.bench.profile_step --host-time --batch-size 1 --input-len 64
    .venv/bin/python -m tokenmill.bench.profile_step --host-time --batch-size 128 --input-len 64
"""
from __future__ import annotations

import argparse
import sys
import time

from tokenmill.bench.throughput import (BENCH_MODEL_NAME, BENCH_MODELS, DTYPES,
                                        ensure_bench_model, is_bench_model, platform_kwargs, positive_int,
                                        read_model_config)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tokenmill.bench.profile_step",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help=f"local HF folder or a built-in benchmark model "
                        f"({', '.join(BENCH_MODELS)}); default {BENCH_MODEL_NAME}")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--phase", default="decode", choices=("decode", "prefill"))
    p.add_argument("--batch-size", type=positive_int, default=32, help="requests (default 32)")
    p.add_argument("--input-len", type=positive_int, default=256,
                   help="prompt tokens per request (default 256)")
    p.add_argument("--steps", type=positive_int, default=32,
                   help="profiled decode steps (default 32; decode only)")
    p.add_argument("--warmup-steps", type=int, default=4,
                   help="untimed decode steps before profiling (default 4)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None)
    p.add_argument("--block-size", type=positive_int, default=None,
                   help="tokens per KV cache block (default: the engine's)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sort-by", default="self_cpu_time_total",
                   help="key_averages().table sort key (default self_cpu_time_total)")
    p.add_argument("--row-limit", type=positive_int, default=30)
    p.add_argument("--record-shapes", action="store_true",
                   help="group the table by input shapes too")
    p.add_argument("--trace", default=None, metavar="PATH", help="also write a Chrome trace")
    p.add_argument("--host-time", action="store_true",
                   help="no profiler: kernel time against the rest of each decode step, per "
                        "stage (plain and instrumented steps interleaved)")
    p.add_argument("--round-steps", type=positive_int, default=8,
                   help="--host-time: plain (then instrumented) steps per round (default 8)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads once the engine is built (default: the engine's); "
                        "--threads 1 with --host-time: the calling thread's CPU time is "
                        "then all of the step's work, whatever else shares the machine")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="--host-time: write the figures as JSON")
    from tokenmill.engine.arg_utils import add_cpu_platform_args
    add_cpu_platform_args(p)
    return p


# (object path from the LLMEngine, method) pairs timed as their own profiler ranges.
STAGES = (("engine_core.scheduler", "schedule"), ("engine_core.scheduler", "update_from_output"),
          ("engine_core.runner", "_prepare_inputs"), ("engine_core.runner", "execute_model"),
          ("engine_core.runner", "sample_tokens"), ("output_processor", "process"))


def _wrap(obj, method: str, label: str) -> None:
    from torch.profiler import record_function
    inner = getattr(obj, method)

    def wrapped(*a, **kw):
        with record_function(label):
            return inner(*a, **kw)
    setattr(obj, method, wrapped)  # an instance attribute: shadows the class's method


def label_ranges(engine) -> None:
    """Profiler ranges for the engine's stages (`stage::...`) and for every module of
    the model (`module::ClassName`): native kernels called from Python (paged
    attention, GEMV, RMSNorm) are not aten ops, so without a range their time
    would only show as the self time of whatever encloses them."""
    for path, method in STAGES:
        obj = engine
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is not None and hasattr(obj, method):
            _wrap(obj, method, f"stage::{type(obj).__name__}.{method}")
    model = getattr(getattr(engine.engine_core, "runner", None), "model", None)
    if model is not None:
        for module in model.modules():
            _wrap(module, "forward", f"module::{type(module).__name__}")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.host_time and args.phase != "decode":
        parser.error("--host-time: decode steps only (--phase decode), which repeat alike")
    if args.host_time and args.async_scheduling:
        parser.error("--host-time: the timed aten ops are the calling thread's: "
                     "--no-async-scheduling")
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from tokenmill import LLM, SamplingParams
    from tokenmill.sampling_params import RequestOutputKind

    name = args.model or BENCH_MODEL_NAME
    model_path = ensure_bench_model(name) if is_bench_model(name) else name
    vocab = read_model_config(model_path)["vocab_size"]
    # (+4: room for async scheduling's lag)
    per_step = 2 + HOST_STEPS_PER_STEP if args.host_time else 1
    decode_steps = args.warmup_steps + args.steps * per_step + 4
    if args.host_time:  # every request stays to the end: chunked prompts start apart
        decode_steps += args.batch_size
    clock = None
    if args.host_time:
        from tokenmill import kernels
        from tokenmill.bench.kernel_clock import KernelClock
        clock = KernelClock()
        ops = kernels.cpu_ops(args.cpu_capability) if args.cpu_kernels != "torch" else None
        if ops is not None:  # before the engine is built: layers keep references to kernels
            clock.wrap_native(ops)
    llm = LLM(model_path, dtype=args.dtype, seed=args.seed,
              max_model_len=args.input_len + decode_steps, max_num_seqs=max(args.batch_size, 1),
              max_num_batched_tokens=args.max_num_batched_tokens,
              async_scheduling=args.async_scheduling, **platform_kwargs(args),
              **({"block_size": args.block_size} if args.block_size is not None else {}))
    engine = llm.llm_engine
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"platform: {engine.platform.describe()}")
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(temperature=0, max_tokens=decode_steps, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    # One untimed request first: kernels, allocator and caches are warm when profiling starts.
    engine.add_request(None, {"prompt_token_ids": rng.integers(0, vocab, args.input_len).tolist()},
                       params.clone(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    for _ in range(args.batch_size):
        engine.add_request(None, {"prompt_token_ids":
                                  rng.integers(0, vocab, args.input_len).tolist()}, params)
    started: set[str] = set()

    def step() -> None:
        if clock is not None:  # no profiler range: its enter and exit are aten ops too
            outs = engine.step()
        else:
            with record_function("engine.step"):
                outs = engine.step()
        for out in outs:
            if out.outputs[0].token_ids:
                started.add(out.request_id)

    def prefilling() -> bool:
        return len(started) < args.batch_size and engine.has_unfinished_requests()

    if args.phase == "decode":
        while prefilling():
            step()
        for _ in range(args.warmup_steps):
            step()
    if clock is not None:
        return _host_time(args, engine, clock, step, model_path)
    label_ranges(engine)
    activities = [ProfilerActivity.CPU]
    if engine.model_config.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    times = []
    # With async scheduling the forward runs on the engine's worker thread: record every thread.
    extra = {}
    try:
        from torch._C._profiler import _ExperimentalConfig
        extra["experimental_config"] = _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):  # an older torch: the caller's thread only
        pass
    with profile(activities=activities, record_shapes=args.record_shapes, **extra) as prof:
        while (len(times) < args.steps) if args.phase == "decode" else prefilling():
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    kwargs = {"group_by_input_shape": True} if args.record_shapes else {}
    print(prof.key_averages(**kwargs).table(sort_by=args.sort_by, row_limit=args.row_limit))
    ms = 1e3 * sum(times) / max(len(times), 1)
    print(f"{args.phase}: {len(times)} profiled steps, batch {args.batch_size}, prompts of "
          f"{args.input_len} tokens, {model_path} {args.dtype}, torch threads "
          f"{torch.get_num_threads()}: {ms:.2f} ms per step under the profiler")
    if args.trace:
        prof.export_chrome_trace(args.trace)
        print(f"wrote {args.trace}")
    return 0


# Host-only steps per plain step: they are short and their spread is wide.
HOST_STEPS_PER_STEP = 4


class _CachedHead:
    """The runner's greedy head, replayed in host-only steps (KernelClock.cached)."""

    def __init__(self, head, clock):
        self.lm_head = head.lm_head
        self._call = clock.cached(head.__call__)
        # (what the real step's call said: host-only steps replay real ones)
        self.rows_surely_finite = head.rows_surely_finite

    def __call__(self, x):
        return self._call(x)


def _host_time(args, engine, clock, step, model_path) -> int:
    """Plain and instrumented decode steps in alternating rounds (the KV cache grows
    alike under both); the table of kernel_clock.format_summary."""
    import json

    import torch

    from tokenmill.bench.kernel_clock import STEP, format_summary
    core = engine.engine_core
    runner = getattr(core, "runner", None)
    if runner is None:
        print("--host-time needs the engine core in this process", file=sys.stderr)
        return 2
    for path, method in STAGES:
        obj = engine
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is not None and hasattr(obj, method):
            clock.wrap_stage(obj, method, f"{type(obj).__name__}.{method}")
    model = runner.model
    model.forward = clock.cached(model.forward)  # (instance attributes: nn.Module calls them)
    model.compute_logits = clock.cached(model.compute_logits)
    if runner.greedy_head is not None:
        runner.greedy_head = _CachedHead(runner.greedy_head, clock)
    clock.wrap_stage(model, "forward", "model.forward")
    clock.wrap_stage(engine, "step", STEP)
    done = 0
    while done < args.steps:
        n = min(args.round_steps, args.steps - done)
        for _ in range(n):
            step()
            clock.end_step("plain")
        with clock.kernels():
            for _ in range(n):
                step()
                clock.end_step("timed")
        clock.host_only = True
        for _ in range(n * HOST_STEPS_PER_STEP):
            step()
            clock.end_step("host")
        clock.host_only = False
        done += n
    s = clock.summary()
    s.update(model=model_path, dtype=args.dtype, batch_size=args.batch_size,
             input_len=args.input_len, torch_threads=torch.get_num_threads(),
             platform=engine.platform.describe())
    print(f"host time: {args.steps} plain + {args.steps} instrumented + "
          f"{args.steps * HOST_STEPS_PER_STEP} host-only decode steps, batch "
          f"{args.batch_size}, prompts of {args.input_len} tokens, {model_path} {args.dtype}, "
          f"torch threads {torch.get_num_threads()}")
    print(format_summary(s, top=args.row_limit))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
