"""The all-reduce microbenchmark (scripts/bench_comm.py): one process per GPU (dsv4.parallel's
launcher, NCCL, multicast off); per implementation (dsv4.parallel.IMPLEMENTATIONS, and on request
`twoshot` and `nccl_f32`, BENCH_IMPLS) and bf16 message size, the latency of one all-reduce eager
(100 back-to-back calls from Python) and inside a CUDA graph (a graph of 100 back-to-back
all-reduces, replayed REPLAYS times: median replay / 100), each the slowest rank's median; and a
check: the exact sum (integer inputs), the same bits on every rank and on a second run (random
inputs). An implementation the ranks cannot run is a row that says why. The table comes last on
stdout. Large messages (a prefill chunk's partials: 1 to 32 MB) against NCCL, in bf16 and on a
float32 copy (what TensorParallel.reduce does where the all-reduce may round on the way):

  python scripts/bench_comm.py --device cuda:0,cuda:1 [--sizes 4,8,16,64] [--impls oneshot,nccl]
  python scripts/bench_comm.py --device cuda:0,cuda:1 --sizes 1024,8192,32768 \
      --impls twoshot,nccl,nccl_f32
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time

import torch

from ..backend.decision import cuda_status
from ..errors import DeviceError
from ..parallel import IMPLEMENTATIONS, launch, plan_allreduce
from ..parallel.allreduce import LARGE, LARGE_BYTES_LIMIT, MAX_BYTES, MAX_BYTES_LIMIT

SIZES_KB = (4, 8, 16, 64)
# besides the plan's implementations: our two-shot (a plan with large_bytes: it serves the messages
# above the one-shot's), and NCCL on a float32 copy cast back (the two-shot's numerics, NCCL's way)
BENCH_IMPLS = (*IMPLEMENTATIONS, LARGE, "nccl_f32")
ITERS = 100                 # all-reduces per timed eager loop and per captured graph
REPLAYS = 30                # timed graph replays (>= 20)
EAGER_LOOPS = 5
WARMUP = 10
TIMEOUT_S = 120.0           # the group's: start-up and every wait


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.view(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def _ints(rank: int, n: int, device) -> torch.Tensor:
    """bf16 integers in [-6, 6]: any sum over <= 8 ranks is exact in any order."""
    i = torch.arange(n, dtype=torch.int64)
    return (((i * (rank + 3) + 5 * rank + 1) % 13) - 6).to(torch.bfloat16).to(device)


def _check(group, ar, n: int) -> dict:
    dev = group.device
    x, out = _ints(group.rank, n, dev), torch.full((n,), float("nan"), dtype=torch.bfloat16,
                                                   device=dev)
    ar(x, out)
    want = sum(_ints(r, n, "cpu").double() for r in range(group.world_size)).to(torch.bfloat16)
    y = torch.randn(n, generator=torch.Generator().manual_seed(11 + group.rank))
    y = y.to(torch.bfloat16).to(dev)
    a, b = torch.empty_like(y), torch.empty_like(y)
    ar(y, a)
    ar(y, b)
    return {"exact": bool(torch.equal(out.cpu(), want)), "repeat": _digest(a) == _digest(b),
            "digest": _digest(a)}


class Float32Copy:
    """NCCL's all-reduce of a float32 copy of the message, cast back into out: what
    TensorParallel.reduce does with a bf16 message whose all-reduce may round on the way (the
    casts are timed with it). The planned all-reduce's interface as far as the bench uses it."""
    name = "nccl_f32"

    def __init__(self, ar):
        self.ar = ar

    def impl_for(self, nbytes: int, dtype: torch.dtype):
        return self

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(self.ar(x.float()))

    def check(self) -> None:
        self.ar.check()

    def close(self) -> None:
        self.ar.close()


def plan_args(impl: str, top: int) -> dict | str:
    """plan_allreduce's arguments that time `impl` at messages of up to top bytes, or why it is
    not timed. A small-message implementation serves up to MAX_BYTES_LIMIT (NCCL above: the row
    says "served by nccl"); the two-shot what the default plan's one-shot (<= MAX_BYTES) does
    not; nccl_f32 is NCCL alone (Float32Copy wraps it)."""
    if impl == LARGE:
        if top <= MAX_BYTES:
            return (f"the two-shot serves messages above {MAX_BYTES >> 10} KB (the one-shot's); "
                    f"the largest size asked is {top >> 10} KB")
        return {"large_bytes": top}
    if impl == "nccl_f32":
        return {"prefer": "nccl"}
    return {"max_bytes": min(top, MAX_BYTES_LIMIT), "prefer": impl}


