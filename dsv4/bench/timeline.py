"""Where a profiled decode step leaves the memory idle: from the kernels' start and end times on
each device (torch.profiler, the step replayed as decoding runs it), the time some weight-streaming
kernel runs (the union of their intervals), the time none does, and who holds the step then: the
latency-bound kernels running in those stretches (each stretch shared equally among the kernels
running in it) or no kernel at all (launch and dependency bubbles). The ~60 us a Flash layer loses
beyond its byte floor is, in this view, the streams' own inefficiency (inside `streaming_us`) plus
`idle_us`; this module says how much is which and which kernels make up the idle part.

With PDL a dependent kernel starts before the kernel it waits for has finished: its first part
loads weights (the streams do that before their wait) or waits. A stream's interval therefore
counts its wait as streaming, and `idle_us` is a lower bound of the time the memory has nothing
to do (DSV4_PDL=0 gives the serialized view). Kernels with "gemv", "gemm", "mma", "fp4_up" or
"fp4_down" in their names stream weights (STREAM_NAMES): the FP8 GEMVs (CUDA C++ and Triton),
the bf16 GEMVs of the side projections and the gate, the routed experts, the head's matmul.
"""
from __future__ import annotations

import re

STREAM_NAMES = re.compile(r"gemv|gemm|mma|fp4_up|fp4_down|cutlass|xmma", re.IGNORECASE)
NO_KERNEL = "(no kernel)"


def short_name(name: str, width: int = 48) -> str:
    """A kernel's name without its C++ template and argument lists: `void (anonymous
    namespace)::fp8_gemv_kernel<8, 2>(Args)` -> `fp8_gemv_kernel`."""
    base = re.sub(r"^void\s+", "", name)
    base = re.sub(r"^\(anonymous namespace\)::", "", base)
    base = re.split(r"[<(]", base, maxsplit=1)[0].strip()
    return (base or name)[:width]


def by_short_name(top: dict) -> dict:
    """count_kernels' `top` (kernel name -> [launches, device us]) keyed by short_name, the
    instances of one template (fp8_mma_kernel<2, true> and <4, false>, say) summed into one
    entry."""
    out: dict = {}
    for name, (n, us) in top.items():
        t = out.setdefault(short_name(name), [0, 0.0])
        t[0] += n
        t[1] += us
    return out


def analyze(events: list[tuple], layers: int = 1, top: int = 12) -> dict:
    """events [(device, start_us, end_us, name)] of one step -> the step's timeline: per device
    and summed over devices (a pipeline's devices run one after the other): `span_us` (first
    kernel start to last end), `streaming_us` (some streaming kernel running), `idle_us` (none),
    of it `no_kernel_us`, and `idle_under` [[kernel, us], ...] the idle time each latency-bound
    kernel held (largest first); `*_per_layer` divide the sums by `layers` (the head's and the
    embedding's kernels included)."""
    per_dev, under_all = {}, {}
    for dev in sorted({e[0] for e in events}):
        evs = [e for e in events if e[0] == dev and e[2] > e[1]]
        if not evs:
            continue
        # a sweep over the kernels' starts and ends: between two consecutive marks the same
        # kernels run (at one time ends sort before starts)
        marks = sorted([(e[1], 1, i) for i, e in enumerate(evs)] +
                       [(e[2], 0, i) for i, e in enumerate(evs)])
        live: dict = {}
        streaming = idle = none = 0.0
        under: dict = {}
        prev = marks[0][0]
        for t, start, i in marks:
            if t > prev:
                names = list(live.values())
                d = t - prev
                if any(STREAM_NAMES.search(n) for n in names):
                    streaming += d
                else:
                    idle += d
                    if not names:
                        none += d
                        under[NO_KERNEL] = under.get(NO_KERNEL, 0.0) + d
                    for n in names:
                        k = short_name(n)
                        under[k] = under.get(k, 0.0) + d / len(names)
                prev = t
            if start:
                live[i] = evs[i][3]
            else:
                live.pop(i, None)
        span = marks[-1][0] - marks[0][0]
        per_dev[dev] = {"span_us": span, "streaming_us": streaming, "idle_us": idle,
                        "no_kernel_us": none}
        for k, v in under.items():
            under_all[k] = under_all.get(k, 0.0) + v
    tot = {k: sum(d[k] for d in per_dev.values())
           for k in ("span_us", "streaming_us", "idle_us", "no_kernel_us")}
    n = max(layers, 1)
    return {**tot, **{k.replace("_us", "_us_per_layer"): v / n for k, v in tot.items()},
            "idle_under": [[k, round(v, 2)] for k, v in
                           sorted(under_all.items(), key=lambda kv: -kv[1])[:top]],
            "per_device": {str(d): v for d, v in per_dev.items()}, "layers": layers}


def format_line(tl: dict) -> str:
    """One log line: a layer's span, streaming and idle time, and who holds the idle part."""
    n = tl["layers"]
    who = ", ".join(f"{k} {v / n:.1f}" for k, v in tl["idle_under"][:8])
    share = tl["streaming_us"] / tl["span_us"] if tl["span_us"] else 0.0
    return (f"a layer (profiled): span {tl['span_us_per_layer']:.1f} us, weights streaming "
            f"{tl['streaming_us_per_layer']:.1f} us ({share:.0%}), none streaming "
            f"{tl['idle_us_per_layer']:.1f} us: {who}")


def gaps(events: list[tuple], top: int = 8) -> list[list]:
    """events [(device, start_us, end_us, name)] -> the largest stretches in which no kernel runs
    on a device, [[us, kernel before, kernel after, device], ...] largest first (what the device
    waited for: the host's launch or read, a hand-off)."""
    out = []
    for dev in sorted({e[0] for e in events}):
        evs = sorted((e for e in events if e[0] == dev and e[2] > e[1]), key=lambda e: e[1])
        end, last = None, None
        for e in evs:
            if end is not None and e[1] > end:
                out.append([round(e[1] - end, 1), short_name(last), short_name(e[3]), str(dev)])
            if end is None or e[2] > end:
                end, last = e[2], e[3]
    return sorted(out, key=lambda g: -g[0])[:top]
