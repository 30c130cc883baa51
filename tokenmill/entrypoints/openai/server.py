"""FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /version,
/tokenize, /detokenize, /metrics; errors in OpenAI's shape."""
from __future__ import annotations

import asyncio
import json
import logging
import re
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
from tokenmill.entrypoints.openai.logprobs import LogprobFormatter, sample_positions_of
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                   DetokenizeRequest, TokenizeRequest)
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

_PARAM_NAMES = ("n", "temperature", "top_p", "top_k", "seed", "max_tokens", "stop_token_ids",
                "stop", "prompt", "prompt_token_ids", "messages", "ignore_eos", "logprobs",
                "top_logprobs", "prompt_logprobs", "logit_bias", "allowed_token_ids",
                "bad_words", "min_p", "min_tokens", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "include_stop_str_in_output", "skip_special_tokens",
                "spaces_between_special_tokens", "max_completion_tokens",
                "structured_outputs", "response_format", "guided_json", "guided_regex",
                "guided_choice", "guided_grammar", "cache_salt")
_FIRST_WORD = re.compile(r"[A-Za-z_]+")


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
    """The request field a ValueError's message starts with ("n=2 with ..." -> "n")."""
    m = _FIRST_WORD.match(message)
    first = m.group(0) if m else ""
    if first == "prompt_token_ids":
        return "prompt"
    return first if first in _PARAM_NAMES else None


def _bad_value(e: ValueError, param: str | None = None) -> APIError:
    msg = str(e)
    return APIError(msg, 400, "BadRequestError", _param_of(msg) or param)


