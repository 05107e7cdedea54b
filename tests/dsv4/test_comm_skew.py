"""dsv4.bench.comm_skew: the all-reduce calls of two ranks' hand-made steps (PDL overlap, a rank
late by a known amount, NCCL's kernels, a rank with a call more), put on one clock from each
rank's profile start, and the TP bench's line of it (dsv4.bench.tp.allreduce_skew)."""
from __future__ import annotations

import pytest

from dsv4.bench.comm_skew import (COLLECTIVES, NO_CALLS, analyze, arrival, format_line,
                                  on_one_clock)

AR = "void allreduce_oneshot_kernel<__nv_bfloat16, 2>(ArPeers, char*, ArCall)"
NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GEMV = "void (anonymous namespace)::fp8_gemv_kernel<8, 2, true>(ArgsA)"


def layer(t: float, ready: float, ar_end: float, name: str = AR) -> list[tuple]:
    """A wo_b GEMV from t to t + ready, the all-reduce launched with PDL at t + 2 (before the
    GEMV ends, spinning in its wait) until t + ar_end, the next kernel starting before it ends."""
    return [(t, t + ready, GEMV), (t + 2.0, t + ar_end, name),
            (t + ar_end - 1.0, t + ar_end + 5.0, "_hc_post_kernel")]


def test_pdl_overlap_arrives_at_the_predecessors_end_not_at_the_kernels_start():
    evs = layer(0.0, ready=10.0, ar_end=15.0)
    assert arrival(evs, 2.0, 15.0) == 10.0
    # a kernel that starts after the all-reduce (the next, with PDL) is not its input
    assert arrival([(3.0, 14.0, "_next")], 2.0, 15.0) == 2.0
    assert arrival([], 2.0, 15.0) == 2.0          # nothing before it: its own start


def test_a_rank_late_by_a_known_amount():
    """Rank 1's input is ready 6 us after rank 0's at every call: rank 0 waits 6 us, both end
    4 us after the last arrival; rank 1 arrives last every time."""
    r0 = layer(0.0, 10.0, 20.0) + layer(100.0, 10.0, 20.0)
    r1 = layer(0.0, 16.0, 20.0) + layer(100.0, 16.0, 20.0)
    sk = analyze([r0, r1])
    assert sk["calls"] == 2 and sk["ties"] == 0
    assert sk["skew_us"] == pytest.approx({"median": 6.0, "mean": 6.0})
    assert sk["wait_us"] == pytest.approx([6.0, 0.0])
    assert sk["after_us"] == pytest.approx({"median": 4.0, "mean": 4.0})
    assert sk["kernel_us"]["median"] == pytest.approx(18.0)
    assert sk["last_to_arrive"] == [0, 2] and sk["skew_us_per_call"] == [6.0, 6.0]
    line = format_line(sk)
    assert ("2 calls, kernel median 18.0 us, skew median 6.0 us (mean 6.0), after the last "
            "arrival 4.0 us, waits r0 6.0 / r1 0.0 us, last to arrive: r0 0, r1 2") in line


def test_skew_changing_sides_medians_ties_and_a_clamp():
    """Call 0: rank 0 late by 2; call 1: rank 1 late by 8 (rank 0's end read 1 us before the
    last arrival: clock error, clamped to 0); call 2: both at once."""
    r0 = [(0.0, 12.0, GEMV), (1.0, 15.0, AR),
          (50.0, 60.0, GEMV), (51.0, 67.0, AR),
          (100.0, 110.0, GEMV), (101.0, 113.0, AR)]
    r1 = [(0.0, 10.0, GEMV), (1.0, 15.0, AR),
          (50.0, 68.0, GEMV), (51.0, 70.0, AR),
          (100.0, 110.0, GEMV), (101.0, 113.0, AR)]
    sk = analyze([r0, r1])
    assert sk["skew_us_per_call"] == [2.0, 8.0, 0.0]
    assert sk["skew_us"] == pytest.approx({"median": 2.0, "mean": 10 / 3})
    assert sk["wait_us"] == pytest.approx([8 / 3, 2 / 3])
    # after: call 0 3, 3; call 1 0 (clamped), 2; call 2 3, 3
    assert sk["after_us"] == pytest.approx({"median": 3.0, "mean": 14 / 6})
    assert sk["last_to_arrive"] == [1, 1] and sk["ties"] == 1
    assert format_line(sk).endswith("last to arrive: r0 1, r1 1, tied 1")


def test_nccl_kernels_count_and_other_collectives_do_not():
    r0 = layer(0.0, 10.0, 20.0, NCCL) + [(30.0, 40.0, "ncclDevKernel_AllGather_RING_LL(x)")]
    r1 = layer(0.0, 13.0, 20.0, NCCL) + [(30.0, 40.0, "ncclDevKernel_AllGather_RING_LL(x)")]
    sk = analyze([r0, r1])
    assert sk["calls"] == 1 and sk["skew_us"]["median"] == pytest.approx(3.0)
    symm = "void c10d::symmetric_memory::one_shot_all_reduce_kernel<bf16, 2>(x)"
    assert analyze([layer(0, 10, 20, symm), layer(0, 10, 20, symm)])["calls"] == 1


