"""The step's checks that fail single requests instead of the engine: the fault-injection
sites of the runner (tokenmill/faults.py, armed by the isolation tests) and the sampled
tokens' NaN / vocabulary check (the reference's clamp-and-terminate)."""
from __future__ import annotations

import logging

import numpy as np

from tokenmill import faults
from tokenmill.errors import RequestFault

logger = logging.getLogger(__name__)


def input_fault(req_id: str, prompt_token_ids) -> None:
    """The "input" site: preparing a new request's row fails (the step fails)."""
    if faults.ARMED and faults.fires("input", req_id, prompt_token_ids):
        raise faults.InjectedFault(f"input preparation of {req_id}")


def sampler_fault(req_ids, requests) -> None:
    """The "sampler" site: sampling fails for one request (a RequestFault naming it)."""
    if faults.ARMED:
        for rid in req_ids:
            if faults.fires("sampler", rid, requests[rid].prompt_token_ids):
                raise RequestFault([rid], faults.InjectedFault(f"sampler of {rid}"))


def check_sampled(req_ids, discard: np.ndarray, nan_rows: np.ndarray | None,
                   tokens: np.ndarray, num_emitted: np.ndarray,
                   vocab: int) -> dict[str, tuple[str, str]]:
    """The rows that must not emit their tokens: NaN logits, or an id outside the
    vocabulary (the reference's clamp-and-terminate). request id -> (reason, message)."""
    errored = {}
    if nan_rows is not None and nan_rows.any():
        for r in np.nonzero(nan_rows & ~discard)[0].tolist():
            errored[req_ids[r]] = ("nan_logits", "the model produced NaN logits for this "
                                                 "request")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):  # (else none is out)
        emitted = np.arange(tokens.shape[1]) < num_emitted[:, None]
        outside = (((tokens < 0) | (tokens >= vocab)) & emitted).any(axis=1) & ~discard
        for r in np.nonzero(outside)[0].tolist():
            bad = tokens[r][emitted[r] & ((tokens[r] < 0) | (tokens[r] >= vocab))]
            errored.setdefault(req_ids[r], ("token_out_of_vocab",
                                            f"sampled token id {int(bad[0])} is outside "
                                            f"the vocabulary"))
    for rid, (reason, _) in errored.items():
        logger.error("request %s failed: %s", rid, reason)
    return errored
