"""FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /version,
/tokenize, /detokenize, /metrics; errors in OpenAI's shape."""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.engine.async_llm import AsyncLLM, EngineDeadError
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                   DetokenizeRequest, TokenizeRequest)
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_PARAM_NAMES = ("n", "temperature", "top_p", "top_k", "seed", "max_tokens", "stop_token_ids",
                "stop", "prompt", "prompt_token_ids", "messages", "ignore_eos")


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, type: str = "BadRequestError",
                 param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param = message, status, type, param


def error_response(message: str, status: int = 400, type: str = "BadRequestError",
                   param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": param,
                                   "code": status}}, status_code=status)


def _param_of(message: str) -> str | None:
    first = message.split(" ", 1)[0].rstrip(":")
    if first == "prompt_token_ids":
        return "prompt"
    return first if first in _PARAM_NAMES else None


def _bad_value(e: ValueError, param: str | None = None) -> APIError:
    msg = str(e)
    return APIError(msg, 400, "BadRequestError", _param_of(msg) or param)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _BearerAuth:
    """401 on /v1/* without `Authorization: Bearer KEY`. A plain ASGI middleware:
    Starlette's BaseHTTPMiddleware would hide client disconnects from the routes."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = dict(scope.get("headers") or ())
            if headers.get(b"authorization") != self.expected:
                resp = error_response("invalid or missing API key", 401, "AuthenticationError")
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(async_llm: AsyncLLM, served_model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="tokenmill OpenAI-compatible server")
    app.state.async_llm = async_llm
    tok = async_llm.tokenizer
    max_model_len = async_llm.model_config.max_model_len
    from tokenmill import __version__ as version

    # ---- errors ----------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return error_response(exc.message, exc.status, exc.type, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, exc: RequestValidationError):
        errs = exc.errors()
        if errs:
            e = errs[0]
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            if e.get("type") == "json_invalid":
                return error_response(f"malformed JSON: {e.get('msg')}", 400)
            param = loc[0] if loc else None
            msg = f"{param}: {e.get('msg')}" if param else str(e.get("msg"))
            return error_response(msg, 400, "BadRequestError", param)
        return error_response("invalid request", 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):
        kind = {404: "NotFoundError", 405: "MethodNotAllowed"}.get(exc.status_code, "Error")
        return error_response(str(exc.detail), exc.status_code, kind)

    @app.exception_handler(EngineDeadError)
    async def _dead(_, exc: EngineDeadError):
        return error_response(str(exc), 503, "ServiceUnavailableError")

    if api_key:
        app.add_middleware(_BearerAuth, api_key=api_key)

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise APIError(f"The model `{name}` does not exist.", 404, "NotFoundError", "model")

    def render_chat(messages, add_generation_prompt: bool, chat_template: str | None) -> list[int]:
        if tok is None:
            raise APIError("this model has no tokenizer, so no chat template", 400,
                           param="messages")
        if not messages:
            raise APIError("messages must not be empty", 400, param="messages")
        try:
            return async_llm.engine.apply_chat_template(
                [m.model_dump(exclude_none=True) for m in messages], add_generation_prompt,
                chat_template)
        except Exception as e:  # jinja errors, templates that reject a message
            raise APIError(f"messages: could not apply the chat template: {e}", 400,
                           param="messages") from e

    def make_params(req, default_max_tokens: int | None) -> SamplingParams:
        try:
            return req.to_sampling_params(default_max_tokens=default_max_tokens)
        except ValueError as e:
            raise _bad_value(e) from e

    async def start(prompt, params: SamplingParams, request_id: str):
        """Add the request now (so validation errors become a 400); return its stream."""
        try:
            rid, queue = await async_llm.add_request(prompt, params, request_id)
        except ValueError as e:
            raise _bad_value(e, "prompt") from e
        return async_llm.stream(rid, queue)

    class Merged:
        """(index, output) from several request streams as they come; close() frees them all."""

        def __init__(self, streams, request_ids):
            self.streams, self.request_ids = streams, request_ids
            self.q: asyncio.Queue = asyncio.Queue()
            self.tasks = [asyncio.create_task(self._pump(i, g)) for i, g in enumerate(streams)]
            self.closed = False

        async def _pump(self, i, gen):
            try:
                async for out in gen:
                    await self.q.put((i, out))
                await self.q.put((i, None))
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # noqa: BLE001 - handed to the reader
                await self.q.put((i, e))

        async def __aiter__(self):
            remaining = len(self.tasks)
            while remaining:
                i, item = await self.q.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item

        async def close(self):
            if self.closed:
                return
            self.closed = True
            for t in self.tasks:
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            for g in self.streams:
                try:
                    await g.aclose()
                except RuntimeError:
                    pass
            for rid in self.request_ids:  # idempotent: finished ids are ignored
                async_llm.abort(rid)

    async def start_all(prompts, params, base_id):
        starts, ids = [], []
        try:
            for i, p in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                ids.append(rid)
                starts.append(await start(p, params, rid))
        except BaseException:
            await Merged(starts, ids).close()
            raise
        return Merged(starts, ids)

    async def collect(job, raw: Request) -> list:
        """The final output of each request of a non-streaming response; a client that
        goes away meanwhile (checked every 0.25 s) aborts them."""
        finals: list = [None] * len(job.request_ids)

        async def consume():
            async for i, out in job:
                finals[i] = out

        task = asyncio.create_task(consume())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    task.result()
                    return finals
                if await raw.is_disconnected():
                    logger.info("client disconnected: aborting %s", ", ".join(job.request_ids))
                    raise APIError("client disconnected", 499, "ClientClosedRequest")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await job.close()

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def streaming(body: AsyncIterator[str], job) -> StreamingResponse:
        async def wrapped():
            try:
                async for chunk in body:
                    yield chunk
            finally:  # client gone or done: free everything this response holds
                await job.close()
        return StreamingResponse(wrapped(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    # ---- completions -------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        check_model(req.model)
        params = make_params(req, 16)  # OpenAI's default for completions
        p = req.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [{"prompt_token_ids": p}]
        elif p and all(isinstance(x, str) for x in p):
            prompts = list(p)
        elif p and all(isinstance(x, list) for x in p):
            prompts = [{"prompt_token_ids": x} for x in p]
        else:
            raise APIError("prompt must not be empty", 400, param="prompt")
        base_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        job = await start_all(prompts, params, base_id)
        n = len(prompts)
        model = served_model_name

        def prompt_text(out) -> str:
            if out.prompt is not None:
                return out.prompt
            return tok.decode(out.prompt_token_ids) if tok is not None else ""

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def body():
                sent = [0] * n
                echoed = [False] * n
                prompt_tokens = [0] * n
                completion_tokens = [0] * n
                async for i, out in job:
                    c = out.outputs[0]
                    delta = c.text[sent[i]:]
                    sent[i] = len(c.text)
                    if req.echo and not echoed[i]:
                        delta = prompt_text(out) + delta
                        echoed[i] = True
                    prompt_tokens[i] = len(out.prompt_token_ids)
                    completion_tokens[i] = len(c.token_ids)
                    # Text can lag the tokens (an incomplete UTF-8 character): skip
                    # empty chunks then; without a tokenizer, one chunk per step.
                    if not delta and c.finish_reason is None and tok is not None:
                        continue
                    yield _sse({"id": base_id, "object": "text_completion", "created": created,
                                "model": model,
                                "choices": [{"index": i, "text": delta, "logprobs": None,
                                             "finish_reason": c.finish_reason,
                                             "stop_reason": c.stop_reason}]})
                if include_usage:
                    yield _sse({"id": base_id, "object": "text_completion", "created": created,
                                "model": model, "choices": [],
                                "usage": usage(sum(prompt_tokens), sum(completion_tokens))})
                yield "data: [DONE]\n\n"
            return streaming(body(), job)

        finals = await collect(job, raw)
        choices = []
        for i, out in enumerate(finals):
            c = out.outputs[0]
            text = (prompt_text(out) + c.text) if req.echo else c.text
            choices.append({"index": i, "text": text, "logprobs": None,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": base_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices,
                "usage": usage(sum(len(o.prompt_token_ids) for o in finals),
                               sum(len(o.outputs[0].token_ids) for o in finals))}

    # ---- chat ----------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        check_model(req.model)
        params = make_params(req, None)  # chat: up to the context length
        ids = render_chat(req.messages, req.add_generation_prompt, req.chat_template)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        job = Merged([await start({"prompt_token_ids": ids}, params, rid)], [rid])
        model = served_model_name

        def chunk(delta: dict, finish_reason=None, stop_reason=None) -> str:
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                         "model": model,
                         "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish_reason,
                                      "stop_reason": stop_reason}]})

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def body():
                yield chunk({"role": "assistant", "content": ""})
                sent = 0
                last = None
                async for _, out in job:
                    last = out
                    c = out.outputs[0]
                    delta = c.text[sent:]
                    sent = len(c.text)
                    if not delta and c.finish_reason is None:
                        continue
                    yield chunk({"content": delta}, c.finish_reason, c.stop_reason)
                if include_usage and last is not None:
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                "model": model, "choices": [],
                                "usage": usage(len(last.prompt_token_ids),
                                               len(last.outputs[0].token_ids))})
                yield "data: [DONE]\n\n"
            return streaming(body(), job)

        final = (await collect(job, raw))[0]
        c = final.outputs[0]
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                             "logprobs": None, "finish_reason": c.finish_reason,
                             "stop_reason": c.stop_reason}],
                "usage": usage(len(final.prompt_token_ids), len(c.token_ids))}

    # ---- the rest -------------------------------------------------------------------
    @app.get("/v1/models")
    async def models():
        return {"object": "list",
                "data": [{"id": served_model_name, "object": "model", "created": int(time.time()),
                          "owned_by": "tokenmill", "root": async_llm.model_config.path,
                          "max_model_len": max_model_len}]}

    @app.get("/health")
    async def health():
        if not async_llm.is_healthy():
            return error_response("the engine is not running", 503, "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/version")
    async def get_version():
        return {"version": version}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_model(req.model)
        if tok is None:
            raise APIError("this model has no tokenizer", 400)
        if req.messages is not None:
            ids = render_chat(req.messages, req.add_generation_prompt, None)
        elif req.prompt is not None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise APIError("give prompt or messages", 400, param="prompt")
        return {"tokens": list(ids), "count": len(ids), "max_model_len": max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        if tok is None:
            raise APIError("this model has no tokenizer", 400)
        vocab = async_llm.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"tokens: token id {bad[0]} is outside the vocabulary", 400,
                           param="tokens")
        return {"prompt": tok.decode(req.tokens)}

    server_metrics = ServerMetrics(async_llm, served_model_name)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(server_metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def run_server(args) -> int:
    """`tokenmill serve`: build the engine, then serve until SIGINT / SIGTERM."""
    import uvicorn

    from tokenmill.demo_model import DEMO_MODEL_NAME
    from tokenmill.engine.llm_engine import EngineArgs
    from tokenmill.entrypoints.cli import engine_kwargs, resolve_model

    model_arg = args.model_pos or args.model
    model = resolve_model(model_arg)
    name = args.served_model_name or model_arg or DEMO_MODEL_NAME
    async_llm = AsyncLLM.from_engine_args(EngineArgs.from_kwargs(model, **engine_kwargs(args)),
                                          log_stats_interval=args.log_stats_interval)
    app = build_app(async_llm, name, api_key=args.api_key)
    logger.info("serving %s as %r on http://%s:%d", model, name, args.host, args.port)
    # uvicorn catches SIGINT / SIGTERM, stops accepting, lets in-flight requests finish
    # (cancelled after --shutdown-grace seconds, which aborts them) and then re-raises
    # the signal: these handlers take that re-raise, so a clean shutdown exits 0.
    old = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, lambda *_: None)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                    timeout_graceful_shutdown=args.shutdown_grace)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        async_llm.shutdown()
    logger.info("server stopped")
    return 0
