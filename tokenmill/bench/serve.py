"""`tokenmill bench serve`: online serving latency and throughput over HTTP.

Sends the same seeded workload as `bench throughput` (random token-id prompts,
greedy, ignore_eos, per-request output lengths) as streaming POST
/v1/completions requests, at most --concurrency in flight, to --url or to a
`tokenmill serve` this command starts (and stops) itself.

Per request: TTFT (send -> first chunk with output), ITL (gaps between output
chunks; the stream does not say how many tokens a chunk holds, so per chunk),
E2E (send -> end of stream) and output tokens (from the usage chunk). Every
chunk with a choice carries new output: the server sends one per engine step
(without a tokenizer, an empty-text chunk per step).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from tokenmill.bench.throughput import (DTYPES, Workload, _fmt_range, ensure_bench_model,
                                        int_range, make_workload, positive_int,
                                        read_model_config)

logger = logging.getLogger(__name__)


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None,
                   help="a running server, e.g. http://127.0.0.1:8000 (default: start "
                        "`tokenmill serve` on a free local port and stop it at the end)")
    p.add_argument("--model", default=None,
                   help="local HF model folder: the one to serve (default: the benchmark "
                        "model), or with --url where to read vocab_size from (default: the "
                        "server's /v1/models root)")
    p.add_argument("--api-key", default=None, help="with --url: sent as a Bearer token")
    p.add_argument("--num-prompts", type=positive_int, default=128)
    p.add_argument("--input-len", type=int_range, default=(32, 512), metavar="A:B",
                   help="prompt lengths, uniform integers in [A, B] (default 32:512)")
    p.add_argument("--output-len", type=int_range, default=(32, 256), metavar="A:B",
                   help="output lengths, uniform integers in [A, B] (default 32:256)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--concurrency", type=positive_int, default=16,
                   help="most requests in flight at once (default 16)")
    p.add_argument("--output-json", default=None, metavar="PATH")
    from tokenmill.engine.arg_utils import add_cpu_platform_args
    add_cpu_platform_args(p)  # for the server this command starts
    s = p.add_argument_group("the server this command starts (not with --url)")
    s.add_argument("--dtype", default=None, choices=DTYPES, help="default bfloat16")
    s.add_argument("--device", default=None)
    s.add_argument("--num-kv-blocks", type=positive_int, default=None)
    s.add_argument("--max-num-seqs", type=positive_int, default=None)
    s.add_argument("--max-num-batched-tokens", type=positive_int, default=None)
    s.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding for the server (see tokenmill serve)")
    s.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="the server's engine core in its own process (default: the "
                        "server's choice)")
    s.add_argument("--data-parallel-size", type=positive_int, default=None, metavar="N")
    s.add_argument("--compare-engine-process", action="store_true",
                   help="run the workload twice, on a server with the engine core in its "
                        "process and on one with it in its own process, and print the ratio")
    s.add_argument("--server-timeout", type=float, default=300.0,
                   help="seconds to wait for the server's /health (default 300)")


# ---- one request ---------------------------------------------------------------
@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    chunks: int = 0  # SSE chunks with output


async def send_request(client, url: str, model: str | None, prompt: list[int],
                       max_tokens: int) -> RequestResult:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    res = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                # Any chunk with a choice is output (usage-only chunks have none).
                if chunk.get("choices"):
                    res.chunks += 1
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - start
    res.ok = res.ttft is not None
    if not res.ok:
        res.error = "the stream held no output"
    return res


async def run_workload(url: str, model: str | None, workload: Workload, concurrency: int,
                       api_key: str | None = None) -> tuple[list[RequestResult], float]:
    """-> (one result per request, wall seconds)."""
    import httpx
    sem = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits,
                                 headers=headers) as client:
        async def one(prompt, n):
            async with sem:
                return await send_request(client, url, model, prompt, n)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p, n) for p, n in
                                         zip(workload.prompts, workload.output_lens)))
        return list(results), time.perf_counter() - start


# ---- the server ----------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(log, n: int = 3000) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-n:]


@contextlib.contextmanager
def local_server(model_path: str, args, max_model_len: int):
    """Start `tokenmill serve` on a free 127.0.0.1 port; yield its URL; stop it."""
    import httpx
    port = _free_port()
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", model_path,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype or "bfloat16",
           "--max-model-len", str(max_model_len), "--seed", str(args.seed),
           "--log-stats-interval", "0", "--uvicorn-log-level", "warning",
           "--shutdown-grace", "5"]
    for flag in ("device", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens",
                 "speculative_config", "cpu_kernels", "cpu_capability",
                 "linear_bf16_max_rows", "greedy_head_max_rows", "tensor_parallel_size",
                 "kv_cache_dtype"):
        if getattr(args, flag, None) is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if getattr(args, "decode_layers", True) is False:
        cmd.append("--no-decode-layers")
    if getattr(args, "engine_process", None) is not None:
        cmd.append("--engine-process" if args.engine_process else "--no-engine-process")
    if getattr(args, "data_parallel_size", None) is not None:
        cmd += ["--data-parallel-size", str(args.data_parallel_size)]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        logger.info("starting: %s", " ".join(cmd))
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + args.server_timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode}:\n"
                                       f"{_log_tail(log)}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server was not healthy after {args.server_timeout}"
                                       f" s:\n{_log_tail(log)}")
                time.sleep(0.25)
            yield url
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def server_info(url: str, api_key: str | None) -> dict:
    """/v1/models' first entry: id (the model name), root, max_model_len."""
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        resp = httpx.get(f"{url}/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        raise ValueError(f"--url {url}: cannot reach the server ({e})") from None
    if resp.status_code != 200:
        raise ValueError(f"--url {url}: GET /v1/models answered {resp.status_code}: "
                         f"{resp.text[:300]}")
    return resp.json()["data"][0]


# ---- report --------------------------------------------------------------------
def _stats_ms(values: list[float]) -> dict:
    import numpy as np
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    a = np.asarray(values) * 1000
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p99": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], seconds: float) -> dict:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    return {
        "completed": len(done), "failed": len(results) - len(done), "duration_s": seconds,
        "request_throughput": len(done) / seconds, "output_tok_s": out_tokens / seconds,
        "total_output_tokens": out_tokens,
        "ttft_ms": _stats_ms([r.ttft for r in done]),
        "itl_ms": _stats_ms([g for r in done for g in r.itl]),
        "e2e_ms": _stats_ms([r.e2e for r in done]),
    }


