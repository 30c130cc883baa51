"""The calling thread's CPU time per decode step: inside the native kernels, and in each
engine stage, averaged over many plain steps (no profiler, no dispatch mode: only a
thread_time pair around each native kernel call and each stage).

    PYTHONPATH=. .venv/bin/python scripts/host_cpu_stages.py --batch-size 1 --steps 600
    PYTHONPATH=. .venv/bin/python scripts/host_cpu_stages.py --batch-size 128 --steps 64
    PYTHONPATH=. .venv/bin/python scripts/host_cpu_stages.py --speculative-config \
        '{"method": "eagle3", "num_speculative_tokens": 3}'

`rest` is the step's CPU time outside the native kernels: the host time, plus at batch
sizes past the native linears' row limit the aten GEMMs and the logits' argmax (which
the stages' figures show apart). Unlike `profile_step --host-time`'s host-only steps,
the host code here runs right after the kernels streamed the weights, as in a real
step: cold caches included (docs/benchmarks.md, "Host time per step").
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import numpy as np
import torch

from tokenmill import LLM, SamplingParams, kernels
from tokenmill.bench.throughput import ensure_bench_model
from tokenmill.sampling_params import RequestOutputKind

NATIVE = ("decode_layers", "greedy_lm_head", "rms_norm", "paged_decode", "silu_mul",
          "qk_norm_rope", "add_rms_norm_", "kv_cache_write", "linear_quant", "paged_prefill")


def wrap_thread_time(acc: Counter, obj, name: str, label: str, calls: Counter | None = None,
                     call_labels: tuple[str, ...] = ()) -> None:
    """Replace obj.name with a wrapper adding its thread CPU time to acc[label] (and,
    with `calls`, one to calls[label] and to each of `call_labels`)."""
    inner = getattr(obj, name)

    def timed(*a, **kw):
        t0 = time.thread_time_ns()
        try:
            return inner(*a, **kw)
        finally:
            acc[label] += time.thread_time_ns() - t0
            if calls is not None:
                for key in (label,) + call_labels:
                    calls[key] += 1
    setattr(obj, name, timed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bench-qwen3-512")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="e.g. '{\"method\": \"eagle3\", \"num_speculative_tokens\": 3}' "
                        "(a draft-model method without a model gets bench spec's random "
                        "drafter: its drafts rejected, the requests backing off)")
    args = p.parse_args()
    acc: Counter = Counter()
    ops = kernels.cpu_ops(None)
    for name in NATIVE:  # before the engine is built: layers keep references to kernels
        if hasattr(ops, name):
            wrap_thread_time(acc, ops, name, "native kernels")
    steps, bs = args.steps, args.batch_size
    path, spec = ensure_bench_model(args.model), None
    if args.speculative_config:
        from tokenmill.bench.spec import random_drafter
        from tokenmill.spec_decode.config import SpeculativeConfig
        path, spec = random_drafter(json.loads(args.speculative_config), path)
        spec = SpeculativeConfig.from_any(spec)
    llm = LLM(path, dtype="bfloat16", seed=0, speculative_config=spec,
              max_model_len=args.input_len + steps + 64, max_num_seqs=bs,
              async_scheduling=False)
    torch.set_num_threads(1)
    engine = llm.llm_engine
    core, runner = engine.engine_core, engine.engine_core.runner
    for obj, name, label in ((core.scheduler, "schedule", "Scheduler.schedule"),
                             (core.scheduler, "update_from_output", "Scheduler.update"),
                             (runner, "_prepare_inputs", "ModelRunner._prepare_inputs"),
                             (runner, "execute_model", "ModelRunner.execute_model"),
                             (runner, "sample_tokens", "ModelRunner.sample_tokens"),
                             (engine.output_processor, "process", "OutputProcessor.process")):
        wrap_thread_time(acc, obj, name, label)
    if runner.drafter is not None:
        name = "propose_with_model" if runner.drafter.model_proposer is not None else "propose"
        wrap_thread_time(acc, runner.drafter, name, f"Drafter.{name}")
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    for _ in range(bs):
        engine.add_request(None, {"prompt_token_ids":
                                  rng.integers(0, 1000, args.input_len).tolist()}, params)
    for _ in range(min(bs, 16) + 8):  # the prompts, then a few decode steps
        engine.step()
    wrap_thread_time(acc, engine, "step", "step")
    acc.clear()
    for _ in range(steps):
        engine.step()
    print(f"{args.model} bf16, batch {bs}, {steps} decode steps, one torch thread: "
          f"calling thread's CPU us per step")
    for label, ns in sorted(acc.items()):
        print(f"  {label:30s} {ns / steps / 1e3:9.1f}")
    rest = (acc["step"] - acc["native kernels"]) / steps / 1e3
    print(f"  {'rest (step - native kernels)':30s} {rest:9.1f} "
          f"= {100 * rest * 1e3 * steps / max(acc['step'], 1):.1f}% of the step")


if __name__ == "__main__":
    main()