def _eager_us(group, ar, x, out) -> float:
    stream = torch.cuda.current_stream(group.device)
    for _ in range(WARMUP):
        ar(x, out)
    torch.cuda.synchronize(group.device)
    group.barrier()
    ms = []
    for _ in range(EAGER_LOOPS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        for _ in range(ITERS):
            ar(x, out)
        b.record(stream)
        b.synchronize()
        ms.append(a.elapsed_time(b) / ITERS)
    return statistics.median(ms) * 1e3


def _graph_us(group, ar, x, out, replays: int) -> float:
    dev = group.device
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    torch.cuda.synchronize(dev)
    group.barrier()                 # every rank captures (no all-reduce runs while capturing)
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            for _ in range(ITERS):
                ar(x, out)
    stream = torch.cuda.current_stream(dev)
    stream.wait_stream(side)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize(dev)
    group.barrier()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
           for _ in range(replays)]
    for a, b in evs:                # back to back: the all-reduces keep the ranks in step
        a.record(stream)
        graph.replay()
        b.record(stream)
    torch.cuda.synchronize(dev)
    del graph
    return statistics.median(a.elapsed_time(b) for a, b in evs) / ITERS * 1e3


def _planned(group, impl: str, top: int):
    """(the all-reduce that times impl at messages of up to top bytes, None), or (None, why not):
    the same on every rank (collective)."""
    kw = plan_args(impl, top)
    if isinstance(kw, str):
        return None, kw
    try:
        ar = plan_allreduce(group, **kw)
    except DeviceError as e:
        return None, str(e)
    if impl == LARGE and ar.large is None:
        why = ar.table()[f"parallel.allreduce.{LARGE}"]
        ar.close()
        return None, why
    return (Float32Copy(ar) if impl == "nccl_f32" else ar), None


def _rank(group, impls: list[str], sizes_kb: list[int], replays: int) -> dict:
    """One rank's part: the default plan's choice, then per implementation and size, a check and
    the eager and graph latencies (or why the implementation is skipped)."""
    dev = group.device
    cuda_status(dev)   # the first load: DSV4_CUDA_LIB's where named (the plan loads no path)
    top = max(sizes_kb) << 10
    default = plan_allreduce(group, max_bytes=min(top, MAX_BYTES_LIMIT))
    out = {"default": default.table(), "rows": []}
    default.close()
    for impl in impls:
        ar, why = _planned(group, impl, top)
        if ar is None:
            out["rows"].append({"impl": impl, "skip": why})
            continue
        for kb in sizes_kb:
            n = (kb << 10) // 2
            row = {"impl": impl, "kb": kb, "served_by": ar.impl_for(n * 2, torch.bfloat16).name}
            row.update(_check(group, ar, n))
            x = torch.randn(n, device=dev).to(torch.bfloat16)
            y = torch.empty_like(x)
            row["eager_us"] = _eager_us(group, ar, x, y)
            row["graph_us"] = _graph_us(group, ar, x, y, replays)
            out["rows"].append(row)
        torch.cuda.synchronize(dev)
        ar.check()
        ar.close()
    return out


def merge(per_rank: list[dict]) -> list[dict]:
    """One row per (implementation, size): the slowest rank's latencies and the checks of all."""
    rows = []
    for i, r0 in enumerate(per_rank[0]["rows"]):
        if "skip" in r0:
            rows.append(dict(r0))
            continue
        same = [p["rows"][i] for p in per_rank]
        bad = []
        if not all(s["exact"] for s in same):
            bad.append("not the exact sum on rank(s) " +
                       ",".join(str(k) for k, s in enumerate(same) if not s["exact"]))
        if len({s["digest"] for s in same}) > 1:
            bad.append("different bits on different ranks")
        if not all(s["repeat"] for s in same):
            bad.append("different bits on a second run")
        check = ("FAIL: " + "; ".join(bad)) if bad else \
            f"exact, same bits on {len(same)} ranks and twice"
        rows.append({"impl": r0["impl"], "kb": r0["kb"], "served_by": r0["served_by"],
                     "eager_us": max(s["eager_us"] for s in same),
                     "graph_us": max(s["graph_us"] for s in same), "check": check})
    return rows


