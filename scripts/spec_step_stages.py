"""The calling thread's CPU time of a decode step that proposes nothing, with and without
a draft model: what a request backing off from a drafter whose drafts all fail pays per
step over the plain engine (`tokenmill bench spec --workload random`'s ratio).

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python scripts/spec_step_stages.py --steps 64 --rounds 10

One request (a random --input-len prompt, greedy) per engine: plain, then each method
with its random-weight drafter (bench/spec.py builds them). Only steps that schedule
one token and propose none count (a backing-off request's step); each figure is the
median over those steps of the engine step's thread CPU time, and the per-stage
figures the mean of the stage's time in those steps. The engines take turns in
--rounds rounds, so a slow spell of the machine hits them alike.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import numpy as np
import torch

from host_cpu_stages import wrap_thread_time  # (scripts/: on sys.path when run)

from tokenmill import LLM, SamplingParams, kernels
from tokenmill.bench.spec import random_drafter
from tokenmill.bench.throughput import ensure_bench_model
from tokenmill.sampling_params import RequestOutputKind

METHODS = {"eagle3": '{"method": "eagle3", "num_speculative_tokens": 3}',
           "dflash": '{"method": "dflash", "num_speculative_tokens": 3}'}


class Probe:
    """One engine and its instrumented stages."""

    def __init__(self, name: str, path: str, spec: dict | None, args, native: Counter,
                 native_calls: Counter):
        self.name = name
        self.acc, self.calls = Counter(), Counter()
        self.native, self.native_calls = native, native_calls
        self.llm = LLM(path, dtype="bfloat16", seed=0, speculative_config=spec,
                       max_model_len=args.input_len + args.steps * args.rounds + 256,
                       max_num_seqs=1, async_scheduling=False)
        torch.set_num_threads(1)
        engine = self.llm.llm_engine
        self.engine = engine
        core, runner = engine.engine_core, engine.engine_core.runner
        self.runner = runner
        stages = [(core.scheduler, "schedule", "schedule"),
                  (core.scheduler, "update_from_output", "scheduler update"),
                  (runner, "execute_model", "execute_model"),
                  (runner.model, "forward", "  target forward"),
                  (runner, "sample_tokens", "sample_tokens"),
                  (engine.output_processor, "process", "output processor")]
        if runner.drafter is not None:
            stages.append((runner.drafter, "propose_with_model", "  propose_with_model"))
            mp = runner.drafter.model_proposer
            if args.max_rows:
                mp.deferred.max_rows = args.max_rows
            stages.append((mp.deferred, "wait_all", "    deferred.wait_all"))
            stages.append((mp.model, "forward", "    drafter forward"))
        for obj, name, label in stages:
            wrap_thread_time(self.acc, obj, name, label, self.calls)
        rng = np.random.default_rng(0)
        params = SamplingParams(temperature=0, max_tokens=args.steps * args.rounds + 200,
                                ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        engine.add_request(None, {"prompt_token_ids":
                                  rng.integers(0, 1000, args.input_len).tolist()}, params)
        for _ in range(100):  # the prompt, then past the drafter's first back-offs
            engine.step()
        self.times: list[int] = []
        self.stage_sum: Counter = Counter()
        self.stage_calls: Counter = Counter()
        self.counted = 0
        self.per_step: list[dict] = []
        self.all_times: list[int] = []  # every step (one token each: no draft is accepted)

    def run(self, steps: int) -> None:
        sched = self.engine.engine_core.scheduler
        for _ in range(steps):
            self.acc.clear()
            self.calls.clear()
            n0, c0 = self.native.copy(), self.native_calls.copy()
            t0 = time.thread_time_ns()
            self.engine.step()
            t = time.thread_time_ns() - t0
            self.all_times.append(t)
            req = next(iter(sched.running), None) if sched.running else None
            proposed = req is not None and bool(getattr(req, "spec_token_ids", None))
            last = self.runner.last_step
            one_row = last is not None and int(last.query_start_loc[1]) == 1
            if one_row and not proposed:
                self.times.append(t)
                self.counted += 1
                self.stage_sum.update(self.acc)
                self.stage_sum["native kernels"] += self.native["native"] - n0["native"]
                self.per_step.append(dict(self.acc, step=t,
                                          native=self.native["native"] - n0["native"]))
                self.stage_calls.update(self.calls)
                self.stage_calls["native kernels"] += (self.native_calls["native"]
                                                       - c0["native"])
                self.stage_calls["  decode_layers"] += (self.native_calls["decode_layers"]
                                                        - c0["decode_layers"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bench-qwen3-512")
    p.add_argument("--steps", type=int, default=200, help="steps per engine per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--methods", default="eagle3,dflash")
    p.add_argument("--max-rows", type=int, default=None,
                   help="rows a request's decode rows may gather before they run "
                        "(default: spec_decode/deferred.py's MAX_DEFERRED_ROWS)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    native, native_calls = Counter(), Counter()
    ops = kernels.cpu_ops(None)
    for name in dir(ops):  # before the engines are built: layers keep kernel references
        fn = getattr(ops, name)
        if name.startswith("_") or not callable(fn) or isinstance(fn, type):
            continue
        wrap_thread_time(native, ops, name, "native", native_calls, (name,))
    target = ensure_bench_model(args.model)
    probes = [Probe("plain", target, None, args, native, native_calls)]
    for m in args.methods.split(","):
        path, spec = random_drafter(json.loads(METHODS[m]), target)
        probes.append(Probe(m, path, spec, args, native, native_calls))
    for _ in range(args.rounds):
        for pr in probes:
            pr.run(args.steps)
    base = np.median(probes[0].times) / 1e3
    out = {}
    for pr in probes:
        med = np.median(pr.times) / 1e3
        mean = np.mean(pr.times) / 1e3
        p10 = np.percentile(pr.times, 10) / 1e3  # the quietest steps: least disturbed by
        base10 = np.percentile(probes[0].times, 10) / 1e3  # whatever shares the machine
        print(f"{pr.name}: {pr.counted} no-proposal decode steps, median step "
              f"{med:.1f} us thread CPU ({med - base:+.1f} us, {med / base:.3f}x plain), "
              f"mean {mean:.1f} us ({mean / (np.mean(probes[0].times) / 1e3):.3f}x plain)")
        print(f"  10th percentile step {p10:.1f} us ({p10 - base10:+.1f} us, "
              f"{p10 / base10:.3f}x plain)")
        every = np.mean(pr.all_times) / 1e3
        print(f"  every step (proposing ones too): mean {every:.1f} us "
              f"({every / (np.mean(probes[0].all_times) / 1e3):.3f}x plain)")
        n = max(pr.counted, 1)
        print(f"  {'stage':28s} {'mean us':>8s} {'median':>8s} calls/step")
        for label in sorted(pr.stage_sum):
            key = "native" if label == "native kernels" else label
            mid = np.median([d.get(key, 0) for d in pr.per_step]) / 1e3
            print(f"  {label:28s} {pr.stage_sum[label] / n / 1e3:8.1f} {mid:8.1f}  "
                  f"{pr.stage_calls[label] / n:5.2f}")
        print(f"  {'  decode_layers calls':28s} {pr.stage_calls['  decode_layers'] / n:5.2f}")
        out[pr.name] = dict(median_us=med, p10_us=p10, steps=pr.counted, mean_us=mean, every_step_us=every,
                            stages_us={k: v / n / 1e3 for k, v in pr.stage_sum.items()},
                            calls={k: v / n for k, v in pr.stage_calls.items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
