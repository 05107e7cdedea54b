"""Profiling hooks for a decode session: NVTX ranges, torch.profiler traces + per-layer summary, and
cudaProfilerStart/Stop brackets for `nsys --capture-range=cudaProfilerApi`.

`--profile-steps A-B` selects decode steps A..B (inclusive). Without a profiler NVTX is a no-op;
the `nvtx` package is optional (missing on some GPU images).
"""
from __future__ import annotations

import contextlib
import json
import re
import time
from collections import defaultdict
from pathlib import Path

import torch

from .errors import InputError

PROFILES_DIR = Path(__file__).resolve().parents[1] / "profiles"
DOMAIN = "dsv4"

try:  # pragma: no cover - depends on the image
    import nvtx as _nvtx
except ImportError:  # pragma: no cover
    _nvtx = None


def nvtx_range(name: str):
    """An NVTX range in the dsv4 domain (no-op without the nvtx package)."""
    if _nvtx is None:
        return contextlib.nullcontext()
    return _nvtx.annotate(name, domain=DOMAIN)


def parse_steps(spec: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", spec or "")
    if not m or int(m.group(1)) > int(m.group(2)) or int(m.group(1)) < 1:
        raise InputError(f"--profile-steps {spec!r}: expected A-B with 1 <= A <= B (decode steps)")
    return int(m.group(1)), int(m.group(2))


class Profiler:
    """Context manager installed on a Session: starts/stops the chosen profiler around steps A..B."""

    def __init__(self, kind: str, steps: str, session, out_dir: Path | None = None):
        self.kind, self.session = kind, session
        self.first, self.last = parse_steps(steps) if kind != "none" else (0, -1)
        self.out_dir = Path(out_dir or PROFILES_DIR)
        self.summary_path = None
        self._prof = None
        cuda = session.model.head_device.type == "cuda"
        if kind == "nsys" and not cuda:
            raise InputError("--profile nsys needs CUDA; use --profile torch on the CPU")

    def __enter__(self):
        if self.kind != "none":
            self.session.step_hook = self._hook
        return self

    def _hook(self, step: int, before: bool) -> None:
        if before and step == self.first:
            self._start()
        elif not before and step == self.last:
            self._stop()

    def _start(self) -> None:
        if self.kind == "nsys":
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
        elif self.kind == "torch":
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.session.model.head_device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=acts)
            self._prof.__enter__()

    def _stop(self) -> None:
        if self.kind == "nsys":
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
        elif self.kind == "torch" and self._prof is not None:
            if self.session.model.head_device.type == "cuda":
                torch.cuda.synchronize()
            self._prof.__exit__(None, None, None)
            self._write_torch()
            self._prof = None

    def __exit__(self, *exc):
        if self._prof is not None or (self.kind == "nsys" and self.session.step_hook is not None):
            with contextlib.suppress(Exception):
                self._stop()
        self.session.step_hook = None
        return False

    def _write_torch(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        trace = self.out_dir / f"trace-{stamp}.json"
        self._prof.export_chrome_trace(str(trace))
        summary = per_segment_summary(self._prof, self.last - self.first + 1)
        summary["trace"] = str(trace)
        path = self.out_dir / f"summary-{stamp}.json"
        path.write_text(json.dumps(summary, indent=1))
        self.summary_path = str(path)


def per_segment_summary(prof, n_steps: int) -> dict:
    """Kernels and device time per segment (layer) per step, from `replay/.../<segment>` ranges.

    Device kernels are attributed to the innermost enclosing CPU range of the launch that issued
    them (torch.profiler links each kernel to its launching runtime call)."""
    kernels = defaultdict(int)
    gpu_us = defaultdict(float)
    events = list(prof.events())
    ranges = [e for e in events if e.name.startswith("replay/") or e.name.startswith("eager/")]
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        parent = getattr(e, "cpu_parent", None) or getattr(e, "parent", None)
        seg = None
        while parent is not None and seg is None:
            if parent.name.startswith(("replay/", "eager/")):
                seg = parent.name.split("/")[-1]
            parent = getattr(parent, "cpu_parent", None) or getattr(parent, "parent", None)
        seg = seg or "other"
        kernels[seg] += 1
        gpu_us[seg] += e.device_time if hasattr(e, "device_time") else e.cuda_time
    per = {k: {"kernels_per_step": kernels[k] / n_steps, "gpu_us_per_step": gpu_us[k] / n_steps}
           for k in sorted(kernels)}
    layers = [v for k, v in per.items() if k.startswith("layer")]
    return {"steps": n_steps, "segments": per, "n_ranges": len(ranges),
            "kernels_per_layer": (sum(v["kernels_per_step"] for v in layers) / len(layers))
            if layers else None,
            "gpu_us_per_layer": (sum(v["gpu_us_per_step"] for v in layers) / len(layers))
            if layers else None}
