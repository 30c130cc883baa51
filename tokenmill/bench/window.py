"""`tokenmill bench window`: what a sliding window (or MLA) saves on a long context, in one run.

With an MLA model (DeepSeek; `--model bench-deepseek-v2-512`) the comparison is its
latent cache and absorbed decode against the same attention with K and V per head
(run_mla_bench).

One request alone: a --context-len token prompt (default 8192, random ids), greedy,
ignore_eos, --output-len new tokens, on a model with sliding-window layers (default
the built-in Gemma 3, five local layers of window 1024 per global one), and on the
same weights with the window turned off: a twin folder whose config.json sets
sliding_window past the context (every layer then attends the whole sequence, with
its own rope table unchanged) and links the same weight files.

Per variant: KV bytes the request holds in its last decode step (each KV cache
group's blocks held x the group's layers x the page size; a sliding group holds only
its window's blocks), TTFT (the prompt, chunked prefill) and decode tok/s (tokens after the first
/ the time after the first token). The ratios are windowed over full.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import tempfile
import time

from tokenmill.bench.throughput import (BENCH_MODELS, DTYPES, ensure_bench_model, is_bench_model,
                                        format_platform, platform_kwargs, positive_int,
                                        read_model_config)

logger = logging.getLogger(__name__)

WINDOW_BENCH_MODEL = "bench-gemma3-512"


def add_window_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help=f"local HF model folder with sliding-window layers, or a built-in "
                        f"benchmark model ({', '.join(BENCH_MODELS)}). Default: "
                        f"{WINDOW_BENCH_MODEL}")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--context-len", type=positive_int, default=8192,
                   help="prompt tokens (default 8192)")
    p.add_argument("--output-len", type=positive_int, default=64,
                   help="new tokens (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None, metavar="PATH")
    from tokenmill.engine.arg_utils import add_cpu_platform_args
    add_cpu_platform_args(p)


def full_attention_twin(model_path: str, dest: str, span: int) -> str:
    """A folder with `model_path`'s weights (linked) and its config with the sliding
    window set to `span` (past every position: full attention)."""
    cfg = read_model_config(model_path)
    if not cfg.get("sliding_window"):
        raise ValueError(f"--model {model_path!r} has no sliding_window: nothing to compare")
    for name in os.listdir(model_path):
        if name != "config.json":
            os.symlink(os.path.join(os.path.abspath(model_path), name),
                       os.path.join(dest, name))
    cfg["sliding_window"] = span
    cfg.pop("use_sliding_window", None)  # (Qwen2: keep its layers' kinds as they are)
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dest


def kv_bytes_held(engine, request_id: str) -> int:
    """KV bytes the request's blocks take now, over every attention group."""
    core = engine.engine_core
    kvm = core.scheduler.kv_cache_manager
    total = 0
    for gid, group in enumerate(core.kv_cache_config.groups):
        if group.is_attention:
            total += (kvm.num_blocks_held(request_id, gid) * len(group.layer_names)
                      * group.spec.page_size_bytes)
    return total


