"""dsv4.parallel's all-reduce on 2 and 4 GPUs (one process a GPU, NCCL): every implementation gives
the exact sum into poisoned (NaN) outputs, eager and inside a CUDA graph replayed with new inputs,
the same bits on every rank and on a second run; messages past the fast path's size go through
NCCL; our kernel gives up on a rank that never arrives, naming it, instead of hanging. Our two-shot
kernel (large messages): the bits of the float32 rank-order sum rounded once, at every size and
through sizes that change between calls, eager and in a graph, with and without PDL; its timeout;
its C entry's refusals (one GPU).
GPU: `python -m pytest -m "cuda or multigpu" tests/dsv4/parallel/test_allreduce_gpu.py`."""
from __future__ import annotations

import ctypes

import pytest
import torch

import parallel_ranks
import twoshot_ranks
from dsv4.kernels.cuda import lib as cuda_lib
from dsv4.parallel import IMPLEMENTATIONS, launch


def _devices(n: int) -> list[str]:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, {torch.cuda.device_count()} visible")
    return [f"cuda:{i}" for i in range(n)]


@pytest.mark.multigpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_every_implementation_sums_exactly_everywhere(impl, world):
    # the group's default timeout: rank 0 may build the CUDA library first (about a minute)
    got = launch(parallel_ranks.gpu_checks, _devices(world), impl, deadline_s=600)
    if "skip" in got[0]:
        assert impl != "nccl", got[0]["skip"]
        pytest.skip(got[0]["skip"])
    head = got[0]["table"]["parallel.allreduce"]
    assert head == ("nccl" if impl == "nccl" else f"{impl} up to 64 KB, nccl above")
    for r in got:
        bad = [e for e in r["exact"] if not e[-1]]
        assert not bad, f"rank {got.index(r)}: not the exact sum for {bad}"
        assert all(r["repeat"]) and all(r["close"])
        assert all(ok for ok, _ in r["graph"]), r["graph"]
        assert r["digests"] == got[0]["digests"] and r["graph"] == got[0]["graph"]
    served = {(dt, n): name for dt, n, name, _ in got[0]["exact"]}
    assert served[("torch.bfloat16", 65536)] == "nccl"      # 128 KB: past the fast path
    if impl != "nccl":
        assert served[("torch.bfloat16", 4096)] == impl     # one 4096-wide row: the fast path


@pytest.mark.multigpu
@pytest.mark.parametrize("world", [2, 4])
def test_oneshot_with_pdl_sums_exactly_everywhere(world):
    """Our kernel launched with PDL (as a TP rank's decode step launches it where DSV4_PDL is
    on), right behind the kernel that writes its input, eager and in a graph: the same checks."""
    got = launch(parallel_ranks.gpu_checks, _devices(world), "oneshot", True, deadline_s=600)
    if "skip" in got[0]:
        pytest.skip(got[0]["skip"])
    for r in got:
        assert all(e[-1] for e in r["exact"]) and all(r["repeat"]) and all(r["close"])
        assert all(ok for ok, _ in r["graph"]), r["graph"]
        assert r["digests"] == got[0]["digests"] and r["graph"] == got[0]["graph"]


@pytest.mark.multigpu
@pytest.mark.parametrize("world, pdl", [(2, False), (2, True), (4, True)])
def test_oneshot_with_the_mhc_post_gives_the_post_of_the_sum_everywhere(world, pdl):
    """Our kernel's all-reduce + mHC post in one launch (DSV4_FUSE_POST): every output element
    written (poisoned memory), the same bits on every rank and on a second call, x untouched,
    the float64 post of the plain call's sum within its float32 bound and the Triton hc_post of
    that sum within one rounding of the dtype; a graph replay gives the eager bits."""
    got = launch(parallel_ranks.post_checks, _devices(world), pdl, deadline_s=600)
    if "skip" in got[0]:
        pytest.skip(got[0]["skip"])
    for r in got:
        for c, c0 in zip(r["cases"], got[0]["cases"]):
            assert c["took"] and c["finite"] and c["repeat"] and c["x kept"], c
            assert c["near"] and c["one rounding"], c
            assert c["digest"] == c0["digest"], (c["case"], "differs between ranks")
        assert all(ok for ok, _ in r["graph"]) and r["graph"] == got[0]["graph"], r["graph"]
    # how often the fused post's float order gives the Triton hc_post's bits: reported, not
    # required (its float order is its own)
    print({str(c["case"]): c["same as triton"] for c in got[0]["cases"]})


@pytest.mark.multigpu
def test_oneshot_gives_up_on_a_rank_that_never_arrives():
    got = launch(parallel_ranks.oneshot_timeout, _devices(2), deadline_s=600)
    if got[0].startswith("all-reduce implementation 'oneshot' is unavailable"):
        pytest.skip(got[0])
    assert got[1] == "skipped the call"
    assert "waited 5 s for rank 1" in got[0] and "its output is NaN" in got[0], got[0]
    assert got[0].endswith("| nan: True")


@pytest.mark.multigpu
def test_nccl_on_two_ranks_rounds_once():
    """NcclAllReduce.sums_in_float32 on two ranks (so a TP2 prefill chunk's bf16 partials are
    summed by NCCL in bf16, without the float32 copy): NCCL's own bf16 / fp16 sum gives the bits
    of the float32 copy's sum cast back, on values chosen to make the roundings differ if they
    could; on four ranks the plan does not claim it."""
    got = launch(parallel_ranks.nccl_rounds_once, _devices(2), deadline_s=600)
    for r in got:
        assert all(r["says"].values()), r["says"]
        for dtype, cases in r["equal"].items():
            assert all(ok for _, ok in cases), (dtype, cases)
    if torch.cuda.device_count() >= 4:
        got = launch(parallel_ranks.nccl_rounds_once, _devices(4), deadline_s=600)
        assert not any(got[0]["says"].values())


