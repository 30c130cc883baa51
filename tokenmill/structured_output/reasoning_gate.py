"""A grammar that waits for the reasoning to end (vLLM's `--reasoning-parser` with
structured output): the tokens a request thinks with are free, the grammar applies to the
answer after the end tag.

`ReasoningGates` is the engine's: from `--reasoning-parser` and the tokenizer, once, the
tags' token ids; per request a `ReasoningEndTracker` (tokenmill.parsers.reasoning) started
where the prompt leaves off. Per position of a request's output the mask is one of

* the grammar's, once the reasoning has ended;
* the grammar's plus the start tag, before the first token of an output that need not
  think (the model may open a reasoning block, or begin the answer at once);
* none (every token allowed) while it thinks.
"""
from __future__ import annotations

import copy

import numpy as np

from tokenmill.parsers.reasoning import ReasoningEndTracker


def prompt_starts_in_reasoning(prompt_ids, start_id: int | None, end_id: int) -> bool | None:
    """From the prompt's token ids, as ReasoningParser.starts_in_reasoning from its text:
    True when the last think tag opens a block, False when it closes one, None without."""
    for tok in reversed(prompt_ids):
        if tok == end_id:
            return False
        if tok == start_id:
            return True
    return None


class ReasoningGates:
    """The engine's `--reasoning-parser`, for its grammars."""

    def __init__(self, parser, tokenizer):
        self.parser = parser
        self.error: str | None = None  # why no grammar can wait here (no end-tag token)
        self.start_id = self.end_id = None
        try:
            tracker = parser.end_tracker(tokenizer)
            self.start_id, self.end_id = tracker.start_id, tracker.end_id
        except (ValueError, AttributeError) as e:  # AttributeError: no tokenizer at all
            self.error = str(e) if isinstance(e, ValueError) else "this model has no tokenizer"

    def tracker(self, prompt_ids) -> ReasoningEndTracker:
        starts = prompt_starts_in_reasoning(prompt_ids, self.start_id, self.end_id)
        if starts is None:
            starts = self.parser.unknown_start
        return ReasoningEndTracker(self.start_id, self.end_id, starts)


def fill_gated_rows(matcher, gate: ReasoningEndTracker | None, bitmask: np.ndarray, row: int,
                    drafts) -> None:
    """Rows row .. row + len(drafts) of `bitmask` for one request: its state now, then
    after each draft (every row starts all-allowed). The matcher and the gate are where
    they were afterwards (the matcher rolled back, the gate copied)."""
    gate = copy.copy(gate) if gate is not None else None
    accepted = 0
    for j in range(len(drafts) + 1):
        if matcher.is_terminated():
            # A draft was the grammar's stop token: a verified request ends there, so the
            # rows after it are never read (left all-allowed); xgrammar refuses to fill
            # a terminated matcher's mask.
            break
        if gate is None or gate.ended:
            matcher.fill_next_token_bitmask(bitmask, row + j)
        elif gate.undecided:
            matcher.fill_next_token_bitmask(bitmask, row + j)
            if gate.start_id is not None:
                words = bitmask[row + j].view(np.uint32)
                words[gate.start_id // 32] |= np.uint32(1 << (gate.start_id % 32))
        if j == len(drafts):
            break
        tok = drafts[j]
        if gate is not None and not gate.ended and not gate.feed([tok]):
            continue  # a thinking token: the grammar does not see it
        if not matcher.accept_token(tok):
            break  # the rows after a broken draft stay all-allowed: never read
        accepted += 1
    if accepted:
        matcher.rollback(accepted)
