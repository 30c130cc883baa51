"""POST /v1/chat/completions."""
from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from tokenmill.entrypoints.openai.chat_output import ChoiceOutput, chat_finish_reason
from tokenmill.entrypoints.openai.context import Ctx, salted, usage
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.logprobs import sample_positions_of
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.openai.streaming import (DONE, check_finals, collect, raise_if_failed,
                                                   sse, streaming)
from tokenmill.entrypoints.openai.tools import tool_plan
from tokenmill.sampling_params import RequestOutputKind

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, raw: Request, ctx: Ctx):
    ctx.check_model(req.model)
    # chat asks for top-N logprobs with `top_logprobs`: the engine's checks say `logprobs`
    rename = {"logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:  # its errors say max_tokens: name the field sent
        rename["max_tokens"] = "max_completion_tokens"
    if req.logprobs and req.top_logprobs is not None and req.top_logprobs > ctx.max_logprobs:
        raise APIError(f"top_logprobs: {req.top_logprobs} is more than this server's "
                       f"max_logprobs={ctx.max_logprobs}", 400, param="top_logprobs")
    opts = ctx.options
    plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls,
                     opts.enable_auto_tool_choice, opts.tool_call_parser)
    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    forced = plan.grammar() if plan else None
    defaults = {"skip_special_tokens": False} if plan and plan.needs_special_tokens else None
    # chat: up to the context length
    params = ctx.sampling_params(req, None, kind, rename, forced=forced, defaults=defaults)
    ids = await ctx.render_chat(req.messages, req.add_generation_prompt, req.chat_template,
                                plan.tools if plan else None, req.chat_template_kwargs)
    starts_in_reasoning = await ctx.starts_in_reasoning(ids)
    images = await ctx.chat_images(req.messages)
    prompt = {"prompt_token_ids": ids}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    job = await ctx.start_all([salted(prompt, req.cache_salt)], params, rid, rename)
    ctx.log_request(rid, params, bool(req.stream), f"{len(ids)} prompt tokens",
                    [m.model_dump(exclude_none=True) for m in req.messages])
    model, n, fmt = ctx.model_name, params.n, ctx.logprobs
    num_logprobs = params.logprobs  # None unless logprobs=true
    want_prompt_logprobs = req.prompt_logprobs is not None

    def choice_output() -> ChoiceOutput:  # one per choice: its own parser state
        return ChoiceOutput(ctx.reasoning_parser, starts_in_reasoning,
                            plan.output_stream() if plan else None)

    def chunk(index: int, delta: dict, logprobs=None, finish_reason=None,
              stop_reason=None, **extra) -> str:
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created,
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
            outputs = {index: choice_output() for index in range(n)}
            prompt_tokens = completion_tokens = 0
            plp_extra = {}  # the prompt logprobs, sent with the first content chunk
            async for _, out in job:
                prompt_tokens = len(out.prompt_token_ids)
                if want_prompt_logprobs and out.prompt_logprobs is not None:
                    plp_extra = {"prompt_logprobs": fmt.prompt_logprobs_json(out.prompt_logprobs)}
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    positions = pending.setdefault(c.index, [])
                    if num_logprobs is not None:
                        positions.extend(sample_positions_of(c))
                    parsed = outputs[c.index]
                    deltas = parsed.feed(c.text)
                    done = c.finish_reason is not None
                    if done:
                        deltas += parsed.finish()
                    if not deltas and (done or plp_extra):
                        deltas = [{"content": ""}]
                    for k, delta in enumerate(deltas):
                        last = k == len(deltas) - 1
                        logprobs = None
                        if num_logprobs is not None and k == 0:
                            logprobs = {"content": fmt.chat_logprobs(positions, num_logprobs)}
                            pending[c.index] = []
                        yield chunk(c.index, delta, logprobs,
                                    chat_finish_reason(c.finish_reason, parsed.calls) if last
                                    else None, c.stop_reason if last else None, **plp_extra)
                        plp_extra = {}
                raise_if_failed(out)
            if include_usage:
                yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                           "model": model, "choices": [],
                           "usage": usage(prompt_tokens, completion_tokens)})
            yield DONE
        return streaming(body(), job)

    final = (await collect(job, raw))[0]
    check_finals([final])
    choices = []
    for c in sorted(final.outputs, key=lambda c: c.index):
        logprobs = None
        if num_logprobs is not None:
            logprobs = {"content": fmt.chat_logprobs(sample_positions_of(c), num_logprobs)}
        message = choice_output().message(c.text)
        choices.append({"index": c.index, "message": message, "logprobs": logprobs,
                        "finish_reason": chat_finish_reason(c.finish_reason,
                                                       message.get("tool_calls")),
                        "stop_reason": c.stop_reason})
    response = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": choices,
                "usage": usage(len(final.prompt_token_ids),
                               sum(len(c.token_ids) for c in final.outputs))}
    if want_prompt_logprobs:
        response["prompt_logprobs"] = fmt.prompt_logprobs_json(final.prompt_logprobs)
    return response
