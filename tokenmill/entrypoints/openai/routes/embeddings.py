"""POST /v1/embeddings: one engine request per input, pooled (tokenmill/pooling), as
OpenAI answers it (`encoding_format` float, or base64 of little-endian float32 bytes).

Served by a pooling engine (--runner pooling / --task embed, or a checkpoint that
defaults to it), and, unlike vLLM, by a generation engine too: any decoder pools (the
engine's pooler config, last token and normalised by default), and the embedding
requests share the scheduler with the generations, so one server takes a mixed load. A
pooling server still refuses generation (its checkpoint may have no LM head)."""
from __future__ import annotations

import base64
import logging
import time
import uuid

import numpy as np
from fastapi import APIRouter, Request

from tokenmill.entrypoints.openai.context import Ctx
from tokenmill.entrypoints.openai.errors import APIError, bad_value, client_message
from tokenmill.entrypoints.openai.protocol_embeddings import EmbeddingRequest
from tokenmill.entrypoints.openai.streaming import collect
from tokenmill.pooling.params import PoolingParams

router = APIRouter()
logger = logging.getLogger("tokenmill.entrypoints.openai.requests")


def _inputs(value, cap: int) -> list:
    """The request's `input` as engine prompts; a 400 naming `input` for an empty one,
    an empty entry or more entries than `cap`."""
    if isinstance(value, str):
        items = [value]
    elif value and all(isinstance(x, int) for x in value):
        items = [{"prompt_token_ids": value}]
    elif value and all(isinstance(x, str) for x in value):
        items = list(value)
    elif value and all(isinstance(x, list) for x in value):
        items = [{"prompt_token_ids": x} for x in value]
    else:
        raise APIError("input must not be empty", 400, param="input")
    if len(items) > cap:
        raise APIError(f"input: {len(items)} entries, more than this server's "
                       f"max_embedding_inputs={cap}", 400, param="input")
    for i, item in enumerate(items):
        if not (item if isinstance(item, str) else item["prompt_token_ids"]):
            where = "input" if len(items) == 1 else f"input[{i}]"
            raise APIError(f"{where} must not be empty", 400, param="input")
    return items


def _encode(vector: list[float], encoding_format: str):
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


@router.post("/v1/embeddings")
async def embeddings(req: EmbeddingRequest, raw: Request, ctx: Ctx):
    ctx.check_model(req.model)
    prompts = _inputs(req.input, ctx.limits.max_embedding_inputs)
    try:
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize,
                               truncate_prompt_tokens=req.truncate_prompt_tokens)
    except ValueError as e:
        raise bad_value(e) from e
    base_id = f"embd-{uuid.uuid4().hex}"
    created = int(time.time())
    job = await ctx.start_all(prompts, params, base_id, rename={"prompt": "input"})
    line = (f"request {base_id}: {len(prompts)} input(s), embeddings, "
            f"encoding_format={req.encoding_format}")
    if ctx.options.log_prompts:
        line += f", input={repr(prompts)[:2000]}"
    logger.info(line)
    finals = await collect(job, raw)
    for out in finals:
        if out.error is not None:
            raise APIError(client_message(out.error), 500, "InternalServerError")
    num_tokens = sum(len(out.prompt_token_ids) for out in finals)
    return {"id": base_id, "object": "list", "created": created, "model": ctx.model_name,
            "data": [{"object": "embedding", "index": i,
                      "embedding": _encode(out.outputs.embedding, req.encoding_format)}
                     for i, out in enumerate(finals)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
