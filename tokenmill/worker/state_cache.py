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


def allocate_state_caches(config: KVCacheConfig, device: torch.device
                          ) -> dict[str, tuple[torch.Tensor, ...]]:
    caches = {}
    for group in config.groups:
        if not isinstance(group.spec, MambaSpec):
            continue
        for name in group.layer_names:
            caches[name] = tuple(
                torch.zeros((config.num_state_slots, *shape), dtype=TORCH_DTYPES[dtype],
                            device=device)
                for shape, dtype in zip(group.spec.shapes, group.spec.dtypes, strict=True))
    return caches


class StateSlots:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.slot_of: dict[str, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out 0 first

    def get_or_allocate(self, req_id: str) -> tuple[int, bool]:
        """(slot, is_new)."""
        slot = self.slot_of.get(req_id)
        if slot is not None:
            return slot, False
        if not self._free:
            raise RuntimeError(f"no free recurrent-state slot for request {req_id} "
                               f"({self.num_slots} slots, all held by live requests)")
        slot = self._free.pop()
        self.slot_of[req_id] = slot
        return slot, True

    def release(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)
