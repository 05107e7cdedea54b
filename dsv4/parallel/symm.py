"""The all-reduce through PyTorch's symmetric memory (torch.distributed._symmetric_memory, CUDA
backend): one buffer per dtype allocated with symm_mem.empty and rendezvoused over the group, then
`symm_mem::one_shot_all_reduce_copy_out` (one launch: copy in, barrier over the signal pads, every
rank reads every peer's buffer and sums) or `symm_mem::two_shot_all_reduce_out` (a copy in, then
each rank reduces 1/n and gathers the rest). Peer loads only, never the multimem ops (they need
NVLink multicast, kept off: group.MULTICAST_OFF).

The ops: one_shot_all_reduce(_out) and two_shot_all_reduce_ since torch 2.6 (pytorch#137472,
#137473), one_shot_all_reduce_copy(_out) since 2.8 (#150129); torch 2.13's schemas hold all of them
and two_shot_all_reduce_out (2.11 too, by PyTorch's sources of that time); each is looked up at run
time, and the plan says which one serves. The sum runs in the element dtype (bf16 rounds after
each add), in rank order 0..n-1 on every rank: the same bits everywhere. The barriers spin without
a timeout: a dead peer is caught by the launcher (or torchrun) ending every rank.
"""
from __future__ import annotations

import torch

from .group import TPGroup, Unavailable

DTYPES = (torch.bfloat16, torch.float32)      # what the symm_mem ops dispatch
OUT_WORLD_SIZES = (2, 4, 8)                   # two_shot_all_reduce_out's kernels (others: in place)


class SymmMemAllReduce:
    """out = the sum over the ranks of x (bf16 or float32, x.nbytes <= max_bytes and a multiple
    of 4 bytes); capture-safe (fixed buffers; the signal pads return to zero every call)."""

    def __init__(self, group: TPGroup, max_bytes: int, variant: str):
        import torch.distributed._symmetric_memory as symm_mem
        if variant not in ("one_shot", "two_shot"):
            raise ValueError(f"variant {variant!r}: expected 'one_shot' or 'two_shot'")
        self.group, self.max_bytes, self.variant = group, max_bytes, variant
        self.name = f"symm_{variant}"
        self.group_name = group.pg.group_name
        self.bufs: dict[torch.dtype, torch.Tensor] = {}
        err = None
        try:
            for dt in DTYPES:          # rendezvous is collective: every rank, the same order
                buf = symm_mem.empty(max_bytes // dt.itemsize, dtype=dt, device=group.device)
                symm_mem.rendezvous(buf, self.group_name)
                self.bufs[dt] = buf
        except RuntimeError as e:
            err = f"{type(e).__name__}: {e}"
        errs = [e for e in group.all_gather_object(err) if e]
        if errs:
            raise Unavailable(f"symmetric-memory rendezvous failed: {errs[0]}")
        self.backend = symm_mem.get_backend(group.device) or "CUDA"
        ops = torch.ops.symm_mem
        self._copy_out = getattr(ops, "one_shot_all_reduce_copy_out", None)
        self._two_out = (getattr(ops, "two_shot_all_reduce_out", None)
                         if group.world_size in OUT_WORLD_SIZES else None)

    @staticmethod
    def unavailable(group: TPGroup, max_bytes: int, variant: str = "one_shot") -> str | None:
        if group.device.type != "cuda":
            return "not a CUDA device"
        try:
            import torch.distributed._symmetric_memory  # noqa: F401
        except ImportError as e:
            return f"torch.distributed._symmetric_memory cannot be imported ({e})"
        op = "one_shot_all_reduce_out" if variant == "one_shot" else "two_shot_all_reduce_"
        if not hasattr(torch.ops.symm_mem, op):
            return f"torch {torch.__version__} has no torch.ops.symm_mem.{op}"
        return None

    def supports(self, nbytes: int, dtype: torch.dtype) -> bool:
        return dtype in self.bufs and nbytes <= self.max_bytes and nbytes % 4 == 0

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        ops = torch.ops.symm_mem
        buf = self.bufs[x.dtype][: x.numel()]
        xv, ov = x.view(-1), out.view(-1)
        if self.variant == "one_shot":
            # the copy_out op copies x into the buffer inside its kernel: one launch; it needs x
            # aligned like the buffer (16 bytes)
            if self._copy_out is not None and (x.storage_offset() * x.element_size()) % 16 == 0:
                self._copy_out(buf, xv, "sum", self.group_name, ov)
            else:
                buf.copy_(xv)
                ops.one_shot_all_reduce_out(buf, "sum", self.group_name, ov)
        elif self._two_out is not None:
            buf.copy_(xv)
            self._two_out(buf, "sum", self.group_name, ov)
        else:
            buf.copy_(xv)
            ops.two_shot_all_reduce_(buf, "sum", self.group_name)
            ov.copy_(buf)

    def check(self) -> None:
        """Nothing to read: the symm_mem barriers have no timeout of their own."""

    def close(self) -> None:
        self.bufs.clear()

    def describe(self) -> str:
        if self.variant == "one_shot":
            op = "one_shot_all_reduce_copy_out" if self._copy_out else "one_shot_all_reduce_out"
        else:
            op = "two_shot_all_reduce_out" if self._two_out else "two_shot_all_reduce_ + copy"
        return f"torch.ops.symm_mem.{op} ({self.backend} backend)"
