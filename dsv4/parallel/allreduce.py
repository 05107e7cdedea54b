"""The all-reduce of a tensor-parallel run, planned once (FlashInfer's plan / run split): which
implementation serves the small messages of decode (a few KB a layer: latency-bound) -- our
one-shot kernel over peer memory (`oneshot`), PyTorch's symmetric-memory one-shot or two-shot
(`symm_one_shot`, `symm_two_shot`) or NCCL --, where asked (large_bytes) our two-shot kernel
(`twoshot`) for the larger ones up to large_bytes (a prefill chunk's partials), while
torch.distributed (NCCL; gloo on the CPU) serves the rest (larger messages, other dtypes).
`plan_allreduce` tries them in PREFERENCE order (or only the one asked), every rank agreeing on
each step; `AllReduce.table()` says what serves and why each other one does not, like the
backend's table.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, field

import torch

from ..errors import DeviceError
from .group import TPGroup, Unavailable
from .nccl import NcclAllReduce

IMPLEMENTATIONS = ("oneshot", "symm_one_shot", "symm_two_shot", "nccl")
# the order tried when none is asked. Our kernel first: one launch, a push of the message and a
# flag to each peer, no second barrier; to be confirmed or reordered by the latencies of
# scripts/bench_comm.py in a CUDA graph on the GPU hosts (BENCHMARKS.md)
PREFERENCE = IMPLEMENTATIONS
MAX_BYTES = 64 << 10        # the fast path's largest message: 8 rows of a 4096-wide bf16 state
MAX_BYTES_LIMIT = 4 << 20   # what max_bytes may be (our kernel's buffer: 16 x max_bytes a rank)
LARGE = "twoshot"           # the implementation of the messages above max_bytes, where asked
# what large_bytes may be: twice a 4096-row chunk's [4096, 4096] bf16 partials (the two-shot's
# buffer: about 2 (N - 1) / N x large_bytes a rank)
LARGE_BYTES_LIMIT = 64 << 20


@dataclass
class AllReduce:
    """The planned all-reduce of one rank. Call it as `ar(x)` (in place) or `ar(x, out)`; every
    rank must make the same calls, in the same order, with the same shapes and dtypes.
    Capture-safe where the serving implementation is (all of them on CUDA)."""
    group: TPGroup
    fast: object | None             # the small-message implementation, None: NCCL serves all
    fallback: NcclAllReduce
    max_bytes: int
    choice: dict[str, str] = field(default_factory=dict)   # implementation -> outcome
    large: object | None = None     # the two-shot (messages the small path does not take), None:
    #                                 not asked or unavailable (NCCL serves them)

    @property
    def name(self) -> str:
        return self.fast.name if self.fast is not None else self.fallback.name

    def impl_for(self, nbytes: int, dtype: torch.dtype):
        """Who serves nbytes of dtype: the same on every rank (it goes by sizes, not addresses):
        the small-message implementation where it can, else the two-shot where it can, else
        NCCL."""
        for impl in (self.fast, self.large):
            if impl is not None and impl.supports(nbytes, dtype):
                return impl
        return self.fallback

    def sums_in_float32(self, nbytes: int, dtype: torch.dtype) -> bool:
        """Whether who serves nbytes of dtype sums the exact float32 values in rank order and
        rounds once to dtype (our one-shot and two-shot kernels; NCCL on two ranks), so that a
        bf16 message gives the bits of its float32 copy's all-reduce cast back; the others may
        round on the way. An implementation says so by a `sums_in_float32` attribute or
        method(dtype)."""
        says = getattr(self.impl_for(nbytes, dtype), "sums_in_float32", False)
        return bool(says(dtype) if callable(says) else says)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out (default x) = the sum over the ranks of x; returns out. x, out: contiguous, on the
        group's device, the same shape and dtype (out may be x)."""
        out = x if out is None else out
        if x.device != self.group.device or out.device != self.group.device:
            raise ValueError(f"all-reduce on {self.group.describe()}: x on {x.device}, out on "
                             f"{out.device}; expected both on {self.group.device}")
        if out.shape != x.shape or out.dtype != x.dtype:
            raise ValueError(f"all-reduce: out {tuple(out.shape)} {out.dtype} does not match x "
                             f"{tuple(x.shape)} {x.dtype}")
        if not (x.is_contiguous() and out.is_contiguous()):
            raise ValueError(f"all-reduce: x and out must be contiguous (x strides {x.stride()}, "
                             f"out strides {out.stride()}); pass x.contiguous()")
        if x.numel():
            self.impl_for(x.numel() * x.element_size(), x.dtype)(x, out)
        return out

    def post(self, x: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             out: torch.Tensor) -> bool:
        """out = hc_post(the sum over the ranks of x, res, post, comb) in one launch where the
        implementation serving x adds the mHC post itself (our one-shot: OneShotAllReduce.post);
        -> whether it did (False: nothing ran; the caller all-reduces and posts). It goes by
        sizes, dtypes and addresses: the same answer on every rank for the same calls."""
        if not x.numel() or x.device != self.group.device:
            return False
        impl = self.impl_for(x.numel() * x.element_size(), x.dtype)
        if not hasattr(impl, "supports_post") or not impl.supports_post(x, res, post, comb, out):
            return False
        impl.post(x, res, post, comb, out)
        return True

    def check(self) -> None:
        """Raise ParallelError if an earlier call gave up waiting for a rank (no sync)."""
        for impl in (self.fast, self.large):
            if impl is not None:
                impl.check()

    def close(self) -> None:
        """Free the buffers (collective: every rank calls it, after its last all-reduce)."""
        if self.fast is not None:
            self.fast.close()
            self.fast = None
        if self.large is not None:
            self.large.close()
            self.large = None

    def table(self) -> dict[str, str]:
        """What serves the all-reduce (`parallel.allreduce`) and each implementation's outcome."""
        g = self.group
        parts = [f"{self.fast.name} up to {self.max_bytes >> 10} KB"] if self.fast else []
        if self.large is not None:
            from .twoshot import size_text
            parts.append(f"{self.large.name} up to {size_text(self.large.max_bytes)}")
        head = ", ".join(parts + ["nccl above"]) if parts else "nccl"
        rows = {"parallel.group": f"{g.world_size} ranks, {g.backend}, timeout {g.timeout_s:g} s",
                "parallel.allreduce": head}
        rows.update({f"parallel.allreduce.{k}": v for k, v in self.choice.items()})
        return rows