def format_table(rows: list[dict], title: str) -> str:
    lines = [title, f"{'impl':<14} {'KB':>5} {'eager us':>9} {'graph us':>9}  check"]
    for r in rows:
        if "skip" in r:
            lines.append(f"{r['impl']:<14} {'-':>5} {'-':>9} {'-':>9}  skipped: {r['skip']}")
        else:
            via = "" if r["served_by"] == r["impl"] else f" (served by {r['served_by']})"
            lines.append(f"{r['impl']:<14} {r['kb']:>5} {r['eager_us']:>9.2f} "
                         f"{r['graph_us']:>9.2f}  {r['check']}{via}")
    return "\n".join(lines)


def _ints_list(text: str, what: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise DeviceError(f"--{what} {text!r}: expected comma-separated integers") from None
    if not out or min(out) < 1:
        raise DeviceError(f"--{what} {text!r}: expected positive integers")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", required=True, help="one GPU a rank: cuda:0,cuda:1[,...]")
    p.add_argument("--sizes", default=",".join(map(str, SIZES_KB)),
                   help=f"bf16 message sizes in KB, up to {LARGE_BYTES_LIMIT >> 10} (default "
                        f"4,8,16,64; a prefill chunk's: 1024,8192,32768)")
    p.add_argument("--impls", default=",".join(IMPLEMENTATIONS),
                   help=f"implementations to time (default: {','.join(IMPLEMENTATIONS)}; also "
                        f"{LARGE}, nccl_f32 for large messages)")
    p.add_argument("--replays", type=int, default=REPLAYS, help="timed graph replays (>= 20)")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    try:
        devices = [d.strip() for d in args.device.split(",") if d.strip()]
        sizes = _ints_list(args.sizes, "sizes")
        if max(sizes) > LARGE_BYTES_LIMIT >> 10:
            raise DeviceError(f"--sizes {args.sizes}: {max(sizes)} KB is past the largest "
                              f"message the two-shot takes ({LARGE_BYTES_LIMIT >> 10} KB)")
        impls = [s.strip() for s in args.impls.split(",") if s.strip()]
        unknown = [s for s in impls if s not in BENCH_IMPLS]
        if unknown:
            raise DeviceError(f"--impls: unknown {', '.join(unknown)}; expected some of "
                              f"{', '.join(BENCH_IMPLS)}")
        if len(devices) < 2 or any(not d.startswith("cuda:") for d in devices):
            raise DeviceError(f"--device {args.device}: expected two or more GPUs, e.g. "
                              f"cuda:0,cuda:1")
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(devices):
            raise DeviceError(f"--device {args.device}: {torch.cuda.device_count()} GPU(s) "
                              f"visible to this torch ({torch.__version__})")
        if args.replays < 20:
            raise DeviceError(f"--replays {args.replays}: expected at least 20")
    except DeviceError as e:
        print(f"bench_comm: {e}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    # build (or find, or load the DSV4_CUDA_LIB one) the CUDA library once here, before the
    # ranks look for it
    lib_status = cuda_status(devices[0])
    name = torch.cuda.get_device_name(torch.device(devices[0]))
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    print(f"{len(devices)} x {name}; torch {torch.__version__}, NCCL {nccl}; CUDA C++ library: "
          f"{lib_status}; multicast off", flush=True)
    per_rank = launch(_rank, devices, impls, sizes, args.replays, timeout_s=TIMEOUT_S,
                      deadline_s=600)
    rows = merge(per_rank)
    default = per_rank[0]["default"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"devices": devices, "gpu": name, "torch": torch.__version__, "nccl": nccl,
                       "default": default, "rows": rows}, f, indent=1)
    print(f"\n(run: {time.monotonic() - t0:.0f} s)")
    print(format_table(rows, f"all-reduce of bf16 messages, {len(devices)} x {name}: us per "
                             f"all-reduce, median, slowest rank; graph = {ITERS} a graph, "
                             f"{args.replays} replays"))
    print(f"default plan: {default['parallel.allreduce']}")
    return 0 if all("FAIL" not in r.get("check", "") for r in rows) else 1