def run_one(model_path: str, prompt: list[int], args, max_model_len: int) -> dict:
    """One request alone: TTFT, decode tok/s, the KV bytes it holds at the end."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.sampling_params import RequestOutputKind
    llm = LLM(model_path, dtype=args.dtype, seed=args.seed, max_model_len=max_model_len,
              max_num_seqs=1, enable_prefix_caching=False, **platform_kwargs(args))
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    # A short warmup request (first-touch costs), then the timed one.
    engine.add_request("warmup", {"prompt_token_ids": prompt[:64]},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    ids, first, held = [], None, 0
    start = time.perf_counter()
    engine.add_request("long", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].token_ids and first is None:
                first = time.perf_counter()
            ids += out.outputs[0].token_ids
        if engine.has_unfinished_requests():  # (decoding: the window's steady state)
            held = kv_bytes_held(engine, "long")
    end = time.perf_counter()
    if len(ids) != args.output_len or first is None:
        raise RuntimeError(f"generated {len(ids)} tokens, expected {args.output_len}")
    core = engine.engine_core
    groups = [f"{len(g.layer_names)} x {type(g.spec).__name__}"
              + (f"(window {g.spec.sliding_window})" if hasattr(g.spec, "sliding_window")
                 else "")
              for g in core.kv_cache_config.groups if g.is_attention]
    result = {
        "ttft_s": first - start,
        "decode_tok_s": (len(ids) - 1) / (end - first) if len(ids) > 1 else None,
        "kv_bytes_held": held,
        "kv_groups": groups,
        "native_decode_layers": getattr(core.runner.model, "decode_layers", None) is not None,
        "platform": engine.platform.as_dict(),
        "token_ids": ids,
    }
    del llm, engine, core
    gc.collect()
    return result


def format_table(win: dict, full: dict, args,
                 names: tuple[str, str] = ("window", "full attention")) -> str:
    rows = [("KV bytes held (MiB)", win["kv_bytes_held"] / 2**20, full["kv_bytes_held"] / 2**20,
             full["kv_bytes_held"] / max(1, win["kv_bytes_held"]), "x less"),
            ("TTFT (s)", win["ttft_s"], full["ttft_s"], full["ttft_s"] / win["ttft_s"],
             "x faster"),
            ("decode tok/s", win["decode_tok_s"], full["decode_tok_s"],
             win["decode_tok_s"] / full["decode_tok_s"], "x faster")]
    out = [f"one request: {args.context_len} tokens of context, {args.output_len} new, "
           f"{args.dtype}",
           f"{'':22} {names[0]:>12} {names[1]:>16} {'ratio':>10}"]
    for name, a, b, r, word in rows:
        out.append(f"{name:22} {a:12.2f} {b:16.2f} {r:9.2f}{word[0]} ({word[2:]})")
    return "\n".join(out)


def run_window_bench(args: argparse.Namespace) -> int:
    import random
    name = args.model or WINDOW_BENCH_MODEL
    model_path = ensure_bench_model(name) if is_bench_model(name) else name
    cfg = read_model_config(model_path)
    max_model_len = args.context_len + args.output_len
    limit = cfg.get("max_position_embeddings", 2048)
    if max_model_len > limit:
        raise ValueError(f"--context-len + --output-len ({max_model_len}) exceeds the model's "
                         f"max_position_embeddings ({limit})")
    if cfg.get("kv_lora_rank"):
        return run_mla_bench(model_path, cfg, args, max_model_len)
    window = cfg.get("sliding_window")
    if not window or window >= max_model_len:
        raise ValueError(f"the model's sliding_window ({window}) must be shorter than the "
                         f"context (--context-len + --output-len = {max_model_len})")
    rng = random.Random(args.seed)
    prompt = [rng.randrange(1, cfg["vocab_size"]) for _ in range(args.context_len)]
    win = run_one(model_path, prompt, args, max_model_len)
    logger.info("window: %.1f decode tok/s, %.1f MiB of KV", win["decode_tok_s"],
                win["kv_bytes_held"] / 2**20)
    with tempfile.TemporaryDirectory(prefix="tokenmill-full-twin-") as tmp:
        twin = full_attention_twin(model_path, tmp, 2 * max_model_len)
        full = run_one(twin, prompt, args, max_model_len)
    logger.info("full attention: %.1f decode tok/s, %.1f MiB of KV", full["decode_tok_s"],
                full["kv_bytes_held"] / 2**20)
    print(format_platform(win["platform"]))
    print(f"KV groups: window {win['kv_groups']}; full {full['kv_groups']}")
    print(format_table(win, full, args))
    ratios = {"kv_bytes": full["kv_bytes_held"] / max(1, win["kv_bytes_held"]),
              "decode_tok_s": win["decode_tok_s"] / full["decode_tok_s"],
              "ttft": full["ttft_s"] / win["ttft_s"]}
    if args.output_json:
        strip = ("token_ids", "platform")
        with open(args.output_json, "w") as f:
            json.dump({"bench": "window", "model": model_path, "dtype": args.dtype,
                       "context_len": args.context_len, "output_len": args.output_len,
                       "sliding_window": window,
                       "window": {k: v for k, v in win.items() if k not in strip},
                       "full_attention": {k: v for k, v in full.items() if k not in strip},
                       "ratio": ratios, "platform": win["platform"]}, f, indent=2)
    return 0


def run_mla_bench(model_path: str, cfg: dict, args, max_model_len: int) -> int:
    """An MLA model (DeepSeek): its latent cache and absorbed decode, against the same
    attention with K and V per head. The decode side runs the same weights with every
    decode row in the naive form (K/V expanded per head from the latent each step); the
    KV side is the bytes a per-head K/V cache of the same blocks would hold."""
    import random

    from tokenmill.models.layers.mla import PagedMLAAttention
    rng = random.Random(args.seed)
    prompt = [rng.randrange(1, cfg["vocab_size"]) for _ in range(args.context_len)]
    latent = run_one(model_path, prompt, args, max_model_len)
    PagedMLAAttention.absorb_decode = False
    try:
        expanded = run_one(model_path, prompt, args, max_model_len)
    finally:
        PagedMLAAttention.absorb_decode = True
    row = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    per_head = cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
                                             + cfg["v_head_dim"])
    expanded["kv_bytes_held"] = latent["kv_bytes_held"] * per_head // row
    print(format_platform(latent["platform"]))
    print(f"MLA: a {row}-wide latent row per token and layer, against K and V of "
          f"{cfg['num_attention_heads']} heads ({per_head} values)")
    print(format_table(latent, expanded, args, ("MLA latent", "per-head K/V")))
    ratios = {"kv_bytes": expanded["kv_bytes_held"] / max(1, latent["kv_bytes_held"]),
              "decode_tok_s": latent["decode_tok_s"] / expanded["decode_tok_s"],
              "ttft": expanded["ttft_s"] / latent["ttft_s"]}
    if latent["token_ids"] != expanded["token_ids"]:
        logger.warning("absorbed and naive decode disagree on some greedy tokens")
    if args.output_json:
        strip = ("token_ids", "platform")
        with open(args.output_json, "w") as f:
            json.dump({"bench": "window", "kind": "mla", "model": model_path,
                       "dtype": args.dtype, "context_len": args.context_len,
                       "output_len": args.output_len,
                       "mla_latent": {k: v for k, v in latent.items() if k not in strip},
                       "per_head_kv": {k: v for k, v in expanded.items() if k not in strip},
                       "ratio": ratios, "platform": latent["platform"]}, f, indent=2)
    return 0
