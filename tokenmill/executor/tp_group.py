"""The tensor-parallel group: one gloo process group over 127.0.0.1, and the two
collectives the sharded model needs.

The group is built directly on a TCPStore (not torch.distributed's global default
group), so an engine can be shut down and another started in the same process.
A rank that dies makes the others' pending collective fail at once (gloo sees the
connection close); `timeout_s` bounds a collective whose peer hangs instead.
"""
from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPGroup:
    def __init__(self, rank: int, size: int, port: int, timeout_s: float = 300.0):
        self.rank, self.size = rank, size
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=timeout)
        self._pg = dist.ProcessGroupGloo(self._store, rank, size, timeout)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (every rank gets the same bits)."""
        self._pg.allreduce([x]).wait()
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise max of `x` over the ranks, in place (a row-parallel layer's
        per-row absmax at load: each rank holds a share of the row)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._pg.allreduce([x], opts).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank's `x` side by side along the last dim, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._pg.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)
