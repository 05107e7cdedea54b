"""The communicator a tensor-parallel model holds: this rank's place (rank, world, device) and the
collectives its math calls: the planned all-reduce (allreduce.py: the layers' sums), an all-gather
(the head's vocabulary rows; a prefill chunk's rows) and a reduce-scatter (a prefill chunk's
sums, split by rows). Given to the model at build (dsv4.runtime.build_model); a one-process model
has none.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .allreduce import AllReduce, plan_allreduce
from .group import TPGroup
from .nccl import NcclAllReduce

# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (the old names warn); older
# ones have only those
_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Communicator:
    """One rank's collectives. Every rank must make the same calls, in the same order, with the
    same shapes and dtypes. Capture-safe on CUDA (the all-reduce as planned, NCCL's all-gather
    and reduce-scatter)."""

    def __init__(self, group: TPGroup, allreduce: AllReduce):
        self.group, self.allreduce = group, allreduce
        self._nccl = NcclAllReduce(group)     # NCCL's rounding rule, for the reduce-scatter

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

    def reduce_scatter(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [world * n, ...] (contiguous, the same shape on every rank) -> [n, ...]: rows
        [rank * n, (rank + 1) * n) of the sum over the ranks of x (into out if given), through
        torch.distributed (NCCL, capture-safe; gloo on the CPU)."""
        if x.shape[0] % self.world:
            raise ValueError(f"reduce-scatter of {tuple(x.shape)} over {self.world} ranks: the "
                             f"rows must be a multiple of the ranks")
        if out is None:
            out = torch.empty((x.shape[0] // self.world, *x.shape[1:]), dtype=x.dtype,
                              device=x.device)
        try:
            _SCATTER(out, x, op=dist.ReduceOp.SUM, group=self.group.pg)
        except RuntimeError as e:
            raise self.group.failed(f"reduce-scatter of {tuple(x.shape)} {x.dtype}", e) from e
        return out

    def scatter_sums_in_float32(self, dtype: torch.dtype) -> bool:
        """Whether reduce_scatter of dtype sums the exact float32 values and rounds once (NCCL on
        two ranks: NcclAllReduce.sums_in_float32 says why), as an all-reduce of its float32 copy
        cast back would."""
        return self._nccl.sums_in_float32(dtype)

    def check(self) -> None:
        """Raise ParallelError if an earlier all-reduce gave up waiting for a rank (no sync)."""
        self.allreduce.check()

    def table(self) -> dict[str, str]:
        """What serves the collectives (AllReduce.table)."""
        return self.allreduce.table()

    def close(self) -> None:
        """Free the all-reduce's buffers (collective: every rank, after its last call)."""
        self.allreduce.close()
