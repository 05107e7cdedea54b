"""Concurrent branches inside a captured decode step. Side CUDA streams per device fork from the
current stream and join back, so independent kernels of a layer become parallel branches of the
CUDA graph: the shared expert beside routing and the routed experts, the compressors and the
indexer beside wq_b and attention prep (lane 0), each mHC Sinkhorn beside its sublayer (lane 1).
Only while a graph is being captured: replay pays nothing for it on the host, while an eager step
would pay stream switches and event records per branch, so eager runs keep one stream (the same
arithmetic, the same bits; tests/dsv4/test_kernels.py::test_pdl_and_branches_change_no_bit).
`DSV4_OVERLAP=0` captures without branches; `DSV4_OVERLAP=moe,attn` keeps only the named ones
(moe, attn, mhc). Streams are made before capture (`prepare`)."""
from __future__ import annotations

import contextlib
import os

import torch

SWITCH = "DSV4_OVERLAP"
LANES = 2        # side streams per device: branches on different lanes may overlap each other
_side: dict[tuple, torch.cuda.Stream] = {}


def prepare(device) -> None:
    """Create `device`'s side streams (a no-op off CUDA, or when they exist). Call before capture."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    for lane in range(LANES):
        if (device, lane) not in _side:
            _side[device, lane] = torch.cuda.Stream(device=device)


def enabled(name: str) -> bool:
    """Whether branch `name` is on under DSV4_OVERLAP (unset or "1": all, "0": none, else a list)."""
    v = os.environ.get(SWITCH, "1").strip()
    return v == "1" or (v != "0" and name in {n.strip() for n in v.split(",")})


class Branch:
    """Fork at construction, run the block under `with b.side():` on side stream `lane`, `b.join()`
    before anything consumes its results (a lane's branches must not interleave: join one before
    the next one on the same lane forks). Outside capture (or unprepared, or switched off) both
    are no-ops and the block runs in order on the current stream. Tensors the side branch writes
    must outlive the join (keep references) and must not be written by the main branch before it."""

    def __init__(self, t: torch.Tensor, name: str, when: bool = True, lane: int = 0):
        dev = t.device
        self.on = (when and t.is_cuda and (dev, lane) in _side and enabled(name)
                   and torch.cuda.is_current_stream_capturing())
        if self.on:
            self.main = torch.cuda.current_stream(dev)
            self.stream = _side[dev, lane]
            self.stream.wait_stream(self.main)

    def side(self):
        return torch.cuda.stream(self.stream) if self.on else contextlib.nullcontext()

    def keep(self, *tensors: torch.Tensor) -> None:
        """Hold main-stream tensors the side branch reads until the join: freed earlier, the
        allocator could hand their memory to a main-stream kernel the side branch races with."""
        if self.on:
            self._kept = tensors

    def join(self) -> None:
        if self.on:
            self.main.wait_stream(self.stream)
            self.on = False
            self._kept = ()
