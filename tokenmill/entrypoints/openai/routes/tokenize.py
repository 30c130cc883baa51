"""POST /tokenize, POST /detokenize."""
from __future__ import annotations

from fastapi import APIRouter

from tokenmill.entrypoints.openai.context import Ctx
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from tokenmill.entrypoints.openai.tools import check_tools

router = APIRouter()


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, ctx: Ctx):
    ctx.check_model(req.model)
    tok = ctx.tokenizer
    if tok is None:
        raise APIError("this model has no tokenizer", 400)
    if req.messages is not None:
        if req.tools:
            check_tools(req.tools)
        ids = await ctx.render_chat(req.messages, req.add_generation_prompt, req.chat_template,
                                    req.tools, req.chat_template_kwargs)
    elif req.prompt is not None:  # a long prompt takes a while: not on the event loop
        ids = await ctx.run_blocking(tok.encode, req.prompt,
                                     add_special_tokens=req.add_special_tokens)
    else:
        raise APIError("give prompt or messages", 400, param="prompt")
    return {"tokens": list(ids), "count": len(ids), "max_model_len": ctx.max_model_len}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, ctx: Ctx):
    ctx.check_model(req.model)
    if ctx.tokenizer is None:
        raise APIError("this model has no tokenizer", 400)
    vocab = ctx.async_llm.model_config.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(f"tokens: token id {bad[0]} is outside the vocabulary", 400,
                       param="tokens")
    return {"prompt": await ctx.run_blocking(ctx.tokenizer.decode, req.tokens)}
