"""What each rank runs in the tests of tests/dsv4/parallel/ (module-level functions: the launcher
pickles them into spawned processes, which import this module from the test folder on sys.path).
Each takes the rank's TPGroup first and returns something small and picklable."""
from __future__ import annotations

import functools
import hashlib
import os
import time

import torch

from dsv4.errors import DeviceError, ParallelError
from dsv4.parallel import MULTICAST_OFF, launch, plan_allreduce

POISON = float("nan")


def digest(t: torch.Tensor) -> str:
    """The bits of t (any dtype), as a short hash: equal digests, equal bits."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()[:16]


def int_data(rank: int, n: int, dtype, device) -> torch.Tensor:
    """Integers in [-6, 6], different on each rank and element: their sums over <= 8 ranks are
    exact in bf16 / fp16 / float32 whatever the order of the additions."""
    i = torch.arange(n, dtype=torch.int64)
    return (((i * (rank + 3) + 5 * rank + 1) % 13) - 6).to(dtype).to(device)


def int_sum(world: int, n: int, dtype, device) -> torch.Tensor:
    return sum(int_data(r, n, torch.float64, "cpu") for r in range(world)).to(dtype).to(device)


def describe(group) -> dict:
    """Start-up: who this rank is, what it sees of the others and of the environment."""
    return {"rank": group.rank, "world": group.world_size, "device": str(group.device),
            "backend": group.backend, "ranks": group.all_gather_object(group.rank),
            "env": {k: os.environ.get(k) for k in MULTICAST_OFF}}


def fail_after_start(group, how: str) -> None:
    """Rank 1 fails as `how` says; rank 0 meanwhile all-reduces (and fails because of rank 1)."""
    ar = plan_allreduce(group)
    if group.rank == 1:
        if how == "raise":
            raise ValueError("boom at rank 1")
        if how == "exit":
            os._exit(7)
        time.sleep(120)                 # "stall": alive, never joins the collective
        return None
    x = torch.ones(16)
    ar(x)
    return x.tolist()


def allreduce_checks(group, prefer: str | None = None) -> dict:
    """The NCCL path (gloo here) or `prefer`: exact sums, the same bits on every rank and on a
    second run, out of place into poisoned memory, in place, shapes, and the plan's table."""
    dev = group.device
    ar = plan_allreduce(group, prefer=prefer)
    res = {"table": ar.table(), "exact": [], "digests": [], "repeat": []}
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for shape in ((4096,), (4100,), (2, 4096), (1,)):
            n = 1
            for s in shape:
                n *= s
            x = int_data(group.rank, n, dtype, dev).view(shape)
            out = torch.full(shape, POISON, dtype=dtype, device=dev)
            ar(x, out)
            want = int_sum(group.world_size, n, dtype, dev).view(shape)
            res["exact"].append((str(dtype), shape, bool(torch.equal(out, want))))
            g = torch.Generator().manual_seed(1000 + group.rank)
            y = torch.randn(shape, generator=g).to(dtype).to(dev)
            a, b = y.clone(), y.clone()
            ar(a)
            ar(b)
            res["digests"].append(digest(a))
            res["repeat"].append(digest(a) == digest(b))
    empty = torch.empty(0, device=dev)
    res["empty"] = ar(empty).numel() == 0
    try:
        ar(torch.zeros(8, device=dev), torch.zeros(9, device=dev))
        res["mismatch"] = "no error"
    except ValueError as e:
        res["mismatch"] = str(e)
    ar.close()
    res["prefer_oneshot"] = prefer_unavailable(group, "oneshot")
    return res


def prefer_unavailable(group, prefer: str) -> str:
    try:
        plan_allreduce(group, prefer=prefer)
    except DeviceError as e:
        return str(e)
    return "no error"


def oneshot_timeout(group) -> str:
    """Rank 1 skips the one all-reduce rank 0 makes: rank 0's kernel gives up after its 5 s
    timeout, writes NaN and reports rank 1 through check()."""
    try:
        ar = plan_allreduce(group, prefer="oneshot", timeout_s=5)
    except DeviceError as e:
        return str(e)
    x = torch.ones(4096, dtype=torch.bfloat16, device=group.device)
    if group.rank == 0:
        ar(x)
        torch.cuda.synchronize(group.device)
        try:
            ar.check()
            return "no error; nan: %s" % bool(x.isnan().all())
        except ParallelError as e:
            return f"{e} | nan: {bool(x.isnan().all())}"
    return "skipped the call"


