"""The xgrammar backend: parse a request's grammar, compile it for the tokenizer,
make matchers.

Parsing (`parse`) needs no tokenizer and is quick: it runs when a request is
added, so a bad schema / regex / grammar is a ValueError naming the field for
that request alone. Compiling (`compile`) builds the per-token masks for this
tokenizer; the manager runs it in a worker thread. The TokenizerInfo and the
GrammarCompiler are built once per engine, on the first compilation.
"""
from __future__ import annotations

import json
import logging
import re
import threading

from tokenmill.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes
# "Check failed: (...) is false: ".
_LOCATION = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")
_CHECK = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def clean_error(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    msg = _LOCATION.sub("", msg)
    return _CHECK.sub("", msg).strip()


def choice_ebnf(choices: list[str]) -> str:
    """A grammar whose sentences are exactly the choices (JSON string escapes
    are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XgrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 compile_threads: int = 2):
        import xgrammar  # noqa: F401 - fail here, not in a worker thread
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.compile_threads = compile_threads
        self.bitmask_words = -(-vocab_size // 32)
        self._compiler = None
        self._lock = threading.Lock()

    # ---- parse: at add_request -------------------------------------------------
    def parse(self, sop: StructuredOutputsParams):
        """-> an xgrammar Grammar; ValueError naming the field when it is invalid."""
        import xgrammar as xgr
        kind = sop.kind
        field = sop.field_name()
        any_ws = not sop.disable_any_whitespace
        try:
            if kind == "json":
                check_json_schema(sop.json, field)
                return xgr.Grammar.from_json_schema(json.dumps(sop.json), any_whitespace=any_ws)
            if kind == "json_object":
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_ws)
            if kind == "regex":
                return xgr.Grammar.from_regex(sop.regex)
            if kind == "choice":
                return xgr.Grammar.from_ebnf(choice_ebnf(sop.choice))
            if kind == "grammar":
                return _parse_grammar(sop.grammar)
            if kind == "structural_tag":
                return _parse_structural_tag(sop.structural_tag)
        except ValueError as e:
            if str(e).startswith(field):
                raise
            raise ValueError(f"{field}: invalid {_WHAT[kind]}: {clean_error(e)}") from None
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and its own types
            raise ValueError(f"{field}: invalid {_WHAT[kind]}: {clean_error(e)}") from None
        raise AssertionError(kind)

    # ---- compile: in a worker thread --------------------------------------------
    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.compile_threads)
            return self._compiler

    def compile(self, grammar):
        return self._get_compiler().compile_grammar(grammar)

    def new_matcher(self, compiled):
        import xgrammar as xgr
        # Without any stop token the grammar ends the request as soon as it is complete.
        # (Speculative decoding rolls a matcher back over a step's drafts: xgrammar's
        # matchers roll back any number of tokens.)
        return xgr.GrammarMatcher(compiled,
                                  terminate_without_stop_token=not self.stop_token_ids)


_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
         "choice": "choice list", "grammar": "grammar", "structural_tag": "structural tag"}


def check_json_schema(schema: dict, field: str) -> None:
    """The JSON Schema meta-schema check, when jsonschema is installed (xgrammar
    checks the parts it converts either way)."""
    try:
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise ValueError(f"{field}: invalid JSON schema: {e.message}"
                         + (f" (at {where})" if where else "")) from None


def _parse_grammar(text: str):
    import xgrammar as xgr
    try:
        return xgr.Grammar.from_ebnf(text)
    except Exception as ebnf_error:  # noqa: BLE001
        if "::=" in text:
            raise
        try:  # no EBNF rule at all: maybe a Lark grammar ("start: ...")
            return xgr.Grammar.from_lark(text)
        except Exception:  # noqa: BLE001 - report the EBNF error, the documented format
            raise ebnf_error from None


def _parse_structural_tag(tag: dict):
    import xgrammar as xgr
    if "structures" in tag:  # vLLM's format: {"structures": [{begin, schema, end}], "triggers"}
        from xgrammar.structural_tag import StructuralTag
        structures, triggers = tag.get("structures"), tag.get("triggers")
        if not isinstance(structures, list) or not isinstance(triggers, list):
            raise ValueError("structures and triggers must be lists")
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                       end=s["end"]) for s in structures]
        tag = StructuralTag.from_legacy_structural_tag(items, triggers).model_dump_json()
    return xgr.Grammar.from_structural_tag(tag)
