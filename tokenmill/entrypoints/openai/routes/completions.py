"""POST /v1/completions."""
from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from tokenmill.entrypoints.openai.context import Ctx, salted, usage
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.logprobs import sample_positions_of
from tokenmill.entrypoints.openai.protocol import CompletionRequest
from tokenmill.entrypoints.openai.streaming import (DONE, check_finals, collect, raise_if_failed,
                                                   sse, streaming)
from tokenmill.sampling_params import RequestOutputKind

router = APIRouter()


def _prompts(p) -> list:
    """The request's prompt field as a list of engine prompts."""
    if isinstance(p, str):
        return [p]
    if p and all(isinstance(x, int) for x in p):
        return [{"prompt_token_ids": p}]
    if p and all(isinstance(x, str) for x in p):
        return list(p)
    if p and all(isinstance(x, list) for x in p):
        return [{"prompt_token_ids": x} for x in p]
    raise APIError("prompt must not be empty", 400, param="prompt")


@router.post("/v1/completions")
async def completions(req: CompletionRequest, raw: Request, ctx: Ctx):
    ctx.check_model(req.model)
    # echo + logprobs asks the engine for prompt logprobs: its errors are about `logprobs`
    rename = ({"prompt_logprobs": "logprobs"}
              if req.echo and req.logprobs is not None and req.prompt_logprobs is None
              else None)
    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    params = ctx.sampling_params(req, 16, kind, rename)  # OpenAI's default max_tokens: 16
    prompts = _prompts(req.prompt)
    cap = ctx.limits.max_prompts_per_request
    if len(prompts) > cap:
        raise APIError(f"prompt: {len(prompts)} prompts, more than this server's "
                       f"max_prompts_per_request={cap}", 400, param="prompt")
    base_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    job = await ctx.start_all([salted(x, req.cache_salt) for x in prompts], params, base_id,
                              rename)
    ctx.log_request(base_id, params, bool(req.stream), f"{len(prompts)} prompt(s)", prompts)
    tok, model, n = ctx.tokenizer, ctx.model_name, params.n
    fmt = ctx.logprobs
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
                            extra["prompt_logprobs"] = fmt.prompt_logprobs_json(plps.get(i))
                    if num_logprobs is not None:
                        positions.extend(sample_positions_of(c))
                    # Text can lag the tokens (an incomplete UTF-8 character, a possible
                    # stop string): skip empty chunks then, their logprobs go with the
                    # next one; without a tokenizer, one chunk per step.
                    if not text and c.finish_reason is None and tok is not None and not extra:
                        continue
                    logprobs = None
                    if num_logprobs is not None:
                        logprobs, offsets[index] = fmt.completion_logprobs(
                            positions, num_logprobs, offsets.get(index, 0))
                        pending[index] = []
                    yield sse({"id": base_id, "object": "text_completion", "created": created,
                               "model": model,
                               "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                            "finish_reason": c.finish_reason,
                                            "stop_reason": c.stop_reason, **extra}]})
                raise_if_failed(out)
            if include_usage:
                yield sse({"id": base_id, "object": "text_completion", "created": created,
                           "model": model, "choices": [],
                           "usage": usage(sum(prompt_tokens), completion_tokens)})
            yield DONE
        return streaming(body(), job)

    finals = await collect(job, raw)
    check_finals(finals)
    choices = []
    for i, out in enumerate(finals):
        for c in sorted(out.outputs, key=lambda c: c.index):
            text = (prompt_text(out) + c.text) if req.echo else c.text
            logprobs = None
            if num_logprobs is not None:
                positions = sample_positions_of(c)
                if req.echo:
                    positions = prompt_positions(out, out.prompt_logprobs) + positions
                logprobs, _ = fmt.completion_logprobs(positions, num_logprobs, 0)
            choice = {"index": i * n + c.index, "text": text, "logprobs": logprobs,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if want_prompt_logprobs:
                choice["prompt_logprobs"] = fmt.prompt_logprobs_json(out.prompt_logprobs)
            choices.append(choice)
    return {"id": base_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices,
            "usage": usage(sum(len(o.prompt_token_ids) for o in finals),
                           sum(len(c.token_ids) for o in finals for c in o.outputs))}
