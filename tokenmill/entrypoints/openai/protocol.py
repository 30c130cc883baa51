"""Request bodies of the OpenAI API (the fields tokenmill honours; unknown ones are ignored)."""
from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict

from tokenmill.sampling_params import RequestOutputKind, SamplingParams


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI ignores unknown fields


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False


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

    def _max_tokens(self) -> int | None:
        return self.max_tokens

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
        return SamplingParams(**kwargs)


class CompletionRequest(_SamplingRequest):
    prompt: Union[list[list[int]], list[int], list[str], str]
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
