"""dsv4.parallel's all-reduce on 2 and 4 GPUs (one process a GPU, NCCL): every implementation gives
the exact sum into poisoned (NaN) outputs, eager and inside a CUDA graph replayed with new inputs,
the same bits on every rank and on a second run; messages past the fast path's size go through
NCCL; our kernel gives up on a rank that never arrives, naming it, instead of hanging."""
from __future__ import annotations

import pytest
import torch

import parallel_ranks
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
