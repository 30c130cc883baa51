"""Running a response's engine requests: merging their streams, collecting the finals,
and server-sent events."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from tokenmill.entrypoints.openai.errors import (ENGINE_DEAD, INTERNAL_ERROR, APIError,
                                                client_message)
from tokenmill.errors import EngineDeadError

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Merged:
    """(index, output) from several request streams as they come; close() frees them all."""

    def __init__(self, async_llm, streams, request_ids):
        self.async_llm, self.streams, self.request_ids = async_llm, streams, request_ids
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
            self.async_llm.abort(rid)


async def collect(job: Merged, raw: Request) -> list:
    """The final output of each request of a non-streaming response; a client that
    goes away meanwhile aborts them at once (the body is read: the next ASGI message
    the connection sends is its disconnect)."""
    finals: list = [None] * len(job.request_ids)

    async def consume():
        async for i, out in job:
            finals[i] = out

    async def disconnected():
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.create_task(consume())
    gone = asyncio.create_task(disconnected())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
            return finals
        logger.info("client disconnected: aborting %s", ", ".join(job.request_ids))
        raise APIError("client disconnected", 499, "ClientClosedRequest")
    finally:
        for t in (task, gone):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
        await job.close()


class RequestFailed(Exception):
    """The engine finished a request with finish_reason "error" (it failed that request
    alone: NaN logits, a fault in its sampling or detokenizing)."""


def request_error(out) -> str | None:
    """The error message of an output whose request failed, else None."""
    msg = getattr(out, "error", None)
    if msg is None and any(c.finish_reason == "error" for c in out.outputs):
        msg = "the request failed"
    return client_message(msg) if msg is not None else None


def raise_if_failed(out) -> None:
    """After a failed output's chunks went out: end the stream with an error event."""
    msg = request_error(out)
    if msg is not None:
        raise RequestFailed(msg)


def check_finals(finals: list) -> None:
    """A non-streaming response whose requests failed is a 500 with the engine's message."""
    for out in finals:
        msg = request_error(out)
        if msg is not None:
            raise APIError(msg, 500, "InternalServerError")


def error_event(message: str, type: str, code: int) -> str:
    return sse({"error": {"message": message, "type": type, "param": None, "code": code}})


def streaming(body: AsyncIterator[str], job: Merged) -> StreamingResponse:
    """An SSE response from `body`; a stream that fails ends with an error event and
    [DONE] (the status line went out long ago), never by just stopping."""
    async def wrapped():
        try:
            async for chunk in body:
                yield chunk
        except RequestFailed as e:
            yield error_event(str(e), "InternalServerError", 500)
            yield DONE
        except EngineDeadError:
            yield error_event(ENGINE_DEAD, "ServiceUnavailableError", 503)
            yield DONE
        except Exception:  # noqa: BLE001 - logged here, never sent
            logger.exception("stream of %s failed", ", ".join(job.request_ids))
            yield error_event(INTERNAL_ERROR, "InternalServerError", 500)
            yield DONE
        finally:  # client gone or done: free everything this response holds
            await job.close()
    return StreamingResponse(wrapped(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