def test_unequal_calls_are_refused_by_name():
    r0 = layer(0.0, 10.0, 20.0) + layer(100.0, 10.0, 20.0)
    with pytest.raises(ValueError, match=r"rank 0: 2, rank 1: 1\).*same profiled step"):
        analyze([r0, layer(0.0, 10.0, 20.0)])


def test_no_all_reduce_kernels():
    for ranks in ([], [[], []], [[(0.0, 1.0, GEMV)], [(0.0, 1.0, GEMV)]]):
        sk = analyze(ranks)
        assert sk == {"calls": 0, "what": "all-reduce", "note": NO_CALLS}
        assert format_line(sk) == f"all-reduce across ranks: {NO_CALLS}"


def test_a_prefill_split_by_rows_pairs_its_gathers_and_scatters():
    """A sequence-parallel prefill layer: all-gather, GEMV, reduce-scatter (NCCL's names), twice;
    no all-reduce among them. COLLECTIVES pairs all four calls (rank 1 late by 2 us at the
    first scatter); the all-reduce analysis finds none, and says so."""
    AG = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    RS = "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"

    def sp_layer(late):
        return [(0.0, 5.0, AG), (5.0, 20.0 + late, GEMV), (21.0 + late, 30.0, RS),
                (30.0, 35.0, AG), (35.0, 50.0, GEMV), (51.0, 60.0, RS)]
    ranks = [sp_layer(0.0), sp_layer(2.0)]
    sk = analyze(ranks, COLLECTIVES)
    assert sk["calls"] == 4 and sk["what"] == "collectives"
    assert sk["skew_us_per_call"] == [0.0, 2.0, 0.0, 0.0] and sk["last_to_arrive"] == [0, 1]
    assert format_line(sk).startswith("collectives across ranks: 4 calls")
    none = analyze(ranks)
    assert none["calls"] == 0 and format_line(none) == f"all-reduce across ranks: {NO_CALLS}"
    with pytest.raises(ValueError, match=r"collective calls differ.*rank 0: 4, rank 1: 3"):
        analyze([ranks[0], ranks[1][:-1]], COLLECTIVES)


def test_ranks_put_on_one_clock_from_their_profile_starts():
    """Rank 1's profile started 1 ms + 0.5 us after rank 0's (host-clock ns since the epoch,
    too large for a float to keep sub-microsecond): its times move by 1000.5 us."""
    o0 = 1_795_814_083_983_039_089
    got = on_one_clock([o0, o0 + 1_000_500], [[(1.0, 2.0, "a")], [(1.0, 2.0, "b")]])
    assert got[0] == [(1.0, 2.0, "a")]
    assert got[1] == [(1001.5, 1002.5, "b")]         # exact: the origins subtract as integers


def test_tp_bench_line_from_every_ranks_step(capsys):
    """The TP bench's wiring: each rank's profiled step (times after its own profile start)
    compared on the host clock, logged as one line; no step on some rank (the CPU, eager, no
    --trace): nothing; calls that do not pair: the refusal in the line, the run kept."""
    from dsv4.bench.tp import allreduce_skew
    o0 = 10**18
    # rank 1's profiler started 5 us later: its times read 5 us less for the same moments
    steps = [{"origin_ns": o0, "events": layer(0.0, 10.0, 20.0)},
             {"origin_ns": o0 + 5_000, "events": layer(-5.0, 17.0, 25.0)}]
    sk = allreduce_skew(steps, "graph/device")
    assert sk["calls"] == 1 and sk["skew_us"]["median"] == pytest.approx(7.0)
    assert sk["last_to_arrive"] == [0, 1] and sk["wait_us"] == pytest.approx([7.0, 0.0])
    assert "graph/device: all-reduce across ranks: 1 calls" in capsys.readouterr().err
    assert allreduce_skew([None, None], "eager/segment") is None
    assert allreduce_skew([steps[0], None], "graph/device") is None
    assert capsys.readouterr().err == ""
    steps[1]["events"] = []
    sk = allreduce_skew(steps, "graph/device")
    assert "rank 0: 1, rank 1: 0" in sk["error"]
    assert "all-reduce across ranks: not compared: all-reduce calls differ" in \
        capsys.readouterr().err


def test_a_profiles_origin_is_on_the_host_clock():
    """trace_origin_ns: torch.profiler's event times are us after it, and it is the host's
    clock (ns since the epoch), which every process of the host shares; a profile object
    without it (another torch): None."""
    import time
    import types

    import torch

    from dsv4.bench.common import trace_origin_ns
    before = time.time_ns()
    with (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
          torch.profiler.record_function("mark")):
        t = time.time_ns()
    after = time.time_ns()
    origin = trace_origin_ns(prof)
    assert before <= origin <= after
    (mark,) = [e for e in prof.events() if e.name == "mark"]
    # t was read inside the range: on one clock, between its start and end (0.1 ms of slack
    # for the profiler's approximate clock)
    lo, hi = (origin + x * 1e3 for x in (mark.time_range.start, mark.time_range.end))
    assert lo - 1e5 <= t <= hi + 1e5, (lo, t, hi)
    assert trace_origin_ns(types.SimpleNamespace()) is None
