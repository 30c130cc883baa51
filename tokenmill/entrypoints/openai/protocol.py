"""Request bodies of the OpenAI API: the fields tokenmill honours are the models' fields;
fields that would change what a correct answer is, and that tokenmill does not implement,
are refused (a 400 naming the field: REFUSED_FIELDS); fields accepted and ignored on purpose
are IGNORED_FIELDS; any other unknown field is ignored and logged once per name."""
from __future__ import annotations

import itertools
import logging
import re
from typing import Annotated, Any, Callable, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

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


# ---- fields refused, fields ignored on purpose, unknown fields ---------------------------
# A request that asks for something tokenmill does not do (legacy function calls, audio,
# beam search, a reasoning effort, ...) gets a 400 naming the field instead of a plain answer
# the client cannot tell from a correct one. A value that asks for nothing beyond what
# tokenmill does is accepted: null always (clients that send every field send nulls), and
# the "off" values (`functions: []`, `use_beam_search: false`, `best_of` equal to `n`, ...).

UNSUPPORTED_FIELD = "unsupported_field"  # the pydantic error type errors.py turns into a 400

logger = logging.getLogger(__name__)


def _null(v, data) -> bool:
    return v is None


def _null_or(*ok) -> Callable[[Any, dict], bool]:
    """Null, or one of `ok` (same type: `false` is not `0`, `1.0` is `1`)."""
    def harmless(v, data) -> bool:
        return v is None or any(
            v == o and (type(v) is type(o) or {type(v), type(o)} == {int, float}) for o in ok)
    return harmless


def _best_of_is_n(v, data) -> bool:
    """best_of generates best_of sequences and returns the n best: the same as n alone only
    when best_of == n."""
    n = data.get("n")
    n = 1 if n is None else n
    return v is None or (type(v) is int and type(n) is int and v == n)


_NO_TOOLS = "tool calling is not implemented by this server"
_LEGACY_FUNCTIONS = "the legacy function calling fields are not implemented (use tools)"
# Completions take no tools; a client sending them wants tool calls.
_TOOL_FIELDS: dict[str, tuple] = {
    "tools": (_null_or([]), _NO_TOOLS + " on /v1/completions (use /v1/chat/completions)"),
    "tool_choice": (_null_or("none"), _NO_TOOLS + ' on /v1/completions (only "none" is '
                                                  'accepted)'),
    "parallel_tool_calls": (_null, _NO_TOOLS + " on /v1/completions"),
}
# Chat takes tools (tools.py); OpenAI's deprecated function calling is refused.
_FUNCTION_FIELDS: dict[str, tuple] = {
    "functions": (_null_or([]), _LEGACY_FUNCTIONS),
    "function_call": (_null_or("none"), _LEGACY_FUNCTIONS + ' (only "none" is accepted)'),
}
_BEAM_FIELDS: dict[str, tuple] = {
    "best_of": (_best_of_is_n, "best_of other than n (generate more, return the best) is "
                               "not implemented"),
    "use_beam_search": (_null_or(False), "beam search is not implemented"),
    "length_penalty": (_null_or(1.0), "beam search is not implemented"),
    "early_stopping": (_null_or(False), "beam search is not implemented"),
}
_VLLM_OUTPUT_FIELDS: dict[str, tuple] = {
    "logits_processors": (_null_or([]), "logits processors are not implemented"),
    "return_tokens_as_token_ids": (_null_or(False), "token ids in place of token strings "
                                                    "are not implemented"),
    "return_token_ids": (_null_or(False), "token ids in the response are not implemented"),
    "guided_whitespace_pattern": (_null, "a whitespace pattern for JSON is not implemented"),
    "mm_processor_kwargs": (_null_or({}), "multimodal processor arguments are not "
                                          "implemented"),
}
_CHAT_TEMPLATE_FIELDS: dict[str, tuple] = {
    "documents": (_null_or([]), "documents for the chat template are not implemented"),
    "continue_final_message": (_null_or(False), "continuing the last message is not "
                                                "implemented"),
}

# Fields accepted and ignored on purpose: none of them changes what a correct answer is.
# (`user` is also one; it is declared, so a wrong type is still a 400.)
IGNORED_FIELDS = frozenset({
    "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
    "prompt_cache_retention",
    "prediction",  # a latency hint: the answer is the model's own either way
    "priority", "request_id", "guided_decoding_backend",  # vLLM: scheduling, ids, backend
})

