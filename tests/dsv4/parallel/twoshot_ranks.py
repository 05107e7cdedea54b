"""What each rank runs in the GPU tests of our two-shot all-reduce (test_allreduce_gpu.py), beside
parallel_ranks.py (whose helpers it shares): module-level functions the launcher pickles into
spawned processes. Each takes the rank's TPGroup first and returns something small and picklable.
"""
from __future__ import annotations

import torch

from dsv4.errors import ParallelError
from dsv4.parallel import plan_allreduce
from parallel_ranks import POISON, _poison, digest, int_data, int_sum

TWO_SHOT_BYTES = 32 << 20      # the two-shot's capacity here: a 4096-row chunk's bf16 partials


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def f32_rank_sum(parts: list, dtype) -> torch.Tensor:
    """The float32 sum of parts in rank order, rounded once to dtype: our kernels' arithmetic
    (elementwise float32 adds are IEEE: the same bits from torch on any GPU)."""
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc.to(dtype)


def rand_parts(world: int, n: int, dtype, device, seed: int) -> list:
    """Every rank's random part of one call (each rank draws all of them: it needs the sum)."""
    return [torch.randn(n, generator=torch.Generator().manual_seed(seed * 8 + r)).to(dtype)
            .to(device) for r in range(world)]


def twoshot_checks(group, pdl: bool = False) -> dict:
    """Our two-shot kernel (a plan with large_bytes = TWO_SHOT_BYTES) on GPUs, memory poisoned
    first: per dtype and size (16 bytes, one chunk, a non-multiple of the chunk, past the grid's
    first round, the capacity) the bits of the float32 rank-order sum rounded once, into a NaN
    output and in place; calls of sizes going up and down (chunks a call does not reach keep older
    epochs); the plan's choice by size (integers: exact whoever serves); a CUDA graph of a kernel
    writing the input and three calls of changing sizes, replayed with new inputs. pdl: launched
    with PDL. Returns {"skip": reason} where the two-shot is unavailable."""
    dev, world, rank = group.device, group.world_size, group.rank
    bf16 = torch.bfloat16
    _poison(dev)
    ar = plan_allreduce(group, pdl=pdl, large_bytes=TWO_SHOT_BYTES)
    if ar.large is None:
        why = ar.table()["parallel.allreduce.twoshot"]
        ar.close()
        return {"skip": f"the two-shot: {why}"}
    two, res = ar.large, {"table": ar.table(), "exact": [], "digests": []}
    C, G = two.chunk, two.ctas
    for dtype in (bf16, torch.float16, torch.float32):
        for nbytes in (16, C, 3 * C + 48, C * G + 48, two.cap):
            n = nbytes // dtype.itemsize
            parts = rand_parts(world, n, dtype, dev, seed=nbytes)
            want = f32_rank_sum(parts, dtype)
            out = torch.full((n,), POISON, dtype=dtype, device=dev)
            two(parts[rank], out)
            y = parts[rank].clone()
            two(y, y)
            res["exact"].append((str(dtype), nbytes, same_bits(out, want), same_bits(y, want)))
            res["digests"].append(digest(out))
    # each call's inputs differ (a slot or flag of an earlier call read by mistake would show)
    base = rand_parts(world, two.cap // 2, bf16, dev, seed=99)
    res["sequence"] = []
    for i, nbytes in enumerate((two.cap, 16, 5 * C + 32, C * G + 48, 16, two.cap - 16, 2 * C,
                                2 * C * G + 112, 3 * C + 48)):
        parts = [torch.roll(b, 7919 * (i + 1))[: nbytes // 2] for b in base]
        out = torch.full((nbytes // 2,), POISON, dtype=bf16, device=dev)
        two(parts[rank], out)
        res["sequence"].append((nbytes, same_bits(out, f32_rank_sum(parts, bf16))))
        res["digests"].append(digest(out))
    res["served"] = []
    for nbytes in (4096, 64 << 10, (64 << 10) + 16, 1 << 20, two.cap, two.cap + 16):
        n = nbytes // 2
        x, out = int_data(rank, n, bf16, dev), torch.full((n,), POISON, dtype=bf16, device=dev)
        ar(x, out)
        res["served"].append((nbytes, ar.impl_for(nbytes, bf16).name,
                              bool(torch.equal(out, int_sum(world, n, bf16, dev)))))
    res["graph"] = _twoshot_graph(group, two, base)
    ar.check()
    group.barrier()
    ar.close()
    return res


def _twoshot_graph(group, two, base: list) -> list:
    """A graph of a kernel writing the input, the two-shot of the whole capacity, then of a
    non-multiple of the chunk out of place and again in place; three replays with new inputs.
    Per replay: (all bits right, digests)."""
    dev, world, bf16 = group.device, group.world_size, torch.bfloat16
    n, m = two.cap // 2, (3 * two.chunk + 48) // 2
    src = torch.empty(n, dtype=bf16, device=dev)
    xs, o1, o2 = (torch.full((n,), POISON, dtype=bf16, device=dev) for _ in range(3))
    torch.cuda.synchronize(dev)
    group.barrier()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                torch.add(src, 0, out=xs)       # the all-reduce must wait for this write
                two(xs, o1)
                two(o1[:m], o2[:m])
                two(o2[:m], o2[:m])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream(dev).wait_stream(side)
    out = []
    for step in range(3):
        parts = [torch.roll(b, 104729 * (step + 1)) for b in base]
        src.copy_(parts[group.rank])
        for t in (xs, o1, o2):
            t.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize(dev)
        want1 = f32_rank_sum(parts, bf16)
        # the sum of world equal bf16 values, twice: world^2 times them, exact (world 2 or 4)
        want2 = (want1[:m].float() * (world * world)).to(bf16)
        ok = same_bits(o1, want1) and same_bits(o2[:m], want2) and bool(o2[m:].isnan().all())
        out.append((ok, digest(o1), digest(o2[:m])))
    return out


def twoshot_timeout(group) -> str:
    """Rank 1 skips the one 1 MB all-reduce rank 0 makes (the two-shot serves it): rank 0's
    kernel gives up after its 5 s timeout, writes NaN and reports rank 1 through check()."""
    ar = plan_allreduce(group, timeout_s=5, large_bytes=TWO_SHOT_BYTES)
    if ar.large is None:
        return "unavailable: " + ar.table()["parallel.allreduce.twoshot"]
    x = torch.ones(1 << 19, dtype=torch.bfloat16, device=group.device)
    if group.rank == 0:
        ar(x)
        torch.cuda.synchronize(group.device)
        try:
            ar.check()
            return f"no error; served by {ar.impl_for(1 << 20, x.dtype).name}; nan: " \
                   f"{bool(x.isnan().all())}"
        except ParallelError as e:
            return f"{e} | nan: {bool(x.isnan().all())}"
    return "skipped the call"
