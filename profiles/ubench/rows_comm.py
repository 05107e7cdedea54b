"""What a sequence-parallel prefill chunk's collectives cost on this machine's GPUs, alone.

A TP prefill chunk split by rows gathers each sublayer's input ([T / world, 4096] bf16 a rank ->
[T, 4096]) and reduce-scatters its output ([T, 4096] -> [T / world, 4096]). This times both
through NCCL (one process a GPU, NVLink multicast off), through PyTorch symmetric memory's
low-contention collectives (peer copies from a side stream, no SM of the caller's: what could
overlap a chunk's compute), and through the peer copy engines (one process, a copy of a rank's
rows into each other GPU), and prints GB/s of the bytes a rank receives.

    python profiles/ubench/rows_comm.py [--gpus 2] [--rows 4096] [--width 4096] [--iters 20]

Set NCCL_* variables in the environment to compare NCCL's settings (NCCL_PROTO=Simple, say).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# as dsv4.parallel.group.MULTICAST_OFF (this file does not import dsv4)
for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
             "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[k] = v


def _timed(fn, iters: int) -> float:
    """us a call of fn (on the current stream), after 3 warm calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1000 / iters


def _rank(rank: int, world: int, port: int, rows: int, width: int, iters: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    dev = torch.device("cuda", rank)
    mine = torch.randn(rows // world, width, device=dev).to(torch.bfloat16)
    whole = torch.empty(rows, width, device=dev, dtype=torch.bfloat16)
    full = torch.randn(rows, width, device=dev).to(torch.bfloat16)
    part = torch.empty(rows // world, width, device=dev, dtype=torch.bfloat16)
    got = mine.numel() * mine.element_size() * (world - 1)   # bytes a rank receives
    res = {}
    for name, fn in (("all-gather", lambda: dist.all_gather_into_tensor(whole, mine)),
                     ("reduce-scatter", lambda: dist.reduce_scatter_tensor(part, full))):
        dist.barrier()
        us = _timed(fn, iters)
        res[name] = us
    res.update(_symm(rank, world, mine, full, iters))
    out = [None] * world
    dist.all_gather_object(out, res)
    if rank == 0:
        for name in dict.fromkeys(k for r in out for k in r):
            got_all = [r.get(name) for r in out]
            if not all(isinstance(v, float) for v in got_all):
                print(f"{name}: " + "; ".join(f"rank {i}: {v}" for i, v in enumerate(got_all)))
                continue
            worst = max(got_all)
            who = "nccl " if name in ("all-gather", "reduce-scatter") else ""
            print(f"{who}{name:15s} {rows} x {width} bf16 over {world}: {worst:8.1f} us "
                  f"(the slowest rank), {got / worst / 1e3:6.1f} GB/s received a rank")
    dist.destroy_process_group()


def _symm(rank: int, world: int, mine, full, iters: int) -> dict:
    """PyTorch symmetric memory's low-contention all-gather and reduce-scatter (peer copies from
    a side stream, the inputs in symmetric memory: no SM of the caller's), timed as NCCL's ->
    {name: us}, or {name: why not} where this torch lacks them."""
    name = "symm-mem all-gather / reduce-scatter"
    try:
        import torch.distributed._symmetric_memory as sm
        group = dist.group.WORLD.group_name
        if hasattr(sm, "enable_symm_mem_for_group"):
            sm.enable_symm_mem_for_group(group)
        a = sm.empty(mine.shape, dtype=mine.dtype, device=mine.device)
        b = sm.empty(full.shape, dtype=full.dtype, device=full.device)
        a.copy_(mine)
        b.copy_(full)
        sm.rendezvous(a, group)
        sm.rendezvous(b, group)
        ag = torch.ops.symm_mem._low_contention_all_gather
        rs = torch.ops.symm_mem._low_contention_reduce_scatter
        # this rank's rows where they belong in the gather (the timing goes on either way: every
        # rank must reach the same barriers)
        kept = torch.equal(ag(a, group)[rank * a.shape[0]:(rank + 1) * a.shape[0]], mine)
        out = {} if kept else {"symm all-gather, rank %d" % rank: "lost this rank's rows"}
        for n, fn in (("symm all-gather", lambda: ag(a, group)),
                      ("symm reduce-scatter", lambda: rs(b, "sum", group))):
            dist.barrier()
            out[n] = _timed(fn, iters)
        return out
    except Exception as e:   # an older / newer torch, or no peer access: say so, time the rest
        return {name: f"not measured ({type(e).__name__}: {str(e).splitlines()[0][:120]})"}


def _copy_engines(world: int, rows: int, width: int, iters: int) -> None:
    """One process: each GPU's rows copied into every other GPU's buffer (the copy engines, as a
    gather over peer memory would run), all copies in flight together."""
    n = rows // world
    src = [torch.randn(n, width, device=f"cuda:{g}").to(torch.bfloat16) for g in range(world)]
    dst = [torch.empty(rows, width, device=f"cuda:{g}", dtype=torch.bfloat16) for g in range(world)]
    streams = [torch.cuda.Stream(device=f"cuda:{g}") for g in range(world)]

    def gather():
        for g in range(world):
            with torch.cuda.stream(streams[g]):
                for o in range(world):
                    if o != g:
                        dst[g][o * n:(o + 1) * n].copy_(src[o], non_blocking=True)
        for g in range(world):
            streams[g].synchronize()

    import time
    for _ in range(3):
        gather()
    t = time.perf_counter()
    for _ in range(iters):
        gather()
    us = (time.perf_counter() - t) / iters * 1e6
    got = n * width * 2 * (world - 1)
    print(f"copy engines   pulled {rows} x {width} bf16 over {world}: {us:8.1f} us (host-timed, "
          f"with a sync a call), {got / us / 1e3:6.1f} GB/s received a GPU")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args(argv)
    if torch.cuda.device_count() < a.gpus:
        print(f"rows_comm: needs {a.gpus} GPUs, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name(0)} x {a.gpus}; NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}; "
          + " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")))
    for rows in sorted({a.rows, a.rows // 4}):
        mp.spawn(_rank, args=(a.gpus, 29500 + rows % 97, rows, a.width, a.iters), nprocs=a.gpus)
        _copy_engines(a.gpus, rows, a.width, a.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