def _poison(device) -> None:
    from conftest import poison_cuda_memory      # tests/ is on the inherited sys.path
    if os.environ.get("DSV4_TEST_POISON", "1") != "0":
        poison_cuda_memory(device)


def gpu_checks(group, prefer: str, pdl: bool = False) -> dict:
    """On GPUs, one implementation: eager and captured calls give the exact sum into poisoned
    outputs, the same bits on every rank and on a second run; messages past the fast path's size
    (NCCL) too; pdl: our kernel launched with PDL, right behind the kernel that writes its input.
    Returns {"skip": reason} where the implementation is unavailable."""
    dev = group.device
    _poison(dev)
    try:
        ar = plan_allreduce(group, prefer=prefer, pdl=pdl)
    except DeviceError as e:
        return {"skip": str(e)}
    world, res = group.world_size, {"table": ar.table(), "exact": [], "digests": [], "repeat": []}
    sizes = (2048, 4096, 4100, 16384, 32768, 65536)    # bf16: 4 KB .. 128 KB (past 64 KB: NCCL)
    for dtype in (torch.bfloat16, torch.float32):
        for n in sizes:
            x = int_data(group.rank, n, dtype, dev)
            out = torch.full((n,), POISON, dtype=dtype, device=dev)
            ar(x, out)
            want = int_sum(world, n, dtype, dev)
            res["exact"].append((str(dtype), n, ar.impl_for(n * x.element_size(), dtype).name,
                                 bool(torch.equal(out, want))))
            g = torch.Generator().manual_seed(7 + group.rank)
            y = torch.randn(n, generator=g).to(dtype).to(dev)
            a, b = y.clone(), y.clone()
            ar(a)
            ar(b)
            res["digests"].append(digest(a))
            res["repeat"].append(digest(a) == digest(b))
            parts = [torch.randn(n, generator=torch.Generator().manual_seed(7 + r))
                     .to(dtype).double() for r in range(world)]
            # every rounding (one per add in the element dtype, or the one of a float32 sum) is
            # at most a unit roundoff of a partial sum, itself at most sum |x_r|
            u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24
            bound = world * u * sum(p.abs() for p in parts)
            err = (a.double().cpu() - sum(parts)).abs()
            res.setdefault("close", []).append(bool((err <= bound).all()))
    # a graph of a kernel writing the input, then three chained all-reduces (one in place),
    # replayed with new inputs
    n = 4096
    src = int_data(group.rank, n, torch.bfloat16, dev)
    xs = torch.full_like(src, POISON)
    o1 = torch.full((n,), POISON, dtype=torch.bfloat16, device=dev)
    o2 = torch.full_like(o1, POISON)
    torch.cuda.synchronize(dev)
    group.barrier()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                torch.add(src, 0, out=xs)       # the all-reduce must wait for this write
                ar(xs, o1)
                ar(o1, o2)
                ar(o2)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream(dev).wait_stream(side)
    res["graph"] = []
    for step in range(3):
        src.copy_(int_data(group.rank + step, n, torch.bfloat16, dev))
        xs.fill_(POISON)
        o1.fill_(POISON)
        o2.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize(dev)
        base = sum(int_data(r + step, n, torch.float64, "cpu") for r in range(world))
        want = (base * world * world).to(torch.bfloat16).to(dev)    # exact for 2 and 4 ranks
        res["graph"].append((bool(torch.equal(o2, want)), digest(o2)))
    ar.check()
    group.barrier()
    ar.close()
    return res


