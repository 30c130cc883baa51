"""Sampling parameters, with vLLM's names and meanings.

Every check here raises ParamError (a ValueError) naming the offending field,
at construction, before a request reaches the engine: types, ranges, and that
every number fits what the engine stores it in (int32 / int64 / finite
float32). Checks that need the model (token ids inside the vocabulary, the
logprobs cap) and the engine's caps (`check_limits`) run in LLMEngine.add_request.
"""
from __future__ import annotations

import enum
import math
from dataclasses import MISSING, dataclass, field, fields

from tokenmill.errors import ParamError
from tokenmill.limits import FLOAT32_MAX, INT32_MAX, INT64_MAX, INT64_MIN, UINT64_MAX, RequestLimits
from tokenmill.structured_output.params import StructuredOutputsParams


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries everything so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


ENGINE_DERIVED = ("all_stop_token_ids", "bad_words_token_ids")


@dataclass(init=False)
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top-N per generated position (plus the sampled token)
    prompt_logprobs: int | None = None  # top-N per prompt position (plus the prompt token)
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Keep only the prompt's last k tokens (left truncation; -1: as many as the context
    # holds with room for one output token), as vLLM's field.
    truncate_prompt_tokens: int | None = None
    # Constrain the output to a JSON schema / regex / choice / grammar (dict or
    # StructuredOutputsParams); the grammar itself is checked at add_request.
    structured_outputs: StructuredOutputsParams | None = None
    # Derived by the engine when it takes a request in (llm_engine.py), never passed by
    # a user: the stop token ids with EOS, the bad words as token ids. Fields, so they
    # travel with the request in the scheduler/runner messages (core/serial.py).
    all_stop_token_ids: frozenset[int] | None = field(default=None, repr=False,
                                                      compare=False)
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False,
                                                        compare=False)

    def __init__(self, **kwargs):
        known = {f.name: f for f in fields(self) if f.name not in ENGINE_DERIVED}
        for name in kwargs:
            if name not in known:
                raise ParamError(name, f"SamplingParams got an unknown field {name!r}; "
                                       f"known fields: {', '.join(known)}")
        self.all_stop_token_ids = self.bad_words_token_ids = None
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
        def fail(name, message):
            raise ParamError(name, message)

        def number(name, kinds=(int, float)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, kinds):
                kind = "an int" if kinds is int else "a number"
                fail(name, f"{name} must be {kind}, got {v!r}")
            # NaN passes every `<` check and inf overflows the float32 tensors the
            # sampler keeps: refuse both here, once.
            if isinstance(v, float) and not (math.isfinite(v) and abs(v) <= FLOAT32_MAX):
                fail(name, f"{name} must be a finite number, got {v!r}")
            return v

        def int_in(name, lo, hi):
            v = number(name, int)
            if not lo <= v <= hi:
                fail(name, f"{name} must be in [{lo}, {hi}], got {v}")
            return v

        def int_list(name, v):
            if not isinstance(v, (list, tuple, set, frozenset)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in v):
                fail(name, f"{name} must be a list of ints, got {_short(v)}")
            return list(v)  # inside the vocabulary: checked by the engine, which knows it

        if number("n", int) < 1:
            fail("n", f"n must be at least 1, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= number(name) <= 2.0:
                fail(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if number("repetition_penalty") <= 0:
            fail("repetition_penalty",
                 f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if number("temperature") < 0:
            fail("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0 < number("top_p") <= 1:
            fail("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if number("top_k", int) < -1:
            fail("top_k", f"top_k must be -1 (disable) or >= 0, got {self.top_k}")
        int_in("top_k", -1, INT32_MAX)
        if not 0 <= number("min_p") <= 1:
            fail("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None:
            if number("max_tokens", int) < 1:
                fail("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
            # Past the context it is clamped to it when the request is added; past the
            # integer type it is an error.
            int_in("max_tokens", 1, INT64_MAX)
        if number("min_tokens", int) < 0:
            fail("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        int_in("min_tokens", 0, INT32_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                               f"({self.max_tokens})")
        if self.seed is not None:
            # torch generators take seeds in [-2^63, 2^64); completion i of n uses seed + i.
            number("seed", int)
            if not INT64_MIN <= self.seed <= UINT64_MAX - (self.n - 1):
                fail("seed", f"seed must be in [{INT64_MIN}, {UINT64_MAX - (self.n - 1)}], "
                             f"got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and number(name, int) < 0:
                fail(name, f"{name} must be >= 0, got {getattr(self, name)}")
        if self.truncate_prompt_tokens is not None:
            v = number("truncate_prompt_tokens", int)
            if v != -1 and not 1 <= v <= INT32_MAX:
                fail("truncate_prompt_tokens", f"truncate_prompt_tokens must be -1 or in "
                                               f"[1, {INT32_MAX}], got {v}")
        for name in ("ignore_eos", "detokenize", "skip_special_tokens",
                     "spaces_between_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                fail(name, f"{name} must be a bool, got {getattr(self, name)!r}")
        self.stop_token_ids = int_list("stop_token_ids", self.stop_token_ids)

        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            fail("stop", f"stop must be a string or a list of strings, got {_short(self.stop)}")
        if any(s == "" for s in stop):
            fail("stop", "stop must not contain an empty string")
        self.stop = list(stop)
        if self.stop and not self.detokenize:
            fail("stop", "stop strings need detokenize=True")

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail("logit_bias", f"logit_bias must be a dict of token id -> bias, "
                                   f"got {_short(self.logit_bias)}")
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    tok = int(k)  # JSON keys arrive as strings
                except (TypeError, ValueError, OverflowError):
                    fail("logit_bias", f"logit_bias: key {_short(k)} is not a token id")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or (
                        isinstance(v, float) and not math.isfinite(v)):
                    fail("logit_bias", f"logit_bias: bias of token {tok} must be a finite "
                                       f"number, got {_short(v)}")
                bias[tok] = max(-100.0, min(100.0, float(v)))  # OpenAI's range
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = int_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                fail("allowed_token_ids", "allowed_token_ids must not be empty")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in self.bad_words):
                fail("bad_words", f"bad_words must be a list of non-empty strings, "
                                  f"got {_short(self.bad_words)}")
            self.bad_words = list(self.bad_words)
        if self.structured_outputs is not None:
            try:
                self.structured_outputs = StructuredOutputsParams.from_dict(
                    self.structured_outputs)
            except ParamError:
                raise
            except ValueError as e:
                fail("structured_outputs", str(e))
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            fail("output_kind", f"output_kind must be a RequestOutputKind, "
                                f"got {_short(self.output_kind)}")

        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.min_p = float(self.min_p)
        self.presence_penalty = float(self.presence_penalty)
        self.frequency_penalty = float(self.frequency_penalty)
        self.repetition_penalty = float(self.repetition_penalty)
        if self.top_k == -1:
            self.top_k = 0
        if self.n > 1 and self.greedy:
            fail("n", f"n={self.n} with greedy sampling (temperature=0) would give "
                      f"{self.n} identical completions; set temperature > 0")
        self._derive()

    def _derive(self) -> None:
        """Attributes computed from the fields (not fields: not in messages)."""
        self.stop_token_ids_set = frozenset(self.stop_token_ids)
        # Text held back while streaming: it may yet turn out to start a stop string.
        self.output_text_buffer_length = (max(len(s) for s in self.stop) - 1
                                          if self.stop and not self.include_stop_str_in_output
                                          else 0)

    # A message decoded into a SamplingParams (core/serial.py) sets the fields
    # without __init__, then calls this: the values were checked where they were made.
    __post_init__ = _derive

    def check_limits(self, limits: RequestLimits) -> None:
        """The engine's caps (RequestLimits): ParamError naming the field past one."""
        def cap(name, count, limit, what="entries"):
            if count > limit:
                raise ParamError(name, f"{name}: {count} {what}, more than this server's "
                                       f"limit of {limit}")

        cap("n", self.n, limits.max_n, "completions")
        cap("stop", len(self.stop), limits.max_stop_strings, "stop strings")
        longest = max((len(s) for s in self.stop), default=0)
        cap("stop", longest, limits.max_stop_string_length, "characters in a stop string")
        cap("stop_token_ids", len(self.stop_token_ids), limits.max_stop_token_ids)
        if self.bad_words:
            cap("bad_words", len(self.bad_words), limits.max_bad_words, "words")
            cap("bad_words", max(len(w) for w in self.bad_words), limits.max_bad_word_length,
                "characters in a word")
        if self.allowed_token_ids:
            cap("allowed_token_ids", len(self.allowed_token_ids), limits.max_allowed_token_ids)
        if self.logit_bias:
            cap("logit_bias", len(self.logit_bias), limits.max_logit_bias)
        if self.structured_outputs is not None:
            sop = self.structured_outputs
            cap(sop.field_name(), len(sop.cache_key()[1].encode()), limits.max_grammar_bytes,
                "bytes of grammar")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def needs_processors(self) -> bool:
        """A logits processor acts on its rows (they read the tokens before each
        position: such a request gets no drafts)."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids
                    or self.min_tokens or self.has_penalties)

    def clone(self, **changes) -> "SamplingParams":
        """A copy with `changes` (user fields), checked again; the derived ones are not
        copied."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(self)
                  if f.name not in ENGINE_DERIVED}
        kwargs.update(changes)
        return SamplingParams(**kwargs)


def _short(value, limit: int = 80) -> str:
    """A value for an error message, cut short: a client may send a huge one."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
