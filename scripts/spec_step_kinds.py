"""Where speculation's cost goes on the random workload: every engine step's wall time
by kind, plain engine against each draft-model method (random-weight drafters, so
nearly every draft is rejected), one process, the engines taking turns.

    .venv/bin/python scripts/spec_step_kinds.py --rounds 24 --methods eagle3,dflash [--no-prior] [--no-shadow] [--no-suspend] [--concurrency 16]

Each round gives every engine the same fresh random prompt (--input-len ids, greedy,
--output-len tokens, k = 3); a variant has two engines (see below), so its figures
cover 2 x --rounds requests. A step is `prefill`, `decode` (one token) or `verifyN`
(N tokens: the request's token and its drafts), `+propose` when the runner drafted
from it. With --concurrency C a round gives every engine C such prompts at once. Prints per engine the wall time per request, the ratio of the plain engine's
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


def timed_steps(core, into: dict, concurrency: int = 1) -> None:
    """Wrap the engine core's _execute: each step's wall time into[kind]."""
    execute = core._execute

    def step(so):
        t0 = time.perf_counter()
        out = execute(so)
        seconds = time.perf_counter() - t0
        n = so.total_num_scheduled_tokens
        drafts = core.runner.step_drafts
        if concurrency > 1:  # a step of rows with one token each, or one with a prompt
            reqs = len(so.num_scheduled_tokens)
            kind = f"decode{reqs}" if n == reqs else "prefill" if max(
                so.num_scheduled_tokens.values()) > 8 else f"verify{n}/{reqs}"
        else:  # one request: 2-8 tokens are its token and its drafts, more its prompt
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
    p.add_argument("--output-len", default="128",
                   help="new tokens a request (default 128), or LO:HI for a length drawn "
                        "per request and round (a burst whose batch drains at its tail)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="requests a round gives each engine at once (default 1); above 1 "
                        "a step's kind counts its requests (decode16: 16 one-token rows)")
    p.add_argument("--warmup-rounds", type=int, default=8,
                   help="untimed rounds first (default 8: the drafters' server-wide record "
                        "needs about five requests)")
    p.add_argument("--same-prompt", action="store_true",
                   help="one prompt for every round, as bench spec has (its prefix cached "
                        "after the first)")
    p.add_argument("--no-prior", action="store_true",
                   help="also run each method with its drafter's server-wide record off "
                        "(every request starts at k and five probes)")
    p.add_argument("--no-shadow", action="store_true",
                   help="also run each method with verified probes out of a back-off (not "
                        "shadow probes: spec_decode/drafter.py)")
    p.add_argument("--no-suspend", action="store_true",
                   help="also run each method with every request drafting under a poor "
                        "record (no suspended requests: spec_decode/drafter.py)")
    args = p.parse_args()
    lo, _, hi = args.output_len.partition(":")
    out_lo, out_hi = int(lo), int(hi or lo)
    path = ensure_bench_model(args.model)
    common = dict(dtype="bfloat16", seed=0, max_model_len=args.input_len + out_hi + 8,
                  max_num_seqs=args.concurrency)
    # name -> (model, speculative config, record on, shadow probes on, suspension on)
    variants = {"plain": (path, None, True, True, True)}
    for method in args.methods.split(","):
        target, spec = random_drafter({"method": method, "num_speculative_tokens": 3}, path)
        variants[method] = (target, spec, True, True, True)
        if args.no_prior:
            variants[f"{method}-no-prior"] = (target, spec, False, True, True)
        if args.no_shadow:
            variants[f"{method}-no-shadow"] = (target, spec, True, False, True)
        if args.no_suspend:
            variants[f"{method}-no-suspend"] = (target, spec, True, True, False)
    # Two engines a variant, built in palindromic order (A B C C B A): in one process an
    # engine built earlier decodes measurably slower than one built later (up to ~10%
    # from the first to the fourth here, placement of its memory), which a single
    # engine a variant would charge to whichever variant was built first.
    names = list(variants) + list(variants)[::-1]
    engines = []
    for name in names:
        model, spec, record, shadow, suspend = variants[name]
        llm = LLM(model, **common) if spec is None else LLM(
            model, speculative_config=SpeculativeConfig.from_any(spec), **common)
        if not record:
            llm.llm_engine.engine_core.runner.drafter.poor_record = lambda: False
        if not shadow:
            llm.llm_engine.engine_core.runner.drafter._shadow_probes = lambda *a: None
        if not suspend:
            llm.llm_engine.engine_core.scheduler.config.suspend_drafts = False
        engines.append((name, llm))
    steps = {name: defaultdict(list) for name in variants}
    for name, llm in engines:
        timed_steps(llm.llm_engine.engine_core, steps[name], args.concurrency)

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
    rng = np.random.default_rng(0)
    wall = defaultdict(list)
    warm = max(1, args.warmup_rounds)
    for r in range(args.rounds + warm):
        if r == 0 or not args.same_prompt:
            prompt = [{"prompt_token_ids": rng.integers(0, 32000, args.input_len).tolist()}
                      for _ in range(args.concurrency)]
            lengths = rng.integers(out_lo, out_hi + 1, args.concurrency).tolist()
            sampling = [params(n) for n in lengths]
        if r == warm:
            for kinds in steps.values():
                kinds.clear()
        for name, llm in (engines if r % 2 else engines[::-1]):  # each engine first in turn
            t0 = time.perf_counter()
            llm.generate(prompt, sampling, use_tqdm=False)
            if r >= warm:
                wall[name].append(time.perf_counter() - t0)
    runs = 2 * args.rounds  # rounds a variant ran (two engines)
    plain = statistics.mean(wall["plain"])
    for name in variants:
        mean = statistics.mean(wall[name])
        resumed = sum(llm.llm_engine.engine_core.scheduler.num_draft_resumes
                      for n, llm in engines if n == name)
        print(f"{name}: {mean * 1e3:.1f} ms a round, plain / {name} {plain / mean:.3f}x"
              + (f", {resumed} requests resumed to draft" if resumed else ""))
        for kind, times in sorted(steps[name].items()):
            print(f"  {kind:>16}: {len(times) / runs:6.1f} a round, median "
                  f"{statistics.median(times) * 1e3:7.3f} ms, {sum(times) / runs * 1e3:7.2f}"
                  f" ms a round")


if __name__ == "__main__":
    main()
