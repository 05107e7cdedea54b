"""Where a layer's decode time goes (`dsv4 bench --layer-kernels`): each kernel op of one layer's
decode step replayed alone (PDL off, no parallel branches, in a CUDA graph, the L2 cache flushed
before it: the weights come from memory as in a step), the bytes it must read and its share of the
copy bandwidth; against the same layer's step replayed whole (as decoding runs it, and with PDL and
branches off). The layer's time minus the sum of its kernels alone is what its kernel boundaries
cost (ramp-up, tail, the dependency wait of each launch). Each op also replayed with what fits of
its bytes already in L2 (back to back, no flush), and with its weights prefetched into L2
(dsv4.backend.fused.prefetch's kernel, then a pause) after the flush: what reading the weights
from L2 could win at most, and what the prefetch wins. And, for each op of 1 MB or more, a plain
streaming read of as many bytes (csrc/prefetch.cu's dsv4_read_bytes, the best of a few grids,
after the flush): what a kernel of that size can reach at all, ramp-up and tail included, so an
op's distance from it is its own stream's inefficiency, not its size's.

The ops are the named kernel ops of dsv4.backend.ops: the layer is bound to a recording Ops for
one eager step (every call and its arguments kept), then each call is captured alone. Torch glue
between them (a few elementwise kernels, if any) is not an op: it lands in the boundary cost.
Legend: L = context, k = activated experts, E = routed experts, r = compress ratio.
"""
from __future__ import annotations

import statistics
from dataclasses import replace

import torch

from ..backend.binding import bind_block
from ..backend.ops import Ops

# the Ops methods that launch kernels
OPS = ("hc_pre_norm", "hc_post", "hc_post_mix", "rms_norm_row", "attention_prep",
       "attention_prep_rows", "sparse_attention_decode", "sparse_attention_decode_rows",
       "compressor_decode", "index_query", "index_scores", "index_topk", "fp8_linear",
       "fp8_linear2", "fp8_swiglu", "bf16_linear", "bf16_linear_multi", "route_decode",
       "fp4_experts_up", "fp4_experts_down")
FLUSH_BYTES = 256 << 20      # read before each replay: evicts the 50-60 MB L2 of an H100 / H200
PAUSE_CYCLES = 40_000        # ~20 us at 1.98 GHz: between a prefetch and its op


class RecordingOps:
    """An Ops that keeps every kernel op called through it: calls [(name, args, kwargs)]."""

    def __init__(self, ops: Ops):
        self._ops, self.calls = ops, []

    def __getattr__(self, name):
        attr = getattr(self._ops, name)
        if name not in OPS:
            return attr

        def record(*args, **kw):
            self.calls.append((name, args, kw))
            return attr(*args, **kw)
        return record


def _tensors(x):
    """Every tensor in an argument (lists and tuples of tensors included)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def op_bytes(name: str, args: tuple, kw: dict, blk, st, context: int, rows: int = 1) -> int:
    """The bytes one call must read: its input tensors, with what a decode step of `rows` rows
    reads of the large ones: rows * k / E of an expert bank (the rows' experts taken distinct, as
    random routing makes them), the attended rows of the KV cache, the visible rows of the index
    cache, the tokens' rows of the hash table; outputs (`out=`) not counted."""
    cfg, f = blk.cfg, blk.ffn
    bank = f.experts
    banks = {t.data_ptr() for t in (bank.w1, bank.w1_scale, bank.w2, bank.w2_scale, bank.w3,
                                    bank.w3_scale) if t is not None}
    k, E = cfg.n_activated_experts, bank.n_experts
    W, r = cfg.window_size, blk.ratio
    row = st.kv_cache.shape[1] * st.kv_cache.element_size()
    visible = (context + 1) // r if r else 0
    attended = min(W, context + 1) + (min(cfg.index_topk, visible) if r == 4 else visible)

    def within(t, cache):     # t is cache or a view of it (the compressor's part of the KV rows)
        return cache is not None and \
            t.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()

    total = 0
    for t in _tensors(list(args) + [v for key, v in kw.items() if key != "out"]):
        p, n = t.data_ptr(), t.numel() * t.element_size()
        if p in banks:
            n = n * min(E, rows * k) // E
        elif within(t, st.kv_cache):   # the compressor, the prep: one row written
            n = attended * row if name.startswith("sparse_attention") else 0
        elif within(t, st.index_cache):
            n = visible * st.index_cache.shape[1] * st.index_cache.element_size() \
                if name == "index_scores" else 0
        elif f.tid2eid is not None and p == f.tid2eid.data_ptr():
            n = rows * k * f.tid2eid.element_size()
        total += n
    return total


