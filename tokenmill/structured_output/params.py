"""StructuredOutputsParams: what a request's output must match (vLLM's names).

Exactly one kind per request: `json` (a JSON schema, dict or string),
`json_object` (any JSON object), `regex`, `choice` (one of a list of strings),
`grammar` (EBNF / GBNF) or `structural_tag`. `disable_any_whitespace` makes
JSON output compact (no free whitespace between tokens of the JSON).

The checks here are the cheap ones (types, one kind, JSON that parses); the
schema, regex and grammar themselves are checked when the request is added
(the xgrammar backend parses them), still as a ValueError naming the field.
This module imports nothing heavy: SamplingParams imports it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        # The request field this came from, for error messages ("response_format",
        # "guided_json", ...); None: structured_outputs.<kind>.
        self._origin: str | None = None
        self._key: tuple | None = None  # memo of cache_key()
        if self.json_object is False:
            self.json_object = None  # False asks for nothing
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            what = " and ".join(given) if given else "none"
            raise ValueError(f"structured_outputs: give exactly one of {', '.join(KINDS)}; "
                             f"got {what}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be a bool, "
                             f"got {self.disable_any_whitespace!r}")
        if self.json is not None:
            self.json = _json_value(self.json, "structured_outputs.json", "JSON schema")
            if not isinstance(self.json, dict):
                raise ValueError(f"structured_outputs.json: invalid JSON schema: must be an "
                                 f"object, got {type(self.json).__name__}")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be a bool, "
                             f"got {self.json_object!r}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, "
                                 f"got {v!r}")
        if self.choice is not None:
            c = self.choice
            if (not isinstance(c, (list, tuple)) or not c
                    or not all(isinstance(s, str) for s in c)):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of "
                                 f"strings, got {c!r}")
            self.choice = list(c)
        if self.structural_tag is not None:
            self.structural_tag = _json_value(self.structural_tag,
                                              "structured_outputs.structural_tag",
                                              "structural tag")
            if not isinstance(self.structural_tag, dict):
                raise ValueError("structured_outputs.structural_tag: invalid structural tag: "
                                 "must be a JSON object")

    @classmethod
    def from_dict(cls, d: Any, origin: str = "structured_outputs") -> "StructuredOutputsParams":
        """From a request body's dict; unknown keys are an error naming them."""
        if isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"{origin} must be an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = [k for k in d if k not in known]
        if unknown:
            raise ValueError(f"{origin}: unknown field {unknown[0]!r}; known fields: "
                             f"{', '.join(sorted(known))}")
        return cls(**d)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    def field_name(self) -> str:
        """The request field that error messages name."""
        return self._origin or f"structured_outputs.{self.kind}"

    def cache_key(self) -> tuple:
        """(kind, canonical text, whitespace flag): equal keys compile to the same grammar.

        JSON keeps its key order (a schema's property order is the output's order)."""
        if self._key is None:
            kind = self.kind
            value = getattr(self, kind)
            if kind in ("json", "structural_tag", "choice"):
                text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
            elif kind == "json_object":
                text = ""
            else:
                text = value
            self._key = (kind, text, self.disable_any_whitespace)
        return self._key


def _json_value(v, name: str, what: str):
    if isinstance(v, str):
        try:
            return json.loads(v)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: invalid {what}: not valid JSON ({e})") from None
    return v
