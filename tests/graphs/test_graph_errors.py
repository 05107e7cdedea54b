"""Error messages name the problem, the fix and the escape hatch; the hierarchy is catchable."""
from __future__ import annotations

import torch

from graphs import (BufferError, CaptureError, ConfigError, DebugPointerError, GraphError,
                    LifecycleError, ModeError, PlanError, ReplayError)
from graphs.capture import _oom_in


def test_hierarchy():
    for cls in (BufferError, CaptureError, ConfigError, DebugPointerError, LifecycleError,
                ModeError, PlanError, ReplayError):
        assert issubclass(cls, GraphError)
    assert issubclass(GraphError, RuntimeError) and issubclass(ConfigError, ValueError)


def test_capture_error_quotes_the_embedders_fixes():
    e = CaptureError("cuda:1", "layer17", RuntimeError("boom"),
                     ("--max-seq-len 32768", "--mode eager"))
    assert str(e) == ("capture of segment layer17 on cuda:1 failed: RuntimeError: boom. "
                      "Fixes: 1) --max-seq-len 32768 2) --mode eager")
    assert (e.device, e.segment) == ("cuda:1", "layer17")


def test_capture_error_with_memory_and_default_fixes():
    e = CaptureError(torch.device("cuda:0"), "head", torch.OutOfMemoryError("CUDA out of memory"),
                     memory="free 0.10 of 79.10 GiB on cuda:0")
    msg = str(e)
    assert "OutOfMemoryError: CUDA out of memory (free 0.10 of 79.10 GiB on cuda:0)" in msg
    assert "1) reduce the context capacity 2) run in eager mode" in msg


def test_oom_is_found_through_a_chained_error():
    try:
        try:
            raise torch.OutOfMemoryError("oom")
        except Exception:
            raise RuntimeError("capture_end failed")
    except RuntimeError as outer:
        assert _oom_in(outer)
    assert not _oom_in(RuntimeError("x"))


def test_replay_error_on_cuda_advises_launch_blocking():
    e = ReplayError(12, "layer3", "cuda:1", RuntimeError("illegal memory access"),
                    ("--mode eager",))
    msg = str(e)
    assert msg.startswith("step 12 failed in segment layer3 on cuda:1: RuntimeError: illegal")
    assert "CUDA_LAUNCH_BLOCKING=1" in msg and "1) --mode eager" in msg
    assert (e.step, e.segment, e.device) == (12, "layer3", "cuda:1")


def test_debug_pointer_error_lists_moved_buffers():
    e = DebugPointerError("step 3", [(f"layer{i}.reads[h]", 16 * i + 16, 0) for i in range(12)])
    msg = str(e)
    assert msg.startswith("step 3: 12 static buffer(s) moved since capture: layer0.reads[h]: 0x10")
    assert "(and 2 more)" in msg and "in place" in msg and "eager" in msg
