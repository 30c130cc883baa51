"""Request bodies of the OpenAI API (the fields tokenmill honours; unknown ones are ignored)."""
from __future__ import annotations

import itertools
import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.structured_output.params import StructuredOutputsParams


# A JSON string may carry a lone surrogate (an escaped "\ud800", or CESU-8 bytes: json.loads
# decodes bytes with surrogatepass) that no tokenizer, grammar compiler or UTF-8 response can
# take: it reached them as a 500 (issue 14's hostile-input table). Refused at the edge.
_SURROGATE = re.compile("[\ud800-\udfff]")
_NUMBERS = {int, float, bool, type(None)}


def _check_unicode(value):
    """`value` (any JSON value), unless some string in it holds a lone surrogate."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if not v.isascii() and _SURROGATE.search(v):
                raise ValueError("text must be valid Unicode (no lone surrogate code point)")
        elif isinstance(v, dict):
            stack.extend(v)
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            kinds = set(map(type, v))  # lists of token ids (or of such lists): C speed
            if kinds == {list}:
                kinds = set(map(type, itertools.chain.from_iterable(v)))
            if not kinds <= _NUMBERS:
                stack.extend(v)
    return value


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI ignores unknown fields

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value):  # a 400 naming the field
        return _check_unicode(value)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False


class JsonSchemaFormat(OpenAIBaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# Request fields that ask for structured output, in the order their errors are named.
_STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                      "guided_choice", "guided_grammar")


# Request fields passed to SamplingParams under the same name when given (not None).
_PASSTHROUGH = ("n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                "logit_bias", "top_k", "min_p", "repetition_penalty", "min_tokens",
                "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                "include_stop_str_in_output", "stop_token_ids", "allowed_token_ids",
                "bad_words", "prompt_logprobs")


class _SamplingRequest(OpenAIBaseModel):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int | None = 1
    stop: Union[str, list[str], None] = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Prefix caching: only requests with the same salt share cached KV (vLLM's field).
    cache_salt: str | None = None
    # not OpenAI (extra_body), vLLM's names
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    # structured output: OpenAI's response_format; vLLM's structured_outputs and guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The one structured-output field given, as StructuredOutputsParams; its errors
        (here, and when the request is added) name that field."""
        given = [f for f in _STRUCTURED_FIELDS if getattr(self, f) is not None
                 and not (f == "response_format" and self.response_format.type == "text")]
        if not given:
            return None
        if len(given) > 1:
            raise ValueError(f"{given[1]}: cannot be combined with {given[0]}; give one way of "
                             f"constraining the output")
        origin = given[0]
        value = getattr(self, origin)
        try:
            if origin == "response_format":
                if value.type == "json_object":
                    sop = StructuredOutputsParams(json_object=True)
                elif value.json_schema is None or value.json_schema.json_schema is None:
                    raise ValueError("response_format: type json_schema needs "
                                     "json_schema.schema")
                else:
                    sop = StructuredOutputsParams(json=value.json_schema.json_schema)
            elif origin == "structured_outputs":
                sop = StructuredOutputsParams.from_dict(value)
            else:
                sop = StructuredOutputsParams(**{origin[len("guided_"):]: value})
        except ValueError as e:
            if origin == "structured_outputs":
                raise
            raise ValueError(re.sub(r"^structured_outputs(\.\w+)?", origin, str(e))) from None
        if origin != "structured_outputs":
            sop._origin = origin
        return sop

    def _logprobs(self) -> int | None:
        """Top-N logprobs per generated token, or None for none."""
        return None

    def _prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def to_sampling_params(self, default_max_tokens: int | None,
                           output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
                           ) -> SamplingParams:
        """Raises ValueError naming the field (SamplingParams' checks)."""
        kwargs: dict[str, Any] = {"output_kind": output_kind}
        for name in _PASSTHROUGH:
            v = getattr(self, name)
            if v is not None:
                kwargs[name] = v
        max_tokens = self._max_tokens()
        kwargs["max_tokens"] = max_tokens if max_tokens is not None else default_max_tokens
        if self.stop is not None:
            kwargs["stop"] = self.stop
        logprobs = self._logprobs()
        if logprobs is not None:
            kwargs["logprobs"] = logprobs
        prompt_logprobs = self._prompt_logprobs()
        if prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = prompt_logprobs
        structured = self._structured_outputs()
        if structured is not None:
            kwargs["structured_outputs"] = structured
        return SamplingParams(**kwargs)


class CompletionRequest(_SamplingRequest):
    # fail_fast: a member that does not match stops at its first bad item, else a million
    # token ids spent a second and a half of the event loop on list[list[int]]'s errors
    prompt: Union[Annotated[list[list[int]], Field(fail_fast=True)],
                  Annotated[list[int], Field(fail_fast=True)], list[str], str]
    echo: bool | None = False
    logprobs: int | None = None  # top-N per token (OpenAI's completions shape)

    def _logprobs(self) -> int | None:
        return self.logprobs

    def _prompt_logprobs(self) -> int | None:
        # echo with logprobs shows the prompt tokens' logprobs too: ask the engine for them
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


class ChatMessage(OpenAIBaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def _logprobs(self) -> int | None:
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs: needs logprobs=true")
            if self.top_logprobs < 0:
                raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
