"""Request bodies of the OpenAI API (the fields tokenmill honours; unknown ones are ignored)."""
from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict

from tokenmill.sampling_params import SamplingParams


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI ignores unknown fields


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False


class _SamplingRequest(OpenAIBaseModel):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int = 1
    stop: Union[str, list[str], None] = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # not OpenAI (extra_body)
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """Raises ValueError naming the field (SamplingParams' checks)."""
        if self.stop:
            raise ValueError("stop: stop strings are not supported yet (use stop_token_ids)")
        kwargs: dict[str, Any] = dict(n=self.n, ignore_eos=self.ignore_eos,
                                      skip_special_tokens=self.skip_special_tokens)
        max_tokens = self._max_tokens()
        kwargs["max_tokens"] = max_tokens if max_tokens is not None else default_max_tokens
        for name in ("temperature", "top_p", "seed", "top_k", "stop_token_ids"):
            v = getattr(self, name)
            if v is not None:
                kwargs[name] = v
        return SamplingParams(**kwargs)


class CompletionRequest(_SamplingRequest):
    prompt: Union[list[list[int]], list[int], list[str], str]
    echo: bool | None = False


class ChatMessage(OpenAIBaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


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

