"""The sampler's per-step operations, torch's form against the CPU's, on one batch of
logits, in one process.

    .venv/bin/python scripts/sampler_kernels_ab.py [--rows 128] [--vocab 32000] [--reps 20]

Each operation runs on the same fp32 [rows, vocab] logits both ways, in turn, and prints
the best time of each and the ratio (the cut on a fresh copy of the logits each time:
the copy's own time, printed first, is taken off its; the mask and the penalties cost
the same on their own output, and run on one copy): the grammar bitmask (numpy unpacking + masked_fill
against the native grammar_bitmask_), the logprobs (compare-and-sum + topk against the
native row_logprobs), the penalties (dense [rows, vocab + 1] tensors against the seen
tokens only), the min-p / top-k / top-p cut (sort against the native radix select) and
the draw (softmax, cumsum and search against the native draw_rows).
scripts/sampling_ab.py measures the same changes in whole engine runs.
"""
from __future__ import annotations

import argparse
import time

import torch

from tokenmill.kernels import cpu_capability, cpu_ops
from tokenmill.sample import sampler
from tokenmill.sample.bitmask import apply_grammar_bitmask


def best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("no native CPU kernels here: nothing to compare")
    n, v = args.rows, args.vocab
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, v, generator=g) * 3
    buf = torch.empty_like(logits)

    def fresh():
        return buf.copy_(logits)
    rows = torch.arange(n)
    words = (v + 31) // 32
    half = torch.randint(-2**31, 2**31 - 1, (n, words), generator=g, dtype=torch.int32)
    few = torch.zeros(n, words, dtype=torch.int32)
    few[:, :4] = -1  # 128 tokens allowed: a grammar mid-way
    raw = logits.log_softmax(dim=-1)
    chosen = torch.randint(0, v, (n,), generator=g)
    pen = sampler.Penalties(
        rows=rows, presence=torch.full((n,), 0.5), frequency=torch.full((n,), 0.5),
        repetition=torch.full((n,), 1.1), prompt_token_ids=torch.randint(0, v, (n, 256), generator=g),
        output_token_ids=torch.randint(0, v, (n, 128), generator=g))
    top_p, top_k, min_p = torch.full((n,), 0.95), torch.full((n,), 50), torch.full((n,), 0.05)
    cases = {
        "grammar bitmask, half allowed": (
            lambda: apply_grammar_bitmask(buf, rows, half),
            lambda: apply_grammar_bitmask(buf, rows, half, ops)),
        "grammar bitmask, 128 allowed": (
            lambda: apply_grammar_bitmask(buf, rows, few),
            lambda: apply_grammar_bitmask(buf, rows, few, ops)),
        "logprobs, top 5 and rank": (
            lambda: sampler.gather_logprobs(raw, 5, chosen),
            lambda: sampler.gather_logprobs(raw, 5, chosen, ops)),
        "penalties (rep / freq / presence)": (
            lambda: sampler._apply_penalties_dense(buf, pen),
            lambda: sampler.apply_penalties(buf, pen)),
        "top-p 0.95": (
            lambda: sampler.top_k_top_p_(fresh(), None, top_p),
            lambda: sampler.top_k_top_p_(fresh(), None, top_p, ops)),
        "min-p 0.05, top-k 50, top-p 0.95": (
            lambda: sampler.top_k_top_p_(fresh(), top_k, top_p, min_p=min_p),
            lambda: sampler.top_k_top_p_(fresh(), top_k, top_p, ops, min_p=min_p)),
        "draw (inverse CDF)": (
            lambda: sampler.random_sample(logits.softmax(dim=-1), {}),
            lambda: ops.draw_rows(logits, sampler.uniforms(n, {}, logits.device))),
    }
    copy = best_ms(fresh, args.reps)
    print(f"{n} rows x {v} fp32 logits, kernels at level {cpu_capability()}, "
          f"{torch.get_num_threads()} threads; best of {args.reps}, ms; a copy of the "
          f"logits {copy:.3f} ms")
    fresh()
    in_place = {"top-p", "min-p"}
    for name, (before, after) in cases.items():
        a, b = best_ms(before, args.reps), best_ms(after, args.reps)
        if name.split()[0] in in_place:
            a, b = max(a - copy, 1e-3), max(b - copy, 1e-3)
        print(f"{name:36s} torch {a:8.3f}  native {b:8.3f}  {a / b:6.1f}x")


if __name__ == "__main__":
    main()
