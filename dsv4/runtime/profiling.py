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

from ..errors import InputError

PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"   # the repository's profiles/
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

    def _decoders(self) -> list:
        spec = self.session.spec
        return [self.session.decoder] + (spec.decoders() if spec is not None else [])

    def _start(self) -> None:
        for d in self._decoders():
            d.record_ranges = True
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
        for d in self._decoders():
            d.record_ranges = False
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
        summary = per_segment_summary(trace, self.last - self.first + 1)
        summary["trace"] = str(trace)
        summary["backend"] = self.session.model.binding.table()   # which kernel ran which op
        path = self.out_dir / f"summary-{stamp}.json"
        path.write_text(json.dumps(summary, indent=1))
        self.summary_path = str(path)


def per_segment_summary(trace_path, n_steps: int) -> dict:
    """Kernels and device time per segment per step, from an exported torch.profiler chrome trace.

    Each host-side call of the decoder is a `replay/dev{d}/{segment}` (or `eager/...`) range
    (decoder.record_ranges). A GPU kernel belongs to the range enclosing the runtime call that
    launched it (cudaLaunchKernel or cudaGraphLaunch, matched by correlation id). On the CPU,
    where there are no kernels, top-level aten ops inside each range are counted instead."""
    events = [e for e in json.loads(Path(trace_path).read_text()).get("traceEvents", [])
              if e.get("ph") == "X"]
    ranges = sorted(((e["ts"], e["ts"] + e.get("dur", 0), e.get("tid"), e["name"].split("/")[-1])
                     for e in events if e.get("cat") == "user_annotation"
                     and e["name"].startswith(("replay/", "eager/"))), key=lambda r: r[1] - r[0])

    def segment_at(ts, tid):
        for lo, hi, t, name in ranges:          # narrowest first = innermost
            if t == tid and lo <= ts <= hi:
                return name
        return "other"

    runtime = {e.get("args", {}).get("correlation"): (e["ts"], e.get("tid"))
               for e in events if e.get("cat") == "cuda_runtime"}
    kernels, gpu_us = defaultdict(float), defaultdict(float)
    gpu = [e for e in events if e.get("cat") == "kernel"]
    for e in gpu:
        ts, tid = runtime.get(e.get("args", {}).get("correlation"), (None, None))
        seg = segment_at(ts, tid) if ts is not None else "other"
        kernels[seg] += 1
        gpu_us[seg] += e.get("dur", 0)
    unit = "kernels"
    if not gpu:                                  # CPU: top-level aten ops per range
        unit = "aten_ops"
        ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
        end = -1.0
        for e in ops:
            if e["ts"] >= end:                   # not nested in the previous top-level op
                kernels[segment_at(e["ts"], e.get("tid"))] += 1
                end = e["ts"] + e.get("dur", 0)
    per = {k: {f"{unit}_per_step": kernels[k] / n_steps, "gpu_us_per_step": gpu_us[k] / n_steps}
           for k in sorted(kernels)}
    layers = [v for k, v in per.items() if k.startswith("layer")]
    mean = (lambda key: sum(v[key] for v in layers) / len(layers)) if layers else (lambda key: None)
    return {"steps": n_steps, "unit": unit, "segments": per,
            "kernels_per_layer": mean(f"{unit}_per_step"), "gpu_us_per_layer": mean("gpu_us_per_step")}
