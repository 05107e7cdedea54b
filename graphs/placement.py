"""Which segment runs on which device, and the hand-off copies between their static buffers:
planned once at allocate time (host work), then issued by the decoder eagerly or inside a graph.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from graphs.buffers import check_buffers, overlaps, same_buffer
from graphs.errors import ConfigError, ModeError, PlanError

INPUT_STAGE = "inputs"  # the producer name of the decoder's static inputs


@dataclass(frozen=True, eq=False)
class Segment:
    """One capturable unit: a callable over static buffers on one device.

    `fn` reads `reads` and writes `writes` in place and must be capture-safe on CUDA (no host
    sync, no data-dependent shapes, no first-call compilation). Compared by identity.
    """

    name: str                               # e.g. "layer17", "head" (NVTX ranges, errors)
    device: torch.device                    # cpu or cuda:i
    fn: Callable[[], None]
    reads: Mapping[str, torch.Tensor]       # named static buffers (on `device`) it reads
    writes: Mapping[str, torch.Tensor]      # named static buffers (on `device`) it writes
    group: str | None = None                # optional tag, e.g. the layer range

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"Segment.name must be a non-empty string; got {self.name!r}")
        try:
            object.__setattr__(self, "device", torch.device(self.device))
        except (TypeError, RuntimeError) as e:
            raise ConfigError(f"segment {self.name}: device {self.device!r} is not a device") from e
        if not callable(self.fn):
            raise ConfigError(f"segment {self.name}: fn must be callable; got {type(self.fn).__name__}")
        for kind in ("reads", "writes"):
            if not isinstance(getattr(self, kind), Mapping):
                raise ConfigError(f"segment {self.name}: {kind} must be a mapping name -> tensor")


@dataclass(frozen=True, eq=False)
class Handoff:
    """Copy `src` (written by `producer`) into `dst` (read by `consumer`) before the consumer runs."""

    name: str
    src: torch.Tensor
    dst: torch.Tensor
    producer: str   # a segment name, INPUT_STAGE, or "<segment> (previous step)"
    consumer: str   # a segment name, or INPUT_STAGE for the carry of an input

    @property
    def cross_device(self) -> bool:
        return self.src.device != self.dst.device

    def run(self) -> None:
        """dst <- src; asynchronous between CUDA devices, blocking when the host is involved."""
        gpu = self.src.device.type == "cuda" and self.dst.device.type == "cuda"
        self.dst.copy_(self.src, non_blocking=gpu)


@dataclass(frozen=True)
class Plan:
    """The hand-offs of one step: `before[i]` runs right before segment i; `carries[name]` refills
    input `name` from the previous step's producer when the caller passes no new value."""

    primary: torch.device
    devices: tuple[torch.device, ...]          # primary first, then in order of first use
    placement: tuple[torch.device, ...]        # resolved device of each segment
    before: tuple[tuple[Handoff, ...], ...]
    carries: Mapping[str, Handoff] = field(default_factory=dict)

    @property
    def n_copies(self) -> int:
        return sum(len(b) for b in self.before)


