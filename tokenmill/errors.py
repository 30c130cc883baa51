"""Errors that cross the engine / server boundary.

`ParamError` carries the request field it is about as data (`param`), so the
server does not have to parse it back out of the message. It subclasses
ValueError: everything that catches a bad request as ValueError still does.
"""
from __future__ import annotations


class ParamError(ValueError):
    """A request field failed validation; `param` names it ("top_k", "stop", ...)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


class EngineDeadError(RuntimeError):
    """The engine failed or was shut down; the request cannot complete."""


class EngineOverloadedError(RuntimeError):
    """Admission control: the waiting queue is full. The server answers 503 with
    Retry-After; the client may try again later."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class RequestFault(Exception):
    """A failure inside a step that belongs to these requests only: the engine
    finishes them with finish_reason "error" and the rest of the batch goes on."""

    def __init__(self, request_ids, cause: BaseException | str):
        self.request_ids = list(request_ids)
        self.cause = cause
        super().__init__(f"requests {self.request_ids}: {cause}")
