"""The `tokenmill` command: generate, chat, serve, bench."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from tokenmill.engine.arg_utils import add_engine_args, engine_kwargs, resolve_model


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
    from tokenmill.parsers.registry import TOOL_CALL_PARSERS
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto" (the default when a request has tools): the '
                        "model's output goes through --tool-call-parser")
    s.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                   help="how the model writes tool calls, for tool_choice \"auto\" "
                        "(\"required\" and named calls need none: a grammar forces them)")
    s.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                   help="the chat template (a Jinja file, or the template itself) in place "
                        "of the tokenizer's")
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