# Unknown fields: one WARNING per name per process, at most this many names (a client
# sending random names cannot grow the set or the log without bound).
_MAX_WARNED_NAMES = 256
_warned: set[str] = set()  # the names logged so far (their first 64 characters)
_warned_cap_reached = False


def _warn_unknown(names: list[str], endpoint: str) -> None:
    global _warned_cap_reached
    for name in names:
        key = name[:64]
        if key in _warned:
            continue
        if len(_warned) >= _MAX_WARNED_NAMES:
            if not _warned_cap_reached:
                _warned_cap_reached = True
                logger.warning("more than %d unknown request field names: no more are logged",
                               _MAX_WARNED_NAMES)
            return
        _warned.add(key)
        # ascii(): a name may hold anything a JSON string can (newlines, lone surrogates)
        logger.warning("%s: unknown request field %s is ignored (logged once per field name)",
                       endpoint, ascii(key) + ("..." if len(name) > 64 else ""))


def _refuse(param: str, message: str):
    return PydanticCustomError(UNSUPPORTED_FIELD, "{message}",
                               {"message": message, "param": param})


# The content part types a chat message may carry: text, and images (media.py's types).
_PART_TYPES = frozenset({"text", "image_url", "image", "image_pil"})


def _check_tool_calls(calls, where: str) -> None:
    """An assistant turn's `tool_calls`, in OpenAI's shape."""
    if not isinstance(calls, list):
        raise _refuse("messages", f"{where}: must be a list of calls")
    for j, c in enumerate(calls):
        at = f"{where}[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or c.get("type", "function") != "function":
            raise _refuse("messages", f'{at}: a call is {{"type": "function", "function": '
                                      f'{{"name", "arguments"}}}}')
        if not isinstance(fn.get("name"), str):
            raise _refuse("messages", f"{at}.function.name: must be a string")
        if not isinstance(fn.get("arguments"), (str, dict)):
            raise _refuse("messages", f"{at}.function.arguments: must be a JSON string")
        if c.get("id") is not None and not isinstance(c["id"], str):
            raise _refuse("messages", f"{at}.id: must be a string")


def _check_messages(messages) -> None:
    """Refuses the message fields that only mean something with legacy function calling or
    audio output, malformed tool turns, and content parts tokenmill does not render (a 400
    naming `messages`)."""
    if not isinstance(messages, list):
        return  # the field's own validation names the problem
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        where = f"messages[{i}]"
        role = m.get("role")
        if role == "function":
            raise _refuse("messages", f"{where}.role: 'function' messages are not supported: "
                                      f"{_LEGACY_FUNCTIONS} (a tool result is role 'tool')")
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise _refuse("messages", f"{where}.tool_call_id: a tool message needs the id of "
                                      f"the call it answers")
        if not _null_or([])(m.get("tool_calls"), m):
            if role != "assistant":
                raise _refuse("messages", f"{where}.tool_calls: only assistant messages "
                                          f"carry tool calls")
            _check_tool_calls(m["tool_calls"], f"{where}.tool_calls")
        if m.get("function_call") is not None:
            raise _refuse("messages", f"{where}.function_call: {_LEGACY_FUNCTIONS}")
        if m.get("audio") is not None:
            raise _refuse("messages", f"{where}.audio: audio is not supported")
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in _PART_TYPES:
                shown = ascii(kind[:40])  # the client's string: never echoed raw
                raise _refuse("messages", f"{where}.content[{j}]: content parts of type "
                                          f"{shown} are not supported (text and image_url "
                                          f"are)")


