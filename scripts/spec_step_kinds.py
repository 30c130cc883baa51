"""Where speculation's cost goes on the random workload: every engine step's wall time
by kind, plain engine against each draft-model method (random-weight drafters, so
nearly every draft is rejected), one process, the engines taking turns.

    .venv/bin/python scripts/spec_step_kinds.py --rounds 12 --methods eagle3,dflash

Each round gives every engine the same fresh random prompt (--input-len ids, greedy,
--output-len tokens, k = 3). A step is `prefill`, `decode` (one token) or `verifyN`
(N tokens: the request's token and its drafts), `+propose` when the runner drafted
from it. Prints per engine the wall time per request, the ratio of the plain engine's
mean to its own (bench spec's ratio, from many rounds in one process), and per step
kind the steps per request, the median step and the time per request.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import numpy as np

from tokenmill import LLM, SamplingParams
from tokenmill.bench.spec import random_drafter
from tokenmill.bench.throughput import ensure_bench_model
from tokenmill.spec_decode.config import SpeculativeConfig


def timed_steps(core, into: dict) -> None:
    """Wrap the engine core's _execute: each step's wall time into[kind]."""
    execute = core._execute

    def step(so):
        t0 = time.perf_counter()
        out = execute(so)
        seconds = time.perf_counter() - t0
        n = so.total_num_scheduled_tokens
        drafts = core.runner.step_drafts
        # (one request: 2-8 tokens are its token and its drafts, more its prompt)
        kind = "decode" if n == 1 else f"verify{n}" if n <= 8 else "prefill"
        if drafts and any(len(d) for d in drafts):
            kind += "+propose"
        into[kind].append(seconds)
        return out
    core._execute = step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bench-qwen3-512")
    p.add_argument("--methods", default="eagle3,dflash")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    args = p.parse_args()
    path = ensure_bench_model(args.model)
    common = dict(dtype="bfloat16", seed=0, max_model_len=args.input_len + args.output_len + 8,
                  max_num_seqs=1)
    engines = {"plain": LLM(path, **common)}
    for method in args.methods.split(","):
        target, spec = random_drafter({"method": method, "num_speculative_tokens": 3}, path)
        engines[method] = LLM(target, speculative_config=SpeculativeConfig.from_any(spec),
                              **common)
    steps = {name: defaultdict(list) for name in engines}
    for name, llm in engines.items():
        timed_steps(llm.llm_engine.engine_core, steps[name])
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                            detokenize=False)
    rng = np.random.default_rng(0)
    wall = defaultdict(list)
    for r in range(args.rounds + 1):  # round 0 warms up
        prompt = [{"prompt_token_ids": rng.integers(0, 32000, args.input_len).tolist()}]
        for name, llm in engines.items():
            if r == 1:
                steps[name].clear()
            t0 = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False)
            if r:
                wall[name].append(time.perf_counter() - t0)
    plain = statistics.mean(wall["plain"])
    for name in engines:
        mean = statistics.mean(wall[name])
        print(f"{name}: {mean * 1e3:.1f} ms a request, plain / {name} {plain / mean:.3f}x")
        for kind, times in sorted(steps[name].items()):
            print(f"  {kind:>16}: {len(times) / args.rounds:6.1f} a request, median "
                  f"{statistics.median(times) * 1e3:7.3f} ms, {sum(times) / args.rounds * 1e3:7.2f}"
                  f" ms a request")


if __name__ == "__main__":
    main()
