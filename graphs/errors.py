"""Typed errors of the graph runtime; every message names the problem, the fix and the escape hatch.
Embedders pass their own wording of the fixes (`fix_hints`, e.g. "--max-seq-len 32768").
"""
from __future__ import annotations

from collections.abc import Sequence

DEFAULT_FIX_HINTS = ("reduce the context capacity", "run in eager mode")
LAUNCH_BLOCKING_ADVICE = (
    "rerun with CUDA_LAUNCH_BLOCKING=1 to find the kernel that failed (CUDA errors are reported "
    "asynchronously, often at a later step or at the next read of an output)"
)


def _numbered(hints: Sequence[str]) -> str:
    return " ".join(f"{i}) {h}" for i, h in enumerate(hints, 1))


class GraphError(RuntimeError):
    """Base of every error raised by `graphs`."""


class ConfigError(GraphError, ValueError):
    """A bad constructor argument (names the argument, the value and what is allowed)."""


class ModeError(GraphError):
    """A mode that cannot run here, e.g. mode="graph" without CUDA or with a CPU segment."""


class LifecycleError(GraphError):
    """A method called out of order (step() before capture(), anything after close())."""


class BufferError(GraphError):  # noqa: A001 - the contract's name; shadows the builtin only here
    """A static buffer that is on the wrong device, has the wrong shape, or is not a tensor."""


class PlanError(GraphError):
    """A hand-off that cannot be planned: a name nobody produces, or mismatched producer/reader."""


class CaptureError(GraphError):
    """Capturing one unit (a segment, or a device's run of segments) failed."""

    def __init__(self, device: object, segment: str, cause: BaseException | str,
                 fix_hints: Sequence[str] = DEFAULT_FIX_HINTS, memory: str | None = None):
        self.device, self.segment, self.cause = str(device), segment, cause
        what = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else cause
        mem = f" ({memory})" if memory else ""
        super().__init__(f"capture of segment {segment} on {device} failed: {what}{mem}. "
                         f"Fixes: {_numbered(fix_hints)}")


class ReplayError(GraphError):
    """A step failed while running (replaying or eagerly calling) one segment."""

    def __init__(self, step: int | str, segment: str, device: object, cause: BaseException | str,
                 fix_hints: Sequence[str] = DEFAULT_FIX_HINTS):
        self.step, self.segment, self.device, self.cause = step, segment, str(device), cause
        what = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else cause
        advice = (f" To locate it, {LAUNCH_BLOCKING_ADVICE}." if str(device).startswith("cuda")
                  else "")
        super().__init__(f"step {step} failed in segment {segment} on {device}: {what}.{advice} "
                         f"Fixes: {_numbered(fix_hints)}")


class DebugPointerError(GraphError):
    """Debug mode found a static buffer whose storage moved since capture (the graph reads stale memory)."""

    def __init__(self, when: str, moved: Sequence[tuple[str, int, int]]):
        self.when, self.moved = when, list(moved)
        shown = "; ".join(f"{label}: 0x{old:x} -> 0x{new:x}" for label, old, new in self.moved[:10])
        more = f" (and {len(self.moved) - 10} more)" if len(self.moved) > 10 else ""
        super().__init__(
            f"{when}: {len(self.moved)} static buffer(s) moved since capture: {shown}{more}. "
            "A captured graph keeps reading the old address. Fix: allocate every buffer before "
            "capture and update it in place (copy_/fill_), never rebind or .set_() it; or call "
            "close() and capture again after reallocating. Escape hatch: eager mode.")
