"""Decode benchmark: a preset's real shapes on device-generated weights, state filled to a context,
eager vs CUDA graphs timed with CUDA events against the byte floor measured in the same process;
with --prefill and --speculative also the prefill (dsv4.bench.prefill) and speculative
(dsv4.bench.speculative) measurements on the same model.

Method and result rows: BENCHMARKS.md. Entry point: `main(argv)` (`dsv4 bench`, scripts/bench.py).
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch

from graphs import CUDAGraphDecoder

from ..backend.binding import bind
from ..errors import DeviceError, InputError
from ..model.transformer import Transformer
from ..runtime.build import build_model
from ..runtime.config import (
    DTYPES,
    PREFILL_GRAPHS_EXPECTED,
    RuntimeConfig,
    prefill_graphs_ok,
    resolve_devices,
)
from ..runtime.passes import build_segments
from ..runtime.sampling import SamplingParams
from ..runtime.session import Session
from ..weights.device_weights import DeviceWeights
from ..weights.presets import get_preset
from . import MIN_STEPS
from . import prefill as bench_prefill
from . import speculative as bench_spec
from . import timeline
from .common import (
    GIB,
    _log,
    _sync,
    _versions,
    copy_bandwidth,
    count_kernels,
    fill_state,
    time_steps,
)
from .memory import check_memory, token_bytes

CAPACITY_ALIGN = 256          # capacity = max(context + steps + warmup + 1, 256), rounded up to this
KERNELS_METHOD = ("CUDA kernel events (memcpy/memset excluded) of one profiled step, minus those of "
                  "one profiled step of an embed+head-only decoder in the same mode, / layers")
EXTRAPOLATION = ("(step - head/embed) / layers x full_layers + head/embed; head/embed timed with an "
                 "embed+head-only decoder in the same mode; layer mix of the measured prefix")


def capacity_for(context: int, steps: int, warmup: int) -> int:
    need = max(context + steps + warmup + 1, CAPACITY_ALIGN)
    return -(-need // CAPACITY_ALIGN) * CAPACITY_ALIGN


def checked_capacity(args, cfg, prompts: list) -> int:
    """The cache capacity of a run at --context and of prompts of these lengths (prefill, the
    speculative bench's), or InputError where it passes the model's positions."""
    cap = capacity_for(max([args.context] + prompts), args.steps, args.warmup)
    if cap > cfg.max_position_embeddings:
        what = f"--context {args.context}" + (f" (and prompts of up to {max(prompts)} tokens)"
                                              if prompts else "")
        raise InputError(f"{what} + steps + warmup needs capacity {cap}, above the model's "
                         f"{cfg.max_position_embeddings} positions; lower "
                         f"{'them' if prompts else '--context'}")
    return cap


def _stats(ms: list[float]) -> dict:
    med = statistics.median(ms)
    return {"ms_per_token": med, "spread_ms": [min(ms), max(ms)], "tokens_per_s": 1e3 / med}


def measure(model: Transformer, mode: str, granularity: str, context: int, steps: int,
            warmup: int, seed: int, kernels: bool, trace: str | None = None, log=_log,
            meet=None, step_events: dict | None = None) -> dict:
    """One (mode, granularity): decoder over the model at position `context`, warmed up, timed;
    `log` takes the profiled step's lines (a tensor-parallel rank other than 0: none); `meet`,
    a tensor-parallel group's barrier, starts every rank's profiled step together. With
    `step_events` (a dict), where a step is profiled, its kernels go there: `events` [(start us,
    end us, name)] after `origin_ns`, the profile's start on the host clock (a tensor-parallel
    rank's, for dsv4.bench.comm_skew)."""
    devices = list(dict.fromkeys([model.head_device, *model.placement]))
    sess = Session(model, SamplingParams(), mode=mode, granularity=granularity)
    he = None
    try:
        bufs, dec = sess.bufs, sess.decoder
        fill_state(model, context, seed)    # capture reset the state; fill it after
        at_context = lambda: bufs.pos.fill_(context)  # noqa: E731
        at_context()
        for _ in range(warmup):
            dec.step()
        at_context()
        res = {"mode": mode, "granularity": granularity if mode == "graph" else None,
               **_stats(time_steps(dec.step, steps, devices))}
        at_context()    # the capture's warm-up below writes out_ids[pos + 1]: stay in range
        segs = build_segments(model, bufs, SamplingParams())
        he = CUDAGraphDecoder([s for s in segs if not s.name.startswith("layer")],
                              inputs={"token": bufs.token, "pos": bufs.pos},
                              outputs={"logits": bufs.logits}, mode=mode, granularity=granularity)
        he.allocate()
        if mode == "graph":
            he.capture()
        at_context()
        for _ in range(min(warmup, 3)):
            he.step()
        at_context()
        res["head_embed_ms"] = statistics.median(time_steps(he.step, steps, devices))
        res["per_layer_ms"] = (res["ms_per_token"] - res["head_embed_ms"]) / model.cfg.n_layers
        res["kernels_per_step"] = res["kernels_head_embed"] = res["kernels_per_layer"] = None
        res["timeline"] = None
        if kernels and model.head_device.type == "cuda":
            at_context()
            top: dict = {}
            suffix = f"-{granularity}" if mode == "graph" else ""
            events: list = []
            origin: list = []
            total = count_kernels(dec.step, devices, top, trace and f"{trace}-{mode}{suffix}.json",
                                  events, meet, origin)
            if step_events is not None:
                step_events.update(origin_ns=origin[0], events=[e[1:] for e in events])
            res["top_kernels"] = sorted(([k, n, round(us, 1)] for k, (n, us) in top.items()),
                                        key=lambda r: -r[2])[:20]
            for k, n, us in res["top_kernels"][:12]:
                log(f"{mode}/{granularity}: {us:9.1f} us {n:5d}x {k}")
            res["timeline"] = timeline.analyze(events, model.cfg.n_layers)
            log(f"{mode}/{granularity}: {timeline.format_line(res['timeline'])}")
            at_context()
            res["kernels_head_embed"] = count_kernels(he.step, devices, meet=meet)
            res["kernels_per_step"] = total
            if total:
                res["kernels_per_layer"] = (total - res["kernels_head_embed"]) / model.cfg.n_layers
        graph = mode == "graph"
        res["capture_s"] = {d: round(s, 3) for d, s in dec.capture_seconds.items()} if graph else None
        res["graph_bytes"] = dict(dec.graph_bytes) if graph else None
        res["capture_wall_s"] = sess.capture_s if graph else None
        return res
    finally:
        if he is not None:
            he.close()
        sess.close()


# ---- the run ----------------------------------------------------------------------------------

def run(args, command: str = "") -> dict:
    """The whole benchmark for parsed `args` (dsv4.cli.bench); returns the report (JSON-ready)."""
    devices = [torch.device(d) for d in resolve_devices(args.device)]
    on_cuda = devices[0].type == "cuda"
    modes, grans, lengths, notes = _plan(args, on_cuda)
    full, cfg = get_preset(args.preset), get_preset(args.preset, args.layers)
    spec_len = [bench_spec.PROMPT + args.spec_tokens + 2] if args.speculative else []
    cap = checked_capacity(args, cfg, lengths + spec_len)
    dtype = DTYPES[args.dtype]
    meta = Transformer(full, RuntimeConfig(cap, dtype, ("meta",)))   # sizes only, no memory
    placement, est = check_memory(meta, cfg.n_layers, devices, int(args.reserve_gib * GIB), cap)
    bw = {str(d): copy_bandwidth(d) for d in devices if d.type == "cuda"}
    if bw:
        _log("copy bandwidth " + ", ".join(f"{d} {v:.3f} TB/s" for d, v in bw.items()))
    model = build_model(cfg, RuntimeConfig(cap, dtype, tuple(devices), mtp=args.speculative),
                        placement)
    t0 = time.perf_counter()
    model.load(DeviceWeights(cfg, args.seed))
    _sync(devices)
    load_s = time.perf_counter() - t0
    _log(f"generated {model.weight_bytes() / GIB:.2f} GiB of weights in {load_s:.1f} s")
    breakdown = token_bytes(model, args.context)
    nbytes = sum(breakdown.values())
    copy = bw.get(str(devices[0]))
    floor = nbytes / (copy * 1e12) * 1e3 if copy else None

    runs = _decode_runs(args, model, [] if args.no_decode else modes, grans, floor)
    partial = cfg.n_layers < full.n_layers
    ext = None
    if partial:
        fbytes = sum(token_bytes(meta, args.context).values())
        ffloor = fbytes / (copy * 1e12) * 1e3 if copy else None
        for r in runs:
            r["extrapolated_ms"] = r["per_layer_ms"] * full.n_layers + r["head_embed_ms"]
        ext = {"method": EXTRAPOLATION, "layers": full.n_layers, "bytes_per_token": fbytes,
               "floor_ms": ffloor}
    graph = next((r for r in runs if r["mode"] == "graph"), None)
    graph_ms = graph["ms_per_token"] if graph else None
    prefill = _prefill_runs(args, model, lengths, copy, graph_ms) if lengths else None
    spec = None
    if args.speculative:
        spec = bench_spec.run(model, args.context, args.seed, graph_ms, _log,
                              reps=min(bench_spec.REPS, args.steps), n_new=args.spec_tokens,
                              kernels=not args.no_kernels,
                              granularity=graph["granularity"] if graph else grans[0])
    layers = None
    if args.layer_kernels:
        if not on_cuda:
            raise DeviceError("--layer-kernels needs a CUDA device")
        layers = _layer_kernel_runs(model, args, bw)
    spans = {}
    for l, d in enumerate(placement):
        spans.setdefault(str(d), [l, l])[1] = l
    report = {"preset": args.preset, "layers": cfg.n_layers, "full_layers": full.n_layers,
              "partial": partial, "devices": [str(d) for d in devices], "layers_on": spans,
              "context": args.context, "capacity": cap, "steps": args.steps,
              "warmup": args.warmup, "dtype": args.dtype, "seed": args.seed, "mode": args.mode,
              "granularity": args.granularity, "bytes_per_token": nbytes,
              "bytes_breakdown": breakdown, "floor_ms": floor, "copy_TBps": copy,
              "copy_TBps_per_device": bw or None, "kernels_per_layer_method": KERNELS_METHOD,
              **_headline(runs, ext), "runs": runs, "extrapolated": ext,
              "memory_estimate_bytes": est, "load_s": load_s,
              "peak_bytes": {str(d): torch.cuda.max_memory_allocated(d) for d in devices}
              if on_cuda else None,
              **_versions(devices), "command": command,
              "valid": on_cuda and args.steps >= MIN_STEPS, "notes": notes,
              "layer_kernels": layers}
    if prefill is not None:
        report.update(prefill)
    if spec is not None:
        report.update(spec)
    return report


def _plan(args, on_cuda: bool) -> tuple[list, list, list, list]:
    """The checked flags -> (modes, graph granularities, prefill lengths, notes)."""
    modes = ["eager", "graph"] if args.mode == "both" else [args.mode]
    grans = {"both": ["segment", "device"], "all": ["segment", "device", "staged"]}.get(
        args.granularity, [args.granularity])
    notes = []
    if "graph" in modes and not on_cuda:
        if args.mode == "graph":
            raise DeviceError("--mode graph needs CUDA devices; use --mode eager or --device cuda:0")
        modes = ["eager"]
        notes.append("graph mode needs CUDA: not measured")
    for flag, v, lo in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0),
                        ("--context", args.context, 1), ("--spec-tokens", args.spec_tokens, 2),
                        ("--layer-rows", args.layer_rows, 1)):
        if v < lo:
            raise InputError(f"{flag} {v}: must be >= {lo}")
    if args.layer_rows > 1 and not args.layer_kernels:
        raise InputError(f"--layer-rows {args.layer_rows}: the rows of the --layer-kernels step; "
                         f"add --layer-kernels")
    if args.steps < MIN_STEPS:
        notes.append(f"--steps {args.steps} < {MIN_STEPS}: not a figure for BENCHMARKS.md")
    if not on_cuda:
        notes.append("CPU run: perf_counter timing, no copy bandwidth, floor or kernel counts")
    lengths = _lengths(args.prefill)
    if args.prefill_reps < 1 or (args.prefill_chunk is not None and args.prefill_chunk < 1):
        raise InputError("--prefill-reps and --prefill-chunk must be >= 1")
    g = args.prefill_graphs
    if not prefill_graphs_ok(g) or (g and not lengths):
        raise InputError(f"--prefill-graphs {g}: {PREFILL_GRAPHS_EXPECTED}, with --prefill")
    return modes, grans, lengths, notes


