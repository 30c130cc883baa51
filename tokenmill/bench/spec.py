"""`tokenmill bench spec`: speculative decoding against the same engine without it.

One run, one workload, both sides: for each --concurrency C, C requests are
generated with --speculative-config and without, greedy, ignore_eos, exactly
--output-len new tokens each; output tok/s is the best of --num-iters timed runs
(after a warm-up; the engines take turns, so a slow spell of a shared machine hits
both sides), the ratio compares those ("all runs": the ratio over every timed run,
where runs differ by design, as a speculative engine's scouts do), and the acceptance
counters are taken over the timed runs only (the warm-up request's are in too).

Two engines a side (--engines-per-side), built plain, spec, spec, plain, and a side's
figure the mean of its engines': in one process an engine built later decodes faster
than one built before it (where its memory lies; 5-10% between the first and the
last of three on the 2-core EPYC), which with one engine a side credited speculation
with the plain engine's handicap: a speculative config that never drafts measured
1.02x and 1.10x that way.

Workloads (--workload):
- loop: drafts can be right. A random-weight model's greedy output falls into
  repetition loops; each prompt is a random --input-len prefix plus the model's
  own greedy continuation of --loop-len tokens (made untimed, without
  speculation), so the timed part continues text that already repeats.
- random: plain random prompts; few drafts are accepted, so this shows what a
  step of mostly-rejected drafts costs.

Draft-model methods without a "model" (and mtp on a model without an MTP head) get
a random-weight drafter built for the target (tokenmill/spec_decode/random_drafters.py,
cached beside the benchmark model): nearly all its drafts are rejected, so the run
shows what drafting costs when it does not pay (the adaptive back-off included).

In bf16 the two sides can part ways after a while (a verify step's GEMM has more
rows than a plain decode step, which changes rounding); both still generate
exactly --output-len tokens per request, and fp32 gives identical tokens.
"""
from __future__ import annotations

import argparse
import json
import time
from statistics import mean

from tokenmill.bench.throughput import (BENCH_MODEL_NAME, BENCH_MODELS, DTYPES,
                                        ensure_bench_model, format_platform, platform_kwargs,
                                        positive_int, read_model_config)

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4}'


def add_spec_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help=f"local HF folder or a built-in benchmark model "
                        f"({', '.join(BENCH_MODELS)}); default {BENCH_MODEL_NAME}")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--speculative-config", default=DEFAULT_SPEC, metavar="JSON",
                   help=f"the speculative side's config (default {DEFAULT_SPEC})")
    p.add_argument("--concurrency", default="1,16",
                   help="comma-separated numbers of concurrent requests (default 1,16)")
    p.add_argument("--workload", default="loop", choices=("loop", "random"))
    p.add_argument("--input-len", type=positive_int, default=64)
    p.add_argument("--loop-len", type=positive_int, default=192,
                   help="loop workload: tokens of the model's own output in each prompt")
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--num-iters", type=positive_int, default=3)
    p.add_argument("--engines-per-side", type=int, choices=(1, 2), default=2,
                   help="2 (default): engines built plain, spec, spec, plain, so the order "
                        "they were built in favours neither side; 1 halves the memory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None, metavar="PATH")
    from tokenmill.engine.arg_utils import add_cpu_platform_args
    add_cpu_platform_args(p)


def random_drafter(spec: dict, target_path: str) -> tuple[str, dict]:
    """(target folder, speculative config) for a draft-model method given no draft: a
    random-weight one, built once into the cache, for the target."""
    import json
    import os
    import shutil

    from tokenmill.spec_decode import random_drafters as rd
    method = spec.get("method", "ngram")
    if method == "ngram" or (spec.get("model") and method != "mtp"):
        return target_path, spec
    config = json.load(open(os.path.join(target_path, "config.json")))
    if method == "mtp":
        if config.get("mtp_num_hidden_layers"):
            return target_path, spec
        path = target_path.rstrip("/") + "-random-mtp"
        if not os.path.exists(os.path.join(path, "config.json")):
            shutil.rmtree(path, ignore_errors=True)
            config["mtp_num_hidden_layers"] = 1
            rd.write_folder(path, target_path, config, rd.mtp_tensors(target_path, seed=0))
        return path, spec
    path = target_path.rstrip("/") + f"-random-{method}"
    if not os.path.exists(os.path.join(path, "config.json")):
        if method == "eagle3":
            rd.build_eagle3_checkpoint(path, config)
        else:
            layers = config["num_hidden_layers"]
            k = spec.get("num_speculative_tokens", 4)
            rd.build_dflash_checkpoint(path, config, num_layers=1,
                                       target_layer_ids=(1, layers // 2, layers - 2),
                                       block_size=max(8, k + 1 if isinstance(k, int) else 8))
    return target_path, dict(spec, model=path)


def make_prompts(llm, args, n: int, vocab: int) -> list[list[int]]:
    import numpy as np

    from tokenmill import SamplingParams
    rng = np.random.default_rng(args.seed + n)
    prompts = [rng.integers(0, vocab, args.input_len).tolist() for _ in range(n)]
    if args.workload == "loop":
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=args.loop_len,
                                           ignore_eos=True), use_tqdm=False)
        prompts = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    return prompts


