"""The scheduler's view of the runner's encoder cache (multimodal models).

The runner keeps each encoded image's output (one embedding per placeholder
token) keyed on the image's hash, so an image is encoded once however many
prompt chunks read it, and again neither for a later request showing the same
image nor for a request back from preemption, while its entry lives. This
class decides which entries exist: it counts their rows against a capacity,
holds an entry while a live request refers to it, keeps unreferenced entries
as long as there is room (least recently released dropped first) and tells the
runner which ones to drop (`take_freed`, sent in the SchedulerOutput).
"""
from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    def __init__(self, capacity: int):
        self.capacity = capacity  # encoder output rows (placeholder tokens)
        self.used = 0
        self._length: dict[str, int] = {}  # hash -> rows, every entry the runner holds
        self._refs: dict[str, set[str]] = {}  # hash -> live requests reading it
        self._unreferenced: OrderedDict[str, None] = OrderedDict()  # oldest release first
        self._freed: list[str] = []

    def has(self, mm_hash: str) -> bool:
        return mm_hash in self._length

    def add_ref(self, mm_hash: str, req_id: str) -> None:
        self._refs.setdefault(mm_hash, set()).add(req_id)
        self._unreferenced.pop(mm_hash, None)

    def can_allocate(self, length: int) -> bool:
        reclaimable = sum(self._length[h] for h in self._unreferenced)
        return length <= self.capacity - self.used + reclaimable

    def allocate(self, mm_hash: str, length: int, req_id: str) -> None:
        """An entry the runner fills this step; unreferenced ones make room."""
        while self.capacity - self.used < length and self._unreferenced:
            old, _ = self._unreferenced.popitem(last=False)
            self.used -= self._length.pop(old)
            self._refs.pop(old, None)
            self._freed.append(old)
        self._length[mm_hash] = length
        self.used += length
        self.add_ref(mm_hash, req_id)

    def release(self, req_id: str, hashes) -> None:
        """The request no longer reads these (finished, preempted): kept while there is room."""
        for h in hashes:
            refs = self._refs.get(h)
            if refs is None:
                continue
            refs.discard(req_id)
            if not refs and h in self._length:
                self._unreferenced[h] = None
                self._unreferenced.move_to_end(h)

    def reset(self) -> None:
        """Forget every entry (the runner drops them all with the next step)."""
        self._freed.extend(self._length)
        self._length.clear()
        self._refs.clear()
        self._unreferenced.clear()
        self.used = 0

    def take_freed(self) -> list[str]:
        freed, self._freed = self._freed, []
        return freed