def _decode_runs(args, model: Transformer, modes: list, grans: list, floor) -> list[dict]:
    """One decode measurement per mode (and graph granularity)."""
    runs = []
    for mode in modes:
        for g in grans if mode == "graph" else grans[:1]:
            _log(f"measuring {mode}" + (f"/{g}" if mode == "graph" else ""))
            r = measure(model, mode, g, args.context, args.steps, args.warmup, args.seed,
                        kernels=not args.no_kernels, trace=args.trace)
            r["ratio_to_floor"] = r["ms_per_token"] / floor if floor else None
            runs.append(r)
    return runs


def _prefill_runs(args, model: Transformer, lengths: list, copy, graph_ms) -> dict:
    """The prefill measurement of each prompt length (and the chunk graphs, when asked)."""
    with _prefill_kernels(model, args.prefill_kernels == "on"):
        pg = None
        if args.prefill_graphs:
            from ..runtime.prefill_graphs import PrefillGraphs
            _log(f"capturing prefill chunk graphs up to {args.prefill_graphs} tokens")
            pg = model.prefill_graphs = PrefillGraphs(model, args.prefill_graphs)
            _log("chunk graph replay / eager ms (measured when built): " + ", ".join(
                f"{S}: {pg.replay_ms[S]:.1f} / {pg.eager_ms[S]:.1f}" for S in pg.chunks))
        prefill = bench_prefill.run(model, lengths, args.prefill_reps, args.seed,
                                    args.prefill_chunk, copy, graph_ms, _log,
                                    args.prefill_profile)
        model.prefill_graphs = None
    prefill["prefill_kernels"] = args.prefill_kernels
    prefill["prefill_graphs"] = (None if pg is None else
                                 {"max_rows": pg.max_rows, "max_prompt": pg.max_prompt,
                                  "capture_s": pg.capture_s, "graph_bytes": pg.graph_bytes(),
                                  "built_replay_ms": pg.replay_ms,
                                  "built_eager_ms": pg.eager_ms})
    return prefill