def timed_runs(engines, prompts, output_len: int, num_iters: int):
    """Best output tok/s of each engine over num_iters runs, the engines taking turns (in
    build order, then reversed, and so on: a slow spell of the machine hits all alike),
    after one warm-up each; its tok/s over all of them (where runs differ by design -
    a speculative engine's scouts, spec_decode/drafter.py - the best hides the slow
    ones); and each engine's last tokens."""
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                            detokenize=False)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    for llm in engines:
        llm.generate(reqs[:1], params, use_tqdm=False)
    best = [0.0] * len(engines)
    seconds_all = [0.0] * len(engines)
    tokens = [None] * len(engines)
    order = list(range(len(engines)))
    for it in range(num_iters):
        for i in (order if it % 2 == 0 else order[::-1]):
            start = time.perf_counter()
            outs = engines[i].generate(reqs, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens[i] = [list(o.outputs[0].token_ids) for o in outs]
            if any(len(t) != output_len for t in tokens[i]):
                raise RuntimeError("a request did not get exactly --output-len tokens")
            best[i] = max(best[i], len(prompts) * output_len / seconds)
            seconds_all[i] += seconds
    overall = [num_iters * len(prompts) * output_len / t for t in seconds_all]
    return best, overall, tokens


def _stats(llms) -> dict:
    """The speculative engines' acceptance counters, summed."""
    stats = [llm.llm_engine.engine_core.scheduler.spec_stats for llm in llms]
    total = {key: sum(getattr(s, key) for s in stats)
             for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    total["accepted_per_position"] = [sum(col) for col in
                                      zip(*(s.accepted_per_position for s in stats))]
    return total


def run_spec_bench(args: argparse.Namespace) -> int:
    from tokenmill import LLM
    from tokenmill.spec_decode.config import SpeculativeConfig
    model = args.model or BENCH_MODEL_NAME
    try:
        spec = json.loads(args.speculative_config)
        if not isinstance(spec, dict):
            raise ValueError("--speculative-config must be a JSON object")
        levels = [int(c) for c in args.concurrency.split(",")]
        if any(c < 1 for c in levels):
            raise ValueError("--concurrency must be positive ints, e.g. 1,16")
        path = ensure_bench_model(model) if model in BENCH_MODELS else model
        path, spec = random_drafter(spec, path)
        spec = SpeculativeConfig.from_any(spec)
    except ValueError as e:
        print(f"error: {e}")
        return 2
    vocab = read_model_config(path)["vocab_size"]
    max_len = args.input_len + (args.loop_len if args.workload == "loop" else 0) \
        + args.output_len + 8
    common = dict(dtype=args.dtype, seed=args.seed, max_model_len=max_len,
                  max_num_seqs=max(levels), **platform_kwargs(args))
    sides = [False, True] if args.engines_per_side == 1 else [False, True, True, False]
    engines = [LLM(path, speculative_config=spec, **common) if fast else LLM(path, **common)
               for fast in sides]
    plain = engines[0]
    fast_engines = [e for e, fast in zip(engines, sides) if fast]
    rows = []
    for c in levels:
        prompts = make_prompts(plain, args, c, vocab)
        before = _stats(fast_engines)
        best, overall, tokens = timed_runs(engines, prompts, args.output_len, args.num_iters)
        plain_tok_s = mean([b for b, fast in zip(best, sides) if not fast])
        spec_tok_s = mean([b for b, fast in zip(best, sides) if fast])
        plain_all = mean([b for b, fast in zip(overall, sides) if not fast])
        spec_all = mean([b for b, fast in zip(overall, sides) if fast])
        plain_tokens = tokens[0]
        spec_tokens = [t for t, fast in zip(tokens, sides) if fast]
        after = _stats(fast_engines)
        drafts = after["num_drafts"] - before["num_drafts"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        proposed = after["num_draft_tokens"] - before["num_draft_tokens"]
        rows.append(dict(
            concurrency=c, plain_tok_s=plain_tok_s, spec_tok_s=spec_tok_s,
            ratio=spec_tok_s / plain_tok_s,
            ratio_all_runs=spec_all / plain_all,
            mean_acceptance_length=1 + accepted / drafts if drafts else 0.0,
            acceptance_rate=accepted / proposed if proposed else 0.0,
            accepted_per_position=[a - b for a, b in zip(after["accepted_per_position"],
                                                         before["accepted_per_position"])],
            same_tokens=mean([sum(a == b for a, b in zip(plain_tokens, side)) / c
                              for side in spec_tokens])))
    platform = fast_engines[0].llm_engine.platform.as_dict()
    print(format_platform(platform))
    print(f"speculative decoding: {spec.describe()}; workload {args.workload}, "
          f"{args.output_len} new tokens a request, {args.dtype}, best of {args.num_iters}, "
          f"{args.engines_per_side} engine(s) a side")
    print(f"{'concurrency':>11} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>7} "
          f"{'all runs':>8} {'accept len':>10} {'accept rate':>11} {'same out':>8}")
    for r in rows:
        print(f"{r['concurrency']:>11} {r['plain_tok_s']:>12.1f} {r['spec_tok_s']:>11.1f} "
              f"{r['ratio']:>6.2f}x {r['ratio_all_runs']:>7.2f}x "
              f"{r['mean_acceptance_length']:>10.2f} "
              f"{r['acceptance_rate']:>11.2f} {r['same_tokens']:>8.2f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": model, "dtype": args.dtype, "workload": args.workload,
                       "engines_per_side": args.engines_per_side,
                       "speculative_config": spec.__dict__, "platform": platform,
                       "output_len": args.output_len, "results": rows}, f, indent=2)
    return 0
