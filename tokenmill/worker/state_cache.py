"""Recurrent state of the MambaSpec (Gated DeltaNet) layers: memory and slots.

Each such layer owns one tensor per entry of its spec ([num_slots, *shape],
the spec's dtype). A slot holds one live sequence's state; slots are keyed on
the request id, never on a block id (a block table can present the null
block for several sequences), handed out when a request is first scheduled,
zeroed then, kept while it runs (also across steps it sits out), and given
back when it finishes or is preempted (its state is recomputed on resume).
"""
from __future__ import annotations

import torch

from tokenmill.core.kv_cache_spec import KVCacheConfig, MambaSpec
from tokenmill.worker.kv_cache import TORCH_DTYPES


def allocate_state_caches(config: KVCacheConfig, device: torch.device, extra_slots: int = 0
                          ) -> dict[str, tuple[torch.Tensor, ...]]:
    """`extra_slots`: scratch slots after the config's, never handed to a request (the
    pad rows of a CUDA graph read and write one: worker/cuda_graph.py). The state
    snapshot slots (hybrid prefix caching) follow them: `snapshot_base`."""
    num = config.num_state_slots + extra_slots + config.num_state_snapshots
    caches = {}
    for group in config.groups:
        if not isinstance(group.spec, MambaSpec):
            continue
        for name in group.layer_names:
            caches[name] = tuple(
                torch.zeros((num, *shape), dtype=TORCH_DTYPES[dtype], device=device)
                for shape, dtype in zip(group.spec.shapes, group.spec.dtypes, strict=True))
    return caches


def snapshot_base(config: KVCacheConfig, extra_slots: int = 0) -> int:
    """Index of snapshot slot 0 in every recurrent layer's state tensors."""
    return config.num_state_slots + extra_slots


class StateSlots:
    """Slots handed out in groups of `width`: one group per live request.

    Without speculation width is 1 and a request's state is updated in place. With k
    drafts a step, width is k + 1: a verification step writes the state after each of
    its 1 + j tokens to its own slot of the group (the first in place), and the
    accepted count picks which of them the request goes on from (`accept`): nothing
    is copied and a rejected draft's state is simply left behind.
    """

    def __init__(self, num_slots: int, width: int = 1):
        if width < 1 or num_slots % width:
            raise ValueError(f"{num_slots} state slots do not split into groups of {width}")
        self.num_slots = num_slots
        self.width = width
        self.slot_of: dict[str, int] = {}  # request -> the slot holding its current state
        self._group_of: dict[str, int] = {}
        self._free = list(range(num_slots // width - 1, -1, -1))  # pop() hands out 0 first

    def get_or_allocate(self, req_id: str) -> tuple[int, bool]:
        """(current slot, is_new)."""
        slot = self.slot_of.get(req_id)
        if slot is not None:
            return slot, False
        if not self._free:
            raise RuntimeError(f"no free recurrent-state slot for request {req_id} "
                               f"({self.num_slots} slots, all held by live requests)")
        group = self._free.pop()
        self._group_of[req_id] = group
        slot = self.slot_of[req_id] = group * self.width
        return slot, True

    def write_slots(self, req_id: str, num_tokens: int) -> list[int]:
        """Where a step of `num_tokens` decode tokens (1 + drafts) leaves the state after
        each token: the current slot first, then the group's other slots."""
        cur = self.slot_of[req_id]
        base = self._group_of[req_id] * self.width
        others = [base + i for i in range(self.width) if base + i != cur]
        return [cur] + others[:num_tokens - 1]

    def accept(self, req_id: str, slot: int) -> None:
        """The request goes on from `slot` (one its last step wrote)."""
        self.slot_of[req_id] = slot

    def release(self, req_id: str) -> None:
        self.slot_of.pop(req_id, None)
        group = self._group_of.pop(req_id, None)
        if group is not None:
            self._free.append(group)

    @property
    def num_free(self) -> int:
        return len(self._free) * self.width
