"""`tokenmill bench prefix`: prefix caching and the external KV tier, in one run.

Workload: N requests that share one long system prompt (a 1,024-token prefix by
default) and differ in a 64-token suffix, all arriving at once; greedy,
ignore_eos, a few output tokens each (random token ids on the benchmark model).
Four engines run it, each freshly started (an untimed warm-up request first,
with unrelated tokens):

1. prefix caching off: every request computes its whole prompt;
2. prefix caching on (cold cache): the first request computes the prefix, the
   others find its blocks (in the same step) and compute their suffix only;
3. a cold engine with a Redis store that holds nothing: it computes the prefix
   once, as (2), and writes the prompt blocks to Redis;
4. another cold engine on the same Redis: the prefix comes from Redis.

Per run: mean / p50 time to first token (from the moment the requests are
added), wall time, request and output-token throughput. Ratios: TTFT off / on
(the goal is >= 3x), throughput on / off, the median TTFT of single requests sent
after the batch (the shared prefix and a new suffix: computed when caching is off,
cached when on; the goal is >= 5x), and TTFT of the cold engine
recomputing (3) / served from Redis (4). Redis: --redis-url, else a
redis-server started for the run on a free port (skipped when not installed).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import tempfile
import time
import uuid

from tokenmill.kv_connector.local_redis import RedisServer

logger = logging.getLogger(__name__)


def add_prefix_bench_args(p: argparse.ArgumentParser) -> None:
    from tokenmill.bench.throughput import BENCH_MODEL_NAME, DTYPES, positive_int
    p.add_argument("--model", default=None,
                   help=f"local HF model folder or a built-in bench model name (default: "
                        f"{BENCH_MODEL_NAME})")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--num-requests", type=positive_int, default=16)
    p.add_argument("--prefix-len", type=positive_int, default=1024,
                   help="tokens of the shared system prompt (default 1024)")
    p.add_argument("--suffix-len", type=positive_int, default=64,
                   help="tokens of each request's own part (default 64)")
    p.add_argument("--output-len", type=positive_int, default=16)
    p.add_argument("--single-requests", type=int, default=3,
                   help="after the batch, requests sent one at a time with the cached prefix "
                        "and a new suffix: their median TTFT, off vs on (default 3; 0: none)")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--redis-url", default=None,
                   help="a Redis for runs 3 and 4 (default: start redis-server on a free port)")
    p.add_argument("--no-redis", action="store_true", help="skip runs 3 and 4")
    p.add_argument("--output-json", default=None, metavar="PATH")


# ---- a redis-server for the run ----------------------------------------------------------
# ---- one run ------------------------------------------------------------------------------
def _engine(model_path: str, args, max_model_len: int, **kw):
    from tokenmill.engine.llm_engine import EngineArgs, LLMEngine
    return LLMEngine(EngineArgs.from_kwargs(
        model_path, dtype=args.dtype, seed=args.seed, max_model_len=max_model_len,
        block_size=args.block_size, max_num_seqs=args.num_requests,
        max_num_batched_tokens=args.max_num_batched_tokens, **kw))


def _drive(engine, prompts: list[list[int]], output_len: int, tag: str) -> dict:
    """Add every request at once, step to the end; TTFT from the add."""
    from tokenmill.sampling_params import RequestOutputKind, SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA, detokenize=False)
    start = time.perf_counter()
    ids = [engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, sp)
           for i, p in enumerate(prompts)]
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            new = out.outputs[0].token_ids
            if new and out.request_id not in first:
                first[out.request_id] = now - start
            tokens[out.request_id].extend(new)
    wall = time.perf_counter() - start
    ttft = sorted(first[r] for r in ids)
    n_out = sum(len(t) for t in tokens.values())
    return {"mean_ttft_s": sum(ttft) / len(ttft), "p50_ttft_s": ttft[len(ttft) // 2],
            "max_ttft_s": ttft[-1], "wall_s": wall, "requests_per_s": len(ids) / wall,
            "output_tok_per_s": n_out / wall, "tokens": [tokens[r] for r in ids]}


def _run(name: str, model_path: str, args, prompts, warm, max_model_len: int,
         singles=(), **kw) -> dict:
    logger.info("run: %s", name)
    engine = _engine(model_path, args, max_model_len, **kw)
    try:
        _drive(engine, [warm], 2, "warmup")  # first-call costs stay untimed
        core = engine.engine_core
        before = core.kv_cache_stats()
        res = _drive(engine, prompts, args.output_len, "bench")
        # Then one request at a time, each the shared prefix and a suffix never seen:
        # with caching on its prefix is cached by the batch above, off it is computed.
        single = [_drive(engine, [p], 1, f"single-{i}")["mean_ttft_s"]
                  for i, p in enumerate(singles)]
        res["single_ttft_s"] = sorted(single)[len(single) // 2] if single else None
        after = core.kv_cache_stats()
        res["prefix_cache_hit_tokens"] = after["prefix_cache_hits"] - before["prefix_cache_hits"]
        ext_a, ext_b = after["external"], before["external"]
        res["external_hit_tokens"] = (ext_a["hit_tokens"] - ext_b["hit_tokens"]) if ext_a else 0
        res["external_bytes_loaded"] = (ext_a["bytes_loaded"] - ext_b["bytes_loaded"]) \
            if ext_a else 0
        res["external_bytes_stored"] = (ext_a["bytes_stored"] - ext_b["bytes_stored"]) \
            if ext_a else 0
        res["platform"] = engine.platform.as_dict()  # which kernels ran
        res["external_tier"] = getattr(core, "kv_connector", None) is not None
    finally:
        shutdown = getattr(engine.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()
        del engine
        gc.collect()
    res["name"] = name
    return res


def run_prefix_bench(args) -> int:
    import numpy as np

    from tokenmill.bench.throughput import BENCH_MODELS, ensure_bench_model, read_model_config
    model_path = (ensure_bench_model(args.model) if args.model in BENCH_MODELS
                  else args.model or ensure_bench_model())
    cfg = read_model_config(model_path)
    vocab = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")
    rng = np.random.default_rng(args.seed)
    prefix = rng.integers(1, vocab, size=args.prefix_len).tolist()
    prompts = [prefix + rng.integers(1, vocab, size=args.suffix_len).tolist()
               for _ in range(args.num_requests)]
    warm = rng.integers(1, vocab, size=48).tolist()
    singles = [prefix + rng.integers(1, vocab, size=args.suffix_len).tolist()
               for _ in range(args.single_requests)]
    bs = args.block_size
    max_model_len = -(-(args.prefix_len + args.suffix_len + args.output_len) // bs) * bs + bs
    runs = [_run("prefix caching off", model_path, args, prompts, warm, max_model_len,
                 singles, enable_prefix_caching=False),
            _run("prefix caching on", model_path, args, prompts, warm, max_model_len,
                 singles)]
    redis_note = None
    if not args.no_redis:
        server = None
        url = args.redis_url
        if url is None:
            if shutil.which("redis-server") is None:
                redis_note = "redis-server not installed: runs 3 and 4 skipped (--redis-url)"
            else:
                workdir = tempfile.mkdtemp(prefix="tokenmill-bench-redis-")
                server = RedisServer(shutil.which("redis-server"), workdir).start()
                url = server.url
        if url is not None:
            # A fresh namespace for this run, so run 3 really starts from an empty store.
            kv = {"stores": [url], "model_id": f"bench-{uuid.uuid4().hex[:12]}",
                  "redis_ttl_s": 3600}
            try:
                runs.append(_run("cold engine, recompute (+ store to Redis)", model_path, args,
                                 prompts, warm, max_model_len, kv_connector=kv))
                runs.append(_run("cold engine, prefix from Redis", model_path, args, prompts,
                                 warm, max_model_len, kv_connector=kv))
            finally:
                if server is not None:
                    server.stop()
                    shutil.rmtree(workdir, ignore_errors=True)
    return _report(args, model_path, runs, redis_note)


def _report(args, model_path: str, runs: list[dict], redis_note: str | None) -> int:
    ref = runs[0]["tokens"]
    print(f"\ntokenmill bench prefix: {args.num_requests} requests, {args.prefix_len}-token "
          f"shared prefix + {args.suffix_len}-token suffixes, {args.output_len} output tokens, "
          f"{os.path.basename(model_path.rstrip('/'))} {args.dtype}, block {args.block_size}, "
          f"budget {args.max_num_batched_tokens} tokens/step")
    head = (f"{'run':44s} {'mean TTFT':>10s} {'p50 TTFT':>10s} {'wall':>8s} {'req/s':>7s} "
            f"{'out tok/s':>10s} {'cache hits':>11s} {'ext hits':>9s} {'same out':>9s}")
    print(f"platform: {runs[0]['platform']['description']}")
    print(head)
    print("-" * len(head))
    for r in runs:
        same = sum(a == b for a, b in zip(r["tokens"], ref))
        r["same_outputs_as_off"] = same
        print(f"{r['name']:44s} {r['mean_ttft_s']:9.3f}s {r['p50_ttft_s']:9.3f}s "
              f"{r['wall_s']:7.2f}s {r['requests_per_s']:7.2f} {r['output_tok_per_s']:10.1f} "
              f"{r['prefix_cache_hit_tokens']:11d} {r['external_hit_tokens']:9d} "
              f"{same:>4d}/{len(ref):<4d}")
    off, on = runs[0], runs[1]
    ratios = {"ttft_off_over_on": off["mean_ttft_s"] / on["mean_ttft_s"],
              "throughput_on_over_off": on["output_tok_per_s"] / off["output_tok_per_s"]}
    print(f"\nmean TTFT, caching off / on:        {ratios['ttft_off_over_on']:.2f}x "
          f"(goal >= 3x: {'met' if ratios['ttft_off_over_on'] >= 3 else 'NOT met'})")
    print(f"throughput, caching on / off:       {ratios['throughput_on_over_off']:.2f}x")
    if off["single_ttft_s"] and on["single_ttft_s"]:
        ratios["single_ttft_cold_over_cached"] = off["single_ttft_s"] / on["single_ttft_s"]
        print(f"one request alone, TTFT with its {args.prefix_len}-token prefix computed / "
              f"cached: {off['single_ttft_s'] * 1e3:.1f} / {on['single_ttft_s'] * 1e3:.1f} ms "
              f"= {ratios['single_ttft_cold_over_cached']:.2f}x (median of "
              f"{args.single_requests}; goal >= 5x)")
    if len(runs) == 4 and not runs[2]["external_tier"]:
        print("runs 3 and 4: the external KV tier is off for this model (see the log), "
              "so both are cold engines with local prefix caching")
    elif len(runs) == 4:
        ratios["cold_ttft_recompute_over_redis"] = runs[2]["mean_ttft_s"] / runs[3]["mean_ttft_s"]
        ratios["cold_throughput_redis_over_recompute"] = (runs[3]["output_tok_per_s"]
                                                          / runs[2]["output_tok_per_s"])
        print(f"cold engine mean TTFT, recompute / Redis: "
              f"{ratios['cold_ttft_recompute_over_redis']:.2f}x "
              f"({runs[3]['external_bytes_loaded'] / 2**20:.1f} MiB loaded from Redis)")
    elif redis_note:
        print(redis_note)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "func"},
                       "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
                       "ratios": ratios}, f, indent=2)
    return 0