def _layer_kernel_runs(model: Transformer, args, bw: dict) -> list[dict]:
    """--layer-kernels: the first layer of each kind, its kernels alone and whole."""
    from . import layer_kernels as lk
    out = []
    fill_state(model, args.context, args.seed)
    for l in lk.representative_layers(model):
        _log(f"layer {l}: each kernel alone, then the layer whole")
        rep = lk.layer_kernels(model, l, args.context, bw[str(model.layers[l].device)],
                               rows=args.layer_rows)
        out.append(rep)
        for line in lk.format_rows(rep):
            _log(line)
    return out


@contextlib.contextmanager
def _prefill_kernels(model: Transformer, on: bool):
    """The prefill measurement with the prefill kernels on or off (--prefill-kernels: the model's
    backend with DSV4_PREFILL_KERNELS so set); the model's own backend again afterwards."""
    prior = model.binding.options
    bind(model, prior.replace(prefill_kernels=on))
    try:
        yield
    finally:
        bind(model, prior)


def _lengths(text: str | None) -> list[int]:
    if text is None:
        return []
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise InputError(f"--prefill {text!r}: expected comma-separated token counts") from None
    if not out or min(out) < 1:
        raise InputError(f"--prefill {text!r}: lengths must be >= 1")
    return out


def _headline(runs: list[dict], ext: dict | None) -> dict:
    """Top-level figures: eager, and the first graph granularity (all of them under
    per_granularity when more than one was measured)."""
    eager = next((r for r in runs if r["mode"] == "eager"), None)
    graphs = [r for r in runs if r["mode"] == "graph"]
    graph = graphs[0] if graphs else None
    pick = lambda r, k: r[k] if r is not None else None  # noqa: E731
    out = {"eager_ms_per_token": pick(eager, "ms_per_token"),
           "graph_ms_per_token": pick(graph, "ms_per_token")}
    for k in ("tokens_per_s", "spread_ms", "ratio_to_floor", "kernels_per_layer"):
        out[k] = {"eager": pick(eager, k), "graph": pick(graph, k)}
    out["capture_s"], out["graph_bytes"] = pick(graph, "capture_s"), pick(graph, "graph_bytes")
    keys = ("ms_per_token", "spread_ms", "tokens_per_s", "ratio_to_floor", "kernels_per_layer",
            "capture_s", "graph_bytes")
    out["per_granularity"] = ({r["granularity"]: {k: r[k] for k in keys} for r in graphs}
                              if len(graphs) > 1 else None)
    if ext is not None:
        for name, r in (("eager", eager), ("graph", graph)):
            ms = pick(r, "extrapolated_ms")
            ext[f"{name}_ms_per_token"] = ms
            ext.setdefault("ratio_to_floor", {})[name] = (
                ms / ext["floor_ms"] if ms is not None and ext["floor_ms"] else None)
    return out


