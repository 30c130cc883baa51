"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""
from __future__ import annotations

import logging
import math
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.entrypoints.openai.protocol import UNSUPPORTED_FIELD
from tokenmill.errors import EngineDeadError, EngineOverloadedError, ParamError

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
                   param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": param,
                                   "code": status}}, status_code=status, headers=headers)


def _param_of(message: str) -> str | None:
    """The request field a ValueError's message starts with ("n=2 with ..." -> "n")."""
    m = _FIRST_WORD.match(message)
    first = m.group(0) if m else ""
    if first == "prompt_token_ids":
        return "prompt"
    return first if first in _PARAM_NAMES else None


def bad_value(e: ValueError, param: str | None = None, rename: dict | None = None) -> APIError:
    """A 400 for the engine's ValueError: the field from ParamError.param when it has one,
    else parsed from the message, else `param`; then renamed to the request's own name."""
    msg = str(e)
    named = getattr(e, "param", None)  # tokenmill.errors.ParamError
    if named:  # the top-level request field: "structured_outputs.json" -> "structured_outputs"
        named = re.split(r"[.\[]", named, maxsplit=1)[0]
        named = "prompt" if named == "prompt_token_ids" else named
    param = named or _param_of(msg) or param
    if rename and param in rename:
        param = rename[param]
    return APIError(msg, 400, "BadRequestError", param)


def client_message(text: str, limit: int = 300) -> str:
    """What of an error text a client may see: its first line, at most `limit` characters
    (tracebacks and long dumps stay in the server log)."""
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


# 4xx statuses -> the reason label of tokenmill:requests_rejected_total
_REJECT_REASON = {400: "invalid", 401: "unauthorized", 404: "not_found", 413: "too_large"}

INTERNAL_ERROR = "internal server error"
ENGINE_DEAD = "the engine is not running"


def install_handlers(app: FastAPI, rejected) -> None:
    """Exception handlers that turn every failure into an OpenAI-shaped error, never with
    a traceback, a repr or a path in it. `rejected(reason)` counts the requests turned away."""

    def reject(message: str, status: int, type: str, param: str | None = None):
        if status in _REJECT_REASON:
            rejected(_REJECT_REASON[status])
        return error_response(message, status, type, param)

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return reject(exc.message, exc.status, exc.type, exc.param)

    @app.exception_handler(ParamError)
    async def _param_error(_, exc: ParamError):  # a request field checked in a route
        return reject(client_message(exc.message), 400, "BadRequestError", exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, exc: RequestValidationError):
        errs = exc.errors()
        if errs:
            e = errs[0]
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            if e.get("type") == "json_invalid":
                return reject(f"malformed JSON: {e.get('msg')}", 400, "BadRequestError")
            if e.get("type") == UNSUPPORTED_FIELD:  # protocol.py refused a field it names
                ctx = e.get("ctx") or {}
                return reject(str(ctx.get("message") or e.get("msg")), 400, "BadRequestError",
                              ctx.get("param"))
            param = loc[0] if loc else None
            msg = f"{param}: {e.get('msg')}" if param else str(e.get("msg"))
            return reject(msg, 400, "BadRequestError", param)
        return reject("invalid request", 400, "BadRequestError")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):
        kind = {404: "NotFoundError", 405: "MethodNotAllowed",
                413: "RequestTooLarge"}.get(exc.status_code, "Error")
        return reject(str(exc.detail), exc.status_code, kind)

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(_, exc: EngineOverloadedError):
        rejected("overloaded")
        retry = max(1, math.ceil(getattr(exc, "retry_after", 1) or 1))
        return error_response(client_message(str(exc)) or "the server is overloaded", 503,
                              "ServiceUnavailableError", headers={"Retry-After": str(retry)})

    @app.exception_handler(EngineDeadError)
    async def _dead(_, exc: EngineDeadError):
        rejected("engine_dead")  # the engine's message may name its cause: not sent
        return error_response(ENGINE_DEAD, 503, "ServiceUnavailableError")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        # Starlette re-raises it after this response: uvicorn logs the traceback.
        logger.error("unhandled %s on %s %s", type(exc).__name__, request.method,
                     request.url.path)
        return error_response(INTERNAL_ERROR, 500, "InternalServerError")
