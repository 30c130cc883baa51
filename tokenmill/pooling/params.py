"""PoolingParams: what one embedding request asks for (vLLM's names).

This module imports nothing heavy: the scheduler's request and the runner contract
carry it (core/serial.py sends it as a plain dataclass).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tokenmill.errors import ParamError
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

# How a prompt's hidden states become one vector (vLLM's pooling_type names).
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass
class PoolingParams:
    # Matryoshka truncation of the vector: only for models trained for it, which no
    # model tokenmill loads declares; any value is refused when the request is added.
    dimensions: int | None = None
    # L2-normalise the vector (None: the model's pooler config says).
    normalize: bool | None = None
    # Keep only the prompt's last k tokens (-1: as many as max_model_len holds).
    truncate_prompt_tokens: int | None = None
    # Set by the engine from the model's pooler config when it takes the request in
    # (a field, so it travels to the runner with the request): never passed by a user.
    pooling_type: str | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not isinstance(self.dimensions, int)
                                            or isinstance(self.dimensions, bool)):
            raise ParamError("dimensions", f"dimensions must be an int, got "
                                           f"{type(self.dimensions).__name__}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ParamError("normalize", f"normalize must be true, false or null, got "
                                          f"{type(self.normalize).__name__}")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool)
                              or (k < 1 and k != -1)):
            raise ParamError("truncate_prompt_tokens", f"truncate_prompt_tokens must be "
                                                       f"-1 or a positive int, got {k!r}")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ParamError("pooling_type", f"pooling_type must be one of "
                                             f"{', '.join(POOLING_TYPES)}, got "
                                             f"{self.pooling_type!r}")

    def clone(self, **changes) -> "PoolingParams":
        return dataclasses.replace(self, **changes)


def pooling_sampling_params() -> SamplingParams:
    """The SamplingParams an embedding request carries through the scheduler and the
    persistent batch (which read one per request): one greedy token, never sampled -
    the runner discards its row and the scheduler finishes it on its vector."""
    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                          output_kind=RequestOutputKind.FINAL_ONLY)