def _salted(prompt, cache_salt: str | None):
    """The engine's prompt with the request's cache_salt (prefix caching) attached."""
    if cache_salt is None:
        return prompt
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": cache_salt}
    return {**prompt, "cache_salt": cache_salt}


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

    def make_params(req, default_max_tokens: int | None, output_kind: RequestOutputKind,
                    rename: dict | None = None) -> SamplingParams:
        try:
            return req.to_sampling_params(default_max_tokens=default_max_tokens,
                                          output_kind=output_kind)
        except ValueError as e:
            raise _renamed(_bad_value(e), rename) from e

    def _renamed(err: APIError, rename: dict | None) -> APIError:
        if rename and err.param in rename:
            err.param = rename[err.param]
        return err

    async def start(prompt, params: SamplingParams, request_id: str, rename: dict | None = None):
        """Add the request now (so validation errors become a 400); return its stream."""
        try:
            rid, queue = await async_llm.add_request(prompt, params, request_id)
        except ValueError as e:
            raise _renamed(_bad_value(e, "prompt"), rename) from e
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

    async def start_all(prompts, params, base_id, rename: dict | None = None):
        starts, ids = [], []
        try:
            for i, p in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                ids.append(rid)
                starts.append(await start(p, params, rid, rename))
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

    max_logprobs = getattr(getattr(async_llm.engine, "args", None), "max_logprobs", 20)
    fmt = LogprobFormatter(tok)
    completion_logprobs, chat_logprobs = fmt.completion_logprobs, fmt.chat_logprobs
    prompt_logprobs_json, sample_positions = fmt.prompt_logprobs_json, sample_positions_of

    # ---- completions -------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        check_model(req.model)
        # echo + logprobs asks the engine for prompt logprobs: its errors are about `logprobs`
        rename = ({"prompt_logprobs": "logprobs"}
                  if req.echo and req.logprobs is not None and req.prompt_logprobs is None
                  else None)
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        params = make_params(req, 16, kind, rename)  # OpenAI's default max_tokens: 16
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
        prompts = [_salted(x, req.cache_salt) for x in prompts]
        base_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        job = await start_all(prompts, params, base_id, rename)
        n = params.n
        model = served_model_name
        num_logprobs = req.logprobs
        want_prompt_logprobs = req.prompt_logprobs is not None

        def prompt_text(out) -> str:
            if out.prompt is not None:
                return out.prompt
            return tok.decode(out.prompt_token_ids) if tok is not None else ""

        def prompt_positions(out, plp) -> list:
            return list(zip(out.prompt_token_ids, plp or [None] * len(out.prompt_token_ids)))

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def body():
                started: set[int] = set()  # choices whose first chunk went out
                pending: dict[int, list] = {}  # logprob positions not sent yet, per choice
                offsets: dict[int, int] = {}  # text offset of the next token, per choice
                plps: dict[int, list] = {}  # prompt logprobs, per prompt
                prompt_tokens = [0] * len(prompts)
                completion_tokens = 0
                async for i, out in job:
                    prompt_tokens[i] = len(out.prompt_token_ids)
                    if out.prompt_logprobs is not None and i not in plps:
                        plps[i] = out.prompt_logprobs
                    for c in out.outputs:
                        index = i * n + c.index
                        completion_tokens += len(c.token_ids)
                        text = c.text
                        positions = pending.setdefault(index, [])
                        extra = {}
                        if index not in started:
                            started.add(index)
                            if req.echo:
                                text = prompt_text(out) + text
                                if num_logprobs is not None:
                                    positions[:0] = prompt_positions(out, plps.get(i))
                            if want_prompt_logprobs:
                                extra["prompt_logprobs"] = prompt_logprobs_json(plps.get(i))
                        if num_logprobs is not None:
                            positions.extend(sample_positions(c))
                        # Text can lag the tokens (an incomplete UTF-8 character, a possible
                        # stop string): skip empty chunks then, their logprobs go with the
                        # next one; without a tokenizer, one chunk per step.
                        if (not text and c.finish_reason is None and tok is not None
                                and not extra):
                            continue
                        logprobs = None
                        if num_logprobs is not None:
                            logprobs, offsets[index] = completion_logprobs(
                                positions, num_logprobs, offsets.get(index, 0))
                            pending[index] = []
                        yield _sse({"id": base_id, "object": "text_completion",
                                    "created": created, "model": model,
                                    "choices": [{"index": index, "text": text,
                                                 "logprobs": logprobs,
                                                 "finish_reason": c.finish_reason,
                                                 "stop_reason": c.stop_reason, **extra}]})
                if include_usage:
                    yield _sse({"id": base_id, "object": "text_completion", "created": created,
                                "model": model, "choices": [],
                                "usage": usage(sum(prompt_tokens), completion_tokens)})
                yield "data: [DONE]\n\n"
            return streaming(body(), job)

        finals = await collect(job, raw)
        choices = []
        for i, out in enumerate(finals):
            for c in sorted(out.outputs, key=lambda c: c.index):
                text = (prompt_text(out) + c.text) if req.echo else c.text
                logprobs = None
                if num_logprobs is not None:
                    positions = sample_positions(c)
                    if req.echo:
                        positions = prompt_positions(out, out.prompt_logprobs) + positions
                    logprobs, _ = completion_logprobs(positions, num_logprobs, 0)
                choice = {"index": i * n + c.index, "text": text, "logprobs": logprobs,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if want_prompt_logprobs:
                    choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
                choices.append(choice)
        return {"id": base_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices,
                "usage": usage(sum(len(o.prompt_token_ids) for o in finals),
                               sum(len(c.token_ids) for o in finals for c in o.outputs))}

    # ---- chat ----------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        check_model(req.model)
        # chat asks for top-N logprobs with `top_logprobs`: the engine's checks say `logprobs`
        rename = {"logprobs": "top_logprobs"}
        if req.logprobs and req.top_logprobs is not None and req.top_logprobs > max_logprobs:
            raise APIError(f"top_logprobs: {req.top_logprobs} is more than this server's "
                           f"max_logprobs={max_logprobs}", 400, param="top_logprobs")
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        params = make_params(req, None, kind, rename)  # chat: up to the context length
        ids = render_chat(req.messages, req.add_generation_prompt, req.chat_template)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        job = Merged([await start(_salted({"prompt_token_ids": ids}, req.cache_salt), params, rid,
                                  rename)], [rid])
        model = served_model_name
        n = params.n
        num_logprobs = params.logprobs  # None unless logprobs=true
        want_prompt_logprobs = req.prompt_logprobs is not None

        def chunk(index: int, delta: dict, logprobs=None, finish_reason=None,
                  stop_reason=None, **extra) -> str:
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                         "model": model,
                         "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": finish_reason,
                                      "stop_reason": stop_reason}], **extra})

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def body():
                for index in range(n):
                    yield chunk(index, {"role": "assistant", "content": ""})
                pending: dict[int, list] = {}
                prompt_tokens = completion_tokens = 0
                plp_extra = {}  # the prompt logprobs, sent with the first content chunk
                async for _, out in job:
                    prompt_tokens = len(out.prompt_token_ids)
                    if want_prompt_logprobs and out.prompt_logprobs is not None:
                        plp_extra = {"prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs)}
                    for c in out.outputs:
                        completion_tokens += len(c.token_ids)
                        positions = pending.setdefault(c.index, [])
                        if num_logprobs is not None:
                            positions.extend(sample_positions(c))
                        if not c.text and c.finish_reason is None and not plp_extra:
                            continue
                        logprobs = None
                        if num_logprobs is not None:
                            logprobs = {"content": chat_logprobs(positions, num_logprobs)}
                            pending[c.index] = []
                        yield chunk(c.index, {"content": c.text}, logprobs, c.finish_reason,
                                    c.stop_reason, **plp_extra)
                        plp_extra = {}
                if include_usage:
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                "model": model, "choices": [],
                                "usage": usage(prompt_tokens, completion_tokens)})
                yield "data: [DONE]\n\n"
            return streaming(body(), job)

        final = (await collect(job, raw))[0]
        choices = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            logprobs = None
            if num_logprobs is not None:
                logprobs = {"content": chat_logprobs(sample_positions(c), num_logprobs)}
            choices.append({"index": c.index,
                            "message": {"role": "assistant", "content": c.text},
                            "logprobs": logprobs, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason})
        response = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                    "choices": choices,
                    "usage": usage(len(final.prompt_token_ids),
                                   sum(len(c.token_ids) for c in final.outputs))}
        if want_prompt_logprobs:
            response["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)
        return response

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
