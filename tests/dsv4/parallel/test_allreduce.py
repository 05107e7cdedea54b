"""dsv4.parallel.allreduce on the CPU: two gloo ranks; the plan falls back to torch.distributed
(the NCCL path) and says why the others cannot serve; sums exact where the arithmetic is, into
poisoned outputs and in place, the same bits on every rank and on a second run; bad calls and an
unavailable implementation get errors that name the problem and the fix."""
from __future__ import annotations

import pytest

import parallel_ranks
from dsv4.parallel import IMPLEMENTATIONS, PREFERENCE
from dsv4.parallel.allreduce import _agreed


@pytest.fixture(scope="module")
def two_ranks():
    return [r["allreduce"] for r in parallel_ranks.two_cpu_ranks()]


def test_plan_on_the_cpu_is_torch_distributed(two_ranks):
    for r in two_ranks:
        t = r["table"]
        assert t["parallel.allreduce"] == "nccl"
        assert t["parallel.group"] == "2 ranks, gloo, timeout 30 s"
        assert t["parallel.allreduce.nccl"] == "chosen: torch.distributed.all_reduce (gloo)"
        for name in ("oneshot", "symm_one_shot", "symm_two_shot"):
            assert t[f"parallel.allreduce.{name}"] == "unavailable: not a CUDA device"


def test_sums_are_exact_and_the_same_bits_everywhere(two_ranks):
    r0, r1 = two_ranks
    assert r0["exact"] and all(ok for *_, ok in r0["exact"] + r1["exact"]), r0["exact"]
    assert r0["digests"] == r1["digests"]             # every rank, every dtype and shape
    assert all(r0["repeat"]) and all(r1["repeat"])    # a second run, the same bits
    assert r0["empty"] and r1["empty"]
    assert "out (9,) torch.float32 does not match x (8,) torch.float32" in r0["mismatch"]


def test_an_unavailable_implementation_asked_for_says_why_and_what_to_do(two_ranks):
    for msg in (r["prefer_oneshot"] for r in two_ranks):
        assert "all-reduce implementation 'oneshot' is unavailable on rank" in msg
        assert "not a CUDA device" in msg and "Ask for 'nccl'" in msg


def test_the_choice_is_agreed_and_ordered():
    assert set(PREFERENCE) == set(IMPLEMENTATIONS) and PREFERENCE[-1] == "nccl"
    assert _agreed([None, None]) is None
    assert _agreed(["no GPU", "no GPU"]) == "no GPU"
    assert _agreed([None, "no peer access"]) == "rank 1: no peer access"


def test_a_failure_of_one_rank_building_the_kernel_is_agreed_and_freed():
    got = [r["agreed"] for r in parallel_ranks.two_cpu_ranks()]
    (alloc0, name0, calls0), (open0, _, calls0b) = got[0]
    (alloc1, name1, calls1), (open1, _, calls1b) = got[1]
    assert alloc0 == alloc1 == ("unavailable: rank 1: allocating the buffer: allocation failed "
                                "(out of memory)")
    assert name0 == name1 == "nccl"             # both fell back, none waits on the other
    assert calls0 == ["alloc", "free"] and calls1 == []
    assert open0 == open1 == ("unavailable: rank 0: mapping the peers' buffers: opening rank 1's "
                              "buffer (cuda:None) failed (out of memory)")
    assert calls0b == ["alloc", "free"]         # rank 0 mapped nothing, freed its own
    assert calls1b == ["alloc", "open", "close", "free"]


def test_ranks_on_several_hosts_use_nccl_alone():
    for t in (r["hosts"] for r in parallel_ranks.two_cpu_ranks()):
        assert t["parallel.allreduce"] == "nccl"
        for name in ("oneshot", "symm_one_shot", "symm_two_shot"):
            assert t[f"parallel.allreduce.{name}"] == ("unavailable: the ranks span 2 hosts (peer "
                                                       "memory is one host's)")