def post_checks(group, pdl: bool = False) -> dict:
    """On GPUs, our one-shot kernel with the mHC post (AllReduce.post; DSV4_FUSE_POST): into
    poisoned outputs, x [T, D] of each rank summed and put into the 4 streams (res, post, comb the
    same on every rank, as a TP block's are) -> per case: the same bits on every rank (digest),
    on a second call, x left as it was, the bits of its sum as the plain call writes them (the
    post of the plain call's output through the Triton hc_post within one rounding of the
    output dtype, and the float64 post of that sum within the bound of its float32 sums); then
    a graph (a kernel writing x, the fused call) replayed with new inputs gives the eager bits.
    Returns {"skip": reason} where the one-shot is unavailable."""
    from dsv4.kernels.decode.mhc import hc_post as triton_hc_post
    dev, C = group.device, 4
    _poison(dev)
    try:
        ar = plan_allreduce(group, prefer="oneshot", pdl=pdl)
    except DeviceError as e:
        return {"skip": str(e)}
    res = {"cases": []}

    def inputs(T, D, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        h = torch.randn(T, C, D, generator=g).to(dtype).to(dev)
        post = (2 * torch.rand(T, C, generator=g)).to(dev)
        comb = torch.rand(T, C, C, generator=g).to(dev)
        xg = torch.Generator().manual_seed(seed + 100 + group.rank)
        return torch.randn(T, D, generator=xg).to(dtype).to(dev), h, post, comb

    # up to the buffer's 64 KB: 8 bf16 rows of 4096 (the speculative verify rows), 4 float32
    for dtype, rows in ((torch.bfloat16, 8), (torch.float32, 4)):
        for T, D in ((1, 4096), (3, 1024), (rows, 4096)):
            x, h, post, comb = inputs(T, D, dtype, 11 + T)
            x0 = x.clone()
            out = torch.full((T, C, D), POISON, dtype=dtype, device=dev)
            took = ar.post(x, h, post, comb, out)
            again = torch.full_like(out, POISON)
            ar.post(x, h, post, comb, again)
            s = x.clone()
            ar(s)                                         # the plain call's sum
            via = triton_hc_post(s, h, post, comb, pdl=False)
            terms = (post.double().unsqueeze(-1) * s.double().unsqueeze(-2),
                     comb.double().unsqueeze(-1) * h.double().unsqueeze(-2))
            want = terms[0] + terms[1].sum(1)
            size = terms[0].abs() + terms[1].abs().sum(1)
            u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24
            near = bool(((out.double() - want).abs() <= u * want.abs() + 8 * 2.0 ** -24 * size)
                        .all())
            one = bool(((out.double() - via.double()).abs() <= 2 * u * via.double().abs()
                        + 16 * 2.0 ** -24 * size).all())
            torch.cuda.synchronize(dev)
            res["cases"].append({"case": (str(dtype), T, D), "took": took,
                                 "digest": digest(out), "repeat": torch.equal(out, again),
                                 "x kept": torch.equal(x, x0), "near": near, "one rounding": one,
                                 "finite": bool(out.isfinite().all()),
                                 "same as triton": torch.equal(out, via)})
    # a graph: a kernel writes x, then the fused call; replayed with new inputs
    T, D, dtype = 1, 4096, torch.bfloat16
    x, h, post, comb = inputs(T, D, dtype, 3)
    src, xs = x.clone(), torch.full_like(x, POISON)
    o = torch.full((T, C, D), POISON, dtype=dtype, device=dev)
    torch.cuda.synchronize(dev)
    group.barrier()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            torch.add(src, 0, out=xs)               # the fused call must wait for this write
            ar.post(xs, h, post, comb, o)
    torch.cuda.current_stream(dev).wait_stream(side)
    res["graph"] = []
    for step in range(3):
        x2, h2, post2, comb2 = inputs(T, D, dtype, 40 + step)
        src.copy_(x2)
        h.copy_(h2)
        post.copy_(post2)
        comb.copy_(comb2)
        o.fill_(POISON)
        graph.replay()
        eager = torch.full_like(o, POISON)
        ar.post(x2, h2, post2, comb2, eager)
        torch.cuda.synchronize(dev)
        res["graph"].append((torch.equal(o, eager), digest(o)))
    ar.check()
    group.barrier()
    ar.close()
    return res


class FakeLib:
    """The CUDA library's buffer calls on the CPU, one of them failing on one rank: what the
    one-shot all-reduce's host side does with a failure (every rank agrees, every rank frees)."""

    def __init__(self, rank: int, fail: tuple[str, int]):
        self.rank, self.fail, self.calls = rank, fail, []

    def dsv4_ar_buffer_bytes(self, cap, chunk):
        return 4096

    def dsv4_ar_ipc_handle_bytes(self):
        return 64

    def dsv4_error_string(self, code):
        return b"out of memory"

    def dsv4_ar_alloc(self, dev, nbytes, ptr, handle):
        if self.fail == ("alloc", self.rank):
            return 2
        ptr._obj.value = 0x1000 + self.rank
        self.calls.append("alloc")
        return 0

    def dsv4_ar_status_alloc(self, host, dev):
        return 0                        # left null: check() has nothing to read

    def dsv4_ar_open(self, dev, handle, ptr):
        if self.fail == ("open", self.rank):
            return 2
        ptr._obj.value = 0x2000
        self.calls.append("open")
        return 0

    def dsv4_ar_close(self, dev, ptr):
        self.calls.append("close")
        return 0

    def dsv4_ar_free(self, dev, ptr):
        self.calls.append("free")
        return 0


def oneshot_failures_agreed(group) -> list:
    """The default plan with the one-shot kernel's buffer calls faked, failing (a) the allocation
    on rank 1, (b) the mapping on rank 0: per case, the plan's row and this rank's calls."""
    from dsv4.parallel import oneshot
    oneshot.OneShotAllReduce.unavailable = staticmethod(lambda g, m: None)
    out = []
    for fail in (("alloc", 1), ("open", 0)):
        fake = FakeLib(group.rank, fail)
        oneshot.cuda_lib.lib_for = lambda dev, fake=fake: fake
        ar = plan_allreduce(group)
        out.append((ar.table()["parallel.allreduce.oneshot"], ar.name, fake.calls))
    return out


def large_plans(group) -> dict:
    """Plans that ask for the two-shot of messages up to 1 MB: their tables, by `prefer`."""
    out = {}
    for prefer in (None, "nccl"):
        ar = plan_allreduce(group, prefer=prefer, large_bytes=1 << 20)
        out[str(prefer)] = ar.table()
        ar.close()
    return out


def cpu_rank(group) -> dict:
    """Everything the CPU tests of the group and the all-reduce ask of one rank, in one start-up
    (the fakes of oneshot_failures_agreed last: they patch this process's modules)."""
    return {"describe": describe(group), "allreduce": allreduce_checks(group),
            "large": large_plans(group), "agreed": oneshot_failures_agreed(group),
            "hosts": two_hosts(group)}


def two_hosts(group) -> dict:
    """The plan when the ranks report different host names (torchrun across nodes)."""
    import socket
    socket.gethostname = lambda: f"node{group.rank}"
    return plan_allreduce(group).table()


@functools.cache
def two_cpu_ranks() -> tuple:
    """cpu_rank on two gloo ranks, launched once per test process (a start-up costs seconds)."""
    return tuple(launch(cpu_rank, ["cpu", "cpu"], timeout_s=30, deadline_s=120))


def nccl_rounds_once(group) -> dict:
    """On GPUs, through NCCL itself: a bf16 / fp16 partial all-reduced in its own dtype against
    its float32 copy's all-reduce cast back (the route TensorParallel.reduce takes where the
    serving implementation does not sum in float32), on values that make rounding matter:
    normal values, exponents up to 2^-40 .. 2^40 apart, opposite signs that cancel, values one
    unit apart, sums exactly halfway between two values. -> {"equal": {dtype: [(case, equal
    bits)]}, "says": {dtype: NcclAllReduce.sums_in_float32}} (two ranks: the halfway case needs
    rank 0 and rank 1 as written)."""
    import torch.distributed as dist
    from dsv4.parallel.nccl import NcclAllReduce
    dev, n = group.device, 1 << 16
    g = torch.Generator().manual_seed(11 + group.rank)
    out = {"says": {}, "equal": {}}
    for dtype in (torch.bfloat16, torch.float16):
        top = 40 if dtype == torch.bfloat16 else 12          # fp16: stay inside its range
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10       # at 1.0
        base = torch.randn(n, generator=g)
        cases = {
            "normal": base,
            "exponent gaps": base * torch.exp2(torch.randint(-top, top + 1, (n,), generator=g)
                                               .float()),
            # every rank the same magnitudes, signs by rank: sums cancel to a few units
            "cancelling": torch.randn(n, generator=torch.Generator().manual_seed(5)).abs() *
            (1.0 if group.rank % 2 == 0 else -1.0) * (1 + 2 ** -7 * (group.rank + 1)),
            "unit apart": torch.full((n,), 1.0) + 2.0 ** -7 * torch.randint(
                0, 4, (n,), generator=g).float() * (group.rank + 1),
            # rank 0 one of 1, 1 + ulp, ...; rank 1 half a unit: every sum a tie to break
            "halfway": (1.0 + ulp * torch.randint(0, 8, (n,), generator=g).float()
                        if group.rank == 0 else torch.full((n,), ulp / 2)),
        }
        eq = []
        for name, v in cases.items():
            x = v.to(dtype).to(dev)
            a = x.clone()
            dist.all_reduce(a, group=group.pg)
            b = x.float()
            dist.all_reduce(b, group=group.pg)
            eq.append((name, bool(torch.equal(a, b.to(dtype)))))
        out["equal"][str(dtype)] = eq
        out["says"][str(dtype)] = NcclAllReduce(group).sums_in_float32(dtype)
    return out
