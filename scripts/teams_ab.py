"""Single-stream decode with the native decode loops' teams on and off (kernels/
parallel.h), in one process, taking turns: the ratio of their output tok/s.

    .venv/bin/python scripts/teams_ab.py --model bench-qwen3-512-gptq-int4 --rounds 16
    .venv/bin/python scripts/teams_ab.py --model bench-qwen3-512 --cpu-capability avx2

One request (a 64-token prompt of fixed ids, greedy, `--tokens` new tokens) per turn;
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
    args = p.parse_args()
    path = ensure_bench_model(args.model) if is_bench_model(args.model) else args.model
    kw = {"cpu_capability": args.cpu_capability} if args.cpu_capability else {}
    llm = LLM(path, dtype=args.dtype, **kw)
    ops = kernels.cpu_ops(args.cpu_capability)
    if ops is None or not hasattr(ops, "set_teams"):
        raise SystemExit("no native kernels with teams at this level")
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 164))}
    rates: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[int]] = {}
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    for _ in range(args.rounds):
        for on in (True, False):
            ops.set_teams(on)
            t0 = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
            rates[on].append(len(out) / (time.perf_counter() - t0))
            tokens[on] = list(out)
    ops.set_teams(True)
    pairs = [a / b for a, b in zip(rates[True], rates[False])]
    print(f"level {ops.capability}, {args.rounds} rounds of {args.tokens} tokens")
    for on in (True, False):
        print(f"{'teams' if on else 'a region per loop':>18}: mean "
              f"{statistics.mean(rates[on]):.1f} tok/s")
    print(f"ratio of means {statistics.mean(rates[True]) / statistics.mean(rates[False]):.3f}x,"
          f" median of the rounds' ratios {statistics.median(pairs):.3f}x"
          f" ({min(pairs):.3f}-{max(pairs):.3f}), same tokens: {tokens[True] == tokens[False]}")


if __name__ == "__main__":
    main()