def _profiled(fn, reps: int, device) -> dict:
    """{CUDA kernel name: [device us of each launch]} of fn() run `reps` times under the profiler
    (memcpy / memset excluded)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize(device)
    per: dict = {}
    for e in prof.events():
        name = e.name.lower()
        if (e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in name
                and "memset" not in name):
            per.setdefault(e.name, []).append(e.device_time_total)
    return per


def _kernel_us(fn, device, reps: int, before=None) -> tuple[dict, float]:
    """fn captured in a graph after an L2 flush (a read of FLUSH_BYTES: the cache then holds clean
    lines of other data, as after the layer's other kernels), replayed `reps` times under the
    profiler -> ({kernel name: median us}, the flush's kernels excluded), and the sum of those
    medians. before: "warm" (no flush: what fits of the op's bytes is in L2 from the replay
    before), or a callable captured between the flush and fn (its kernels excluded too)."""
    flush = torch.ones(FLUSH_BYTES // 4, dtype=torch.float32, device=device)
    skip = set(_profiled(lambda: flush.sum(), 1, device))
    if callable(before):
        skip |= set(_profiled(before, 1, device))
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):            # warm: compiles, allocates
        fn()
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        if before != "warm":
            flush.sum()
        if callable(before):
            before()
        fn()
    g.replay()
    torch.cuda.synchronize(device)
    per = _profiled(g.replay, reps, device)
    del g
    med = {n: statistics.median(v) for n, v in per.items() if n not in skip}
    return med, sum(med.values())


READ_MIN_BYTES = 1 << 20      # ops below this get no read bound (latency-bound, not streams)


def _read_us(nbytes: int, device, reps: int, scratch: dict) -> float | None:
    """The fastest plain streaming read of nbytes from memory (after the flush; dsv4_read_bytes on
    1, 2 and 4 CTAs an SM of 512 threads), us; None without the CUDA library. Timed once per
    size in `scratch` (the layer's ops of equal bytes share it)."""
    from ..kernels.cuda import lib as cuda_cpp
    lib = cuda_cpp.lib_for(device)
    if lib is None:
        return None
    n = nbytes // 16 * 16
    if ("read", n) in scratch:
        return scratch[("read", n)]
    if scratch.get("buf") is None or scratch["buf"].numel() < n:
        scratch["buf"] = torch.ones(n, dtype=torch.uint8, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    sink = torch.empty(4 * sms, 4, dtype=torch.int32, device=device)
    best = None
    for ctas in (sms, 2 * sms, 4 * sms):
        _, us = _kernel_us(lambda c=ctas: cuda_cpp.read_bytes(lib, scratch["buf"][:n], sink, c, 512),
                           device, reps)
        best = us if best is None else min(best, us)
    scratch[("read", n)] = best
    return best


def _weights(args, kw, blk, st) -> list:
    """The weights of a call that a prefetch could bring ahead: its tensors of 1 MB or more, not
    an expert bank (which experts is known only after routing) nor a cache."""
    bank = blk.ffn.experts
    skip = {t.data_ptr() for t in (bank.w1, bank.w1_scale, bank.w2, bank.w2_scale, bank.w3,
                                   bank.w3_scale, st.kv_cache, st.index_cache) if t is not None}
    return [t for t in _tensors(list(args) + [v for key, v in kw.items() if key != "out"])
            if t.is_contiguous() and t.numel() * t.element_size() >= 1 << 20
            and t.data_ptr() not in skip]


def _layer_us(step, device, reps: int) -> float:
    """The layer's step captured whole, each replay after an L2 flush (as after the layer before
    it): median us of `reps` replays (the flush not timed)."""
    flush = torch.ones(FLUSH_BYTES // 4, dtype=torch.float32, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    times = []
    for _ in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush.sum()
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    del g
    return statistics.median(times[3:])


@torch.inference_mode()
def layer_kernels(model, layer: int, context: int, copy_tbps: float, reps: int = 50,
                  rows: int = 1) -> dict:
    """One layer's kernels alone and the layer whole at position `context` (the model's state
    filled, dsv4.bench.common.fill_state); copy_tbps: the device's measured copy bandwidth; rows:
    the step's rows (T > 1: a speculative verify step of T rows at context .. context + T - 1).
    The layer's binding is restored afterwards."""
    # the ops alone are launched outside the model's own device guards: on the layer's device
    # (Triton reads a tensor of cuda:1 from the current device cuda:0 as a host pointer)
    with torch.cuda.device(model.layers[layer].device):
        return _layer_kernels(model, layer, context, copy_tbps, reps, rows)


def _layer_kernels(model, layer: int, context: int, copy_tbps: float, reps: int,
                   rows: int) -> dict:
    from . import common
    blk, st, dev = model.layers[layer], model.states[layer], model.layers[layer].device
    ops = model.binding.ops(dev)
    quiet = Ops(replace(ops.backend, pdl=False, branches=frozenset(), prefetch=frozenset()))
    cfg = model.cfg
    g = torch.Generator(device=dev).manual_seed(layer)
    h = torch.randn(rows, cfg.hc_mult, cfg.dim, generator=g, device=dev).to(model.act)
    ids = torch.tensor([(1234 + 7 * t) % cfg.vocab_size for t in range(rows)], device=dev)
    pos = torch.tensor([context], device=dev)
    out = torch.empty_like(h)
    step = lambda: blk.decode(h, ids, pos, st, out=out)          # noqa: E731
    rec = RecordingOps(quiet)
    try:
        bind_block(blk, rec)
        step()                                          # record the calls (and warm them)
        calls = list(rec.calls)
        quiet_us = _layer_us(step, dev, reps)           # PDL off, no branches
        bind_block(blk, ops)
        from ..backend import branches
        branches.prepare(dev)
        layer_us = _layer_us(step, dev, reps)           # as decoding runs it
    finally:
        bind_block(blk, ops)
    table, scratch = [], {}
    for name, args, kw in calls:
        fn = getattr(quiet, name)
        call = lambda: fn(*args, **kw)                  # noqa: E731
        kernels, us = _kernel_us(call, dev, reps)
        nbytes = op_bytes(name, args, kw, blk, st, context, rows)
        # the same op with what fits of its bytes in L2 (replayed back to back), and with its
        # weights prefetched (dsv4.backend.fused.prefetch's kernel, then 20 us of nothing) after
        # the flush: what an L2 prefetch could win at most, and what it wins
        _, warm = _kernel_us(call, dev, reps, before="warm")
        ws, pre = _weights(args, kw, blk, st), None
        if ws and ops.backend.gemv == "cuda":
            _, pre = _kernel_us(call, dev, reps, before=lambda: (ops.l2_prefetch(ws),
                                                                 torch.cuda._sleep(PAUSE_CYCLES)))
        read = _read_us(nbytes, dev, reps, scratch) if nbytes >= READ_MIN_BYTES else None
        table.append({"op": name, "kernels": sorted(kernels), "us": us, "bytes": nbytes,
                      "pct_copy": 100 * nbytes / (us * 1e-6) / (copy_tbps * 1e12) if us else None,
                      "us_l2_warm": warm, "us_prefetched": pre, "us_read": read})
    scratch.clear()
    common.fill_state(model, context, layer)            # the replays moved the state
    sum_us = sum(r["us"] for r in table)
    nbytes = sum(r["bytes"] for r in table)
    return {"layer": layer, "ratio": blk.ratio, "hash": blk.ffn.hash, "rows": rows, "ops": table,
            "ops_sum_us": sum_us, "layer_us": layer_us, "layer_quiet_us": quiet_us,
            "boundary_us": layer_us - sum_us, "bytes": nbytes,
            "floor_us": nbytes / (copy_tbps * 1e12) * 1e6, "copy_TBps": copy_tbps}


def representative_layers(model) -> list[int]:
    """The first layer of each kind in the model: hash routing, and each compress ratio."""
    seen, out = set(), []
    for l, blk in enumerate(model.layers):
        kind = (blk.ffn.hash, blk.ratio)
        if kind not in seen:
            seen.add(kind)
            out.append(l)
    return out


def format_rows(rep: dict) -> list[str]:
    """The table of one layer's report."""
    kind = (f"layer {rep['layer']} (ratio {rep['ratio']}{', hash' if rep['hash'] else ''}"
            f"{', %d rows' % rep['rows'] if rep.get('rows', 1) > 1 else ''})")
    lines = [f"{kind}: whole {rep['layer_us']:.1f} us (PDL/branches off {rep['layer_quiet_us']:.1f}), "
             f"kernels alone {rep['ops_sum_us']:.1f} us, boundaries {rep['boundary_us']:.1f} us; "
             f"bytes {rep['bytes'] / 1e6:.1f} MB, floor {rep['floor_us']:.1f} us",
             f"  {'op':<30}{'us':>8}{'MB':>9}{'% copy':>8}{'L2 warm':>9}{'prefetched':>11}"
             f"{'read':>7}  kernels"]
    f = lambda v: f"{v:.1f}" if v is not None else "-"         # noqa: E731
    for r in rep["ops"]:
        pct = f"{r['pct_copy']:.0f}" if r["pct_copy"] is not None else "-"
        lines.append(f"  {r['op']:<30}{r['us']:>8.1f}{r['bytes'] / 1e6:>9.2f}{pct:>8}"
                     f"{f(r.get('us_l2_warm')):>9}{f(r.get('us_prefetched')):>11}"
                     f"{f(r.get('us_read')):>7}  "
                     f"{', '.join(k[:40] for k in r['kernels'])}")
    return lines
