"""The OpenAI-compatible HTTP server: `build_app` puts together the routes (routes/*), the
error handlers (errors.py) and the middlewares (middleware.py); `run_server` serves it
with uvicorn until SIGTERM / SIGINT, or until the engine dies (then it exits 1)."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading

from fastapi import FastAPI

from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.entrypoints.openai.context import ServerContext, ServerOptions
from tokenmill.entrypoints.openai.errors import install_handlers
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.entrypoints.openai.middleware import BearerAuth, BodySizeLimit
from tokenmill.entrypoints.openai.routes import (chat, completions, misc, stats, tokenize,
                                                 web_ui)
from tokenmill.entrypoints.openai.routes import embeddings

logger = logging.getLogger(__name__)

# After the engine dies: open streams get this long to send their error events before
# uvicorn stops, and the process this long to exit on its own before os._exit(1).
EXIT_DELAY_S, HARD_EXIT_S = 0.5, 8.0
# The engine core in a process of its own by default: measured with `tokenmill bench serve
# --compare-engine-process` on a 2-core CPU, it gave 1.22-1.27x the output tok/s at 16
# concurrent requests and 1.75x at one (ITL 7.5 -> 4.0 ms): HTTP, tokenizing and
# detokenizing no longer wait on the GIL the engine loop holds (docs/benchmarks.md).
ENGINE_PROCESS_DEFAULT = True


def build_app(async_llm: AsyncLLM, served_model_name: str, api_key: str | None = None,
              options: ServerOptions | None = None) -> FastAPI:
    options = options or ServerOptions()
    if api_key is not None:
        options = dataclasses.replace(options, api_key=api_key)
    metrics = ServerMetrics(async_llm, served_model_name)
    ctx = ServerContext(async_llm, served_model_name, options, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        ctx.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="tokenmill OpenAI-compatible server", lifespan=lifespan)
    app.state.async_llm = async_llm
    app.state.ctx = ctx
    install_handlers(app, metrics.rejected)
    for module in (completions, chat, tokenize, misc, stats):
        app.include_router(module.router)
    app.include_router(embeddings.router)  # (a pooling engine only: routes/embeddings.py)
    if options.web_ui:
        app.include_router(web_ui.router)
    # The last added runs first: auth, then the body cap (an unauthenticated client
    # learns nothing, not even the cap).
    app.add_middleware(BodySizeLimit, cap=ctx.limits.max_request_body_bytes,
                       rejected=metrics.rejected)
    if options.api_key:
        public = ("/health", "/metrics") if options.metrics_public else ("/health",)
        if options.web_ui:  # the page asks for the key; its API calls send it
            public += web_ui.PUBLIC_PATHS
        app.add_middleware(BearerAuth, api_key=options.api_key, public=public,
                           rejected=metrics.rejected)
    return app


def resolve_engine_process(flag: bool | None) -> bool:
    """Whether the server runs its engine core in a process of its own: the flag, else
    TOKENMILL_ENGINE_PROCESS (1 / 0), else the measured default (ENGINE_PROCESS_DEFAULT)."""
    if flag is not None:
        return flag
    env = os.environ.get("TOKENMILL_ENGINE_PROCESS")
    if env is not None:
        if env not in ("0", "1"):
            raise ValueError(f"TOKENMILL_ENGINE_PROCESS must be 0 or 1, got {env!r}")
        return env == "1"
    return ENGINE_PROCESS_DEFAULT


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template itself when it is one."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def run_server(args) -> int:
    """`tokenmill serve`: build the engine, then serve until SIGINT / SIGTERM (exit 0) or
    until the engine dies (exit 1)."""
    import uvicorn

    from tokenmill.demo_model import DEMO_MODEL_NAME
    from tokenmill.engine.engine_args import EngineArgs
    from tokenmill.engine.arg_utils import engine_kwargs, resolve_model

    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    chat_template = load_chat_template(getattr(args, "chat_template", None))
    model_arg = args.model_pos or args.model
    model = resolve_model(model_arg)
    name = args.served_model_name or model_arg or DEMO_MODEL_NAME
    kwargs = engine_kwargs(args)
    kwargs["engine_process"] = resolve_engine_process(getattr(args, "engine_process", None))
    async_llm = AsyncLLM.from_engine_args(
        EngineArgs.from_kwargs(model, **kwargs),
        log_stats_interval=args.log_stats_interval, max_num_waiting=args.max_num_waiting,
        step_timeout=args.engine_step_timeout)
    options = ServerOptions(
        api_key=args.api_key or os.environ.get("TOKENMILL_API_KEY") or None,
        metrics_public=args.metrics_public, log_prompts=args.log_prompts,
        trust_request_chat_template=args.trust_request_chat_template,
        web_ui=not args.no_web_ui,
        allowed_local_media_path=getattr(args, "allowed_local_media_path", None),
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        chat_template=chat_template)
    app = build_app(async_llm, name, options=options)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=args.shutdown_grace))
    engine_died = threading.Event()

    def on_engine_death(exc) -> None:  # called once, on some engine-side thread
        logger.error("the engine died (%s): stopping the server", type(exc).__name__)
        engine_died.set()
        # uvicorn polls should_exit on its loop (every 0.1 s): a plain attribute write from
        # this thread is enough, after a moment for the open streams' error events.
        threading.Timer(EXIT_DELAY_S, setattr, (server, "should_exit", True)).start()
        hard = threading.Timer(HARD_EXIT_S, os._exit, (1,))  # a stuck shutdown still exits
        hard.daemon = True
        hard.start()

    async_llm.add_death_callback(on_engine_death)
    logger.info("serving %s as %r on http://%s:%d", model, name, args.host, args.port)
    if options.web_ui:
        logger.info("web playground and dashboard: http://%s:%d/", args.host, args.port)
    # uvicorn catches SIGINT / SIGTERM, stops accepting, lets in-flight requests finish
    # (cancelled after --shutdown-grace seconds, which aborts them) and then re-raises
    # the signal: these handlers take that re-raise, so a clean shutdown exits 0.
    old = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        async_llm.shutdown()
    if engine_died.is_set():
        logger.error("server stopped: the engine died")
        return 1
    logger.info("server stopped")
    return 0
