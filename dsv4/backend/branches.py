"""Concurrent branches inside a captured decode step. A side CUDA stream per device forks from the
current stream and joins back, so independent kernels of a layer become parallel branches of the
CUDA graph: the shared expert beside routing and the routed experts, the compressors and the
indexer beside wq_b and attention prep (lanes 0 and 1), each mHC Sinkhorn beside its sublayer
(lane 2), the L2 prefetch of weights beside latency-bound kernels (lanes 3 and 4:
dsv4.backend.fused.prefetch). Only while a graph is being captured: replay pays nothing for it on the host, while an
eager step would pay stream switches and event records per branch, so eager runs keep one stream
(the same kernels, the same bits; tests/dsv4/kernels/test_decode_kernels.py::
test_pdl_and_branches_change_no_bit). Which branches are on is the backend's decision
(dsv4.backend: DSV4_OVERLAP=0 none, =moe only the named ones of attn, mhc, moe); each Branch gets
that set. Streams are made before capture (`prepare`): LANES side streams per device. (Side
streams at the highest priority, which the graph's kernel nodes keep, measured no faster: the
shared expert then streams inside up's window and up slows down by as much, BENCHMARKS.md.)"""
from __future__ import annotations

import contextlib

import torch

LANES = 5
_side: dict[torch.device, list] = {}


def prepare(device) -> None:
    """Create `device`'s side stream (a no-op off CUDA, or when it exists). Call before capture."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _side:
        _side[device] = [torch.cuda.Stream(device=device) for _ in range(LANES)]


class Branch:
    """Branch `name` (on when it is in `branches`: Backend.branches) forks at construction (or,
    with fork=False, where `b.fork()` is called: the side branch sees the main stream's work up
    to there), run the block under `with b.side():` on side stream
    `lane`, `b.join()` before anything consumes its results (join one branch before the next one
    on the same lane forks). Outside capture (or unprepared, or switched off) all are no-ops and
    the block runs in order on the current stream. Tensors the side branch reads or writes must
    stay referenced until the join (freed earlier, the allocator could hand their memory to a
    kernel the branch races with; `hold` them), and the main branch must not touch what the side
    branch writes before the join."""

    def __init__(self, t: torch.Tensor, name: str, branches: frozenset, when: bool = True,
                 lane: int = 0, fork: bool = True):
        dev = t.device
        self.on = (when and name in branches and t.is_cuda and dev in _side
                   and torch.cuda.is_current_stream_capturing())
        self._held, self.forked = [], False
        if self.on:
            self.main = torch.cuda.current_stream(dev)
            self.stream = _side[dev][lane]
            if fork:
                self.fork()

    def fork(self) -> None:
        """The side stream waits for the main stream's work so far (once, before side())."""
        if self.on and not self.forked:
            self.stream.wait_stream(self.main)
            self.forked = True

    def side(self):
        return torch.cuda.stream(self.stream) if self.on else contextlib.nullcontext()

    def wait_branch(self, other: "Branch") -> None:
        """The side branch waits for `other` branch's side work so far (another lane)."""
        if self.on and other.on:
            self.stream.wait_stream(other.stream)

    def hold(self, *tensors: torch.Tensor) -> None:
        """Keep tensors the side branch uses (and nothing else references) alive until the join."""
        if self.on:
            self._held.extend(tensors)

    def join(self) -> None:
        if self.on and self.forked:
            self.main.wait_stream(self.stream)
        self.on = False
        self._held.clear()
