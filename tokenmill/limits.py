"""Caps on what one request may ask for, so that no client can make the engine
build a million requests, scan a million stop strings or compile a huge grammar.

Each cap has an engine argument / CLI flag of the same name (`--max-n`, ...).
A request past a cap gets a ParamError naming the field (a 400 from the server).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

# What the engine stores numbers in: token ids, top_k and counters in int32
# tensors, seeds in torch generators (int64 / uint64), floats in float32 tensors.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
UINT64_MAX = 2**64 - 1
FLOAT32_MAX = 3.4028234663852886e38


@dataclass
class RequestLimits:
    max_n: int = 64  # completions per request (n)
    max_prompts_per_request: int = 256  # prompts in one /v1/completions body
    max_embedding_inputs: int = 2048  # inputs in one /v1/embeddings body (OpenAI's cap)
    max_stop_strings: int = 64
    max_stop_string_length: int = 1024  # characters
    max_stop_token_ids: int = 1024
    max_bad_words: int = 1024
    max_bad_word_length: int = 1024  # characters
    max_allowed_token_ids: int = 262144
    max_logit_bias: int = 1024  # entries
    max_messages: int = 2048  # chat messages per request
    max_grammar_bytes: int = 65536  # JSON schema / regex / grammar / choices, as text
    # HTTP body (413 past it). It also bounds how long one body can hold the event loop:
    # JSON decoding and validation keep the GIL (about 0.7 s per MB at worst, measured
    # with half a million one-token prompts), so a thread would not help.
    max_request_body_bytes: int = 8 * 2**20
    grammar_compile_timeout: float = 30.0  # seconds (past it: 400)
    # Multimodal requests: images per request, pixels per image (decoded), bytes per
    # encoded image (a data: URL's payload, a local file).
    max_images_per_request: int = 8
    max_image_pixels: int = 4096 * 4096
    max_image_bytes: int = 10 * 2**20

    @classmethod
    def from_any(cls, value) -> "RequestLimits":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            for k in value:
                if k not in known:
                    raise ValueError(f"limits: unknown field {k!r}; known: {', '.join(sorted(known))}")
            limits = cls(**value)
        else:
            raise ValueError(f"limits must be a RequestLimits or a dict, got {type(value).__name__}")
        limits.validate()
        return limits

    def validate(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{f.name} must be a positive number, got {v!r}")
