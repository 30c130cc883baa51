"""What every route needs: the engine, the served name, the options, the limits; one per
app, on `app.state.ctx`, reached through the `Ctx` dependency."""
from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from tokenmill.entrypoints.openai.errors import APIError, bad_value, client_message
from tokenmill.entrypoints.openai.logprobs import LogprobFormatter
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.entrypoints.openai.streaming import Merged
from tokenmill.entrypoints.openai.tools import template_messages
from tokenmill.limits import RequestLimits
from tokenmill.parsers.registry import get_reasoning_parser
from tokenmill.structured_output.reasoning_gate import (ReasoningGates,
                                                        prompt_starts_in_reasoning)
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

# A template's own errors (syntax, raise_exception(), sandbox refusals) and bad message
# values: the client's to fix. Chat templates need jinja2 (transformers imports it then).
try:
    from jinja2 import TemplateError
    _TEMPLATE_ERRORS: tuple = (TemplateError, ValueError, TypeError)
except ImportError:  # pragma: no cover
    _TEMPLATE_ERRORS = (ValueError, TypeError)

logger = logging.getLogger("tokenmill.entrypoints.openai.requests")

_LOGGED_PROMPT_CHARS = 2000  # --log-prompts: at most this much of a prompt per log line


@dataclass
class ServerOptions:
    api_key: str | None = None  # required as `Authorization: Bearer KEY` (not on /health)
    metrics_public: bool = False  # /metrics without the key
    log_prompts: bool = False  # the request log lines show the prompts
    trust_request_chat_template: bool = False  # accept a request's own chat_template
    web_ui: bool = True  # the playground and dashboard page at /
    # chat image_url parts may name file:// images inside this folder (None: never)
    allowed_local_media_path: str | None = None
    # tool calling (vLLM's flags): tool_choice "auto" needs both
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # a name of tokenmill.parsers.registry
    chat_template: str | None = None  # the server's own template (--chat-template)


