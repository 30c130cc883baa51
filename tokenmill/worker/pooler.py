"""One embedding request's pooling, chunk by chunk: a prompt computed over several
steps (chunked prefill) gives each chunk's final hidden states here as they come, and
the vector is ready once the chunk holding the prompt's last token has run.

LAST keeps the last position's row, CLS the first's, MEAN a float32 running sum over
every position (divided by the prompt length at the end); then an optional L2
normalisation (sentence-transformers' Normalize: x / max(||x||, 1e-12)). Everything is
float32 whatever the model's dtype, and every row kept is a copy (the forward's output
may be a CUDA graph's buffer, overwritten by the next replay).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


class PoolingState:
    def __init__(self, pooling_type: str, normalize: bool, num_prompt_tokens: int):
        self.pooling_type = pooling_type
        self.normalize = normalize
        self.num_prompt_tokens = num_prompt_tokens
        self._acc: torch.Tensor | None = None  # CLS row or MEAN sum so far

    def add_chunk(self, rows: torch.Tensor, start: int) -> torch.Tensor | None:
        """The final hidden states [T, H] of prompt positions [start, start + T); the
        pooled vector (float32 [H], on the rows' device) once the prompt is complete,
        else None. A chunk from position 0 starts over (a preempted request recomputes)."""
        if start == 0:
            self._acc = None
        end = start + rows.shape[0]
        kind = self.pooling_type
        if kind == "CLS" and start == 0:
            self._acc = rows[0].to(torch.float32, copy=True)
        elif kind == "MEAN":
            part = rows.to(torch.float32).sum(dim=0)
            self._acc = part if self._acc is None else self._acc + part
        if end < self.num_prompt_tokens:
            return None
        if kind == "LAST":
            vec = rows[self.num_prompt_tokens - 1 - start].to(torch.float32, copy=True)
        elif kind == "MEAN":
            vec = self._acc / self.num_prompt_tokens
        else:
            vec = self._acc
        self._acc = None
        return F.normalize(vec, p=2.0, dim=-1) if self.normalize else vec


def to_host(vectors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The step's vectors on the host, in one device-to-host copy."""
    if not vectors:
        return {}
    ids = list(vectors)
    stacked = torch.stack([vectors[i] for i in ids]).cpu().numpy()
    return {rid: stacked[k] for k, rid in enumerate(ids)}
