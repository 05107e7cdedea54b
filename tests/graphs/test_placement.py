"""Hand-off planning: sources in step order, no copy for shared buffers, errors naming both ends."""
from __future__ import annotations

import pytest
import torch
from graphs_toy import ToyModel

from graphs import (BufferError, ConfigError, CUDAGraphDecoder, PlanError, Segment, plan_handoffs)
from graphs.placement import INPUT_STAGE, device_units, staged_pieces

CPU = torch.device("cpu")


def noop():
    pass


def seg(name, reads=None, writes=None, fn=noop, device=CPU):
    return Segment(name, device, fn, reads=reads or {}, writes=writes or {})


def test_same_buffer_needs_no_copy():
    x = torch.zeros(4)
    plan = plan_handoffs([seg("a", writes={"x": x}), seg("b", reads={"x": x})], {})
    assert plan.before == ((), ())
    # a view with identical layout is the same buffer too
    plan = plan_handoffs([seg("a", writes={"x": x}), seg("b", reads={"x": x.view(4)})], {})
    assert plan.n_copies == 0


def test_distinct_buffers_get_one_copy_from_the_latest_producer():
    x1, x2, y = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    segs = [seg("a", writes={"x": x1}), seg("b", writes={"x": x2}), seg("c", reads={"x": y})]
    plan = plan_handoffs(segs, {})
    (h,) = plan.before[2]
    assert h.src is x2 and h.dst is y and h.producer == "b" and h.consumer == "c"
    assert not h.cross_device


def test_cross_buffer_copy_runs_before_the_reader():
    src, dst, seen = torch.zeros(3), torch.full((3,), -1.0), []
    segs = [seg("a", writes={"x": src}, fn=lambda: src.fill_(7.0)),
            seg("b", reads={"x": dst}, fn=lambda: seen.append(dst.clone()))]
    dec = CUDAGraphDecoder(segs, {}, {"x": src}, mode="eager")
    dec.allocate()
    dec.step()
    assert torch.equal(seen[0], torch.full((3,), 7.0))


def test_input_stage_then_previous_step_producer():
    tok = torch.zeros(1, dtype=torch.int64)
    state, state_in = torch.zeros(2), torch.zeros(2)
    segs = [seg("a", reads={"token": tok, "s": state_in}),
            seg("b", writes={"s": state, "token": tok})]
    plan = plan_handoffs(segs, {"token": tok})
    (h,) = plan.before[0]  # token: input stage, same tensor -> no copy; s: previous step's b
    assert h.name == "s" and h.producer == "b (previous step)" and h.src is state
    assert plan.carries == {}  # b writes the input tensor itself


def test_input_written_elsewhere_is_carried_into_the_input():
    tok, tok_out = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    segs = [seg("embed", reads={"token": tok}),
            seg("head", writes={"token": tok_out}, fn=lambda: tok_out.add_(1))]
    plan = plan_handoffs(segs, {"token": tok})
    assert plan.before == ((), ())
    carry = plan.carries["token"]
    assert carry.src is tok_out and carry.dst is tok and carry.consumer == INPUT_STAGE
    dec = CUDAGraphDecoder(segs, {"token": tok}, {"token": tok}, mode="eager")
    dec.allocate()
    dec.step(token=10)
    assert int(tok[0]) == 10 and int(tok_out[0]) == 1  # first step: no carry
    dec.step()
    assert int(tok[0]) == 1  # carried from head's buffer of the previous step
    dec.step(token=4)
    assert int(tok[0]) == 4  # host value wins over the carry


def test_repeated_copy_is_not_reissued_until_a_buffer_is_written():
    p, p_local, h = torch.zeros(1), torch.zeros(1), torch.zeros(1)
    segs = [seg("l0", reads={"pos": p_local}, writes={"h": h}),
            seg("l1", reads={"pos": p_local}, writes={"h": h}),
            seg("bump", writes={"pos": p}),
            seg("l2", reads={"pos": p_local})]
    plan = plan_handoffs(segs, {"pos": p})
    assert [len(b) for b in plan.before] == [1, 0, 0, 1]
    assert plan.before[3][0].producer == "bump"