class ServerContext:
    def __init__(self, async_llm, served_model_name: str, options: ServerOptions,
                 metrics: ServerMetrics):
        self.async_llm, self.model_name = async_llm, served_model_name
        self.options, self.metrics = options, metrics
        self.tokenizer = async_llm.tokenizer
        self.max_model_len = async_llm.model_config.max_model_len
        engine_args = getattr(async_llm.engine, "args", None)
        self.max_logprobs = getattr(engine_args, "max_logprobs", 20)
        self.limits = RequestLimits.from_any(getattr(engine_args, "limits", None))
        # --reasoning-parser is the engine's (its grammars wait for the reasoning)
        name = getattr(engine_args, "reasoning_parser", None)
        self.reasoning_parser = get_reasoning_parser(name) if name else None
        self._reasoning_gates = (ReasoningGates(self.reasoning_parser, self.tokenizer)
                                 if self.reasoning_parser is not None else None)
        self.logprobs = LogprobFormatter(self.tokenizer)
        # Chat templates and tokenization of whole prompts: CPU work that must not stall
        # the event loop (threads start on first use; build_app's lifespan shuts it down).
        self.executor = ThreadPoolExecutor(4, thread_name_prefix="tokenmill-tokenize")

    async def run_blocking(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, functools.partial(fn, *args, **kwargs))

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(f"The model `{name}` does not exist.", 404, "NotFoundError", "model")

    async def render_chat(self, messages, add_generation_prompt: bool,
                          chat_template: str | None, tools: list | None = None,
                          template_kwargs: dict | None = None) -> list[int]:
        """The conversation's prompt token ids through the model's chat template (the
        server's --chat-template, or the request's when the server trusts those), with
        the request's tools and extra template arguments, rendered off the event loop."""
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer, so no chat template", 400,
                           param="messages")
        if not messages:
            raise APIError("messages must not be empty", 400, param="messages")
        if len(messages) > self.limits.max_messages:
            raise APIError(f"messages: {len(messages)} messages, more than this server's "
                           f"max_messages={self.limits.max_messages}", 400, param="messages")
        if chat_template is not None and not self.options.trust_request_chat_template:
            raise APIError("chat_template: this server does not accept a request's own chat "
                           "template (start it with --trust-request-chat-template)", 400,
                           param="chat_template")
        param = "messages" if chat_template is None else "chat_template"
        template = chat_template if chat_template is not None else self.options.chat_template
        kwargs = self._template_kwargs(template, tools, template_kwargs)
        dicts = template_messages([m.model_dump(exclude_none=True) for m in messages])
        try:
            # transformers renders in jinja2's ImmutableSandboxedEnvironment
            # (chat_template_utils._cached_compile_jinja_template): a template cannot reach
            # Python internals (`''.__class__.__mro__` raises SecurityError) nor mutate its
            # inputs (`messages.append(...)` does too).
            return await self.run_blocking(self.async_llm.engine.apply_chat_template, dicts,
                                           add_generation_prompt, template, **kwargs)
        except _TEMPLATE_ERRORS as e:
            # the first line of the message, never a traceback
            detail = client_message(getattr(e, "message", None) or str(e))
            raise APIError(f"{param}: could not apply the chat template: {detail}", 400,
                           param=param) from e
        except Exception as e:
            logger.warning("chat template failed: %s", type(e).__name__, exc_info=True)
            raise APIError(f"{param}: could not apply the chat template", 400,
                           param=param) from e

    def _template_kwargs(self, template: str | None, tools, template_kwargs) -> dict:
        """apply_chat_template's extra arguments: the tools, when the template renders
        them (else a 400: they would silently be left out of the prompt), and the
        request's chat_template_kwargs, none of them one of its own parameters."""
        kwargs = dict(template_kwargs or {})
        taken = sorted(set(kwargs) & _reserved_template_args(self.tokenizer)) if kwargs else []
        if taken:
            raise APIError(f"chat_template_kwargs: {ascii(taken[0])[:60]} is an argument of "
                           f"the template call itself, not of the template", 400,
                           param="chat_template_kwargs")
        if tools:
            try:
                source = self.tokenizer.get_chat_template(template, tools)
            except (ValueError, TypeError):
                source = ""
            if "tools" not in source:
                raise APIError("tools: this chat template does not render tools (the server "
                               "takes one that does with --chat-template)", 400, param="tools")
            kwargs["tools"] = tools
        return kwargs

    async def starts_in_reasoning(self, prompt_ids: list[int]) -> bool | None:
        """The reasoning parser's say on where the output starts, from the prompt as the
        model reads it (None without a reasoning parser, or when the prompt has no tag)."""
        if self.reasoning_parser is None or self.tokenizer is None:
            return None
        gates = self._reasoning_gates
        if not gates.error:  # the tags are tokens: read the ids, as the engine's gate does
            return prompt_starts_in_reasoning(prompt_ids, gates.start_id, gates.end_id)
        text = await self.run_blocking(self.tokenizer.decode, prompt_ids,
                                       skip_special_tokens=False)
        return self.reasoning_parser.starts_in_reasoning(text)

    async def chat_images(self, messages) -> list:
        """The images of the conversation's image_url parts, decoded off the event loop
        (a 400 naming the message part for one that is refused or does not decode)."""
        if not any(isinstance(m.content, list) for m in messages):
            return []
        from tokenmill.multimodal.media import extract_images
        dicts = [m.model_dump(exclude_none=True) for m in messages]
        try:
            return await self.run_blocking(extract_images, dicts, self.limits,
                                           self.options.allowed_local_media_path)
        except ValueError as e:
            raise APIError(str(e), 400, param="messages") from e

    @staticmethod
    def sampling_params(req, default_max_tokens: int | None, output_kind: RequestOutputKind,
                        rename: dict | None = None, **extra) -> SamplingParams:
        """`extra`: to_sampling_params' `forced` grammar and `defaults`."""
        try:
            return req.to_sampling_params(default_max_tokens=default_max_tokens,
                                          output_kind=output_kind, **extra)
        except ValueError as e:
            raise bad_value(e, rename=rename) from e

    async def start_all(self, prompts: list, params: SamplingParams, base_id: str,
                        rename: dict | None = None) -> Merged:
        """Add one engine request per prompt now, all or none (so validation errors
        become a 400, a full queue a 503, and a bad prompt runs none of the others);
        return their merged streams. Ids: base_id, or base_id-i."""
        ids = [base_id] if len(prompts) == 1 else [f"{base_id}-{i}" for i in range(len(prompts))]
        try:
            added = await self.async_llm.add_requests(prompts, params, ids)
        except ValueError as e:
            raise bad_value(e, "prompt", rename) from e
        return Merged(self.async_llm, [self.async_llm.stream(rid, queue) for rid, queue in added],
                      ids)

    def log_request(self, request_id: str, params: SamplingParams, stream: bool, what: str,
                    prompt=None) -> None:
        """One line per accepted request; the prompt only with --log-prompts."""
        so = params.structured_outputs
        line = (f"request {request_id}: {what}, n={params.n}, max_tokens={params.max_tokens}, "
                f"temperature={params.temperature}, top_p={params.top_p}, "
                f"top_k={params.top_k}, seed={params.seed}, logprobs={params.logprobs}, "
                f"structured={so is not None}, stream={stream}")
        if self.options.log_prompts and prompt is not None:
            text = repr(prompt)
            if len(text) > _LOGGED_PROMPT_CHARS:
                text = text[:_LOGGED_PROMPT_CHARS] + "..."
            line += f", prompt={text}"
        logger.info(line)


_TEMPLATE_CALL_ARGS = frozenset({"messages", "conversation", "tools", "documents",
                                 "add_generation_prompt", "chat_template", "tokenize"})


@functools.lru_cache(maxsize=4)
def _reserved_names(cls) -> frozenset:
    """apply_chat_template's own parameters: a template argument of that name would
    change the call, not the template."""
    method = getattr(cls, "apply_chat_template", None)
    params = inspect.signature(method).parameters if method is not None else {}
    return frozenset(n for n, p in params.items() if p.kind is not p.VAR_KEYWORD) | \
        _TEMPLATE_CALL_ARGS


def _reserved_template_args(tokenizer) -> frozenset:
    return _reserved_names(type(tokenizer)) if tokenizer is not None else frozenset()


def _get_ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


Ctx = Annotated[ServerContext, Depends(_get_ctx)]


def salted(prompt, cache_salt: str | None):
    """The engine's prompt with the request's cache_salt (prefix caching) attached."""
    if cache_salt is None:
        return prompt
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": cache_salt}
    return {**prompt, "cache_salt": cache_salt}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
