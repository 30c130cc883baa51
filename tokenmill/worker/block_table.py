"""Per-row block ids of one KV cache group, in a preallocated numpy matrix."""
from __future__ import annotations

import numpy as np


class BlockTable:
    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int):
        self.block_size = block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req
        # Unused entries stay 0: the null block.
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)

    def add_row(self, block_ids: list[int], row: int) -> None:
        n = len(block_ids)
        self.block_table[row, :n] = block_ids
        self.block_table[row, n:] = 0
        self.num_blocks_per_row[row] = n

    def append_row(self, block_ids: list[int], row: int) -> None:
        if not block_ids:
            return
        start = self.num_blocks_per_row[row]
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise RuntimeError(f"row {row} needs {end} blocks, the table holds "
                               f"{self.max_num_blocks_per_req}")
        self.block_table[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end

    def move_row(self, src: int, dst: int) -> None:
        n = self.num_blocks_per_row[src]
        self.block_table[dst, :n] = self.block_table[src, :n]
        self.block_table[dst, n:] = 0
        self.num_blocks_per_row[dst] = n

    def swap_row(self, a: int, b: int) -> None:
        self.block_table[[a, b]] = self.block_table[[b, a]]
        self.num_blocks_per_row[[a, b]] = self.num_blocks_per_row[[b, a]]

    def clear_row(self, row: int) -> None:
        self.block_table[row] = 0
        self.num_blocks_per_row[row] = 0
