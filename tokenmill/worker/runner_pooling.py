"""The model runner's pooling concern: embedding requests share the batch with
generation. Their rows run the forward like any prompt chunk (their K/V written, so a
later chunk attends to it), sample nothing (discarded rows) and hand their chunk's final
hidden states to their PoolingState (worker/pooler.py); the vector of a prompt that
completed goes out in the step's ModelRunnerOutput (`pooler_output`), and a non-finite
one fails that request alone. A mixin of `ModelRunner` (worker/model_runner.py)."""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.worker.pooler import PoolingState, to_host


class PoolingMixin:
    def _pool_step(self, hidden: torch.Tensor, discard: np.ndarray) -> bool:
        """After the forward: pool this step's chunk of every embedding row and mark the
        row discarded. Returns whether every row of the step pools (then nothing needs
        logits: a model without an LM head has none to give)."""
        self._pooled_ready = {}
        if not self._pooling_reqs:
            return False
        batch, step = self.input_batch, self.last_step
        n = batch.num_reqs()
        ready = {}
        num_pooling = 0
        for rid in self._pooling_reqs:
            r = batch.req_id_to_index.get(rid)
            if r is None:  # not scheduled this step
                continue
            num_pooling += 1
            discard[r] = True
            state = self.requests[rid]
            if state.pooler is None:
                pp = state.pooling_params
                state.pooler = PoolingState(pp.pooling_type, bool(pp.normalize),
                                            len(state.prompt_token_ids))
            lo, hi = int(step.query_start_loc[r]), int(step.query_start_loc[r + 1])
            vec = state.pooler.add_chunk(hidden[lo:hi], int(step.seq_lens[r]) - (hi - lo))
            if vec is not None:
                ready[rid] = vec
        self._pooled_ready = ready
        return num_pooling == n

    def _attach_pooled(self, out: ModelRunnerOutput) -> ModelRunnerOutput:
        """The vectors pooled by the step sample_tokens() finishes; a vector holding NaN
        or inf (an overflow in that request's activations) fails its request."""
        ready, self._pooled_ready = self._pooled_ready, {}
        for rid, vec in to_host(ready).items():
            if np.isfinite(vec).all():
                out.pooler_output[rid] = vec
            else:
                out.errored[rid] = ("nan_embedding", "the embedding holds NaN or inf")
        return out
