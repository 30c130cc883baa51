"""The sampler's random draw against the exponential race it replaced, in one process.

    .venv/bin/python scripts/sampling_draw_ab.py [--requests 128] [--top-p 1.0] [--rounds 4]

Random rows used to draw by the exponential race (argmax of probs / Exp(1) noise: a
[vocab] row of noise per request per step); they now draw by the inverse of the row's
cumulative distribution (tokenmill.sample.sampler.random_sample: one uniform a row).
Each round runs the same batch (random prompts, temperature 0.8, ignore_eos) once with
each draw, in turn, on one engine; prints tok/s per draw and the ratio.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import tokenmill.sample.sampler as sampler
from tokenmill import LLM, SamplingParams
from tokenmill.bench.throughput import ensure_bench_model


def exponential_race(probs, generators):
    """The draw before: argmax of probs / Exp(1) noise, a seeded row's noise its own."""
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, gen in generators.items():
        noise[row].exponential_(generator=gen)
    return probs.div_(noise).argmax(dim=-1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bench-qwen3-512")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    llm = LLM(ensure_bench_model(args.model), dtype="bfloat16", max_num_seqs=args.requests,
              max_model_len=args.input_len + args.output_len + 8)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, 32000, args.input_len).tolist()}
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0.8, top_p=args.top_p, max_tokens=args.output_len,
                            ignore_eos=True, detokenize=False)
    llm.generate(prompts[:4], params, use_tqdm=False)  # (untimed: first-use costs)
    draws = {"exponential race": exponential_race, "inverse CDF": sampler.random_sample}
    wall = {name: [] for name in draws}
    for r in range(args.rounds):
        for name in (list(draws) if r % 2 else list(draws)[::-1]):
            sampler.random_sample = draws[name]
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall[name].append(time.perf_counter() - t0)
    tokens = args.requests * args.output_len
    for name, times in wall.items():
        print(f"{name}: {tokens / statistics.mean(times):.1f} tok/s "
              f"({', '.join(f'{t:.2f}' for t in times)} s)")
    print(f"inverse CDF / exponential race: "
          f"{statistics.mean(wall['exponential race']) / statistics.mean(wall['inverse CDF']):.2f}x")


if __name__ == "__main__":
    main()