def _unavailable(name: str, group: TPGroup, max_bytes: int) -> str | None:
    if name == "oneshot":
        from .oneshot import OneShotAllReduce
        return OneShotAllReduce.unavailable(group, max_bytes)
    if name == LARGE:
        from .twoshot import TwoShotAllReduce
        return TwoShotAllReduce.unavailable(group, max_bytes)
    from .symm import SymmMemAllReduce
    return SymmMemAllReduce.unavailable(group, max_bytes, name.removeprefix("symm_"))


def _build(name: str, group: TPGroup, max_bytes: int, pdl: bool, timeout_s: float):
    if name == "oneshot":
        from .oneshot import OneShotAllReduce
        return OneShotAllReduce(group, max_bytes, pdl=pdl, timeout_s=timeout_s)
    if name == LARGE:
        from .twoshot import TwoShotAllReduce
        return TwoShotAllReduce(group, max_bytes, pdl=pdl, timeout_s=timeout_s)
    from .symm import SymmMemAllReduce
    return SymmMemAllReduce(group, max_bytes, name.removeprefix("symm_"))


def _agreed(reasons: list) -> str | None:
    """One line for every rank's reason (None where all ranks can)."""
    bad = [(r, why) for r, why in enumerate(reasons) if why]
    if not bad:
        return None
    if len(bad) == len(reasons) and len({w for _, w in bad}) == 1:
        return bad[0][1]
    return "; ".join(f"rank {r}: {w}" for r, w in bad)


def _try(name: str, group: TPGroup, hosts: set, nbytes: int, pdl: bool, timeout_s: float):
    """Build `name` for messages up to nbytes where every rank can (collective): (it, None), or
    (None, why not) on every rank alike."""
    if len(hosts) > 1:
        return None, f"the ranks span {len(hosts)} hosts (peer memory is one host's)"
    # rank 0 first: its check may build the CUDA library (once, cached), the others load it
    if group.rank == 0:
        why = _unavailable(name, group, nbytes)
    group.barrier()
    if group.rank != 0:
        why = _unavailable(name, group, nbytes)
    why = _agreed(group.all_gather_object(why))
    if why is None:
        try:
            return _build(name, group, nbytes, pdl, timeout_s), None
        except Unavailable as e:
            why = str(e)
    return None, why


