"""The `tokenmill` command: generate, chat, serve, bench."""
from __future__ import annotations

import argparse
import json
import logging
import sys


def add_engine_args(p: argparse.ArgumentParser, model_required: bool = False) -> None:
    p.add_argument("--model", required=model_required, default=None,
                   help="local HF folder or hub id (default: the built-in demo model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step N+1 while step N runs (default: on for CUDA, off on CPU)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs / prompt_logprobs a request may ask for")
    p.add_argument("--max-num-encoder-input-tokens", type=int, default=None,
                   help="multimodal models: image tokens the encoder takes per step "
                        "(default: max(max-num-batched-tokens, max-model-len))")
    p.add_argument("--encoder-cache-size", type=int, default=None,
                   help="multimodal models: encoder output rows kept for reuse "
                        "(default: twice the encoder budget)")
    add_kv_cache_args(p)
    add_cpu_platform_args(p)
    add_limit_args(p)
    add_speculative_args(p)
    add_parallel_args(p)


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("processes")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine core in a process of its own, fed over ZeroMQ "
                        "(default: off; `serve` decides where it pays)")
    g.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="N engine replicas, each in its own process with its share of the "
                        "CPUs; requests go to the least loaded")
    g.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp",
                   help="how the engine processes start: local processes, or Ray actors "
                        "(a running Ray cluster, or a local one started on demand)")


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\' (fields: method, '
                        'num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, model, '
                        'disable_by_batch_size, adaptive; default: off)')


def add_cpu_platform_args(p: argparse.ArgumentParser) -> None:
    """The engine arguments that choose the CPU kernels (tokenmill/cpu_platform.py)."""
    from tokenmill import cpu_platform as cp
    from tokenmill.kernels import all_levels
    g = p.add_argument_group("CPU kernels")
    g.add_argument("--cpu-kernels", choices=cp.CPU_KERNELS, default="auto",
                   help="auto: the native C++ kernels where they build, else PyTorch; native: "
                        "the native kernels or an error; torch: the plain PyTorch path "
                        "everywhere (default: auto)")
    g.add_argument("--cpu-capability", default=None, metavar="LEVEL",
                   help=f"run the native kernels built for LEVEL ({', '.join(all_levels())}), "
                        f"at most what this CPU runs; below avx512 a bf16 model's GEMMs run "
                        f"in fp32 as on such a CPU (default: the best level this CPU runs)")
    g.add_argument("--linear-bf16-max-rows", type=int, default=None, metavar="N",
                   help="a bf16 model's inputs of up to N rows take the packed bf16 kernel, "
                        "larger ones a GEMM over a second copy of the weights (fp32 where "
                        "bf16 is emulated) (0: never; default: every input where the CPU "
                        "has no native bf16, so the packed weights are the only copy; "
                        f"{cp.DEFAULT_NATIVE_BF16_PACKED_ROWS} rows where it has)")
    g.add_argument("--greedy-head-max-rows", type=int,
                   default=cp.DEFAULT_GREEDY_HEAD_MAX_ROWS, metavar="N",
                   help="all-greedy steps of up to N rows take their tokens from the "
                        "int8-screened lm_head, same tokens as the full one (0: never; at most "
                        f"{cp.GREEDY_HEAD_KERNEL_ROWS}; default {cp.DEFAULT_GREEDY_HEAD_MAX_ROWS})")
    g.add_argument("--decode-layers", action=argparse.BooleanOptionalAction, default=True,
                   help="decode steps run every decoder layer in one native call where each "
                        "layer would go native anyway (--no-decode-layers: the Python layers; "
                        "default: on)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly instead of replaying the CUDA graphs "
                        "captured at start-up (no effect on CPU)")
    g.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the model over N ranks, one process each (rank 0 is the engine "
                        "process), joined by torch.distributed gloo on 127.0.0.1; the heads and "
                        "intermediate sizes must divide by N; with N > 1 the native decode-"
                        "layer loop and the greedy lm_head are off (default: 1)")