class _RequestBody(OpenAIBaseModel):
    """A request body: its refused fields are a 400 naming them, its unknown fields are
    logged (once per name) and ignored."""
    ENDPOINT: ClassVar[str] = "request"
    # name -> (harmless(value, body) -> bool, why a value that is not harmless is refused)
    REFUSED_FIELDS: ClassVar[dict[str, tuple]] = {}
    IGNORED: ClassVar[frozenset] = IGNORED_FIELDS
    CHECK_MESSAGES: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if not isinstance(data, dict):
            return data  # not an object: the model's own validation says so
        known = cls.model_fields
        unknown = [k for k in data if k not in known and k not in cls.REFUSED_FIELDS
                   and k not in cls.IGNORED]
        if unknown:
            _warn_unknown(unknown, cls.ENDPOINT)
        for name, (harmless, why) in cls.REFUSED_FIELDS.items():
            if name in data and not harmless(data[name], data):
                raise _refuse(name, f"{name}: {why}")
        if cls.CHECK_MESSAGES:
            _check_messages(data.get("messages"))
        return data


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
                "bad_words", "prompt_logprobs", "truncate_prompt_tokens")


class _SamplingRequest(_RequestBody):
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
    truncate_prompt_tokens: int | None = None  # the prompt's last k tokens (-1: what fits)
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
                           output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                           forced: StructuredOutputsParams | None = None,
                           defaults: dict | None = None) -> SamplingParams:
        """Raises ValueError naming the field (SamplingParams' checks). `forced`: a grammar
        the request's tool_choice asks for; `defaults`: values for fields it left unset."""
        kwargs: dict[str, Any] = {"output_kind": output_kind, **(defaults or {})}
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
        if forced is not None:
            if structured is not None:
                field = structured._origin or "structured_outputs"
                raise ValueError(f"{field}: cannot be combined with a tool_choice that forces "
                                 f"a call (required or a named function)")
            structured = forced
        if structured is not None:
            kwargs["structured_outputs"] = structured
        return SamplingParams(**kwargs)


class CompletionRequest(_SamplingRequest):
    ENDPOINT: ClassVar[str] = "/v1/completions"
    REFUSED_FIELDS: ClassVar[dict[str, tuple]] = {
        **_TOOL_FIELDS,  # not completions fields, but a client sending them wants tool calls
        "suffix": (_null_or(""), "a suffix (text insertion) is not implemented"),
        **_BEAM_FIELDS,
        # string prompts are tokenized with the special tokens (vLLM's default too)
        "add_special_tokens": (_null_or(True), "add_special_tokens=false is not implemented"),
        "prompt_embeds": (_null, "prompt embeddings are not implemented"),
        **_VLLM_OUTPUT_FIELDS,
    }
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
    ENDPOINT: ClassVar[str] = "/v1/chat/completions"
    REFUSED_FIELDS: ClassVar[dict[str, tuple]] = {
        **_FUNCTION_FIELDS,
        "reasoning_effort": (_null, "a reasoning effort is not implemented"),
        "verbosity": (_null, "a verbosity setting is not implemented"),
        "modalities": (_null_or(["text"]), 'only text output (["text"]) is implemented'),
        "audio": (_null, "audio output is not implemented"),
        "web_search_options": (_null, "web search is not implemented"),
        **_BEAM_FIELDS,
        "echo": (_null_or(False), "echoing the last message is not implemented"),
        # the chat template places the special tokens; none are added around its text
        "add_special_tokens": (_null_or(False), "special tokens around the chat template's "
                                                "text are not implemented"),
        **_CHAT_TEMPLATE_FIELDS,
        **_VLLM_OUTPUT_FIELDS,
    }
    CHECK_MESSAGES: ClassVar[bool] = True

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # tool calling (tools.py checks them against the server's flags)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}

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


class TokenizeRequest(_RequestBody):
    # what changes the prompt a chat request would get, and what changes the answer's shape
    ENDPOINT: ClassVar[str] = "/tokenize"
    REFUSED_FIELDS: ClassVar[dict[str, tuple]] = {
        **_CHAT_TEMPLATE_FIELDS,
        "mm_processor_kwargs": _VLLM_OUTPUT_FIELDS["mm_processor_kwargs"],
        "return_token_strs": (_null_or(False), "token strings are not implemented"),
    }
    IGNORED: ClassVar[frozenset] = frozenset()
    CHECK_MESSAGES: ClassVar[bool] = True
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None
    tools: list[dict[str, Any]] | None = None  # rendered as chat renders them
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_RequestBody):
    ENDPOINT: ClassVar[str] = "/detokenize"
    IGNORED: ClassVar[frozenset] = frozenset()
    model: str | None = None
    tokens: list[int]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