def plan_allreduce(group: TPGroup, max_bytes: int = MAX_BYTES, prefer: str | None = None,
                   pdl: bool = False, timeout_s: float | None = None,
                   large_bytes: int = 0) -> AllReduce:
    """Choose, once and on every rank alike, the implementation of messages up to max_bytes:
    the first of PREFERENCE (or only `prefer`) that every rank can run; with large_bytes > 0
    (0: off), our two-shot kernel for the messages above them up to large_bytes where every rank
    can run it (not when 'nccl' is asked for); NCCL (gloo) serves the rest. Collective
    (host-side, may sync: call it before capturing). pdl: our kernels launch with programmatic
    dependent launch (each waits for its predecessor before touching memory); timeout_s: how
    long our kernels wait for a rank (default: the group's timeout)."""
    if prefer is not None and prefer not in IMPLEMENTATIONS:
        raise DeviceError(f"all-reduce implementation {prefer!r}: expected one of "
                          f"{', '.join(IMPLEMENTATIONS)} (or none: the plan chooses)")
    if not 0 < max_bytes <= MAX_BYTES_LIMIT:
        raise DeviceError(f"max_bytes = {max_bytes}: expected 1 .. {MAX_BYTES_LIMIT >> 20} MiB "
                          f"(the fast path's buffers hold 16 messages a rank; larger ones go "
                          f"through NCCL anyway)")
    if large_bytes != 0 and not max_bytes < large_bytes <= LARGE_BYTES_LIMIT:
        raise DeviceError(f"large_bytes = {large_bytes}: expected 0 (off) or {max_bytes + 1} .. "
                          f"{LARGE_BYTES_LIMIT >> 20} MiB (above max_bytes = {max_bytes}: the "
                          f"two-shot serves what the small-message path does not; larger "
                          f"messages go through NCCL)")
    timeout_s = group.timeout_s if timeout_s is None else timeout_s
    if not timeout_s > 0:
        raise DeviceError(f"timeout_s = {timeout_s}: expected a positive number of seconds")
    order = PREFERENCE if prefer is None else (prefer,)
    large_row = [LARGE] if large_bytes else []      # the table's row of it, before nccl's
    choice = {n: "not tried" for n in [*IMPLEMENTATIONS[:-1], *large_row, "nccl"]}
    fallback = NcclAllReduce(group)
    fast = large = None
    # peer memory is one host's: ranks on several (torchrun across nodes) all-reduce through NCCL
    hosts = set(group.all_gather_object(socket.gethostname())) if order != ("nccl",) else set()
    for name in order:
        if name == "nccl":
            break
        fast, why = _try(name, group, hosts, max_bytes, pdl, timeout_s)
        if fast is not None:
            choice[name] = f"chosen: {fast.describe()}"
            break
        choice[name] = f"unavailable: {why}"
    if prefer not in (None, "nccl") and fast is None:
        raise DeviceError(f"all-reduce implementation {prefer!r} is unavailable on "
                          f"{group.describe()}: {choice[prefer].removeprefix('unavailable: ')}. "
                          f"Ask for 'nccl' (always there) or let the plan choose")
    if large_bytes and order == ("nccl",):
        choice[LARGE] = "not tried: 'nccl' was asked for (NCCL serves every size)"
    elif large_bytes:
        # launched without PDL: inside a TP2 prefill the two-shot with PDL cost 73.7 ms TTFT, 64.6
        # without (8 Flash layers, 2x H100; BENCHMARKS.md, sixteenth session)
        large, why = _try(LARGE, group, hosts, large_bytes, False, timeout_s)
        choice[LARGE] = (f"chosen: {large.describe()}" if large is not None else
                         f"unavailable: {why}")
    choice["nccl"] = ("chosen: " if fast is None and large is None else "fallback: ") + \
        fallback.describe()
    return AllReduce(group, fast, fallback, fast.max_bytes if fast is not None else 0, choice,
                     large)
