"""`tokenmill bench latency`: single-stream latency, tokenmill vs HF generate, in one run.

One request at a time: a random-id prompt (--input-len tokens, default 64), greedy,
ignore_eos, exactly --output-len new tokens (default 128). Every repetition gets a
fresh prompt from the seeded generator (a repeated prompt would hit tokenmill's
prefix cache), and both systems see the same prompts, on the same weights and dtype.

- tokenmill: `LLMEngine` stepped by hand with `RequestOutputKind.DELTA`; TTFT is the
  wall time from `add_request` to the step that returns the first token, end to end
  the time to the step that returns the last one.
- HF: `generate` at batch 1; end to end is a `max_new_tokens = min_new_tokens =
  --output-len` call, TTFT a separate `max_new_tokens=1` call on the same prompt.

`--quantization int8|fp8` quantizes tokenmill's weights at load (the HF baseline keeps
the checkpoint's: its greedy agreement then measures the quantization's effect too); the
output records the method and tokenmill's resident weight bytes.

Per repetition: TPOT (time per output token after the first) = (e2e - TTFT) /
(output_len - 1); output tok/s = output_len / e2e. The table and the JSON give the
median and the mean over --num-iters repetitions; the ratios compare medians.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import time

from tokenmill.bench.throughput import (BENCH_MODEL_NAME, BENCH_MODELS, DTYPES,
                                        _hf_generate_batch, ensure_bench_model, format_platform,
                                        format_weights, greedy_agreement, platform_kwargs,
                                        hf_baseline_path, is_bench_model, positive_int,
                                        read_model_config, weight_facts)

logger = logging.getLogger(__name__)


def add_latency_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help=f"local HF model folder, or a built-in benchmark model "
                        f"({', '.join(BENCH_MODELS)}). Default: {BENCH_MODEL_NAME}")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    from tokenmill.engine.arg_utils import add_quantization_arg
    add_quantization_arg(p)
    p.add_argument("--input-len", type=positive_int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--output-len", type=positive_int, default=128,
                   help="new tokens per request (default 128)")
    p.add_argument("--num-iters", type=positive_int, default=5,
                   help="timed repetitions per system (default 5)")
    p.add_argument("--num-warmup", type=int, default=1,
                   help="untimed repetitions per system first (default 1)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="tokenmill's async scheduling (default: the engine's choice)")
    p.add_argument("--skip-hf", action="store_true", help="skip the HF generate baseline")
    p.add_argument("--skip-roofline", action="store_true",
                   help="skip the peak GEMM and read bandwidth measurements, the roofline "
                        "ratios and the decode bandwidth_fraction")
    p.add_argument("--output-json", default=None, metavar="PATH")
    from tokenmill.engine.arg_utils import add_cpu_platform_args
    add_cpu_platform_args(p)


def make_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    import numpy as np
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=length).tolist() for _ in range(n)]


def summarize(ttft_s: list[float], e2e_s: list[float], output_len: int) -> dict:
    """Per-repetition times -> {metric: {"median", "mean", "values"}}."""
    tpot = [(e - t) / (output_len - 1) if output_len > 1 else 0.0 for t, e in zip(ttft_s, e2e_s)]
    series = {"ttft_ms": [1e3 * t for t in ttft_s], "tpot_ms": [1e3 * t for t in tpot],
              "e2e_s": list(e2e_s), "tok_s": [output_len / e for e in e2e_s]}
    return {k: {"median": statistics.median(v), "mean": statistics.fmean(v), "values": v}
            for k, v in series.items()}


# ---- tokenmill -----------------------------------------------------------------
def tokenmill_one(engine, prompt: list[int], output_len: int) -> tuple[float, float, list[int]]:
    """One request alone through the engine -> (TTFT s, e2e s, token ids)."""
    from tokenmill import SamplingParams
    from tokenmill.sampling_params import RequestOutputKind
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    ids: list[int] = []
    first = None
    finished = False
    start = time.perf_counter()
    engine.add_request(None, {"prompt_token_ids": prompt}, params)
    while not finished:
        if not engine.has_unfinished_requests():
            raise RuntimeError("the request left the engine unfinished")
        for out in engine.step():
            new = out.outputs[0].token_ids
            if new and first is None:
                first = time.perf_counter()
            ids += new
            finished = finished or out.finished
    end = time.perf_counter()
    if len(ids) != output_len or first is None:
        raise RuntimeError(f"tokenmill generated {len(ids)} tokens, expected {output_len}")
    return first - start, end - start, ids


def run_tokenmill(model_path: str, prompts, warmup_prompts, args, max_model_len: int,
                  architecture: str | None = None):
    """-> (per-repetition TTFT s, e2e s, token ids of each repetition, engine facts).
    `architecture`: the unquantized checkpoint whose shapes the decode read counts start
    from (facts["decode_read"]; measured with the machine's read bandwidth unless
    --skip-roofline)."""
    from tokenmill import LLM
    llm = LLM(model_path, dtype=args.dtype, seed=args.seed, max_model_len=max_model_len,
              async_scheduling=args.async_scheduling,
              quantization=getattr(args, "quantization", None), **platform_kwargs(args))
    engine = llm.llm_engine
    for p in warmup_prompts:
        tokenmill_one(engine, p, args.output_len)
    ttft, e2e, ids = [], [], []
    for p in prompts:
        t, e, out = tokenmill_one(engine, p, args.output_len)
        ttft.append(t)
        e2e.append(e)
        ids.append(out)
    platform = engine.platform.as_dict()
    facts = {"device": engine.model_config.device, "gemm_dtype": platform["gemm_dtype"],
             "platform": platform,
             "async_scheduling": getattr(engine.engine_core, "async_scheduling", None),
             "weights": weight_facts(llm, args), "decode_read": None}
    if architecture is not None and not args.skip_roofline:
        from tokenmill.bench import decode_read
        runner = getattr(engine.engine_core, "runner", None)
        counts = decode_read.count_engine_read(runner, architecture)
        if counts is not None:
            facts["decode_read"] = {"counts": counts,
                                    "bandwidth": _read_bandwidth(engine, facts["device"])}
    del llm, engine
    gc.collect()
    return ttft, e2e, ids, facts


def _read_bandwidth(engine, device) -> dict:
    """Streaming read GB/s of `device`, measured now (the same run as the timings)."""
    import torch
    from tokenmill.bench import decode_read
    if torch.device(device).type == "cpu":
        return decode_read.measure_read_bandwidth(engine.platform)
    from tokenmill.bench.roofline import measure_bandwidth
    copy = measure_bandwidth(device)  # (read + write bytes of a device copy)
    return {"gbps": copy["gbps"], "probes": {"device copy (read + write)": copy["gbps"]},
            "bytes": copy["bytes"], "reps": copy["reps"]}


# ---- HF generate ---------------------------------------------------------------
def run_hf(model_path: str, prompts, warmup_prompts, args, device):
    """-> (per-repetition TTFT s, e2e s, token ids of each repetition)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype))
    model = model.to(device).eval()
    for p in warmup_prompts:
        _hf_generate_batch(model, [p], 1)
        _hf_generate_batch(model, [p], args.output_len)
    ttft, e2e, ids = [], [], []
    for p in prompts:
        start = time.perf_counter()
        _hf_generate_batch(model, [p], 1)
        ttft.append(time.perf_counter() - start)
        start = time.perf_counter()
        out = _hf_generate_batch(model, [p], args.output_len)
        e2e.append(time.perf_counter() - start)
        ids.append(out[0].tolist())
    del model
    gc.collect()
    return ttft, e2e, ids


