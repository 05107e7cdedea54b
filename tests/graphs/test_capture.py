"""GPU tests: graph replay equals eager bit for bit, capture is sync-free, debug pointers, costs, close."""
from __future__ import annotations

import gc

import pytest
import torch
from graphs_toy import (START_TOKEN, FakeNvtx, ToyModel, assert_graph_equals_eager, reference,
                        run)

from graphs import CaptureError, CUDAGraphDecoder, DebugPointerError, LifecycleError, Segment

N_STEPS = 60
pytestmark = pytest.mark.cuda


def build(model: ToyModel, **kw) -> CUDAGraphDecoder:
    kw.setdefault("reset_fn", model.reset)
    dec = CUDAGraphDecoder(model.segments(), model.inputs(), model.outputs(), **kw)
    dec.allocate()
    dec.warmup()
    dec.capture()
    return dec


@pytest.mark.parametrize("granularity", ["segment", "device", "staged"])
def test_graph_replay_equals_eager_bitwise(granularity):
    dev = torch.device("cuda:0")
    eager = build(ToyModel([dev] * 3, dev, head_reads_copy=True), mode="eager")
    graph = build(ToyModel([dev] * 3, dev, head_reads_copy=True), mode="graph",
                  granularity=granularity)
    assert eager.mode == "eager" and graph.mode == "graph"
    assert graph.n_graphs == {"segment": 5, "device": 1, "staged": 2}[granularity]
    assert_graph_equals_eager(eager, graph, N_STEPS)


def test_graph_matches_cpu_reference_within_tolerance():
    dev = torch.device("cuda:0")
    model = ToyModel([dev] * 3, dev)
    ref_tokens, ref_logits = reference(model, N_STEPS)
    forced = [START_TOKEN] + ref_tokens[:-1]  # follow the CPU path even at an argmax near-tie
    with build(model, mode="auto") as dec:
        assert dec.mode == "graph"
        _, logits = run(dec, N_STEPS, forced=forced)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


def test_auto_mode_is_graph_and_eager_steps_interleave():
    dev = torch.device("cuda:0")
    ref = build(ToyModel([dev] * 2, dev), mode="graph")
    mixed = build(ToyModel([dev] * 2, dev))
    assert mixed.mode == "graph"
    r_tok, r_log = run(ref, 20)
    m_tok, m_log = run(mixed, 20, eager_every=3)
    assert torch.equal(m_tok, r_tok) and torch.equal(m_log, r_log)
    ref.close(), mixed.close()


def test_capture_and_replay_under_sync_debug_mode_error():
    dev = torch.device("cuda:0")
    model = ToyModel([dev] * 2, dev)
    dec = CUDAGraphDecoder(model.segments(), model.inputs(), model.outputs(), mode="graph",
                           reset_fn=model.reset)
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dec.allocate()
        dec.warmup()
        dec.capture()
        for t in range(5):  # host values go through pinned staging: still no sync
            dec.step(token=(t * 5) % 32) if t % 2 else dec.step()
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.synchronize()
    assert torch.isfinite(model.logits).all()
    dec.close()


def test_debug_mode_pointer_checks():
    dev = torch.device("cuda:0")
    model = ToyModel([dev] * 2, dev)
    segs = model.segments()
    dec = CUDAGraphDecoder(segs, model.inputs(), model.outputs(), mode="graph", debug=True,
                           reset_fn=model.reset)
    dec.allocate(), dec.warmup(), dec.capture()
    for _ in range(N_STEPS):
        dec.step()
    segs[2].writes["acc1"].set_(torch.zeros(1, 16, device=dev))  # the graph would read stale memory
    with pytest.raises(DebugPointerError, match="layer1.writes\\[acc1\\]"):
        dec.step()
    dec.close()


def test_capture_costs_are_recorded_and_close_frees_graphs():
    dev = torch.device("cuda:0")
    model = ToyModel([dev] * 3, dev)
    dec = CUDAGraphDecoder(model.segments(), model.inputs(), model.outputs(), mode="graph",
                           reset_fn=model.reset)
    dec.allocate()
    dec.warmup()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved_before = torch.cuda.memory_reserved(dev)
    dec.capture()
    assert set(dec.capture_seconds) == {"cuda:0"} and dec.capture_seconds["cuda:0"] > 0
    assert dec.graph_bytes["cuda:0"] > 0  # the toy's temporaries live in the pool
    assert dec.n_graphs == 5 and dec.devices == [dev]
    dec.step()
    dec.close()
    dec.close()
    assert dec.n_graphs == 0
    with pytest.raises(LifecycleError):
        dec.step()
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved(dev) <= reserved_before


def test_capture_failure_names_segment_device_and_fixes():
    dev = torch.device("cuda:0")
    model = ToyModel([dev] * 2, dev)
    bad = Segment("layer17", dev, lambda: model.pos.item(), reads={"pos": model.pos}, writes={})
    segs = model.segments()
    segs.insert(2, bad)
    dec = CUDAGraphDecoder(segs, model.inputs(), model.outputs(), mode="graph",
                           reset_fn=model.reset, fix_hints=("--max-seq-len 32768", "--mode eager"))
    dec.allocate()
    with pytest.raises(CaptureError) as e:
        dec.capture()
    msg = str(e.value)
    assert "capture of segment layer17 on cuda:0 failed" in msg
    assert "Fixes: 1) --max-seq-len 32768 2) --mode eager" in msg
    assert dec.n_graphs == 0
    torch.cuda.synchronize()
    dec.eager_step()  # the per-call eager fallback still works
    dec.close()


@pytest.mark.parametrize("granularity", ["segment", "device", "staged"])
def test_nvtx_range_names(monkeypatch, granularity):
    import graphs.capture
    fake = FakeNvtx()
    monkeypatch.setattr(graphs.capture, "_nvtx", fake)  # the package may be absent on GPU hosts
    dev = torch.device("cuda:0")
    model = ToyModel([dev], dev)
    dec = build(model, mode="graph", granularity=granularity, nvtx_domain="dsv4")
    captured = [m for _, m in fake.events if m.startswith("capture/")]
    fake.events.clear()
    dec.step()
    replayed = [m for _, m in fake.events if m != ")"]
    if granularity == "segment":
        assert captured == ["capture/dev0/embed", "capture/dev0/layer0", "capture/dev0/head"]
        assert replayed == ["replay/dev0/embed", "replay/dev0/layer0", "replay/dev0/head"]
    elif granularity == "staged":                       # pieces of 2, then the rest
        assert captured == ["capture/dev0/embed..layer0", "capture/dev0/head"]
        assert replayed == ["replay/dev0/embed..layer0", "replay/dev0/head"]
    else:
        assert captured == ["capture/dev0/embed..head"] and replayed == ["replay/dev0"]
    assert {d for d, _ in fake.events} == {"dsv4"}
    dec.close()
