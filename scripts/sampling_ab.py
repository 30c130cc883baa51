"""The sampler's pieces against what they replaced, in one process.

    .venv/bin/python scripts/sampling_ab.py [--compare draw|cut|penalties|logprobs]
        [--requests 128] [--top-p 1.0] [--top-k 0] [--min-p 0] [--repetition-penalty 1.0]
        [--presence-penalty 0] [--frequency-penalty 0] [--logprobs N] [--rounds 4]

--compare draw: random rows used to draw from a probabilities tensor (softmax, cumsum
and a search: sampler.random_sample, which also replaced an exponential race); on the
CPU they now draw from the scaled logits themselves (sampler.draw, the native
draw_rows).
--compare cut (give --top-p below 1, --top-k or --min-p): min-p used a softmax and a
masked_fill, the top-k / top-p mask a sort of each row, a mask of the sorted copy and
a scatter back; on the CPU they are now one radix select that masks each row in place
(sampler.top_k_top_p_, the native top_k_top_p_mask_).
--compare penalties (give a penalty): repetition / frequency / presence penalties used
dense [rows, vocab + 1] count and mask tensors; on the CPU they now touch only the
tokens each row has seen (sampler.apply_penalties).
--compare logprobs (give --logprobs): the chosen token's rank and the top-k took
torch's compare-and-sum and topk; on the CPU they are now one pass of the native
row_logprobs (sampler.gather_logprobs).
Each round runs the same batch (random prompts, temperature 0.8, ignore_eos) once with
each variant, in turn, on one engine; prints tok/s per variant and the ratio.
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


def softmax_cumsum_search(logits, md, ops=None):
    """The draw before: a probabilities tensor, its cumsum and a search (the cut, if any,
    still the native one)."""
    return sampler.random_sample(sampler.compute_probs(logits, md, ops), md.generators)


def sort_and_scatter(logits, k, p, ops=None, min_p=None):
    """The cut before: min_p by a softmax, then sort each row, mask the sorted copy,
    scatter it back (in place here, as top_k_top_p_ works)."""
    if min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
        logits.masked_fill_(probs < threshold, float("-inf"))
    if k is None and p is None:
        return None
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if k is not None:
        k = torch.where(k > 0, k, vocab).clamp(max=vocab).long()
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    logits.scatter_(1, order, sorted_logits)
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bench-qwen3-512")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--compare", choices=["draw", "cut", "penalties", "logprobs"],
                   default="draw")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    if args.compare == "cut" and args.top_p >= 1 and args.top_k <= 0 and args.min_p <= 0:
        p.error("--compare cut needs --top-p below 1, --top-k or --min-p above 0")
    if args.compare == "penalties" and (args.repetition_penalty == 1 and not args.presence_penalty
                                        and not args.frequency_penalty):
        p.error("--compare penalties needs a penalty")
    if args.compare == "logprobs" and args.logprobs is None:
        p.error("--compare logprobs needs --logprobs")
    llm = LLM(ensure_bench_model(args.model), dtype="bfloat16", max_num_seqs=args.requests,
              max_model_len=args.input_len + args.output_len + 8)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, 32000, args.input_len).tolist()}
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0.8, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, logprobs=args.logprobs,
                            max_tokens=args.output_len,
                            ignore_eos=True, detokenize=False)
    llm.generate(prompts[:4], params, use_tqdm=False)  # (untimed: first-use costs)
    if args.compare == "draw":
        attr, variants = "draw", {"softmax, cumsum, search": softmax_cumsum_search,
                                  "from the logits": sampler.draw}
    elif args.compare == "cut":
        attr, variants = "top_k_top_p_", {"sort and scatter": sort_and_scatter,
                                          "radix select": sampler.top_k_top_p_}
    elif args.compare == "penalties":
        attr, variants = "apply_penalties", {"dense": sampler._apply_penalties_dense,
                                             "seen tokens": sampler.apply_penalties}
    else:
        native = sampler.gather_logprobs
        attr, variants = "gather_logprobs", {
            "torch": lambda lp, k, chosen, ops=None: native(lp, k, chosen),
            "one pass": native}
    wall = {name: [] for name in variants}
    for r in range(args.rounds):
        for name in (list(variants) if r % 2 else list(variants)[::-1]):
            setattr(sampler, attr, variants[name])
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall[name].append(time.perf_counter() - t0)
    tokens = args.requests * args.output_len
    for name, times in wall.items():
        print(f"{name}: {tokens / statistics.mean(times):.1f} tok/s "
              f"({', '.join(f'{t:.2f}' for t in times)} s)")
    before, after = list(variants)
    print(f"{after} / {before}: "
          f"{statistics.mean(wall[before]) / statistics.mean(wall[after]):.2f}x")


if __name__ == "__main__":
    main()
