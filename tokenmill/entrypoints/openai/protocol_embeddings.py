"""The /v1/embeddings request body (OpenAI's fields, and vLLM's extras), refused and
ignored fields as protocol.py's request bodies have them."""
from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field

from tokenmill.entrypoints.openai.protocol import _null, _null_or, _RequestBody


class EmbeddingRequest(_RequestBody):
    ENDPOINT: ClassVar[str] = "/v1/embeddings"
    REFUSED_FIELDS: ClassVar[dict[str, tuple]] = {
        # vLLM's chat-style embedding requests
        "messages": (_null, "embeddings of chat messages are not implemented (send input)"),
        "chat_template": (_null, "embeddings of chat messages are not implemented"),
        # string inputs are tokenized with the special tokens (vLLM's default too)
        "add_special_tokens": (_null_or(True), "add_special_tokens=false is not implemented"),
        "mm_processor_kwargs": (_null_or({}), "multimodal processor arguments are not "
                                              "implemented"),
    }
    model: str | None = None
    # fail_fast: as CompletionRequest.prompt (a million bad token ids stop at the first)
    input: Union[Annotated[list[list[int]], Field(fail_fast=True)],
                 Annotated[list[int], Field(fail_fast=True)], list[str], str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # refused by the engine: no model here supports it
    user: str | None = None
    # not OpenAI (extra_body), vLLM's names
    truncate_prompt_tokens: int | None = None  # the input's last k tokens (-1: what fits)
    normalize: bool | None = None  # L2-normalise (null: the model's pooler config says)