def cpu_platform_kwargs(args: argparse.Namespace) -> dict:
    return dict(cpu_kernels=args.cpu_kernels, cpu_capability=args.cpu_capability,
                linear_bf16_max_rows=args.linear_bf16_max_rows,
                greedy_head_max_rows=args.greedy_head_max_rows, decode_layers=args.decode_layers,
                tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                enforce_eager=getattr(args, "enforce_eager", False))


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """One flag per field of RequestLimits (`--max-n`, ...): caps on what one request
    may ask for. Unset: the RequestLimits default."""
    from dataclasses import fields

    from tokenmill.limits import RequestLimits
    g = p.add_argument_group("request limits")
    for f in fields(RequestLimits):
        g.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=None,
                       metavar="SECONDS" if isinstance(f.default, float) else "N",
                       help=f"default {f.default}")


def limit_kwargs(args: argparse.Namespace) -> dict:
    """{"limits": {the caps given}} for EngineArgs, or {} when none was."""
    from dataclasses import fields

    from tokenmill.limits import RequestLimits
    given = {f.name: getattr(args, f.name) for f in fields(RequestLimits)
             if getattr(args, f.name, None) is not None}
    return {"limits": given} if given else {}


def add_kv_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None, help="automatic prefix caching (default: on for "
                                      "full-attention models, off for hybrids)")
    p.add_argument("--kv-store", action="append", default=None, metavar="STORE",
                   help="an external KV store, searched in the order given: cpu, disk:PATH "
                        "or redis://HOST:PORT/DB (repeat for several)")
    p.add_argument("--kv-cpu-bytes", type=int, default=None,
                   help="LRU byte budget of the cpu KV store (default 1 GiB)")
    p.add_argument("--kv-disk-bytes", type=int, default=None,
                   help="LRU byte budget of each disk:PATH KV store, per model and KV "
                        "geometry (default 10 GiB): least recently used entries are "
                        "deleted first")
    p.add_argument("--kv-model-id", default=None,
                   help="the model identity in external KV keys (default: a fingerprint "
                        "of the checkpoint files)")


def kv_cache_kwargs(args: argparse.Namespace) -> dict:
    connector = None
    if getattr(args, "kv_store", None):
        connector = {"stores": args.kv_store}
        if args.kv_cpu_bytes is not None:
            connector["cpu_bytes"] = args.kv_cpu_bytes
        if args.kv_disk_bytes is not None:
            connector["disk_bytes"] = args.kv_disk_bytes
        if args.kv_model_id is not None:
            connector["model_id"] = args.kv_model_id
    return dict(enable_prefix_caching=getattr(args, "enable_prefix_caching", None),
                kv_connector=connector)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, device=args.device, seed=args.seed,
                max_model_len=args.max_model_len, block_size=args.block_size,
                num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                enable_chunked_prefill=not args.no_chunked_prefill,
                max_logprobs=args.max_logprobs, async_scheduling=args.async_scheduling,
                max_num_encoder_input_tokens=getattr(args, "max_num_encoder_input_tokens", None),
                encoder_cache_size=getattr(args, "encoder_cache_size", None),
                speculative_config=getattr(args, "speculative_config", None),
                engine_process=bool(getattr(args, "engine_process", None)),
                data_parallel_size=getattr(args, "data_parallel_size", 1),
                distributed_executor_backend=getattr(args, "distributed_executor_backend", "mp"),
                **kv_cache_kwargs(args), **cpu_platform_kwargs(args), **limit_kwargs(args))


def resolve_model(name: str | None) -> str:
    if name:
        return name
    from tokenmill.demo_model import ensure_demo_model
    return ensure_demo_model()


def cmd_generate(args) -> int:
    from tokenmill import LLM, SamplingParams
    llm = LLM(resolve_model(args.model), **engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed,
                            ignore_eos=args.ignore_eos)
    outs = llm.generate(args.prompt, params, use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason}))
        else:
            print(c.text)
    return 0


def cmd_chat(args) -> int:
    """A conversation on stdin/stdout through the model's chat template."""
    from tokenmill import LLM, SamplingParams
    llm = LLM(resolve_model(args.model), **engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.sampling_seed)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("exit", "quit"):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        messages.append({"role": "assistant", "content": reply})
        print(reply, flush=True)


def cmd_serve(args) -> int:
    from tokenmill.entrypoints.openai.server import run_server
    return run_server(args)


