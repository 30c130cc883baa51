"""GET /v1/models, /health, /version, /metrics."""
from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi.responses import Response

from tokenmill.entrypoints.openai.context import Ctx
from tokenmill.entrypoints.openai.errors import error_response

router = APIRouter()


@router.get("/v1/models")
async def models(ctx: Ctx):
    return {"object": "list",
            "data": [{"id": ctx.model_name, "object": "model", "created": int(time.time()),
                      "owned_by": "tokenmill", "root": ctx.async_llm.model_config.path,
                      "max_model_len": ctx.max_model_len}]}


@router.get("/health")
async def health(ctx: Ctx):
    if not ctx.async_llm.is_healthy():
        return error_response("the engine is not running", 503, "ServiceUnavailableError")
    return Response(status_code=200)


@router.get("/version")
async def version():
    from tokenmill import __version__
    return {"version": __version__}


@router.get("/metrics")
async def metrics(ctx: Ctx):
    from prometheus_client import CONTENT_TYPE_LATEST
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)