def format_table(s: dict) -> str:
    def ms(v):
        return f"{v:10.2f}" if v is not None else f"{'-':>10}"
    lines = [f"requests            {s['completed']} ok, {s['failed']} failed, "
             f"{s['duration_s']:.2f} s",
             f"request throughput  {s['request_throughput']:.2f} req/s",
             f"output throughput   {s['output_tok_s']:.1f} tok/s",
             f"{'(ms)':<8}{'mean':>10}{'p50':>10}{'p99':>10}"]
    for name, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        lines.append(f"{name:<8}" + "".join(ms(s[key][q]) for q in ("mean", "p50", "p99")))
    return "\n".join(lines)


def _ratio(a, b):
    return a / b if a is not None and b else None


# ---- the command ---------------------------------------------------------------
def _bench_once(args, model_path, model_name, max_model_len, workload, warmup):
    """Warm up, then send the workload: (results, seconds). RuntimeError on failure."""
    with (contextlib.nullcontext(args.url.rstrip("/")) if args.url else
          local_server(model_path, args, max_model_len)) as url:
        warm, _ = asyncio.run(run_workload(url, model_name, warmup, 2, args.api_key))
        if not all(r.ok for r in warm):
            raise RuntimeError(f"warm-up request failed: "
                               f"{next(r.error for r in warm if not r.ok)}")
        logger.info("sending %d requests (%d prompt, %d output tokens), concurrency %d",
                    args.num_prompts, workload.total_prompt_tokens,
                    workload.total_output_tokens, args.concurrency)
        return asyncio.run(run_workload(url, model_name, workload, args.concurrency,
                                        args.api_key))


