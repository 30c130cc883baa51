"""What generate() returns, shaped like vLLM's RequestOutput."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log probability at one position (vLLM's shape).

    `rank` is 1 for the most likely token; `decoded_token` is its text, or None
    when the request does not detokenize.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: {token id: Logprob} with the top-N tokens plus the chosen one.
SampleLogprobs = list  # list[dict[int, Logprob]]
PromptLogprobs = list  # list[dict[int, Logprob] | None]; the first position has none


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # Set when a completion finished with finish_reason "error": what went wrong (the
    # engine failed this request alone: NaN logits, a fault in its sampling, ...).
    error: str | None = None


# ---- embeddings (LLM.embed, /v1/embeddings) -------------------------------------------
@dataclass
class EmbeddingOutput:
    """One prompt's pooled vector (vLLM's shape)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What embed() returns per prompt, shaped like vLLM's: `outputs.embedding`, the
    prompt's token ids. `error` as RequestOutput's (then the embedding is empty)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)
    error: str | None = None
