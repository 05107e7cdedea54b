"""CUDAGraphDecoder: a model-agnostic decode step over segments, replayed from CUDA graphs
(one per segment, one per device run, or a device run in staged pieces) or run eagerly:
allocate -> warmup -> capture -> step -> close.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import torch

from graphs.buffers import PointerTable, StaticInputs, overlaps
from graphs.capture import Ranges, capture_unit
from graphs.errors import (DEFAULT_FIX_HINTS, BufferError, ConfigError, DebugPointerError,
                           GraphError, LifecycleError, ModeError, ReplayError)
from graphs.placement import (INPUT_STAGE, Op, Plan, Segment, by_device, copy_op, device_tag,
                              device_units, plan_handoffs)

MODES = ("auto", "graph", "eager")
GRANULARITIES = ("segment", "device", "staged")


class CUDAGraphDecoder:
    """Runs `segments` in order as one decode step, from CUDA graphs or eagerly.

    `inputs` are static tensors on the primary device that step(**values) fills; `outputs` are
    the tensors step() returns: views into static buffers, overwritten by the next step.
    """

    def __init__(self, segments: Sequence[Segment], inputs: Mapping[str, torch.Tensor],
                 outputs: Mapping[str, torch.Tensor], *, mode: str = "auto",
                 granularity: str = "segment", warmup_iters: int = 2,
                 reset_fn: Callable[[], None] | None = None, debug: bool = False,
                 nvtx_domain: str = "graphs", fix_hints: Sequence[str] = DEFAULT_FIX_HINTS):
        segments = tuple(segments)
        if not segments or not all(isinstance(s, Segment) for s in segments):
            raise ConfigError("segments must be a non-empty sequence of graphs.Segment")
        if mode not in MODES:
            raise ConfigError(f"mode={mode!r}; expected one of {MODES}")
        if granularity not in GRANULARITIES:
            raise ConfigError(f"granularity={granularity!r}; expected one of {GRANULARITIES}")
        if not isinstance(warmup_iters, int) or warmup_iters < 0:
            raise ConfigError(f"warmup_iters={warmup_iters!r}; expected an int >= 0")
        if reset_fn is not None and not callable(reset_fn):
            raise ConfigError("reset_fn must be callable or None")
        if isinstance(fix_hints, str) or not all(isinstance(h, str) for h in fix_hints):
            raise ConfigError(f"fix_hints={fix_hints!r}; expected a sequence of strings")
        self._segments = segments
        self._inputs = StaticInputs(inputs)
        self._outputs = MappingProxyType(dict(outputs))
        self._mode = self._resolve_mode(mode, segments)
        self._granularity = granularity
        self._warmup_iters = warmup_iters
        self._reset_fn = reset_fn
        self._debug = debug
        self._fix_hints = tuple(fix_hints)
        self._ranges = Ranges(nvtx_domain)
        # when True (set by profilers), each host-side call is also a torch.profiler range
        # named like its NVTX range, so traces can attribute kernels per segment; off by default
        # because record_function costs a few microseconds per call
        self.record_ranges = False
        self._plan: Plan | None = None
        self._units: list[list[int]] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pools: dict[torch.device, object] = {}
        self._events: dict[str, dict[torch.device, torch.cuda.Event]] = {}
        self._graphs: list[torch.cuda.CUDAGraph] = []
        self._eager_blocks: list = []
        self._graph_blocks: list = []
        self._carry_ops: dict[str, Op] = {}
        self._pointers: PointerTable | None = None
        self._capture_seconds: dict[str, float] = {}
        self._graph_bytes: dict[str, int] = {}
        self._state = "new"  # new -> allocated -> warm -> captured -> closed
        self._step_index = 0
        self._step_label: int | str = 0
        self._has_prev = False  # a step ran since the last warmup/capture (carries apply)

    # ----------------------------------------------------------------- properties
    @property
    def mode(self) -> str:
        return self._mode

    @property
    def granularity(self) -> str:
        return self._granularity

    @property
    def devices(self) -> list[torch.device]:
        if self._plan is not None:
            return list(self._plan.devices)
        return list(dict.fromkeys(s.device for s in self._segments))

    @property
    def placement(self) -> dict[str, torch.device]:
        devs = self._plan.placement if self._plan else [s.device for s in self._segments]
        return {s.name: d for s, d in zip(self._segments, devs)}

    @property
    def capture_seconds(self) -> dict[str, float]:
        return dict(self._capture_seconds)

    @property
    def graph_bytes(self) -> dict[str, int]:
        return dict(self._graph_bytes)

    @property
    def n_graphs(self) -> int:
        return len(self._graphs)

    @property
    def plan(self) -> Plan | None:
        """The hand-off plan (after allocate())."""
        return self._plan

    @property
    def steps_run(self) -> int:
        return self._step_index

    # ----------------------------------------------------------------- lifecycle
    def allocate(self) -> None:
        """Validate buffers and devices, plan hand-offs, create per-device streams, events and pools."""
        self._require_open()
        if self._state != "new":
            return
        plan = plan_handoffs(self._segments, self._inputs.tensors)
        self._check_outputs(plan)
        cuda = [d for d in plan.devices if d.type == "cuda"]
        for d in cuda:
            self._streams[d] = torch.cuda.Stream(device=d)
            for kind in ("start", "end", "peer"):
                self._events.setdefault(kind, {})[d] = torch.cuda.Event()
        self._inputs.allocate_staging()
        self._plan = plan
        self._ensure_pools()
        self._units = (device_units(self._segments, plan, self._granularity == "staged")
                       if self._granularity != "segment"
                       else [[i] for i in range(len(self._segments))])
        ops = []
        for i, s in enumerate(self._segments):
            ops += [copy_op(h) for h in plan.before[i]]
            dev = plan.placement[i]
            ops.append(Op(dev, s.name, s.fn, f"eager/{device_tag(dev)}/{s.name}"))
        self._eager_blocks = by_device(ops)
        self._carry_ops = {n: copy_op(h) for n, h in plan.carries.items()}
        zero = {str(d): 0 for d in plan.devices}
        self._capture_seconds = {k: 0.0 for k in zero}
        self._graph_bytes = dict(zero)
        if self._debug:
            self._pointers = PointerTable(self._pointer_entries())
        self._state = "allocated"

    def warmup(self) -> None:
        """Run the whole step eagerly `warmup_iters` times on the decoder's streams, then undo it.

        Triton kernels compile and cuBLAS workspaces appear here, never inside a capture. The
        static inputs are restored to their values before warm-up; model state is restored by
        `reset_fn`.
        """
        self._require_allocated()
        snap = self._inputs.snapshot()
        for k in range(self._warmup_iters):
            self._run_step({}, self._eager_blocks, f"{k} (warm-up)")
        self._inputs.restore(snap)
        if self._reset_fn is not None:
            self._reset_fn()
        self._has_prev = False
        if self._state == "allocated":
            self._state = "warm"

    def capture(self) -> None:
        """Capture each unit with its device current, on its stream, into its device's pool.

        Runs warmup() first if it has not run. Eager mode: a no-op recording zero cost.
        """
        self._require_allocated()
        if self._state == "captured":
            return
        if self._state == "allocated":
            self.warmup()
        self._check_pointers("capture")
        if self._mode == "eager":
            self._state = "captured"
            return
        plan, ops = self._plan, []
        self._ensure_pools()  # fresh ones after a failed capture
        try:
            for unit in self._units:
                dev = plan.placement[unit[0]]
                segs = [self._segments[i] for i in unit]
                label = segs[0].name if len(segs) == 1 else f"{segs[0].name}..{segs[-1].name}"
                inside = [h for i in unit for h in plan.before[i]
                          if not h.cross_device and self._granularity != "segment"]
                outside = [h for i in unit for h in plan.before[i] if h not in inside]
                fn = segs[0].fn if len(segs) == 1 and not inside else self._unit_fn(unit)
                cu = capture_unit(fn, name=label, device=dev, stream=self._streams[dev],
                                  pool=self._pools[dev], ranges=self._ranges,
                                  fix_hints=self._fix_hints)
                self._graphs.append(cu.graph)
                self._capture_seconds[str(dev)] += cu.seconds
                self._graph_bytes[str(dev)] += cu.pool_bytes
                nvtx = (f"replay/{device_tag(dev)}" if self._granularity == "device"
                        else f"replay/{device_tag(dev)}/{label}")
                ops += [copy_op(h) for h in outside]
                ops.append(Op(dev, label, cu.graph.replay, nvtx))
        except Exception:
            self._drop_graphs()
            raise
        self._graph_blocks = by_device(ops)
        self._state = "captured"
        if self._reset_fn is not None:
            self._reset_fn()
        self._has_prev = False

    def step(self, **host_inputs) -> Mapping[str, torch.Tensor]:
        """One decode step; returns `outputs` (views into static buffers, overwritten next step).

        `host_inputs` (ints, lists, arrays, tensors) replace static inputs for this step; inputs
        not given keep what the previous step's producers wrote. No host sync in graph mode:
        reading an output on the current stream is ordered after the step.
        """
        if self._mode == "graph":
            self._require_open()
            if self._state != "captured":
                raise LifecycleError(
                    "step() in graph mode before capture(). Fix: call allocate(), warmup(), "
                    "capture() first; escape hatch: eager_step(), or mode='eager'.")
            blocks = self._graph_blocks
        else:
            self._require_allocated()
            blocks = self._eager_blocks
        self._run_step(host_inputs, blocks, self._step_index)
        self._step_index += 1
        return self._outputs

    def eager_step(self, **host_inputs) -> Mapping[str, torch.Tensor]:
        """The same step run eagerly, in any mode (a per-call fallback; same outputs contract)."""
        self._require_allocated()
        self._run_step(host_inputs, self._eager_blocks, self._step_index)
        self._step_index += 1
        return self._outputs

    def close(self) -> None:
        """Drop every graph and pool together (idempotent); waits for this decoder's streams first."""
        if self._state == "closed":
            return
        for d in self._streams:
            try:
                torch.cuda.synchronize(d)  # in-flight replays must finish before the pool goes
            except Exception:  # a sticky CUDA error must not stop the teardown
                pass
        self._drop_graphs()
        self._inputs.release_staging()
        self._streams.clear()
        self._events.clear()
        self._eager_blocks, self._carry_ops = [], {}
        self._state = "closed"

    def __enter__(self) -> "CUDAGraphDecoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------- internals
    @staticmethod
    def _resolve_mode(mode: str, segments: Sequence[Segment]) -> str:
        if mode == "eager":
            return "eager"
        cuda_ok = torch.cuda.is_available()
        off_gpu = [s for s in segments if s.device.type != "cuda"]
        if mode == "graph":
            if not cuda_ok:
                raise ModeError(
                    f"mode='graph' needs CUDA, but torch.cuda.is_available() is False (torch "
                    f"{torch.__version__}). Fix: run on a machine with a CUDA GPU and a CUDA "
                    "build of torch; escape hatch: mode='eager' (or 'auto', which picks eager).")
            if off_gpu:
                raise ModeError(
                    f"mode='graph' needs every segment on a CUDA device; segment "
                    f"{off_gpu[0].name} is on {off_gpu[0].device}. Fix: place it on a cuda "
                    "device; escape hatch: mode='eager'.")
            return "graph"
        return "graph" if cuda_ok and not off_gpu else "eager"

    def _require_open(self) -> None:
        if self._state == "closed":
            raise LifecycleError("this CUDAGraphDecoder is closed (its graphs and pools are "
                                 "freed). Fix: build a new decoder.")

    def _require_allocated(self) -> None:
        self._require_open()
        if self._state == "new":
            raise LifecycleError("call allocate() first (then warmup() and capture() in graph "
                                 "mode); allocate() validates buffers and plans hand-offs.")

    def _check_outputs(self, plan: Plan) -> None:
        produced = list(self._inputs.tensors.values()) + [
            t for s in self._segments for t in s.writes.values()]
        for name, t in self._outputs.items():
            if not isinstance(t, torch.Tensor):
                raise BufferError(f"outputs[{name!r}] is a {type(t).__name__}, not a tensor")
            if not any(overlaps(t, p) for p in produced):
                raise BufferError(
                    f"outputs[{name!r}] is not (a view of) any input or segment write, so step() "
                    "would never update it. Fix: return a buffer some segment lists in writes.")

    def _pointer_entries(self):
        entries = [(f"inputs[{n}]", self._inputs.tensors, n) for n in self._inputs.tensors]
        for s in self._segments:
            entries += [(f"{s.name}.reads[{n}]", s.reads, n) for n in s.reads]
            entries += [(f"{s.name}.writes[{n}]", s.writes, n) for n in s.writes]
        return entries + [(f"outputs[{n}]", self._outputs, n) for n in self._outputs]

    def _check_pointers(self, when: int | str) -> None:
        if self._pointers is not None:
            moved = self._pointers.moved()
            if moved:
                raise DebugPointerError(when, moved)

    def _unit_fn(self, unit: list[int]) -> Callable[[], None]:
        """Device / staged granularity: same-device hand-offs and segment calls of one unit, in
        order."""
        plan, calls = self._plan, []
        for i in unit:
            calls += [h.run for h in plan.before[i] if not h.cross_device]
            calls.append(self._segments[i].fn)

        def run_unit() -> None:
            for call in calls:
                call()
        return run_unit

    def _ensure_pools(self) -> None:
        """One graph pool per CUDA device, created with that device current (graph mode only)."""
        if self._mode != "graph":
            return
        for d in self._streams:
            if d not in self._pools:
                with torch.cuda.device(d):
                    self._pools[d] = torch.cuda.graph_pool_handle()

    def _drop_graphs(self) -> None:
        for g in self._graphs:
            try:
                g.reset()
            except Exception:
                pass
        self._graphs.clear()
        self._pools.clear()
        self._graph_blocks = []

    def _run_step(self, host_inputs: Mapping[str, object], blocks, label: int | str) -> None:
        unknown = sorted(set(host_inputs) - set(self._inputs.tensors))
        if unknown:
            raise BufferError(f"step() got unknown input(s) {unknown}; the decoder's inputs are "
                              f"{self._inputs.names}. Fix: pass only those names.")
        self._check_pointers(f"step {label}")
        self._step_label = label
        cuda = bool(self._streams)
        if cuda:  # our streams start after the caller's work (and our previous step) per device
            for d, s in self._streams.items():
                ev = self._events["start"][d]
                ev.record(torch.cuda.current_stream(d))
                s.wait_event(ev)
        stage = [Op(self._plan.primary, INPUT_STAGE, _writer(self._inputs, n, v))
                 for n, v in host_inputs.items()]
        if self._has_prev:
            stage += [op for n, op in self._carry_ops.items() if n not in host_inputs]
        if stage:
            self._execute(by_device(stage))
        self._execute(blocks)
        if cuda:  # the caller's current stream (reading outputs) waits for our last work
            for d, s in self._streams.items():
                ev = self._events["end"][d]
                ev.record(s)
                torch.cuda.current_stream(d).wait_event(ev)
        self._has_prev = True

    def _execute(self, blocks) -> None:
        for dev, ops in blocks:
            stream = self._streams.get(dev)
            if stream is None:
                for op in ops:
                    self._run_op(op)
                continue
            with torch.cuda.device(dev), torch.cuda.stream(stream):
                for op in ops:
                    self._run_op(op)

    def _run_op(self, op: Op) -> None:
        if self.record_ranges and op.nvtx is not None:
            with torch.profiler.record_function(op.nvtx):
                self._run_op_inner(op)
        else:
            self._run_op_inner(op)

    def _run_op_inner(self, op: Op) -> None:
        if op.nvtx is not None:
            self._ranges.push(op.nvtx)
        try:
            if op.peer is None:
                op.run()
            else:
                # Cross-GPU hand-off: the destination stream waits on the source stream; torch
                # issues a peer copy on the source device's *current* stream with a two-way
                # barrier against the destination's, so make our source stream current too.
                src_stream, ev = self._streams[op.peer], self._events["peer"][op.peer]
                ev.record(src_stream)
                self._streams[op.device].wait_event(ev)
                with torch.cuda.stream(src_stream):
                    op.run()
        except GraphError:
            raise
        except Exception as e:
            raise ReplayError(self._step_label, op.label, op.device, e, self._fix_hints) from e
        finally:
            if op.nvtx is not None:
                self._ranges.pop()


def _writer(inputs: StaticInputs, name: str, value) -> Callable[[], None]:
    return lambda: inputs.write(name, value)
