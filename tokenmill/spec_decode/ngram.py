"""N-gram ("prompt lookup") draft proposer for speculative decoding.

A request's drafts come from its own tokens: when its last n tokens also occurred
earlier, the tokens that followed that earlier occurrence are proposed as its next
ones. No draft model and no weights; it pays where the output repeats its input
(code edits, quoting, extraction, summaries).

Rule: the longest n in [prompt_lookup_min, prompt_lookup_max] whose suffix n-gram
occurred before (not as the suffix itself), then that n-gram's most recent
occurrence; its continuation is copied as in LZ77, so past the end of the sequence
it reads the drafts already proposed (period P < k still gives k drafts).

Each request keeps an index, n-gram -> end of its latest occurrence, updated with
only the tokens appended since the previous step: a step costs
O(new tokens x number of n) to index plus O(max n + k) to look up, whatever the
sequence length.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

# Below this many new n-grams (per n) a Python loop beats numpy's fixed per-call cost
# (one decode token: ~1 us vs ~10 us); from a prompt's worth up, numpy is ~2x faster.
_VECTORISE_FROM = 32


class _Index:
    """One request's n-grams. The key is the n tokens as int32 bytes (exact, so no hash
    collisions to check; its length tells the n apart, so one dict holds every n)."""

    __slots__ = ("latest_end", "num_seen")

    def __init__(self) -> None:
        # n-gram -> end (exclusive) of its latest occurrence.
        self.latest_end: dict[bytes, int] = {}
        # The sequence length at the previous call. Every n-gram ending before it is
        # indexed; the one ending at it was the suffix then, and is indexed only once a
        # token follows it (else the suffix would find itself).
        self.num_seen = 0


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int):
        for name, value in (("num_speculative_tokens", num_speculative_tokens),
                            ("prompt_lookup_min", prompt_lookup_min),
                            ("prompt_lookup_max", prompt_lookup_max)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max ({prompt_lookup_max}) must be >= "
                             f"prompt_lookup_min ({prompt_lookup_min})")
        self.k = int(num_speculative_tokens)
        self.min_n = int(prompt_lookup_min)
        self.max_n = int(prompt_lookup_max)
        # Keyed by request id, not row: the runner moves requests between rows.
        self._indices: dict[str, _Index] = {}
        # n-grams added to the indices so far: a work count (each token is indexed once
        # per n, never rescanned), which the tests check.
        self.ngrams_indexed = 0

    def propose(self, req_ids: list[str], token_ids: np.ndarray, num_tokens: np.ndarray,
                max_drafts: np.ndarray) -> list[list[int]]:
        """token_ids: [>= len(req_ids), max_model_len] int32 (row i = request req_ids[i]'s
        tokens, prompt then output; only the first num_tokens[i] are real). max_drafts[i]:
        cap on drafts for that request this step (0: propose none; it must still index the
        new tokens). Returns one list of draft token ids (python ints,
        len <= min(k, max_drafts[i])) per request."""
        drafts = []
        for i, req_id in enumerate(req_ids):
            row = token_ids[i]
            length = int(num_tokens[i])
            if not 0 <= length <= row.shape[0]:
                raise ValueError(f"num_tokens[{i}]={length} is outside the row "
                                 f"(0..{row.shape[0]}) for request {req_id!r}")
            index = self._indices.get(req_id)
            if index is None or length < index.num_seen:
                # New, or shrunk (preempted and restarted, or the id reused): the old
                # positions may not hold the same tokens any more.
                index = self._indices[req_id] = _Index()
            self._extend(index, row, length)
            cap = min(self.k, int(max_drafts[i]))
            drafts.append(self._lookup(index, row, length, cap) if cap > 0 else [])
        return drafts

    def remove(self, req_id: str) -> None:
        """Forget a finished request's index."""
        self._indices.pop(req_id, None)

    def _extend(self, index: _Index, row: np.ndarray, length: int) -> None:
        """Index the n-grams ending at num_seen .. length-1 (all but the new suffix)."""
        start = index.num_seen
        index.num_seen = length
        if length <= start:
            return
        # The tokens those n-grams cover, as int32 so the keys match _lookup's.
        lo = max(0, start - self.max_n)
        window = np.ascontiguousarray(row[lo:length - 1], dtype=np.int32)
        latest_end = index.latest_end
        for n in range(self.min_n, self.max_n + 1):
            first = max(start, n)  # an n-gram ends at n at the earliest
            if first >= length:
                continue
            self.ngrams_indexed += length - first
            if length - first >= _VECTORISE_FROM:
                grams = np.ascontiguousarray(sliding_window_view(window[first - n - lo:], n))
                keys = grams.view(f"V{4 * n}").ravel().tolist()  # one bytes object per row
                # In order, so a later occurrence overwrites an earlier one.
                latest_end.update(zip(keys, range(first, length)))
            else:
                for end in range(first, length):
                    latest_end[window[end - n - lo:end - lo].tobytes()] = end

    def _lookup(self, index: _Index, row: np.ndarray, length: int, cap: int) -> list[int]:
        tail = np.ascontiguousarray(row[max(0, length - self.max_n):length], dtype=np.int32)
        # Longest n first; an earlier occurrence needs at least one token before the suffix.
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = index.latest_end.get(tail[len(tail) - n:].tobytes())
            if end is not None:
                # LZ77 copy: row[end:length] repeats with period length - end past the
                # end of the sequence, so tiling it is reading back the drafts.
                return np.resize(row[end:min(length, end + cap)], cap).tolist()
        return []
