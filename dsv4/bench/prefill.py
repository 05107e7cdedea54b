"""Prefill benchmark: time to first token and tokens/s of prompts of given lengths on the bench's
model (device-generated weights), against two floors measured in the same process: compute (the
prompt's FLOPs at the dense bf16 / FP8 rate of a large matmul here) and bytes (the distinct weights
the prompt touches: attention, compressor / indexer, router, shared expert, the union of the routed
experts it hit, head; at the copy bandwidth). Called by dsv4/bench/decode.py (`--prefill N[,N...]`).
"""
from __future__ import annotations

import statistics
import time

import torch

from ..model.transformer import Transformer
from ..runtime.prefill import prefill as run_prefill
from .common import STEP_MARK, kernel_events, kernel_table, trace_origin_ns

RATE_N = 8192          # the rate matmul: [RATE_N, RATE_N] x [RATE_N, RATE_N]
RATE_ITERS = 10
GIB = 2**30


def matmul_rates(device: torch.device) -> dict:
    """Dense TFLOP/s of a large bf16 matmul and (where torch has it) a per-tensor-scaled FP8 one,
    median of RATE_ITERS, in this process."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(RATE_N, RATE_N, device=device, generator=gen).bfloat16()
    b = torch.randn(RATE_N, RATE_N, device=device, generator=gen).bfloat16()
    out = {"bf16": _rate(lambda: a @ b, device)}
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        out["fp8"] = _rate(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16),
                           device)
    except (RuntimeError, AttributeError, TypeError):   # no FP8 matmul on this GPU / build
        out["fp8"] = None
    return out


def _rate(fn, device) -> float:
    for _ in range(2):
        fn()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
           for _ in range(RATE_ITERS)]
    for s, e in evs:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize(device)
    ms = statistics.median(s.elapsed_time(e) for s, e in evs)
    return 2 * RATE_N ** 3 / (ms * 1e-3) / 1e12


def _params(lin) -> int:
    return lin.out_features * lin.in_features


def prefill_flops(model: Transformer, n: int) -> float:
    """FLOPs of prefilling positions 0..n-1: 2 x the weights each token multiplies (attention,
    compressor / indexer projections, router, k routed + the shared expert, mHC mixes), attention
    over the rows each query attends (window + visible compressed / top-k: QK and PV), the
    indexer's scores over the visible entries, and the head for the last token."""
    cfg = model.cfg
    p = torch.arange(n, dtype=torch.float64)
    total = 2.0 * cfg.vocab_size * cfg.dim
    for blk in model.layers:
        a, f, r = blk.attn, blk.ffn, blk.ratio
        w = sum(_params(getattr(a, nm)) for nm in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b"))
        if a.compressor is not None:
            w += _params(a.compressor.wkv) + _params(a.compressor.wgate)
        if a.indexer is not None:
            ix = a.indexer
            w += _params(ix.wq_b) + _params(ix.weights_proj) + _params(ix.compressor.wkv) \
                + _params(ix.compressor.wgate)
        w += _params(f.gate) + 3 * cfg.moe_inter_dim * cfg.dim * (cfg.n_activated_experts + 1)
        w += 2 * cfg.mix_hc * cfg.hc_mult * cfg.dim
        total += 2.0 * w * n
        att = torch.clamp(p + 1, max=cfg.window_size)
        if r == 4:
            vis = torch.floor((p + 1) / 4)
            att = att + torch.clamp(vis, max=cfg.index_topk)
            total += float((2.0 * cfg.index_n_heads * cfg.index_head_dim * vis).sum())
        elif r:
            att = att + torch.floor((p + 1) / r)
        total += float((4.0 * cfg.n_heads * cfg.head_dim * att).sum())
    return total


def touched_bytes(model: Transformer, hits: list[int]) -> int:
    """Weights a prompt reads at least once: every layer's tensors but the routed experts, the
    experts it routed to (hits[l] of layer l), the head, final norm and hc_head."""
    total = sum(t.numel() * t.element_size() for t in
                (model.head, model.norm, *model.hc_head.values()))
    for blk, h in zip(model.layers, hits):
        for name, t in blk.tensors("").items():
            nb = t.numel() * t.element_size()
            total += nb * h // blk.ffn.experts.n_experts if ".experts." in name else nb
    return total


def _involuntary_switches() -> int | None:
    """This thread's involuntary context switches so far (Linux; None elsewhere): the times the
    scheduler took its core for another thread."""
    try:
        with open("/proc/thread-self/status") as f:
            for line in f:
                if line.startswith("nonvoluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def measure(model: Transformer, n: int, reps: int, seed: int, chunk: int | None) -> dict:
    """Prefill a random n-token prompt (one warm-up, then `reps` timed runs): host wall time from
    the call to the first token on the host (prefill + greedy pick + sync), the experts hit per
    layer, and the peak memory of the timed runs. Of the plan's runs, the medians of the host's
    issue (the call until it returns, before the pick's sync): its wall ms, this thread's CPU ms
    in it, and its involuntary context switches: an issue slower with as much CPU time is a
    slower core; with less CPU time and switches, a thread that waited for its core."""
    dev = model.head_device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).to(dev)
    for blk in model.layers:            # record the experts each layer routes to
        blk.ffn.hits = torch.zeros(blk.ffn.experts.n_experts, dtype=torch.bool,
                                   device=blk.device)
    devices = [d for d in dict.fromkeys([dev, *model.placement]) if d.type == "cuda"]
    graphs, model.prefill_graphs = model.prefill_graphs, None
    try:
        run_prefill(model, ids, chunk=chunk)     # eager: records the hits (graphs were captured without)
        model.prefill_graphs = graphs
        if graphs is not None:
            run_prefill(model, ids, chunk=chunk)
        for d in devices:
            torch.cuda.synchronize(d)
            torch.cuda.reset_peak_memory_stats(d)
        def timed():
            """reps prefills -> their TTFT ms and their host issue [(ms, thread CPU ms,
            involuntary switches)]."""
            ms, host = [], []
            for _ in range(reps):
                sw, cpu, t = _involuntary_switches(), time.thread_time(), time.perf_counter()
                logits = run_prefill(model, ids, chunk=chunk)
                host.append((1e3 * (time.perf_counter() - t), 1e3 * (time.thread_time() - cpu),
                             None if sw is None else _involuntary_switches() - sw))
                int(logits.argmax())
                ms.append(1e3 * (time.perf_counter() - t))
            return ms, host
        ms, issue = timed()
        peak = {str(d): torch.cuda.max_memory_allocated(d) for d in devices}
        hits = [int(blk.ffn.hits.sum()) for blk in model.layers]
        eager_ms = replay_ms = None
        if graphs is not None:          # the same prompt as eager chunks only, beside the plan's,
            model.prefill_graphs = None     # and as chunk graphs only (whatever the build measured)
            eager_ms = statistics.median(timed()[0])
            model.prefill_graphs, graphs.prefer = graphs, "replay"
            replay_ms = statistics.median(timed()[0])
    finally:
        if graphs is not None:
            graphs.prefer = None
        model.prefill_graphs = graphs
        for blk in model.layers:
            blk.ffn.hits = None
    med = statistics.median(ms)
    plan = graphs.plan(n, chunk or model.rt.prefill_chunk) if graphs is not None else None
    return {"tokens": n, "ttft_ms": med, "spread_ms": [min(ms), max(ms)],
            "tok_per_s": n / med * 1e3, "experts_hit": hits, "peak_bytes": peak,
            "graphs": plan is not None and any(g for _, g in plan),
            "plan": plan, "eager_ttft_ms": eager_ms, "replay_ttft_ms": replay_ms,
            "host_issue_ms": statistics.median(h[0] for h in issue),
            "host_cpu_ms": statistics.median(h[1] for h in issue),
            "host_switches": (None if issue[0][2] is None
                              else statistics.median(h[2] for h in issue))}


def profile(model: Transformer, n: int, seed: int, chunk: int | None, top: int = 25,
            meet=None, trace: str | None = None, events: bool = False) -> dict:
    """One unprofiled prefill (host issue time vs device span), then one profiled prefill
    (torch.profiler): CUDA kernels launched, their summed device time, the host time, the `top`
    kernels by device time [name, launches, ms] (every kernel in `table`) and the `top` host ops
    by self CPU time [name, calls, ms]. `meet` (a tensor-parallel group's barrier) runs inside the
    profile just before the prefill, so that every rank starts it together (its kernels are not
    the prefill's and are left out); `trace`: the profiled prefill's Chrome trace there; with
    `events`, also `events` [(start us, end us, name)] of its kernels and `origin_ns` (the host
    clock they count from: dsv4.bench.comm_skew lines the ranks up by it)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).to(model.head_device)
    # unprofiled: how long the host takes to issue the prefill vs the device's span over it (the
    # GPU waits on Python when the two are equal)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    torch.cuda.synchronize()
    t = time.perf_counter()
    ev[0].record()
    logits = run_prefill(model, ids, chunk=chunk)
    ev[1].record()
    issue = time.perf_counter() - t
    int(logits.argmax())
    span = ev[0].elapsed_time(ev[1])
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        if meet is not None:
            meet()
            torch.cuda.synchronize()
            t = time.perf_counter()
        with torch.profiler.record_function(STEP_MARK):
            int(run_prefill(model, ids, chunk=chunk).argmax())
    wall = time.perf_counter() - t
    if trace:
        prof.export_chrome_trace(trace)
    rows = kernel_table(prof, after=STEP_MARK)
    host = sorted(([a.key[:70], a.count, round(a.self_cpu_time_total / 1e3, 3)]
                   for a in prof.key_averages()), key=lambda r: -r[2])
    out = {"kernels": sum(c for _, c, _ in rows), "device_ms": sum(ms for *_, ms in rows),
           "wall_ms_profiled": wall * 1e3, "host_issue_ms": issue * 1e3, "device_span_ms": span,
           "top": rows[:top], "table": rows, "host_top": host[:top]}
    if events:
        out["events"] = [(float(e.time_range.start), float(e.time_range.end), e.name)
                         for e in kernel_events(prof, after=STEP_MARK)]
        out["origin_ns"] = trace_origin_ns(prof)
    return out


def run(model: Transformer, lengths: list[int], reps: int, seed: int, chunk: int | None,
        copy_tbps: float | None, decode_ms: float | None, log, with_profile: bool = False
        ) -> dict:
    """Every length, with both floors and their ratios; decode_ms (this run's graph step, if
    measured) gives each length's prefill cost per token relative to decoding."""
    cuda = model.head_device.type == "cuda"
    rates = matmul_rates(model.head_device) if cuda else {"bf16": None, "fp8": None}
    if cuda:
        log("dense matmul " + ", ".join(f"{k} {v:.0f} TFLOP/s" for k, v in rates.items() if v))
    rows = []
    for n in lengths:
        log(f"prefill {n} tokens")
        r = measure(model, n, reps, seed, chunk)
        flops = prefill_flops(model, n)
        nbytes = touched_bytes(model, r["experts_hit"])
        r["flops"], r["bytes"] = flops, nbytes
        floor = lambda v, per_s: v / (per_s * 1e12) * 1e3 if per_s else None  # noqa: E731
        r["compute_floor_ms"] = floor(flops, rates["bf16"])
        r["compute_floor_fp8_ms"] = floor(flops, rates["fp8"])
        r["bytes_floor_ms"] = floor(nbytes, copy_tbps)
        for k in ("compute", "bytes"):
            fl = r[f"{k}_floor_ms"]
            r[f"ratio_to_{k}_floor"] = r["ttft_ms"] / fl if fl else None
        r["ms_per_token"] = r["ttft_ms"] / n
        r["per_token_vs_decode"] = r["ms_per_token"] / decode_ms if decode_ms else None
        if with_profile and cuda:
            r["profile"] = pr = profile(model, n, seed, chunk)
            log(f"prefill {n}: {pr['kernels']} kernels, {pr['device_ms']:.1f} ms on the device, "
                f"{pr['wall_ms_profiled']:.1f} ms wall (profiled); unprofiled: host issue "
                f"{pr['host_issue_ms']:.1f} ms, device span {pr['device_span_ms']:.1f} ms")
            for name, c, ms in pr["top"]:
                log(f"  {ms:9.3f} ms {c:6d}x {name}")
        rows.append(r)
    return {"prefill_rates_tflops": rates, "prefill_chunk": chunk or model.rt.prefill_chunk,
            "prefill_runs": rows}


def format_rows(rep: dict) -> list[str]:
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    rates = rep["prefill_rates_tflops"]
    pg = rep.get("prefill_graphs")
    graphs = (f"; chunk graphs 1..{pg['max_rows']} (capture {pg['capture_s']:.1f} s, "
              f"{pg['graph_bytes'] / GIB:.2f} GiB; g: the plan replays some; eager ms / replay "
              f"ms: the same prompt as eager chunks only / as chunk graphs only)") if pg else ""
    lines = [f"prefill, chunk {rep['prefill_chunk']}; dense matmul bf16 {f(rates['bf16'], '.0f')} "
             f"/ fp8 {f(rates['fp8'], '.0f')} TFLOP/s{graphs}",
             f"{'tokens':>8}{'TTFT ms':>11}{'min-max':>17}{'tok/s':>9}{'x compute':>11}"
             f"{'x bytes':>9}{'GB read':>9}{'peak GiB':>10}{'tok/decode':>12}"
             + (f"{'eager ms':>10}{'replay ms':>11}" if pg else "")]
    for r in rep["prefill_runs"]:
        lo, hi = r["spread_ms"]
        peak = max(r["peak_bytes"].values()) / GIB if r["peak_bytes"] else None
        tokens = f"{'g' if r.get('graphs') else ''}{r['tokens']}"
        lines.append(f"{tokens:>8}{r['ttft_ms']:>11.1f}{f'{lo:.1f}-{hi:.1f}':>17}"
                     f"{r['tok_per_s']:>9.0f}{f(r['ratio_to_compute_floor'], '.2f'):>11}"
                     f"{f(r['ratio_to_bytes_floor'], '.2f'):>9}{r['bytes'] / 1e9:>9.2f}"
                     f"{f(peak, '.1f'):>10}{f(r['per_token_vs_decode'], '.3f'):>12}"
                     + (f"{f(r.get('eager_ttft_ms'), '.1f'):>10}"
                        f"{f(r.get('replay_ttft_ms'), '.1f'):>11}" if pg else ""))
    return lines
