"""dsv4.bench.timeline: where a profiled step leaves the memory idle, on a hand-made timeline
(streams overlapping latency-bound kernels as PDL and the branches make them, a bubble, two small
kernels sharing a stretch, two devices), and the kernel names it reports."""
from __future__ import annotations

import pytest

from dsv4.bench.timeline import NO_KERNEL, analyze, by_short_name, format_line, gaps, short_name

GEMV = "void (anonymous namespace)::fp8_gemv_kernel<8, 2, true>(ArgsA)"
UP = "void (anonymous namespace)::fp4_up_stream_kernel<2>(ArgsB)"


def test_streaming_idle_and_who_holds_the_idle_part():
    ev = [(0, 0.0, 10.0, GEMV),             # streaming 0-10
          (0, 10.0, 14.0, "_pre_finish_kernel"),   # idle 10-14 under the finish
          # 14-15: no kernel (a bubble)
          (0, 15.0, 25.0, "_bf16_gemv_kernel"),     # streaming 15-25 ...
          (0, 20.0, 30.0, "_route_kernel"),        # ... beside it from 20 (PDL); alone 25-30
          (0, 30.0, 40.0, UP),                      # streaming 30-40 ...
          (0, 30.0, 32.0, "_post_kernel"),         # ... while a small kernel runs: streaming
          (0, 40.0, 44.0, "_scores_kernel"),       # 40-44: two small kernels share it
          (0, 40.0, 44.0, "topk_bf16_kernel"),
          (1, 100.0, 110.0, GEMV),                 # another device (a pipeline's next stage)
          (1, 110.0, 113.0, "allreduce_oneshot_kernel")]
    tl = analyze(ev, layers=2)
    assert tl["span_us"] == pytest.approx(44.0 + 13.0)
    assert tl["streaming_us"] == pytest.approx(10 + 10 + 10 + 10)
    assert tl["idle_us"] == pytest.approx(4 + 1 + 5 + 4 + 3)
    assert tl["no_kernel_us"] == pytest.approx(1.0)
    assert tl["streaming_us"] + tl["idle_us"] == pytest.approx(tl["span_us"])
    assert tl["idle_us_per_layer"] == pytest.approx(17 / 2)
    under = dict(tl["idle_under"])
    assert under == pytest.approx({"_route_kernel": 5.0, "_pre_finish_kernel": 4.0,
                                   "allreduce_oneshot_kernel": 3.0, "_scores_kernel": 2.0,
                                   "topk_bf16_kernel": 2.0, NO_KERNEL: 1.0})
    assert [k for k, _ in tl["idle_under"][:2]] == ["_route_kernel", "_pre_finish_kernel"]
    assert tl["per_device"]["1"]["span_us"] == pytest.approx(13.0)
    line = format_line(tl)
    assert "span 28.5 us" in line and "none streaming 8.5 us" in line and "_route_kernel 2.5" in line


def test_a_kernel_that_ends_where_the_next_starts_leaves_no_gap():
    tl = analyze([(0, 0.0, 5.0, GEMV), (0, 5.0, 7.0, "_rms_norm_kernel"), (0, 7.0, 9.0, GEMV)])
    assert tl["idle_us"] == pytest.approx(2.0) and tl["no_kernel_us"] == 0.0
    assert analyze([])["span_us"] == 0.0


def test_gaps_are_the_stretches_without_a_kernel_largest_first():
    ev = [(0, 0.0, 10.0, GEMV),
          (0, 2.0, 12.0, "_route_kernel"),         # ends last: the gap after it is its
          (0, 15.0, 20.0, UP),                     # 3 us after _route_kernel
          (0, 20.0, 21.0, "_post_kernel"),         # touching: no gap
          (0, 29.0, 30.0, "_argmax_kernel"),       # 8 us
          (1, 0.0, 1.0, GEMV), (1, 6.0, 7.0, GEMV)]   # 5 us on the other device
    assert gaps(ev) == [[8.0, "_post_kernel", "_argmax_kernel", "0"],
                        [5.0, "fp8_gemv_kernel", "fp8_gemv_kernel", "1"],
                        [3.0, "_route_kernel", "fp4_up_stream_kernel", "0"]]
    assert gaps(ev, top=1) == [[8.0, "_post_kernel", "_argmax_kernel", "0"]]
    assert gaps([]) == []


def test_short_names():
    assert short_name(GEMV) == "fp8_gemv_kernel"
    assert short_name(UP) == "fp4_up_stream_kernel"
    assert short_name("_pre_finish_kernel") == "_pre_finish_kernel"
    assert short_name("void gemv2T_kernel_val<int, int, __nv_bfloat16>(params)") == "gemv2T_kernel_val"


def test_by_short_name_sums_a_templates_instances():
    """Two instances of one template (the draft head's fp8_mma_stream_kernel<2, ..> beside wo_b's
    <4, ..>) are one entry with both launches and times, not the last one seen."""
    top = {"void (anonymous namespace)::fp8_mma_stream_kernel<4, false>(Args)": [12, 173.2],
           "void (anonymous namespace)::fp8_mma_stream_kernel<2, false>(Args)": [1, 121.7],
           "_pre_finish_kernel": [49, 254.9]}
    merged = by_short_name(top)
    assert merged.keys() == {"fp8_mma_stream_kernel", "_pre_finish_kernel"}
    assert merged["fp8_mma_stream_kernel"][0] == 13
    assert abs(merged["fp8_mma_stream_kernel"][1] - 294.9) < 1e-9
    assert merged["_pre_finish_kernel"] == [49, 254.9]


def test_kernel_events_after_a_host_range_leave_out_what_ran_before_it():
    """kernel_events(after=...): only the kernels that start once the named host range has begun
    (a tensor-parallel rank's barrier before its profiled step launches its own kernel: not the
    step's); memcpy / memset and the range's own device-side annotation never count (on 2 H100s
    it showed as a 40 us "kernel" of the timeline); without `after`, every kernel."""
    import types

    import torch

    from dsv4.bench.common import STEP_MARK, kernel_events

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, dev, start, end, annotation=False):
        return types.SimpleNamespace(name=name, device_type=dev, is_user_annotation=annotation,
                                     time_range=types.SimpleNamespace(start=start, end=end))

    evs = [ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL", cuda, 5.0, 9.0),   # the barrier's
           ev("barrier", cpu, 1.0, 12.0),
           ev(STEP_MARK, cpu, 20.0, 21.0),
           ev(STEP_MARK, cuda, 22.0, 35.0),    # the range's device side (a user annotation)
           ev(GEMV, cuda, 22.0, 30.0),
           ev("Memcpy DtoD (Device -> Device)", cuda, 30.0, 31.0),
           ev("allreduce_oneshot_kernel", cuda, 31.0, 35.0),
           ev("nccl:all_reduce", cuda, 31.0, 35.0, annotation=True)]   # NCCL's annotation
    prof = types.SimpleNamespace(events=lambda: evs)
    assert [e.name for e in kernel_events(prof, after=STEP_MARK)] == [
        GEMV, "allreduce_oneshot_kernel"]
    assert [e.name for e in kernel_events(prof)] == [
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL", GEMV, "allreduce_oneshot_kernel"]
    # no such range (a profile taken without the mark): every kernel, nothing dropped silently
    assert len(kernel_events(prof, after="no such range")) == 3
