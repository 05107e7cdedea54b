"""What the benchmarks share: device syncs, copy bandwidth, CUDA-event timing of a step, kernel
counts from torch.profiler, the decode state filled to a context, logging and version stamps.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import statistics
import sys
import time

import torch

from ..model.transformer import Transformer
from ..weights.synthetic import tensor_seed

GIB = 2**30
COPY_BYTES = 2 * GIB          # copy-bandwidth buffer (read + write counted)
COPY_ITERS = 20
NOT_KERNELS = ("Memcpy", "Memset", "Event Sync", "Stream Sync", "Stream Wait", "Context Sync")


def _sync(devices) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def copy_bandwidth(device: torch.device, nbytes: int = COPY_BYTES, iters: int = COPY_ITERS) -> float:
    """Device-to-device copy bandwidth in TB/s: (read + write bytes) / median time of `iters`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    stream = torch.cuda.current_stream(device)
    for _ in range(3):
        dst.copy_(src)
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
           for _ in range(iters)]
    for a, b in evs:
        a.record(stream)
        dst.copy_(src)
        b.record(stream)
    torch.cuda.synchronize(device)
    ms = statistics.median(a.elapsed_time(b) for a, b in evs)
    del src, dst
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)   # peak_bytes then covers the model run only
    return 2 * nbytes / (ms * 1e-3) / 1e12


def fill_state(model: Transformer, context: int, seed: int) -> None:
    """Every layer's state as if `context` tokens had been decoded: window ring and compressed
    rows [0, context//r) (index cache rows [0, context//4)) ~ N(0, 1) in the activation dtype,
    compressor states finite N(0, 1). In place; the caller sets the position to `context`."""
    W = model.cfg.window_size
    gens: dict = {}
    for blk, st in zip(model.layers, model.states):
        dev = st.kv_cache.device
        if dev not in gens:
            gens[dev] = torch.Generator(device=dev).manual_seed(tensor_seed(seed, "bench.state"))
        gen = gens[dev]
        r = blk.ratio
        st.reset()
        st.kv_cache[:W].normal_(generator=gen)
        if r:
            st.kv_cache[W:W + min(context // r, st.kv_cache.shape[0] - W - 1)].normal_(generator=gen)
        if r == 4:
            st.index_cache[:min(context // 4, st.index_cache.shape[0] - 1)].normal_(generator=gen)
        for c in (st.compressor, st.index_compressor):
            if c is not None:
                c.kv.normal_(generator=gen)
                c.score.normal_(generator=gen)


def time_steps(step, n: int, devices) -> list[float]:
    """ms of each of n calls of step(): CUDA events around each on the head device's current
    stream (the decoder makes it wait for its work); perf_counter on the CPU."""
    hd = devices[0]
    if hd.type != "cuda":
        out = []
        for _ in range(n):
            t = time.perf_counter()
            step()
            out.append(1e3 * (time.perf_counter() - t))
        return out
    stream = torch.cuda.current_stream(hd)
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
           for _ in range(n)]
    _sync(devices)
    for a, b in evs:
        a.record(stream)
        step()
        b.record(stream)
    _sync(devices)
    return [a.elapsed_time(b) for a, b in evs]


STEP_MARK = "dsv4.profiled_step"


def kernel_events(prof, after: str | None = None) -> list:
    """The CUDA kernels of a torch.profiler run (memcpy, memset, syncs and the device side of a
    host range excluded); with `after`, only those that start once the host range of that name
    has begun (kernels and host ranges share the profiler's clock: a kernel cannot start before
    the host issues it). A host range shows on the device too (a user annotation, device type
    CUDA, spanning its kernels): never a kernel; nor are the other device-side annotations
    (NCCL's `nccl:all_reduce` beside its kernel doubled a TP prefill profile's NCCL time)."""
    ev = prof.events()
    t0 = None
    if after is not None:
        t0 = min((e.time_range.start for e in ev
                  if e.name == after and e.device_type != torch.autograd.DeviceType.CUDA),
                 default=None)
    return [e for e in ev
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(NOT_KERNELS)
            and not getattr(e, "is_user_annotation", False) and e.name != STEP_MARK
            and (t0 is None or e.time_range.start >= t0)]


def count_kernels(step, devices, top: dict | None = None, trace: str | None = None,
                  events: list | None = None, meet=None, origin: list | None = None) -> int:
    """CUDA kernels launched by one step() (memcpy/memset excluded), from torch.profiler; with
    `top`, also fills it with kernel name -> [launches, device µs] of that step; with `trace`,
    writes that step's Chrome trace there (kernels per stream with start and duration); with
    `events`, appends each kernel's (device, start µs, end µs, name) (dsv4.bench.timeline).
    `meet` (a tensor-parallel group's barrier) runs inside the profile just before the step, so
    every rank starts its profiled step together: the profiler's start-up takes each rank a
    different time, and a rank's all-reduces would otherwise count the wait for the slowest
    rank's start-up (its kernels are not the step's and are left out). With `origin`, appends
    the host-clock time the events' times count from (trace_origin_ns)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    _sync(devices)
    with torch.profiler.profile(activities=acts) as prof:
        if meet is not None:
            meet()
            _sync(devices)
        with torch.profiler.record_function(STEP_MARK):
            step()
        _sync(devices)
    if trace:
        prof.export_chrome_trace(trace)
    kernels = kernel_events(prof, after=STEP_MARK)
    if origin is not None:
        origin.append(trace_origin_ns(prof))
    if events is not None:
        events += [(e.device_index, float(e.time_range.start), float(e.time_range.end), e.name)
                   for e in kernels]
    if top is not None:
        for name, (n, us) in by_name(kernels, 60).items():
            t = top.setdefault(name, [0, 0.0])
            t[0] += n
            t[1] += us
    return len(kernels)


def trace_origin_ns(prof) -> int | None:
    """The time torch.profiler's event times count from, in ns on the host clock (Kineto puts a
    host's processes and their kernels on it): the ranks of one host compare their events with
    it (dsv4.bench.comm_skew). None where this torch's profiler does not say."""
    res = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    get = getattr(res, "trace_start_ns", None)
    return int(get()) if get is not None else None


def by_name(kernels, width: int) -> dict:
    """Kernel events -> {name cut to `width`: [launches, summed device µs]}."""
    out: dict = {}
    for e in kernels:
        k = out.setdefault(e.name[:width], [0, 0.0])
        k[0] += 1
        k[1] += getattr(e, "device_time", 0.0) or getattr(e, "cuda_time", 0.0)
    return out


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _versions(devices) -> dict:
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    cuda = [d for d in devices if d.type == "cuda"]
    names = ", ".join(dict.fromkeys(torch.cuda.get_device_name(d) for d in cuda)) if cuda else None
    return {"gpu_name": names, "torch": torch.__version__, "triton": triton,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def kernel_table(prof, width: int = 70) -> list:
    """The CUDA kernels of a torch.profiler run -> [name, launches, summed device ms] by time."""
    return sorted(([k, c, round(us / 1e3, 3)] for k, (c, us) in
                   by_name(kernel_events(prof), width).items()), key=lambda r: -r[2])