def resolve_device(device: torch.device) -> torch.device:
    """cuda without an index -> cuda:<current>; touches torch.cuda only for CUDA devices."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ModeError(f"device {device} needs CUDA, but torch.cuda.is_available() is False. "
                            "Fix: place the segment on cpu; escape hatch: mode='eager' on cpu.")
        if device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
    return device


def _check_match(name: str, src: torch.Tensor, dst: torch.Tensor, producer: str, consumer: str):
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise PlanError(
            f"hand-off of {name!r} from {producer} to {consumer}: {producer} writes "
            f"{tuple(src.shape)} {src.dtype} but {consumer} reads {tuple(dst.shape)} {dst.dtype}. "
            f"Fix: allocate both buffers with one BufferSpec (same shape and dtype).")
    if not same_buffer(src, dst) and overlaps(src, dst):
        raise PlanError(f"hand-off of {name!r} from {producer} to {consumer}: the buffers partly "
                        "overlap. Fix: use the same tensor for both, or disjoint tensors.")


def plan_handoffs(segments: Sequence[Segment], inputs: Mapping[str, torch.Tensor]) -> Plan:
    """Validate buffers and resolve, for every read, its latest earlier producer (see EMBEDDING.md).

    The source of segment i's read `name` is the last segment j < i writing `name`; else the
    input stage if `name` is an input; else the last writer of the previous step. Identical
    source and destination buffers need no copy; a copy already issued whose buffers nobody
    wrote since is not repeated.
    """
    names = [s.name for s in segments]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise PlanError(f"segment names must be unique; repeated: {dup}")
    devices = [resolve_device(s.device) for s in segments]
    for s, d in zip(segments, devices):
        check_buffers(f"segment {s.name}", "reads", s.reads, d)
        check_buffers(f"segment {s.name}", "writes", s.writes, d)
    primary = next(iter(inputs.values())).device if inputs else devices[0]
    order = [primary] + [d for d in devices if d != primary]
    all_devices = tuple(dict.fromkeys(order))

    last_writer: dict[str, int] = {}
    for i, s in enumerate(segments):
        for name in s.writes:
            last_writer[name] = i

    before: list[tuple[Handoff, ...]] = []
    live: list[Handoff] = []  # issued copies whose buffers nobody wrote since
    written: dict[str, int] = {}  # name -> latest segment index so far in this step
    for i, s in enumerate(segments):
        todo = []
        for name, dst in s.reads.items():
            if name in written:
                j = written[name]
                src, producer = segments[j].writes[name], segments[j].name
            elif name in inputs:
                src, producer = inputs[name], INPUT_STAGE
            elif name in last_writer:
                j = last_writer[name]
                src, producer = segments[j].writes[name], f"{segments[j].name} (previous step)"
            else:
                known = sorted(set(inputs) | set(last_writer))
                raise PlanError(
                    f"segment {s.name} reads {name!r} but no input and no segment writes it "
                    f"(produced names: {known}). Fix: add it to the decoder's inputs or to the "
                    "writes of the segment that fills it.")
            _check_match(name, src, dst, producer, s.name)
            if same_buffer(src, dst):
                continue
            if any(same_buffer(h.src, src) and same_buffer(h.dst, dst) for h in live):
                continue
            todo.append(Handoff(name, src, dst, producer, s.name))
        before.append(tuple(todo))
        live.extend(todo)
        outs = list(s.writes.values())
        live = [h for h in live if not any(overlaps(w, h.src) or overlaps(w, h.dst) for w in outs)]
        for name in s.writes:
            written[name] = i

    carries = {}
    for name, buf in inputs.items():
        if name in last_writer:
            j = last_writer[name]
            src, producer = segments[j].writes[name], f"{segments[j].name} (previous step)"
            _check_match(name, src, buf, producer, INPUT_STAGE)
            if not same_buffer(src, buf):
                carries[name] = Handoff(name, src, buf, producer, INPUT_STAGE)
    return Plan(primary, all_devices, tuple(devices), tuple(before), carries)


def balanced_placement(layer_bytes: Sequence[int], devices: Sequence, head_bytes: int = 0
                       ) -> list[torch.device]:
    """The device of each layer: contiguous layer ranges per device (one hand-off per boundary, not
    per layer) minimising the largest device's bytes; devices[0] also holds `head_bytes` (the
    embedding and head of a model whose inputs and head live on the primary device)."""
    devices = [torch.device(d) for d in devices]
    if not devices:
        raise ConfigError("balanced_placement needs at least one device")
    n, k = len(layer_bytes), len(devices)
    if k == 1 or n == 0:
        return [devices[0]] * n
    k = min(k, n)

    def fill(cap):          # greedy from the front: device index per layer, or None if > k devices
        out, d, load = [], 0, head_bytes
        for b in layer_bytes:
            if load + b > cap and load > (head_bytes if d == 0 else 0):
                d, load = d + 1, 0
                if d >= k:
                    return None
            out.append(d)
            load += b
        return out

    lo, hi = max(max(layer_bytes), head_bytes), head_bytes + sum(layer_bytes)
    while lo < hi:          # smallest feasible cap (integer bisection)
        mid = (lo + hi) // 2
        if fill(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    return [devices[i] for i in fill(lo)]


def device_units(segments: Sequence[Segment], plan: Plan, staged: bool = False
                 ) -> list[list[int]]:
    """Runs of consecutive segments on one device that can share one graph.

    Cross-device hand-offs stay outside graphs and are issued before the unit's replay, so a
    segment whose incoming cross-device copy would clobber a buffer an earlier segment of the
    run still uses starts a new run. staged: each run cut into pieces of STAGE_FIRST, then twice
    as many, ... segments (staged_pieces).
    """
    units: list[list[int]] = []
    for i, s in enumerate(segments):
        if units and plan.placement[units[-1][0]] == plan.placement[i]:
            run = [segments[k] for k in units[-1]]
            bufs = [t for r in run for t in (*r.reads.values(), *r.writes.values())]
            if not any(h.cross_device and any(overlaps(h.dst, t) for t in bufs)
                       for h in plan.before[i]):
                units[-1].append(i)
                continue
        units.append([i])
    return [p for u in units for p in staged_pieces(u)] if staged else units


STAGE_FIRST = 2


def staged_pieces(run: list[int]) -> list[list[int]]:
    """A run of segments cut into pieces of 2, 4, 8, ... (the last one what is left). A graph's
    launch costs the host time for each of its kernels before the device runs any of it, so one
    graph for a long run leaves the device idle at the start of a step the host waited for (the
    speculative step, a constrained token); in pieces that double, the device starts on the first
    while the host launches the next, each piece's launch shorter than the run of the piece
    before it, and a step has about log2(n) graph boundaries instead of n."""
    out, i, n = [], 0, STAGE_FIRST
    while i < len(run):
        out.append(run[i:i + n])
        i, n = i + n, 2 * n
    return out


@dataclass(frozen=True)
class Op:
    """One host-side call of a step: a hand-off copy, an eager segment call or a graph replay."""

    device: torch.device         # the stream it is issued on (a copy's CUDA end)
    label: str                   # segment / unit name for errors
    run: Callable[[], None]
    nvtx: str | None = None      # range around the host-side call
    peer: torch.device | None = None  # source device of a cross-GPU copy


def device_tag(device: torch.device) -> str:
    return f"dev{device.index}" if device.type == "cuda" else device.type


def copy_op(h: Handoff) -> Op:
    gpu = h.src.device.type == "cuda" and h.dst.device.type == "cuda"
    where = h.dst.device if h.dst.device.type == "cuda" else h.src.device
    return Op(where, h.consumer, h.run, peer=h.src.device if gpu and h.cross_device else None)


def by_device(ops: Sequence[Op]) -> list[tuple[torch.device, list[Op]]]:
    """Consecutive ops on one device share one device/stream context switch."""
    out: list[tuple[torch.device, list[Op]]] = []
    for op in ops:
        if out and out[-1][0] == op.device:
            out[-1][1].append(op)
        else:
            out.append((op.device, [op]))
    return out