# ---- output -----------------------------------------------------------------------------------

def title_line(rep: dict, where: str) -> str:
    """The first line of a report's table: the model, `where` it ran, the context, the steps."""
    part = " (partial)" if rep["partial"] else ""
    return (f"dsv4 bench: {rep['preset']} {rep['layers']}/{rep['full_layers']} layers{part} | "
            f"{where} | context {rep['context']} | {rep['dtype']} | median of {rep['steps']} steps")


def format_table(rep: dict) -> str:
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    lines = [title_line(rep, f"{','.join(rep['devices'])} ({rep['gpu_name'] or 'cpu'})"),
             f"bytes/token {rep['bytes_per_token'] / 1e9:.3f} GB | copy "
             f"{f(rep['copy_TBps'], '.3f')} TB/s | floor {f(rep['floor_ms'], '.3f')} ms",
             f"{'run':<15}{'ms/token':>10}{'min-max':>19}{'tok/s':>9}{'x floor':>9}"
             f"{'kern/layer':>11}{'capture s':>10}{'graph MiB':>10}"]
    for r in rep["runs"]:
        name = r["mode"] + (f"/{r['granularity']}" if r["granularity"] else "")
        cap = sum(r["capture_s"].values()) if r["capture_s"] else None
        gmb = sum(r["graph_bytes"].values()) / 2**20 if r["graph_bytes"] else None
        lo, hi = r["spread_ms"]
        lines.append(f"{name:<15}{r['ms_per_token']:>10.3f}{f'{lo:.3f}-{hi:.3f}':>19}"
                     f"{r['tokens_per_s']:>9.1f}{f(r['ratio_to_floor'], '.2f'):>9}"
                     f"{f(r['kernels_per_layer'], '.1f'):>11}{f(cap, '.2f'):>10}"
                     f"{f(gmb, '.1f'):>10}")
    ext = rep["extrapolated"]
    if ext:
        runs = ", ".join(f"{r['mode']}" + (f"/{r['granularity']}" if r["granularity"] else "")
                         + f" {r['extrapolated_ms']:.3f} ms" for r in rep["runs"])
        lines.append(f"extrapolated to {ext['layers']} layers: {runs}; bytes/token "
                     f"{ext['bytes_per_token'] / 1e9:.3f} GB, floor {f(ext['floor_ms'], '.3f')} ms")
    if rep.get("prefill_runs"):
        lines += bench_prefill.format_rows(rep)
    if rep.get("layer_kernels"):
        from .layer_kernels import format_rows
        for lk in rep["layer_kernels"]:
            lines += format_rows(lk)
    lines += [f"note: {n}" for n in rep["notes"]]
    return "\n".join(lines)