def test_missing_producer_is_an_error():
    with pytest.raises(PlanError) as e:
        plan_handoffs([seg("a", writes={"h": torch.zeros(1)}),
                       seg("layer3", reads={"kv": torch.zeros(1)})], {"token": torch.zeros(1)})
    msg = str(e.value)
    assert "layer3 reads 'kv'" in msg and "['h', 'token']" in msg and "Fix" in msg


def test_shape_mismatch_names_both_segments():
    with pytest.raises(PlanError) as e:
        plan_handoffs([seg("layer2", writes={"h": torch.zeros(1, 16)}),
                       seg("layer3", reads={"h": torch.zeros(1, 8)})], {})
    msg = str(e.value)
    assert "from layer2 to layer3" in msg and "(1, 16)" in msg and "(1, 8)" in msg


def test_dtype_mismatch_with_an_input_names_the_input_stage():
    with pytest.raises(PlanError, match="from inputs to embed.*torch.int32"):
        plan_handoffs([seg("embed", reads={"token": torch.zeros(1, dtype=torch.int32)})],
                      {"token": torch.zeros(1, dtype=torch.int64)})


def test_partial_overlap_is_an_error():
    buf = torch.zeros(8)
    with pytest.raises(PlanError, match="overlap"):
        plan_handoffs([seg("a", writes={"x": buf[0:4]}), seg("b", reads={"x": buf[2:6]})], {})


def test_duplicate_segment_names_are_an_error():
    with pytest.raises(PlanError, match="unique.*'a'"):
        plan_handoffs([seg("a"), seg("a")], {})


def test_buffer_on_the_wrong_device_is_an_error():
    meta = torch.zeros(2, device="meta")
    with pytest.raises(BufferError) as e:
        plan_handoffs([seg("layer17", reads={"h": meta})], {})
    assert "segment layer17.reads['h'] is on meta but segment layer17 runs on cpu" in str(e.value)


def test_non_tensor_buffer_and_bad_segment_fields():
    with pytest.raises(BufferError, match="not a tensor"):
        plan_handoffs([seg("a", writes={"h": [0.0]})], {})
    with pytest.raises(ConfigError, match="callable"):
        Segment("a", CPU, None, {}, {})
    with pytest.raises(ConfigError, match="name"):
        Segment("", CPU, noop, {}, {})


def test_inputs_on_two_devices_are_an_error():
    with pytest.raises(BufferError, match="one \\(primary\\) device"):
        CUDAGraphDecoder([seg("a")], {"a": torch.zeros(1), "b": torch.zeros(1, device="meta")}, {})


def test_output_that_nothing_writes_is_an_error():
    dec = CUDAGraphDecoder([seg("a", writes={"x": torch.zeros(2)})], {}, {"y": torch.zeros(2)})
    with pytest.raises(BufferError, match="outputs\\['y'\\].*never update"):
        dec.allocate()


def test_device_units_group_consecutive_segments():
    model = ToyModel([CPU] * 3, CPU)
    segs = model.segments()
    plan = plan_handoffs(segs, model.inputs())
    assert device_units(segs, plan) == [[0, 1, 2, 3, 4]]
    assert device_units(segs, plan, staged=True) == [[0, 1], [2, 3, 4]]
    assert plan.primary == CPU and plan.devices == (CPU,)


def test_staged_pieces_double():
    assert staged_pieces(list(range(16))) == [[0, 1], [2, 3, 4, 5], list(range(6, 14)), [14, 15]]
    assert staged_pieces([7]) == [[7]] and staged_pieces([]) == []
    # a step of 12 layers (embed, layers, head and the sampling segment: 15 segments): 4 graphs
    assert [len(p) for p in staged_pieces(list(range(15)))] == [2, 4, 8, 1]


def test_balanced_placement_splits_contiguously_with_the_head_on_the_primary():
    from graphs import balanced_placement
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)  # devices are only named, never used
    assert balanced_placement([10] * 4, ["cuda:0", "cuda:1"]) == [d0, d0, d1, d1]
    # the primary also holds the head: it takes fewer layers
    assert balanced_placement([10] * 4, ["cuda:0", "cuda:1"], head_bytes=20) == [d0, d1, d1, d1]
    assert balanced_placement([10] * 3, ["cpu"]) == [CPU] * 3
    with pytest.raises(ConfigError, match="at least one device"):
        balanced_placement([10], [])
