"""Single-stream decode with the native decode loops' teams on and off (kernels/
parallel.h), in one process, taking turns: the ratio of their output tok/s.

    .venv/bin/python scripts/teams_ab.py --model bench-qwen3-512-gptq-int4 --rounds 16
    .venv/bin/python scripts/teams_ab.py --model bench-qwen3-512 --cpu-capability avx2
    .venv/bin/python scripts/teams_ab.py --batch 16 --tokens 48 --rounds 4

`--batch` requests (64-token prompts of fixed ids, greedy, `--tokens` new tokens each;
default one) per turn; decode steps of more than 8 rows open no team (parallel.h's
kTeamMaxRows), so at a larger batch the two sides should be level;
the same LLM serves both sides, `set_teams` switching between one OpenMP region per
decode call and one per kernel loop. Prints the mean tok/s of each side, the ratio of
the means and the median of the rounds' ratios, and whether both sides gave the same
tokens (they must).
"""
from __future__ import annotations

import argparse
import statistics
import time

from tokenmill import LLM, SamplingParams, kernels
from tokenmill.bench.throughput import ensure_bench_model, is_bench_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bench-qwen3-512",
                   help="a built-in benchmark model (built once if missing: "
                        "bench-qwen3-512, bench-qwen3-512-gptq-int4, ...) or a folder")
    p.add_argument("--cpu-capability", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--tokens", type=int, default=384)
    p.add_argument("--batch", type=int, default=1, help="requests per turn")
    args = p.parse_args()
    path = ensure_bench_model(args.model) if is_bench_model(args.model) else args.model
    kw = {"cpu_capability": args.cpu_capability} if args.cpu_capability else {}
    llm = LLM(path, dtype=args.dtype, max_num_seqs=max(args.batch, 1), **kw)
    ops = kernels.cpu_ops(args.cpu_capability)
    if ops is None or not hasattr(ops, "set_teams"):
        raise SystemExit("no native kernels with teams at this level")
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(100 + i, 164 + i))} for i in range(args.batch)]
    rates: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[list[int]]] = {}
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    for _ in range(args.rounds):
        for on in (True, False):
            ops.set_teams(on)
            t0 = time.perf_counter()
            outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)]
            rates[on].append(sum(map(len, outs)) / (time.perf_counter() - t0))
            tokens[on] = [list(t) for t in outs]
    ops.set_teams(True)
    pairs = [a / b for a, b in zip(rates[True], rates[False])]
    print(f"level {ops.capability}, {args.rounds} rounds of {args.batch} x {args.tokens} tokens")
    for on in (True, False):
        print(f"{'teams' if on else 'a region per loop':>18}: mean "
              f"{statistics.mean(rates[on]):.1f} tok/s")
    print(f"ratio of means {statistics.mean(rates[True]) / statistics.mean(rates[False]):.3f}x,"
          f" median of the rounds' ratios {statistics.median(pairs):.3f}x"
          f" ({min(pairs):.3f}-{max(pairs):.3f}), same tokens: {tokens[True] == tokens[False]}")


if __name__ == "__main__":
    main()
