"""Capture one unit into a CUDA graph: side-stream warm-up, capture on the device's own stream into
its pool, time and pool bytes measured; NVTX ranges (a no-op without the `nvtx` package); and a
CPU-side check that a step makes no host sync (find_host_syncs).
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from graphs.errors import DEFAULT_FIX_HINTS, CaptureError

try:  # the `nvtx` package is optional (absent on some GPU machines); torch's own nvtx raises on CPU
    import nvtx as _nvtx
except ImportError:  # pragma: no cover - depends on the environment
    _nvtx = None

GIB = 1024**3
# ops that read device values on the host (.item(), bool(), int() of a tensor) or size their
# output from data: a CUDA graph capture fails on them
HOST_SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
                 "aten::unique", "aten::_unique", "aten::_unique2", "aten::unique_dim",
                 "aten::unique_consecutive")


class Ranges:
    """Push/pop NVTX ranges in one domain; every call is a no-op when `nvtx` is not installed."""

    def __init__(self, domain: str):
        self._domain = _nvtx.get_domain(domain) if _nvtx is not None else None
        self._attrs: dict[str, object] = {}  # message -> registered attributes (cheap re-push)

    @property
    def enabled(self) -> bool:
        return self._domain is not None

    def push(self, message: str) -> None:
        if self._domain is None:
            return
        attrs = self._attrs.get(message)
        if attrs is None:
            attrs = self._attrs[message] = self._domain.get_event_attributes(message=message)
        self._domain.push_range(attrs)

    def pop(self) -> None:
        if self._domain is not None:
            self._domain.pop_range()


@dataclass
class CapturedUnit:
    """A captured graph with what capturing it cost."""

    graph: "torch.cuda.CUDAGraph"
    seconds: float      # host wall time of the capture
    pool_bytes: int     # growth of reserved memory on the device (the pool's new segments)


def _oom_in(e: BaseException | None) -> bool:
    seen = 0
    while e is not None and seen < 8:  # torch.cuda.graph.__exit__ may chain a second error
        if isinstance(e, torch.OutOfMemoryError):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def memory_note(device: torch.device) -> str | None:
    """'free X of Y GiB on cuda:i', or None when the driver cannot say."""
    try:
        free, total = torch.cuda.mem_get_info(device)
    except Exception:  # the context may be broken after the failure we are reporting
        return None
    return f"free {free / GIB:.2f} of {total / GIB:.2f} GiB on {device}"


def capture_unit(fn: Callable[[], None], *, name: str, device: torch.device,
                 stream: "torch.cuda.Stream", pool, ranges: Ranges, warmup_iters: int = 0,
                 fix_hints: Sequence[str] = DEFAULT_FIX_HINTS) -> CapturedUnit:
    """Capture `fn` on `device` (made current) and `stream` into `pool`; raise CaptureError.

    `warmup_iters` eager runs happen first on `stream` (a side stream): lazy initialisation
    (cuBLAS workspaces, Triton compilation) must never happen inside a capture. The decoder
    warms the whole step itself and passes 0. Nothing captured runs here.
    """
    with torch.cuda.device(device):
        if warmup_iters:
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(warmup_iters):
                    fn()
            torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.empty_cache()  # so the reserved growth below is this capture's pool alone
        reserved = torch.cuda.memory_reserved(device)
        graph = torch.cuda.CUDAGraph()
        ranges.push(f"capture/dev{device.index}/{name}")
        t0 = time.perf_counter()
        try:
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                fn()
        except Exception as e:
            memory = memory_note(device) if _oom_in(e) else None
            raise CaptureError(device, name, e, fix_hints, memory=memory) from e
        finally:
            ranges.pop()
        seconds = time.perf_counter() - t0
        grown = max(0, torch.cuda.memory_reserved(device) - reserved)
    return CapturedUnit(graph, seconds, grown)


def find_host_syncs(fn: Callable[[], object]) -> list[str]:
    """Run fn() once eagerly under the CPU profiler and list the ops in it that need a host sync
    ("aten::nonzero x3"); [] means none. Works without a GPU, e.g. on a step of a model you did
    not write (`find_host_syncs(dec.eager_step)`), before taking it to a capture. A proxy: it
    sees the ops of the device fn() ran on, and a few CUDA kernels sync where their CPU
    counterparts do not; capturing on the GPU under torch.cuda.set_sync_debug_mode("error")
    is the final word. fn() runs for real (a decode step advances its state).
    """
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    found = Counter(e.name for e in prof.events() if e.name in HOST_SYNC_OPS)
    return [f"{name} x{n}" for name, n in sorted(found.items())]
