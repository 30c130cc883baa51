"""KV block bookkeeping per request: which block ids each request holds, per group."""
from __future__ import annotations

from tokenmill.core.block_pool import BlockPool
from tokenmill.core.kv_cache_spec import KVCacheConfig
from tokenmill.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Full-attention groups: each request holds a growing list of blocks per group.

    All groups draw from one pool (a block id indexes the same page in every
    layer of its group, and groups never share ids). A recurrent-state
    (MambaSpec) group takes no blocks: its list stays empty, the runner keeps
    the state in a slot keyed on the request id.
    """

    def __init__(self, kv_cache_config: KVCacheConfig):
        self.config = kv_cache_config
        self.block_size = kv_cache_config.block_size
        self.num_groups = len(kv_cache_config.groups)
        self.block_groups = [i for i, g in enumerate(kv_cache_config.groups) if g.is_attention]
        self.first_block_group = self.block_groups[0]
        self.pool = BlockPool(kv_cache_config.num_blocks)
        self.req_to_blocks: dict[str, list[list[int]]] = {}

    @property
    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """A copy: a SchedulerOutput may be read after later steps changed the lists
        (async scheduling runs a step while the next one is scheduled)."""
        blocks = self.req_to_blocks.get(request_id)
        return [list(g) for g in blocks] if blocks else [[] for _ in range(self.num_groups)]

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[list[int]] | None:
        """Make room for `num_new_tokens` more tokens of `request`.

        Returns the newly allocated block ids per group ([] lists when none were
        needed), or None when the pool cannot provide them (nothing changes then).
        """
        blocks = self.req_to_blocks.setdefault(request.request_id,
                                               [[] for _ in range(self.num_groups)])
        needed_per_group = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        num_new = max(0, needed_per_group - len(blocks[self.first_block_group]))
        if num_new * len(self.block_groups) > self.pool.num_free_blocks:
            if not any(blocks):
                del self.req_to_blocks[request.request_id]
            return None
        new_ids = [self.pool.allocate(num_new) if i in self.block_groups else []
                   for i in range(self.num_groups)]
        for group_blocks, ids in zip(blocks, new_ids):
            group_blocks.extend(ids)
        return new_ids

    def share_prefix(self, request: Request, donor_id: str, num_blocks: int) -> int:
        """Give `request` the first `num_blocks` blocks of `donor_id` (per group) and
        return the number of tokens they hold. The caller marks them computed."""
        assert not any(self.req_to_blocks.get(request.request_id, [])), "request holds blocks"
        donor = self.req_to_blocks.get(donor_id)
        if not donor or len(donor[self.first_block_group]) < num_blocks or num_blocks <= 0:
            return 0
        shared = [list(group[:num_blocks]) for group in donor]
        for ids in shared:
            self.pool.share(ids)
        self.req_to_blocks[request.request_id] = shared
        return num_blocks * self.block_size

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            for group_blocks in blocks:
                self.pool.free(group_blocks)
