"""The all-reduce through torch.distributed: NCCL on CUDA (capture-safe: NCCL kernels inside a CUDA
graph), gloo on the CPU. The fallback of every plan and the path of messages too large or of a
dtype the peer-memory implementations do not take. Every rank gets the same bits (a ring or tree
reduces each element once and sends the result on), in NCCL's own order over ranks (not rank
order), which may change with the message size, the topology or the NCCL version.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .group import TPGroup


class NcclAllReduce:
    """out = the sum over the ranks of x (out may be x). Host: enqueues only on CUDA (errors reach
    the NCCL watchdog, which ends the process past the group's timeout); blocks on gloo."""
    name = "nccl"

    def __init__(self, group: TPGroup):
        self.group = group

    @staticmethod
    def unavailable(group: TPGroup, max_bytes: int) -> str | None:
        return None

    def supports(self, nbytes: int, dtype: torch.dtype) -> bool:
        return True

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if out is not x:
            out.copy_(x)
        try:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group.pg)
        except RuntimeError as e:
            raise self.group.failed(f"all-reduce of {tuple(x.shape)} {x.dtype}", e) from e

    def check(self) -> None:
        """Nothing to read: NCCL and gloo raise (or the watchdog ends the process) themselves."""

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return f"torch.distributed.all_reduce ({self.group.backend})"
