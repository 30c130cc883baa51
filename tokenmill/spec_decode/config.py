"""SpeculativeConfig: which drafter proposes tokens, and how many per step.

Given as `LLM(..., speculative_config={...})`, `--speculative-config '<json>'`
on the CLI and the server, or a SpeculativeConfig. Every check names the field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "mtp", "eagle3", "dflash")
# Methods this build can run; the others are refused at start-up with a clear error.
IMPLEMENTED = METHODS
MAX_SPECULATIVE_TOKENS = 16


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    # n-gram (prompt lookup): the suffix lengths that are looked up, longest first.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # Draft checkpoint (eagle3, dflash); mtp uses the target's own mtp.* weights.
    model: str | None = None
    # No drafts in a step whose batch has at least this many requests (verifying
    # costs more than it saves once the forward is compute-bound); None: never off.
    disable_by_batch_size: int | None = 32
    # Per request, fewer drafts while its recent drafts are rejected (False: always k).
    adaptive: bool = True

    @classmethod
    def from_any(cls, value) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, a dict of its fields, or that dict as JSON text."""
        if value is None or isinstance(value, cls):
            if value is not None:
                value.validate()
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or its JSON), "
                             f"got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field {unknown[0]!r}; known: "
                             f"{', '.join(sorted(known))}")
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, "
                             f"got {self.method!r}")
        if self.method not in IMPLEMENTED:
            raise ValueError(f"speculative_config.method {self.method!r} is not available in "
                             f"this build (available: {', '.join(IMPLEMENTED)})")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an int from 1 "
                             f"to {MAX_SPECULATIVE_TOKENS}, got {k!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if not _is_int(v) or not 1 <= v <= 64:
                raise ValueError(f"speculative_config.{name} must be an int from 1 to 64, "
                                 f"got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        d = self.disable_by_batch_size
        if d is not None and (not _is_int(d) or d < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size must be a positive int "
                             f"or null, got {d!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, "
                             f"got {self.adaptive!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model must be a path or null, "
                             f"got {self.model!r}")
        if self.method in ("eagle3", "dflash") and not self.model:
            raise ValueError(f"speculative_config.model: method {self.method!r} needs the "
                             f"draft checkpoint's folder")

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots past a request's tokens the scheduler makes room for, where a draft model
        writes K/V while it proposes: an EAGLE-style drafter's k - 1 chained steps (k for
        slack), a DFlash block's last emitted token and its k mask rows (k + 1); none for
        n-gram lookup."""
        if self.method == "ngram":
            return 0
        return self.num_speculative_tokens + (self.method == "dflash")

    @property
    def drafter_reads_next_token(self) -> bool:
        """Whether the draft model's K/V at position p is made from the token at p + 1
        (EAGLE-3 and MTP: the embedding of the next token beside the target's state at
        p); DFlash's context is the target's state alone."""
        return self.method in ("eagle3", "mtp")

    def describe(self) -> str:
        s = f"{self.method}, k={self.num_speculative_tokens}"
        if self.method == "ngram":
            s += f", lookup {self.prompt_lookup_min}..{self.prompt_lookup_max}"
        if self.disable_by_batch_size is not None:
            s += f", off at batch >= {self.disable_by_batch_size}"
        return s + (", adaptive k" if self.adaptive else "")
