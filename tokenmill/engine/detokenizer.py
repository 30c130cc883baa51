"""Incremental detokenization that never emits half a character.

Each step decodes a short window (a few tokens already shown plus the new
ones) and emits only the text beyond what the window already showed; while the
window ends in U+FFFD (an incomplete UTF-8 sequence), it waits for more tokens.
`finish()` flushes whatever is left, so the concatenated deltas of a byte-level
tokenizer equal decoding the whole output at once.
"""
from __future__ import annotations

# Prompt tokens kept as left context, so the first output token gets its
# leading space right with sentencepiece-style tokenizers.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.decode_kwargs = {"skip_special_tokens": skip_special_tokens}
        if not getattr(tokenizer, "is_fast", True):  # only slow tokenizers take this option
            self.decode_kwargs["spaces_between_special_tokens"] = spaces_between_special_tokens
        self.ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        # A prompt given as ids may end inside a multi-byte character. Such a context
        # decodes with a trailing U+FFFD that the output's first bytes would turn into
        # a real character, so `full` would no longer extend `shown` and those bytes
        # would vanish from the output. Keep only context that ends on a whole character.
        while self.ids and self._decode(self.ids).endswith("\ufffd"):
            self.ids.pop()
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.decode_kwargs)

    def update(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the newly complete text (possibly empty)."""
        self.ids.extend(new_token_ids)
        shown = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(shown) or full.endswith("\ufffd"):
            return ""
        return self._emit(full[len(shown):])

    def finish(self) -> str:
        """The text still held back (an incomplete character at the very end)."""
        if self.read_offset == len(self.ids):
            return ""
        shown = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        return self._emit(full[len(shown):]) if len(full) > len(shown) else ""

    def _emit(self, delta: str) -> str:
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
