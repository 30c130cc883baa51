"""What the runner needs from a draft model of the EAGLE kind (eagle3, mtp).

Such a drafter reads the target's hidden states: for every position p of a step
whose token the target has just computed, the drafter's input is the token at
p + 1 (the next prompt token, or the token the step emitted) together with the
target's hidden state at p, and it predicts the token at p + 2. Its own attention
layers keep K/V in the same paged cache as the target's (same block table and
slot mapping: they are extra layers of the target's KV cache group), so one
AttentionMetadata serves both. The first draft of a request comes from its last
accepted position; drafts 2..k come from k - 1 further one-row steps that feed
the drafter its own output hidden state and its previous draft.
"""
from __future__ import annotations

from typing import Protocol

import torch

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.models.layers.attention import PagedAttention


class EagleStyleDrafter(Protocol):
    # Target layers whose *input* residual stream (the hidden state entering layer i,
    # i.e. what layer i - 1 produced) the drafter consumes, concatenated in this order
    # (EAGLE-3); None: the target's final hidden state, after its last norm (MTP).
    aux_layer_ids: tuple[int, ...] | None

    def combine_target_hidden(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[T, n * H_target] (or [T, H_target]) -> [T, H]: what the first draft step takes
        as `hidden` (EAGLE-3: fc over the concatenated aux states; MTP: unchanged)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (out [T, H]: what draft_token_ids reads, next_hidden [T, H]: the hidden state
        the next draft step takes at the following position)."""

    # Optional: write_kv(input_ids, positions, hidden, meta) -> None writes only the K/V
    # forward would write for those rows. With it, the proposer writes the step's K/V
    # for every token and runs the full forward only at the rows it proposes from.

    def draft_token_ids(self, out: torch.Tensor) -> torch.Tensor:
        """[R, H] -> [R] long: greedy drafts as *target* vocabulary ids."""

    def attention_layers(self) -> list[PagedAttention]:
        """The drafter's attention layers, in order (their KV caches are bound by the runner)."""


def target_greedy_head(runner, model, rows: int):
    """The runner's int8-screened greedy head when `model` drafts through the target's
    own lm_head (`shares_target_lm_head`) and `rows` fit it: the same argmax as the
    full lm_head, fewer bytes read. None otherwise."""
    head = runner.greedy_head
    if (head is not None and getattr(model, "shares_target_lm_head", False)
            and rows <= runner.greedy_head_max_rows):
        return head
    return None