def cmd_bench(args) -> int:
    from tokenmill.bench.throughput import run_throughput_bench
    return run_throughput_bench(args)


def cmd_bench_latency(args) -> int:
    from tokenmill.bench.latency import run_latency_bench
    return run_latency_bench(args)


def cmd_bench_plot(args) -> int:
    from tokenmill.bench.plot import run_plot
    return run_plot(args)


def cmd_bench_window(args) -> int:
    from tokenmill.bench.window import run_window_bench
    return run_window_bench(args)


def cmd_bench_prefix(args) -> int:
    from tokenmill.bench.prefix import run_prefix_bench
    return run_prefix_bench(args)


def cmd_bench_spec(args) -> int:
    from tokenmill.bench.spec import run_spec_bench
    return run_spec_bench(args)


def cmd_bench_serve(args) -> int:
    from tokenmill.bench.serve import run_serve_bench
    return run_serve_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="chat on stdin/stdout through the chat template")
    add_engine_args(c)
    c.add_argument("--system", default=None, help="a system message")
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.7)
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--sampling-seed", type=int, default=None)
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    s.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                   help="local HF folder or hub id (default: the built-in demo model)")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: MODEL as given)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "and the web page's files (or TOKENMILL_API_KEY)")
    s.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the API key")
    s.add_argument("--log-prompts", action="store_true",
                   help="show the prompts in the per-request log lines")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a request's own chat_template (rendered in jinja2's sandbox)")
    s.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="chat image_url parts may name file:// images inside DIR (default: "
                        "none; data: URLs are always taken, http(s) URLs never fetched)")
    s.add_argument("--no-web-ui", action="store_true",
                   help="no web playground and dashboard at / (the JSON routes stay, "
                        "/stats included)")
    s.add_argument("--max-num-waiting", type=int, default=1024,
                   help="requests that may wait for the engine; past it: 503 + Retry-After")
    s.add_argument("--engine-step-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="a step making no progress this long means a hung engine: it is "
                        "declared dead and the server exits 1 (0: no watchdog)")
    s.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM/SIGINT")
    s.add_argument("--log-stats-interval", type=float, default=5.0,
                   help="seconds between stats log lines while busy (0: off)")
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks against baselines in the same run")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    t = bsub.add_parser("throughput", help="offline throughput: tokenmill vs HF generate, HF "
                                             "continuous batching and the GEMM roofline")
    from tokenmill.bench.throughput import add_throughput_args
    add_throughput_args(t)
    t.set_defaults(func=cmd_bench)
    lt = bsub.add_parser("latency", help="single-stream latency: tokenmill vs HF generate")
    from tokenmill.bench.latency import add_latency_args
    add_latency_args(lt)
    lt.set_defaults(func=cmd_bench_latency)
    wn = bsub.add_parser("window", help="a long context on a sliding-window model: KV bytes "
                                        "and decode speed with the window vs without")
    from tokenmill.bench.window import add_window_args
    add_window_args(wn)
    wn.set_defaults(func=cmd_bench_window)
    pl = bsub.add_parser("plot", help="a PNG bar chart from bench throughput / latency JSON")
    from tokenmill.bench.plot import add_plot_args
    add_plot_args(pl)
    pl.set_defaults(func=cmd_bench_plot)
    sv = bsub.add_parser("serve", help="online serving: latency and throughput over HTTP")
    from tokenmill.bench.serve import add_serve_bench_args
    add_serve_bench_args(sv)
    sv.set_defaults(func=cmd_bench_serve)
    pf = bsub.add_parser("prefix", help="prefix caching and the external KV tier: TTFT "
                                        "and throughput, cached vs recomputed")
    from tokenmill.bench.prefix import add_prefix_bench_args
    add_prefix_bench_args(pf)
    pf.set_defaults(func=cmd_bench_prefix)
    sp = bsub.add_parser("spec", help="speculative decoding: the same engine with and without "
                                      "it, single stream and concurrent")
    from tokenmill.bench.spec import add_spec_bench_args
    add_spec_bench_args(sp)
    sp.set_defaults(func=cmd_bench_spec)
    return parser


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