# ---- report --------------------------------------------------------------------
def format_table(args, tm: dict, hf: dict | None) -> str:
    def cell(s: dict, key: str, fmt: str) -> str:
        return f"{s[key]['median']:{fmt}} / {s[key]['mean']:{fmt}}"

    cols = (("TTFT ms", "ttft_ms", ".2f"), ("TPOT ms", "tpot_ms", ".2f"),
            ("output tok/s", "tok_s", ".1f"))
    rows = [("tokenmill", [cell(tm, k, f) for _, k, f in cols])]
    if hf is not None:
        rows.append(("HF generate", [cell(hf, k, f) for _, k, f in cols]))
        r = ratios(tm, hf)
        rows.append(("tokenmill speedup", [f"{r['ttft']:.2f}x", f"{r['tpot']:.2f}x",
                                           f"{r['tok_s']:.2f}x"]))
    else:
        rows.append(("HF generate", ["skipped"] * 3))
    width = max(len(name) for name, _ in rows)
    cw = [max(len(c[0]), *(len(r[1][i]) for r in rows)) for i, c in enumerate(cols)]
    lines = [f"single stream: {args.input_len}-token prompt, {args.output_len} new tokens, "
             f"greedy; {args.num_iters} run(s) each, median / mean",
             f"{'':<{width}}" + "".join(f"  {c[0]:>{w}}" for c, w in zip(cols, cw))]
    for name, cells in rows:
        lines.append(f"{name:<{width}}" + "".join(f"  {c:>{w}}" for c, w in zip(cells, cw)))
    return "\n".join(lines)


def ratios(tm: dict, hf: dict) -> dict:
    """How many times faster tokenmill is, on medians (> 1: tokenmill is faster)."""
    return {"tok_s": tm["tok_s"]["median"] / hf["tok_s"]["median"],
            "tpot": hf["tpot_ms"]["median"] / tm["tpot_ms"]["median"],
            "ttft": hf["ttft_ms"]["median"] / tm["ttft_ms"]["median"]}


