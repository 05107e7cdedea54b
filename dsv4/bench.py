"""Decode benchmark: a preset's real shapes on device-generated weights, state filled to a context,
eager vs CUDA graphs timed with CUDA events against the byte floor measured in the same process.

Method and result rows: BENCHMARKS.md. Entry point: `main(argv)` (scripts/bench.py).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import shlex
import statistics
import sys
import time

import torch

from graphs import CUDAGraphDecoder, balanced_placement

from . import bench_prefill, bench_spec
from .device_weights import DeviceWeights
from .errors import DeviceError, InputError, exit_code
from .generate import Session, resolve_devices
from .kernels import PREFILL_SWITCH
from .model import DTYPES, RuntimeConfig, Transformer
from .presets import PRESETS, get_preset
from .sampling import SamplingParams
from .segments import build_segments
from .synthetic import tensor_seed

GIB = 2**30
CAPACITY_ALIGN = 256          # capacity = max(context + steps + warmup + 1, 256), rounded up to this
MIN_STEPS = 50                # PERFORMANCE.md: median of >= 50 steps
COPY_BYTES = 2 * GIB          # copy-bandwidth buffer (read + write counted)
COPY_ITERS = 20
ATTN_LINEARS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
NOT_KERNELS = ("Memcpy", "Memset", "Event Sync", "Stream Sync", "Stream Wait", "Context Sync")
KERNELS_METHOD = ("CUDA kernel events (memcpy/memset excluded) of one profiled step, minus those of "
                  "one profiled step of an embed+head-only decoder in the same mode, / layers")
EXTRAPOLATION = ("(step - head/embed) / layers x full_layers + head/embed; head/embed timed with an "
                 "embed+head-only decoder in the same mode; layer mix of the measured prefix")


# ---- sizes ------------------------------------------------------------------------------------

def capacity_for(context: int, steps: int, warmup: int) -> int:
    need = max(context + steps + warmup + 1, CAPACITY_ALIGN)
    return -(-need // CAPACITY_ALIGN) * CAPACITY_ALIGN


def _nb(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def token_bytes(model: Transformer, context: int) -> dict[str, int]:
    """Bytes one decode token at position `context` reads, by component, from the model's tensors.

    Per layer: attention linears (+ scales), norms/sink, mHC, compressor, indexer, router (gate +
    bias, or the token's tid2eid row), k/E of the expert bank, the shared expert; KV: window rows
    min(W, L+1), compressed rows visible at L ((L+1)//r; ratio 4: min(topk, (L+1)//4) attended
    plus all (L+1)//4 index-cache rows). Plus the LM head, one embedding row, final norm, hc_head.
    """
    cfg, L = model.cfg, context
    k = cfg.n_activated_experts
    out = dict.fromkeys(("attention", "routed_experts", "shared_expert", "compressor", "indexer",
                         "mhc", "router", "norms", "head", "embed_row", "final_norm_hc_head",
                         "kv_window", "kv_compressed", "index_cache"), 0)
    for blk, st in zip(model.layers, model.states):
        a, f, r = blk.attn, blk.ffn, blk.ratio
        out["attention"] += sum(_nb(*getattr(a, n).tensors("").values()) for n in ATTN_LINEARS)
        out["norms"] += _nb(blk.attn_norm, blk.ffn_norm, a.q_norm, a.kv_norm, a.attn_sink)
        out["mhc"] += _nb(*blk.hc.values())
        if a.compressor is not None:
            out["compressor"] += _nb(*a.compressor.tensors("").values())
        if a.indexer is not None:
            out["indexer"] += _nb(*a.indexer.tensors("").values())
        out["router"] += _nb(*f.gate.tensors("").values()) + (
            k * f.tid2eid.element_size() if f.hash else _nb(f.bias))
        bank = f.experts
        stack = [getattr(bank, n) for n in ("w1", "w1_scale", "w2", "w2_scale", "w3", "w3_scale")]
        out["routed_experts"] += _nb(*(t for t in stack if t is not None)) * k // bank.n_experts
        out["shared_expert"] += sum(_nb(*lin.tensors("").values()) for lin in f.shared.values())
        row = st.kv_cache.shape[1] * st.kv_cache.element_size()
        out["kv_window"] += min(cfg.window_size, L + 1) * row
        visible = (L + 1) // r if r else 0
        if r == 4:
            out["kv_compressed"] += min(cfg.index_topk, visible) * row
            out["index_cache"] += visible * st.index_cache.shape[1] * st.index_cache.element_size()
        elif r:
            out["kv_compressed"] += visible * row
    out["head"] = _nb(model.head)
    out["embed_row"] = model.embed.shape[1] * model.embed.element_size()
    out["final_norm_hc_head"] = _nb(model.norm, *model.hc_head.values())
    return out


# ---- memory -----------------------------------------------------------------------------------

DEQUANT_FP4 = 21   # peak bytes per value while dequantizing FP4: uint8 + 2 x int64 codes + float32
DEQUANT_FP8 = 10   # FP8: float32 copy, float32 product, the activation-dtype result

def layer_sizes(meta: Transformer) -> dict:
    """Per-layer weight / state bytes and largest float32 master DeviceWeights makes (FP4: two
    values per byte), the dequantized copies a CPU run keeps (`dense`, in the activation dtype),
    plus the globals (embed, head, norms), of a model on the meta device."""
    def master(ts):
        return max((t.numel() * (8 if t.dtype == torch.int8 else 4) for t in ts), default=0)
    glob = [meta.embed, meta.head, meta.norm, *meta.hc_head.values()]
    layers = [blk.tensors("").values() for blk in meta.layers]
    return {"weights": [_nb(*ts) for ts in layers], "master": [master(ts) for ts in layers],
            "dense": [dense_bytes(blk, meta.act)[0] for blk in meta.layers],
            "dequant": [dense_bytes(blk, meta.act)[1] for blk in meta.layers],
            "state": [st.nbytes() for st in meta.states], "global": _nb(*glob),
            "global_master": master(glob)}


def dense_bytes(blk, act: torch.dtype) -> tuple[int, int]:
    """(kept, transient) bytes of the dequantized weights a CPU model caches for block `blk`
    (Transformer keeps dense copies on the CPU, where op overhead dominates): every weight stored
    in another dtype than `act`, at `act`'s element size (an FP4 byte holds two values); and the
    peak temporaries of dequantizing the largest one (dsv4.formats: FP4 goes through int64 codes
    and float32 values, ~DEQUANT_FP4 bytes per value; FP8 through float32, ~DEQUANT_FP8)."""
    size, kept, peak = torch.empty((), dtype=act).element_size(), 0, 0
    for w in blk.weights():
        for name in ("w1", "w2", "w3") if hasattr(w, "w1") else ("weight",):
            t = getattr(w, name)
            if t.dtype == act:
                continue
            n = t.numel() * (2 if t.dtype == torch.int8 else 1)
            kept += n * size
            peak = max(peak, n * (DEQUANT_FP4 if t.dtype == torch.int8 else DEQUANT_FP8))
    return kept, peak


def memory_estimate(sizes: dict, n_layers: int, devices, reserve: int):
    """(placement, {device: {weights, dense, state, reserve, total}}) for the first n_layers;
    reserve: per-device workspace on top of the largest float32 master generated there (on the
    CPU, or of the largest dequantization's temporaries if larger); dense: the CPU's dequantized
    copies."""
    placement = balanced_placement(sizes["weights"][:n_layers], devices, sizes["global"])
    est = {str(d): {"weights": 0, "dense": 0, "state": 0, "reserve": reserve} for d in devices}
    master = dict.fromkeys(est, 0)
    for l, d in enumerate(map(str, placement)):
        est[d]["weights"] += sizes["weights"][l]
        est[d]["state"] += sizes["state"][l]
        master[d] = max(master[d], sizes["master"][l])
        if torch.device(d).type == "cpu":       # the CPU keeps dequantized copies as well
            est[d]["dense"] += sizes["dense"][l]
            master[d] = max(master[d], sizes["dequant"][l])
    head = str(torch.device(devices[0]))
    est[head]["weights"] += sizes["global"]
    master[head] = max(master[head], sizes["global_master"])
    for d, e in est.items():
        e["reserve"] += master[d]
        e["total"] = e["weights"] + e["dense"] + e["state"] + e["reserve"]
    return placement, est


def free_memory(device: torch.device) -> int | None:
    """Free bytes on `device` (CUDA: the driver's count; CPU: MemAvailable), None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(meta: Transformer, n_layers: int, devices, reserve: int, capacity: int):
    """Placement and estimate for the run; DeviceError naming the device and the fixes when the
    estimate exceeds the free memory of any device."""
    sizes = layer_sizes(meta)
    placement, est = memory_estimate(sizes, n_layers, devices, reserve)
    free = {str(d): free_memory(torch.device(d)) for d in devices}
    over = [d for d, e in est.items() if free[d] is not None and e["total"] > free[d]]
    if not over:
        return placement, est
    fits = 0
    for n in range(n_layers, 0, -1):
        _, e_n = memory_estimate(sizes, n, devices, reserve)
        if all(free[d] is None or e["total"] <= free[d] for d, e in e_n.items()):
            fits = n
            break
    d, e = over[0], est[over[0]]
    more = (f"--layers {fits} (the most that fit here)" if fits else
            "fewer --layers (not even one layer fits)")
    cpu = torch.device(d).type == "cpu"
    dense = (f" + dequantized copies {e['dense'] / GIB:.1f}" if e["dense"] else "")
    temps = "dequantization" if cpu else "weight generation"
    raise DeviceError(
        f"{d} needs an estimated {e['total'] / GIB:.1f} GiB (weights {e['weights'] / GIB:.1f}"
        f"{dense} + state {e['state'] / GIB:.2f} at capacity {capacity} + reserve "
        f"{e['reserve'] / GIB:.1f}: --reserve-gib {reserve / GIB:g} and the largest {temps}'s "
        f"temporaries) but has {free[d] / GIB:.1f} GiB "
        f"{'host memory available (MemAvailable)' if cpu else 'free'}. Fix: {more}, more "
        f"--devices (e.g. cuda:0,cuda:1), or a smaller --context; escape hatch: --reserve-gib 0")


# ---- measurement ------------------------------------------------------------------------------

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


def count_kernels(step, devices, top: dict | None = None, trace: str | None = None) -> int:
    """CUDA kernels launched by one step() (memcpy/memset excluded), from torch.profiler; with
    `top`, also fills it with kernel name -> [launches, device µs] of that step; with `trace`,
    writes that step's Chrome trace there (kernels per stream with start and duration)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    _sync(devices)
    with torch.profiler.profile(activities=acts) as prof:
        step()
        _sync(devices)
    if trace:
        prof.export_chrome_trace(trace)
    n = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(NOT_KERNELS):
            n += 1
            if top is not None:
                t = top.setdefault(e.name[:60], [0, 0.0])
                t[0] += 1
                t[1] += getattr(e, "device_time", 0.0) or getattr(e, "cuda_time", 0.0)
    return n


def _stats(ms: list[float]) -> dict:
    med = statistics.median(ms)
    return {"ms_per_token": med, "spread_ms": [min(ms), max(ms)], "tokens_per_s": 1e3 / med}


def measure(model: Transformer, mode: str, granularity: str, context: int, steps: int,
            warmup: int, seed: int, kernels: bool, trace: str | None = None) -> dict:
    """One (mode, granularity): decoder over the model at position `context`, warmed up, timed."""
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
        if kernels and model.head_device.type == "cuda":
            at_context()
            top: dict = {}
            suffix = f"-{granularity}" if mode == "graph" else ""
            total = count_kernels(dec.step, devices, top, trace and f"{trace}-{mode}{suffix}.json")
            res["top_kernels"] = sorted(([k, n, round(us, 1)] for k, (n, us) in top.items()),
                                        key=lambda r: -r[2])[:20]
            for k, n, us in res["top_kernels"][:12]:
                _log(f"{mode}/{granularity}: {us:9.1f} us {n:5d}x {k}")
            at_context()
            res["kernels_head_embed"] = count_kernels(he.step, devices)
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


def run(args, command: str = "") -> dict:
    """The whole benchmark for parsed `args`; returns the report (JSON-ready dict)."""
    devices = [torch.device(d) for d in resolve_devices(args.devices)]
    on_cuda = devices[0].type == "cuda"
    modes = ["eager", "graph"] if args.mode == "both" else [args.mode]
    grans = ["segment", "device"] if args.granularity == "both" else [args.granularity]
    notes = []
    if "graph" in modes and not on_cuda:
        if args.mode == "graph":
            raise DeviceError("--mode graph needs CUDA devices; use --mode eager or --devices cuda:0")
        modes = ["eager"]
        notes.append("graph mode needs CUDA: not measured")
    for flag, v, lo in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0),
                        ("--context", args.context, 1), ("--spec-tokens", args.spec_tokens, 2)):
        if v < lo:
            raise InputError(f"{flag} {v}: must be >= {lo}")
    if args.steps < MIN_STEPS:
        notes.append(f"--steps {args.steps} < {MIN_STEPS}: not a figure for BENCHMARKS.md")
    if not on_cuda:
        notes.append("CPU run: perf_counter timing, no copy bandwidth, floor or kernel counts")
    lengths = _lengths(args.prefill)
    if args.prefill_reps < 1 or (args.prefill_chunk is not None and args.prefill_chunk < 1):
        raise InputError("--prefill-reps and --prefill-chunk must be >= 1")
    g = args.prefill_graphs
    if g < 0 or g & (g - 1) or (g and not lengths):
        raise InputError(f"--prefill-graphs {g}: expected 0 or a power of two, with --prefill")
    full = get_preset(args.preset)
    cfg = get_preset(args.preset, args.layers)
    spec_len = [bench_spec.PROMPT + args.spec_tokens + 2] if args.speculative else []
    cap = capacity_for(max([args.context] + lengths + spec_len), args.steps, args.warmup)
    if cap > cfg.max_position_embeddings:
        raise InputError(f"--context {args.context} + steps + warmup needs capacity {cap}, above "
                         f"the model's {cfg.max_position_embeddings} positions; lower --context")
    dtype = DTYPES[args.dtype]
    meta = Transformer(full, RuntimeConfig(cap, dtype, ("meta",)))   # sizes only, no memory
    placement, est = check_memory(meta, cfg.n_layers, devices, int(args.reserve_gib * GIB), cap)
    bw = {str(d): copy_bandwidth(d) for d in devices if d.type == "cuda"}
    if bw:
        _log("copy bandwidth " + ", ".join(f"{d} {v:.3f} TB/s" for d, v in bw.items()))

    model = Transformer(cfg, RuntimeConfig(cap, dtype, tuple(devices), mtp=args.speculative),
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

    runs = []
    for mode in [] if args.no_decode else modes:
        for g in grans if mode == "graph" else grans[:1]:
            _log(f"measuring {mode}" + (f"/{g}" if mode == "graph" else ""))
            r = measure(model, mode, g, args.context, args.steps, args.warmup, args.seed,
                        kernels=not args.no_kernels, trace=args.trace)
            r["ratio_to_floor"] = r["ms_per_token"] / floor if floor else None
            runs.append(r)
    partial = cfg.n_layers < full.n_layers
    ext = None
    if partial:
        fbytes = sum(token_bytes(meta, args.context).values())
        ffloor = fbytes / (copy * 1e12) * 1e3 if copy else None
        for r in runs:
            r["extrapolated_ms"] = r["per_layer_ms"] * full.n_layers + r["head_embed_ms"]
        ext = {"method": EXTRAPOLATION, "layers": full.n_layers, "bytes_per_token": fbytes,
               "floor_ms": ffloor}
    prefill = None
    if lengths:
        graph = next((r for r in runs if r["mode"] == "graph"), None)
        with _prefill_switch(args.prefill_kernels == "on"):
            pg = None
            if args.prefill_graphs:
                from .prefill_graphs import PrefillGraphs
                _log(f"capturing prefill chunk graphs up to {args.prefill_graphs} tokens")
                pg = model.prefill_graphs = PrefillGraphs(model, args.prefill_graphs)
                _log("chunk graph replay / eager ms (measured when built): " + ", ".join(
                    f"{S}: {pg.replay_ms[S]:.1f} / {pg.eager_ms[S]:.1f}" for S in pg.chunks))
            prefill = bench_prefill.run(model, lengths, args.prefill_reps, args.seed,
                                        args.prefill_chunk, copy,
                                        graph["ms_per_token"] if graph else None, _log,
                                        args.prefill_profile)
            model.prefill_graphs = None
        prefill["prefill_kernels"] = args.prefill_kernels
        prefill["prefill_graphs"] = (None if pg is None else
                                     {"max_rows": pg.max_rows, "max_prompt": pg.max_prompt,
                                      "capture_s": pg.capture_s, "graph_bytes": pg.graph_bytes(),
                                      "built_replay_ms": pg.replay_ms,
                                      "built_eager_ms": pg.eager_ms})
    spec = None
    if args.speculative:
        graph = next((r for r in runs if r["mode"] == "graph"), None)
        spec = bench_spec.run(model, args.context, args.seed,
                              graph["ms_per_token"] if graph else None, _log,
                              n_new=args.spec_tokens)
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
              "valid": on_cuda and args.steps >= MIN_STEPS, "notes": notes}
    if prefill is not None:
        report.update(prefill)
    if spec is not None:
        report.update(spec)
    return report


def _prefill_switch(on: bool):
    """Set DSV4_PREFILL_KERNELS for the run; restores the caller's value afterwards."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        prior = os.environ.get(PREFILL_SWITCH)
        os.environ[PREFILL_SWITCH] = "1" if on else "0"
        try:
            yield
        finally:
            if prior is None:
                os.environ.pop(PREFILL_SWITCH, None)
            else:
                os.environ[PREFILL_SWITCH] = prior
    return ctx()


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

def format_table(rep: dict) -> str:
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    part = " (partial)" if rep["partial"] else ""
    lines = [f"dsv4 bench: {rep['preset']} {rep['layers']}/{rep['full_layers']} layers{part} | "
             f"{','.join(rep['devices'])} ({rep['gpu_name'] or 'cpu'}) | context {rep['context']} "
             f"| {rep['dtype']} | median of {rep['steps']} steps",
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
    lines += [f"note: {n}" for n in rep["notes"]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from .cli_options import Parser     # defaults in --help, a usage error is one line
    p = Parser(prog="dsv4 bench", description="Batch-1 decode benchmark on device-generated weights "
                "(method: BENCHMARKS.md).")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS), help="the model's shapes")
    p.add_argument("--layers", type=int, default=None, help="first N layers (default: all)")
    p.add_argument("--devices", default="auto", help="auto | cpu | cuda:0 | cuda:0,cuda:1")
    p.add_argument("--context", type=int, default=4096, help="decode position L (state filled)")
    p.add_argument("--steps", type=int, default=100, help=f"timed steps (>= {MIN_STEPS} to report)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    p.add_argument("--mode", default="both", choices=("both", "eager", "graph"),
                   help="eager steps, CUDA graph replays, or both")
    p.add_argument("--granularity", default="segment", choices=("segment", "device", "both"),
                   help="graph mode: one graph per layer (segment), per device run, or both")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="activation dtype")
    p.add_argument("--seed", type=int, default=0, help="weight / state seed")
    p.add_argument("--json", default=None, metavar="PATH|-", help="write the report as JSON "
                   "(- : stdout, the table then goes to stderr)")
    p.add_argument("--reserve-gib", type=float, default=2.0, help="per-device workspace assumed "
                   "by the memory check (besides weights, state, generation temporaries)")
    p.add_argument("--no-kernels", action="store_true", help="skip the profiled kernel count")
    p.add_argument("--prefill", default=None, metavar="N[,N...]",
                   help="also time prefill of prompts of these lengths (TTFT, tok/s, floors)")
    p.add_argument("--prefill-reps", type=int, default=3, help="timed prefills per length")
    p.add_argument("--prefill-chunk", type=int, default=None, help="prefill chunk (default: "
                   "the runtime's)")
    p.add_argument("--prefill-kernels", default="on", choices=("on", "off"),
                   help="off: the torch prefill path (the state before the prefill kernels)")
    p.add_argument("--no-decode", action="store_true", help="skip the decode measurement")
    p.add_argument("--speculative", action="store_true",
                   help="also measure the speculative mechanism (MTP block loaded): verify pass "
                        "T = 1..4, the speculative step, end-to-end tok/s with an oracle drafting right at "
                        "rates a")
    p.add_argument("--spec-tokens", type=int, default=256, metavar="N",
                   help="with --speculative: tokens per end-to-end run (default 256)")
    p.add_argument("--prefill-graphs", type=int, default=0, metavar="N",
                   help="CUDA: capture prefill chunk graphs of 1..N tokens (a power of two) and "
                        "time prompts up to N through them (capture time, each chunk's replay and eager time in the JSON)")
    p.add_argument("--prefill-profile", action="store_true",
                   help="CUDA: one profiled prefill per length (kernel count, top kernels)")
    p.add_argument("--trace", metavar="PREFIX", default=None,
                   help="write the Chrome trace of the profiled step to PREFIX-<mode>[-<granularity>]"
                        ".json (needs the kernel count)")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return exit_code(lambda: _main(argv))


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    rep = run(args, command="python scripts/bench.py " + shlex.join(argv))
    table = format_table(rep)
    if args.json == "-":
        print(table, file=sys.stderr)
        print(json.dumps(rep))
    else:
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rep, fh, indent=1)
        print(table)
    return 0
