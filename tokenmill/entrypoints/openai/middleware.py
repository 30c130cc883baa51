"""Plain ASGI middlewares (Starlette's BaseHTTPMiddleware would hide client disconnects
from the routes)."""
from __future__ import annotations

import hmac

from fastapi import HTTPException

from tokenmill.entrypoints.openai.errors import error_response


class BearerAuth:
    """401 without `Authorization: Bearer KEY` on every path but the public ones."""

    def __init__(self, app, api_key: str, public: tuple[str, ...], rejected):
        self.app, self.expected = app, f"Bearer {api_key}".encode()
        self.public, self.rejected = public, rejected

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.public:
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            # constant time: the comparison says nothing about how much of the key matched
            if not hmac.compare_digest(given, self.expected):
                self.rejected("unauthorized")
                resp = error_response("invalid or missing API key", 401, "AuthenticationError")
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyTooLarge(HTTPException):
    """Raised from `receive` when the body goes past the cap: FastAPI passes an
    HTTPException from body reading through, so the 413 handler answers it."""

    def __init__(self, cap: int):
        super().__init__(413, f"the request body is larger than this server's "
                              f"max_request_body_bytes={cap}")


class BodySizeLimit:
    """413 for a body over `cap` bytes: at once from Content-Length, else counted as the
    chunks arrive (nothing past the cap is read)."""

    def __init__(self, app, cap: int, rejected):
        self.app, self.cap, self.rejected = app, cap, rejected

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.cap:
            return await self._reject(scope, receive, send)
        received = 0
        started = False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.cap:
                    raise BodyTooLarge(self.cap)
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except BodyTooLarge:  # read outside FastAPI's body parsing: answer it here
            if started:
                raise
            await self._reject(scope, receive, send)

    async def _reject(self, scope, receive, send):
        self.rejected("too_large")
        resp = error_response(BodyTooLarge(self.cap).detail, 413, "RequestTooLarge")
        await resp(scope, receive, send)