def run_latency_bench(args: argparse.Namespace) -> int:
    name = args.model or BENCH_MODEL_NAME
    model_path = ensure_bench_model(name) if is_bench_model(name) else name
    hf_config = read_model_config(model_path)
    max_model_len = args.input_len + args.output_len
    limit = hf_config.get("max_position_embeddings", 2048)
    if max_model_len > limit:
        raise ValueError(f"--input-len + --output-len ({max_model_len}) exceeds the model's "
                         f"max_position_embeddings ({limit})")
    if args.num_warmup < 0:
        raise ValueError(f"--num-warmup must be >= 0, got {args.num_warmup}")
    vocab = hf_config["vocab_size"]
    all_prompts = make_prompts(args.num_warmup + args.num_iters, args.input_len, vocab, args.seed)
    warmup, prompts = all_prompts[:args.num_warmup], all_prompts[args.num_warmup:]

    base = hf_baseline_path(name, model_path)
    tm_ttft, tm_e2e, tm_ids, facts = run_tokenmill(model_path, prompts, warmup, args,
                                                   max_model_len, architecture=base)
    tm = summarize(tm_ttft, tm_e2e, args.output_len)
    bandwidth = None
    if facts["decode_read"] is not None:
        from tokenmill.bench.decode_read import bandwidth_fraction
        read = facts["decode_read"]
        bandwidth = {**bandwidth_fraction(read["counts"], args.input_len, args.output_len,
                                          tm["tpot_ms"]["median"] / 1e3,
                                          read["bandwidth"]["gbps"]), **read}
    logger.info("tokenmill: %.1f output tok/s, TTFT %.1f ms, TPOT %.2f ms (medians)",
                tm["tok_s"]["median"], tm["ttft_ms"]["median"], tm["tpot_ms"]["median"])
    device = facts["device"]

    hf = agreement = None
    if not args.skip_hf:
        hf_ttft, hf_e2e, hf_ids = run_hf(hf_baseline_path(name, model_path), prompts, warmup,
                                         args, device)
        hf = summarize(hf_ttft, hf_e2e, args.output_len)
        agreement = greedy_agreement(tm_ids, hf_ids)
        logger.info("HF generate: %.1f output tok/s, TTFT %.1f ms, TPOT %.2f ms (medians); "
                    "greedy agreement with tokenmill %.1f%%", hf["tok_s"]["median"],
                    hf["ttft_ms"]["median"], hf["tpot_ms"]["median"], 100 * agreement)

    roof = None
    if not args.skip_roofline:
        from tokenmill.bench import roofline as rl
        # (the architecture's FLOPs: a quantized bench model's bf16 base has the same)
        peaks = rl.measure_peaks(base, device, rl.PEAK_DTYPES + (args.dtype,))
        runs = {"tokenmill": ([args.input_len], [args.output_len], tm["e2e_s"]["median"])}
        if hf is not None:
            runs["HF generate"] = ([args.input_len], [args.output_len], hf["e2e_s"]["median"])
        roof = rl.roofline(rl.count_model_flops(base), peaks, runs, facts["gemm_dtype"])

    print(format_platform(facts["platform"]))
    print(format_weights(facts["weights"]))
    print(format_table(args, tm, hf))
    if roof is not None:
        from tokenmill.bench.roofline import format_roofline
        print(format_roofline(roof))
    if bandwidth is not None:
        from tokenmill.bench.decode_read import format_bandwidth
        print(format_bandwidth(bandwidth))
    if args.output_json:
        result = {
            "bench": "latency",
            "tokenmill_tok_s": tm["tok_s"]["median"],
            "hf_generate_tok_s": hf["tok_s"]["median"] if hf else None,
            "ratio": ratios(tm, hf) if hf else None,
            "tokenmill": tm, "hf_generate": hf, "greedy_agreement": agreement,
            "roofline": roof,
            "bandwidth_fraction": bandwidth["bandwidth_fraction"] if bandwidth else None,
            "decode_bandwidth": bandwidth,
            "platform": facts["platform"],
            "weights": facts["weights"],
            "workload": {
                "quantization": facts["weights"]["quantization"],
                "model": model_path, "dtype": args.dtype, "device": str(device),
                "seed": args.seed, "input_len": args.input_len, "output_len": args.output_len,
                "num_iters": args.num_iters, "num_warmup": args.num_warmup,
                "async_scheduling": facts["async_scheduling"],
                "tokenmill_gemm_dtype": facts["gemm_dtype"], "hf_skipped": hf is None,
            },
        }
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0