# ---- the command ---------------------------------------------------------------
def validate_args(args: argparse.Namespace) -> None:
    if args.url is not None:
        if not args.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {args.url!r}")
        given = [f"--{f.replace('_', '-')}" for f in
                 ("dtype", "device", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens",
                  "speculative_config", "engine_process", "data_parallel_size")
                 if getattr(args, f, None) is not None]
        if getattr(args, "compare_engine_process", False):
            given.append("--compare-engine-process")
        if given:
            raise ValueError(f"{', '.join(given)}: only for the server this command starts;"
                             " drop them or drop --url")
    elif args.api_key is not None:
        raise ValueError("--api-key only applies with --url")
    if args.server_timeout <= 0:
        raise ValueError(f"--server-timeout must be > 0, got {args.server_timeout}")


def run_serve_bench(args: argparse.Namespace) -> int:
    validate_args(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    max_model_len = args.input_len[1] + args.output_len[1]
    if args.url:
        url = args.url.rstrip("/")
        info = server_info(url, args.api_key)
        model_name, model_path = info["id"], args.model or info.get("root")
        hf_config = read_model_config(model_path)
        limit, what = info.get("max_model_len"), "the server's max_model_len"
    else:
        model_name, model_path = None, args.model or ensure_bench_model()
        hf_config = read_model_config(model_path)
        limit, what = hf_config.get("max_position_embeddings", 2048), "max_position_embeddings"
    if limit is not None and max_model_len > limit:
        raise ValueError(f"longest prompt + output ({max_model_len}) exceeds {what} ({limit})")
    vocab = hf_config["vocab_size"]
    workload = make_workload(args.num_prompts, args.input_len, args.output_len, vocab, args.seed)
    # Untimed: two requests of the same shape (shortest outputs), from another seed.
    warmup = make_workload(2, args.input_len, (args.output_len[0],) * 2, vocab, args.seed + 1)

    # --compare-engine-process: first the same workload on a server whose engine core
    # shares its process; the last run is the one reported in full.
    modes = ([False, True] if getattr(args, "compare_engine_process", False)
             else [getattr(args, "engine_process", None)])
    in_process = None
    for mode in modes:
        args.engine_process = mode
        try:
            results, seconds = _bench_once(args, model_path, model_name, max_model_len,
                                           workload, warmup)
        except RuntimeError as e:
            logger.error("%s", e)
            return 1
        if len(modes) > 1:
            if mode is False:
                in_process = summarize(results, seconds)
                print("engine core in the server's process:")
                print(format_table(in_process))
            else:
                print("engine core in its own process:")

    summary = summarize(results, seconds)
    for i, r in enumerate(results):
        if r.ok and r.output_tokens != workload.output_lens[i]:
            r.ok, r.error = False, (f"got {r.output_tokens} output tokens, "
                                    f"asked for {workload.output_lens[i]}")
    errors = [(i, r.error) for i, r in enumerate(results) if not r.ok]
    for i, err in errors[:5]:
        logger.error("request %d: %s", i, err)
    lumped = sum(1 for r in results if r.ok and r.chunks == 1 and r.output_tokens > 1)
    if lumped:
        logger.warning("%d requests got all their tokens in one chunk: their TTFT is their "
                       "E2E, ITL misses them", lumped)
    summary["single_chunk_requests"] = lumped
    print(format_table(summary))
    if in_process is not None:
        summary["in_process"] = in_process
        summary["engine_process_ratio"] = ratios = {
            "output_tok_s": summary["output_tok_s"] / in_process["output_tok_s"],
            "ttft_p50": _ratio(summary["ttft_ms"]["p50"], in_process["ttft_ms"]["p50"]),
            "itl_p50": _ratio(summary["itl_ms"]["p50"], in_process["itl_ms"]["p50"])}
        print(f"own process / in process: output tok/s {ratios['output_tok_s']:.2f}x, "
              f"TTFT p50 {ratios['ttft_p50']:.2f}x, ITL p50 {ratios['itl_p50']:.2f}x")
    if args.output_json:
        summary["workload"] = {
            "url": args.url, "model": model_path, "served_model_name": model_name,
            "dtype": None if args.url else (args.dtype or "bfloat16"), "seed": args.seed,
            "num_prompts": args.num_prompts, "input_len": _fmt_range(args.input_len),
            "output_len": _fmt_range(args.output_len), "concurrency": args.concurrency,
            "total_prompt_tokens": workload.total_prompt_tokens,
            "total_output_tokens": workload.total_output_tokens,
            "max_model_len": max_model_len}
        summary["errors"] = [f"request {i}: {e}" for i, e in errors]
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
    return 1 if errors else 0