@pytest.mark.multigpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("pdl", [False, True])
def test_twoshot_gives_the_float32_rank_order_sum_everywhere(world, pdl):
    got = launch(twoshot_ranks.twoshot_checks, _devices(world), pdl, deadline_s=600)
    if "skip" in got[0]:
        pytest.skip(got[0]["skip"])
    assert got[0]["table"]["parallel.allreduce"] == ("oneshot up to 64 KB, twoshot up to 32 MB, "
                                                     "nccl above")
    for k, r in enumerate(got):
        bad = [e for e in r["exact"] if not all(e[2:])]
        assert not bad, f"rank {k}: not the float32 rank-order sum (out, in place) for {bad}"
        bad = [e for e in r["sequence"] if not e[1]]
        assert not bad, f"rank {k}: wrong bits in the sequence of sizes at {bad}"
        assert all(ok for *_, ok in r["served"]), r["served"]
        assert all(ok for ok, *_ in r["graph"]), r["graph"]
        assert r["digests"] == got[0]["digests"] and r["graph"] == got[0]["graph"]
    served = {nbytes: name for nbytes, name, _ in got[0]["served"]}
    assert served == {4096: "oneshot", 64 << 10: "oneshot", (64 << 10) + 16: "twoshot",
                      1 << 20: "twoshot", 32 << 20: "twoshot", (32 << 20) + 16: "nccl"}


@pytest.mark.multigpu
def test_twoshot_gives_up_on_a_rank_that_never_arrives():
    got = launch(twoshot_ranks.twoshot_timeout, _devices(2), deadline_s=600)
    if got[0].startswith("unavailable"):
        pytest.skip(got[0])
    assert got[1] == "skipped the call"
    assert "the two-shot all-reduce waited 5 s for rank 1" in got[0], got[0]
    assert "its output is NaN" in got[0] and got[0].endswith("| nan: True"), got[0]


@pytest.mark.cuda
def test_the_twoshot_entry_refuses_what_it_does_not_support():
    """dsv4_allreduce2 returns -1 (nothing launched) for each unsupported argument, and
    dsv4_ar2_buffer_bytes 0 for unsupported sizes; the buffer of a supported one is the layout
    of the kernel's header (flags, then two regions of ceil(K / N) * (N - 1) slots)."""
    lib = cuda_lib.lib_for(torch.device("cuda:0"))
    if lib is None:
        pytest.skip(cuda_lib.status("cuda:0"))
    cap, chunk, ctas = 1 << 20, 16384, 128
    for world in (2, 3, 4, 8):
        k, slots = cap // chunk, -(-(cap // chunk) // world) * (world - 1)
        flags = ctas * 4 + k * 8 * 4 + k * 4              # each a multiple of 128 bytes here
        assert lib.dsv4_ar2_buffer_bytes(cap, chunk, ctas, world) == flags + 2 * slots * chunk
    for sizes in ((cap, 1000, ctas, 2), (cap + 512, chunk, ctas, 2), (cap, chunk, 0, 2),
                  (cap, chunk, 1025, 2), (cap, chunk, ctas, 1), (cap, chunk, ctas, 9)):
        assert lib.dsv4_ar2_buffer_bytes(*sizes) == 0, sizes
    peers = (ctypes.c_void_p * 2)(16, 32)
    # (world, rank, x, out, nbytes, dtype, cap, chunk, ctas) of a supported call (never made: the
    # addresses are not buffers), then each argument in turn out of bounds
    good = (2, 0, 16, 16, 16, 1, cap, chunk, ctas)
    bad = {0: (1, 9), 1: (-1, 2), 2: (8,), 3: (24,), 4: (0, 24, cap + 16), 5: (-1, 3),
           6: (cap + 512,), 7: (1000,), 8: (0, 1025)}
    for i, values in bad.items():
        for v in values:
            args = (*good[:i], v, *good[i + 1:])
            assert lib.dsv4_allreduce2(peers, *args, 10 ** 9, None, None, 0) == -1, args


@pytest.mark.cuda
def test_the_post_entry_refuses_what_it_does_not_support():
    """dsv4_allreduce_post returns -1 (nothing launched) for each unsupported argument: the
    one-shot's (world, rank, sizes, alignment), rows that do not divide the message, hc other
    than 4, a dtype other than float32 / bf16, a missing post or comb."""
    lib = cuda_lib.lib_for(torch.device("cuda:0"))
    if lib is None:
        pytest.skip(cuda_lib.status("cuda:0"))
    cap, chunk = 64 << 10, 8192
    peers = (ctypes.c_void_p * 2)(16, 32)
    # (world, rank, x, res, post, comb, out, nbytes, row_bytes, hc, dtype, cap, chunk) of a
    # supported call (never made: the addresses are not buffers), then each argument in turn
    # out of bounds
    good = (2, 0, 16, 32, 48, 64, 80, 8192, 8192, 4, 1, cap, chunk)
    bad = {0: (1, 9), 1: (-1, 2), 2: (8,), 3: (40,), 4: (None,), 5: (None,), 6: (24,),
           7: (0, 24, cap + 8192), 8: (0, 24, 3072), 9: (3, 8), 10: (-1, 2, 3),
           11: (cap + 512,), 12: (1000,)}
    for i, values in bad.items():
        for v in values:
            args = (*good[:i], v, *good[i + 1:])
            assert lib.dsv4_allreduce_post(peers, *args, 10 ** 9, None, None, 0) == -1, args
