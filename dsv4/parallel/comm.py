"""The communicator a tensor-parallel model holds: this rank's place (rank, world, device) and the
two collectives its math calls, the planned all-reduce (allreduce.py: the layers' sums) and an
all-gather (the head's vocabulary rows). Given to the model at build (dsv4.runtime.build_model);
a one-process model has none.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .allreduce import AllReduce, plan_allreduce
from .group import TPGroup

# torch 2.13 renamed all_gather_into_tensor (the old name warns); older ones have only it
_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Communicator:
    """One rank's collectives. Every rank must make the same calls, in the same order, with the
    same shapes and dtypes. Capture-safe on CUDA (the all-reduce as planned, NCCL's all-gather)."""

    def __init__(self, group: TPGroup, allreduce: AllReduce):
        self.group, self.allreduce = group, allreduce

    @classmethod
    def plan(cls, group: TPGroup, **kw) -> "Communicator":
        """Plan the all-reduce (plan_allreduce(group, **kw): collective, before any capture)."""
        return cls(group, plan_allreduce(group, **kw))

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world(self) -> int:
        return self.group.world_size

    @property
    def device(self) -> torch.device:
        return self.group.device

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x (contiguous, on the group's device) = the sum over the ranks of x, in place."""
        return self.allreduce(x)

    def all_reduce_post(self, x: torch.Tensor, res: torch.Tensor, post: torch.Tensor,
                        comb: torch.Tensor, out: torch.Tensor) -> bool:
        """out = hc_post(the sum over the ranks of x, res, post, comb) in one launch where the
        all-reduce serving x can add the mHC post (AllReduce.post) -> whether it did."""
        return self.allreduce.post(x, res, post, comb, out)

    def sums_in_float32(self, x: torch.Tensor) -> bool:
        """Whether all_reduce(x) sums x's exact float32 values in rank order and rounds once
        (AllReduce.sums_in_float32): the same on every rank (it goes by size and dtype)."""
        return self.allreduce.sums_in_float32(x.numel() * x.element_size(), x.dtype)

    def all_gather(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, ...] (contiguous, the same shape on every rank) -> [world * n, ...]: every
        rank's x in rank order (into out if given)."""
        if out is None:
            out = torch.empty((self.world * x.shape[0], *x.shape[1:]), dtype=x.dtype,
                              device=x.device)
        try:
            _GATHER(out, x, group=self.group.pg)
        except RuntimeError as e:
            raise self.group.failed(f"all-gather of {tuple(x.shape)} {x.dtype}", e) from e
        return out

    def check(self) -> None:
        """Raise ParallelError if an earlier all-reduce gave up waiting for a rank (no sync)."""
        self.allreduce.check()

    def table(self) -> dict[str, str]:
        """What serves the collectives (AllReduce.table)."""
        return self.allreduce.table()

    def close(self) -> None:
        """Free the all-reduce's buffers (collective: every rank, after its last call)."""
        self.allreduce.close()
