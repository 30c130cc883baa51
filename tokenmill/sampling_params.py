"""Sampling parameters, with vLLM's names and meanings.

Every check raises ValueError naming the offending field, at construction,
before a request reaches the engine.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields


@dataclass(init=False)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __init__(self, **kwargs):
        known = {f.name: f for f in fields(self)}
        for name in kwargs:
            if name not in known:
                raise ValueError(f"SamplingParams got an unknown field {name!r}; "
                                 f"known fields: {', '.join(known)}")
        for name, f in known.items():
            if name in kwargs:
                value = kwargs[name]
            elif f.default_factory is not MISSING:
                value = f.default_factory()
            else:
                value = f.default
            setattr(self, name, value)
        self._verify()

    def _verify(self) -> None:
        def number(name, kinds=(int, float)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, kinds):
                raise ValueError(f"{name} must be a number, got {v!r}")
            return v

        if number("n", int) != 1:
            raise ValueError(f"n must be 1 (n > 1 is not supported yet), got {self.n}")
        if number("temperature") < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < number("top_p") <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if number("top_k", int) < -1:
            raise ValueError(f"top_k must be -1 (disable) or >= 0, got {self.top_k}")
        if self.max_tokens is not None and number("max_tokens", int) < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.seed is not None:
            number("seed", int)
        if not isinstance(self.stop_token_ids, (list, tuple, set)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        if self.top_k == -1:
            self.top_k = 0
        self.stop_token_ids_set = frozenset(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self) -> "SamplingParams":
        return SamplingParams(**{f.name: getattr(self, f.name) for f in fields(self)})
