"""Greedy verification from the target's argmax alone (no logits needed)."""
from __future__ import annotations

import numpy as np


def verify_greedy(target_ids: np.ndarray, draft_ids: np.ndarray,
                  cu_num_logits: np.ndarray) -> np.ndarray:
    """Accepted drafts per request: the longest prefix of its drafts equal to the
    target's argmax at the same positions.

    target_ids [T]: argmax of every verified row; request i owns rows
    cu_num_logits[i] .. cu_num_logits[i+1]-1 (its k_i drafts' positions, then the
    bonus). draft_ids [sum k_i]: the drafts, in request order. Request i then emits
    target_ids[cu[i] : cu[i] + accepted[i] + 1] (an accepted draft equals the argmax).
    """
    cu = np.asarray(cu_num_logits, dtype=np.int64)
    num_drafts = np.diff(cu) - 1
    num_reqs = num_drafts.size
    accepted = np.zeros(num_reqs, dtype=np.int64)
    if draft_ids.size == 0:
        return accepted
    req = np.repeat(np.arange(num_reqs), num_drafts)
    draft_start = cu[:-1] - np.arange(num_reqs)  # where request i's drafts begin
    pos = np.arange(draft_ids.size) - draft_start[req]  # draft position j inside its request
    match = draft_ids == target_ids[cu[:-1][req] + pos]
    # First mismatch per request (k_i where every draft matched).
    first_bad = np.where(match, num_drafts[req], pos)
    has = num_drafts > 0
    accepted[has] = np.minimum.reduceat(first_bad, draft_start[has])
    return accepted
