"""CPU tests of CUDAGraphDecoder on the toy model: eager/auto equal a plain loop, lifecycle, modes."""
from __future__ import annotations

import pytest
import torch
from graphs_toy import START_POS, START_TOKEN, FakeNvtx, ToyModel, reference

from graphs import (CUDAGraphDecoder, DebugPointerError, GraphError, LifecycleError, ModeError,
                    ReplayError, Segment)

CPU = torch.device("cpu")
N_STEPS = 40


def make(model: ToyModel, **kw) -> CUDAGraphDecoder:
    kw.setdefault("reset_fn", model.reset)
    return CUDAGraphDecoder(model.segments(), model.inputs(), model.outputs(), **kw)


def run(dec: CUDAGraphDecoder, n: int, forced=None):
    tokens, logits = [], []
    for t in range(n):
        out = dec.step(token=forced[t]) if forced is not None else dec.step()
        tokens.append(int(out["token"][0]))
        logits.append(out["logits"].clone())  # a view, overwritten by the next step
    return tokens, torch.cat(logits)


@pytest.mark.parametrize("mode", ["eager", "auto"])
@pytest.mark.parametrize("granularity", ["segment", "device", "staged"])
@pytest.mark.parametrize("head_reads_copy", [False, True])
def test_cpu_matches_reference_loop(mode, granularity, head_reads_copy):
    model = ToyModel([CPU] * 3, CPU, head_reads_copy=head_reads_copy)
    ref_tokens, ref_logits = reference(model, N_STEPS)
    with make(model, mode=mode, granularity=granularity) as dec:
        assert dec.mode == "eager"
        dec.allocate()
        dec.warmup()
        dec.capture()
        assert dec.capture_seconds == {"cpu": 0.0} and dec.graph_bytes == {"cpu": 0}
        assert dec.n_graphs == 0
        tokens, logits = run(dec, N_STEPS)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    assert len(set(tokens)) > 3, "toy model degenerate: the test would not catch a stale token"


def test_host_inputs_teacher_forcing_and_restart():
    model = ToyModel([CPU] * 2, CPU)
    forced = [(7 * t + 1) % 32 for t in range(N_STEPS)]
    ref_tokens, ref_logits = reference(model, N_STEPS, forced=forced)
    dec = make(model)
    dec.allocate(), dec.warmup(), dec.capture()
    tokens, logits = run(dec, N_STEPS, forced=forced)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    # a new sequence: both inputs from the host, state reset by the caller
    model.reset()
    out = dec.step(token=torch.tensor([START_TOKEN]), pos=START_POS)
    assert int(out["token"][0]) == reference(model, 1)[0][0]
    assert dec.steps_run == N_STEPS + 1
    dec.close()


def test_warmup_restores_inputs_and_state():
    model = ToyModel([CPU] * 2, CPU)
    dec = make(model, warmup_iters=3)
    dec.allocate()
    dec.warmup()
    assert int(model.token[0]) == START_TOKEN and int(model.pos[0]) == START_POS
    assert all(int(a.abs().sum() == 0) for a in model.acc)


def test_eager_step_equals_step():
    model = ToyModel([CPU] * 2, CPU)
    ref_tokens, _ = reference(model, 6)
    dec = make(model)
    dec.allocate()
    tokens = [int(dec.step()["token"][0]) if t % 2 else int(dec.eager_step()["token"][0])
              for t in range(6)]
    assert tokens == ref_tokens


def test_outputs_are_views_overwritten_by_next_step():
    model = ToyModel([CPU] * 2, CPU)
    dec = make(model)
    dec.allocate()
    out1 = dec.step()
    first = out1["logits"].clone()
    out2 = dec.step()
    assert out2["logits"] is out1["logits"] is model.logits
    assert not torch.equal(out1["logits"], first)


def test_properties():
    model = ToyModel([CPU] * 2, CPU)
    dec = make(model, granularity="device")
    assert dec.granularity == "device" and dec.mode == "eager"
    dec.allocate()
    assert dec.devices == [CPU]
    assert dec.placement == {"embed": CPU, "layer0": CPU, "layer1": CPU, "head": CPU}
    assert dec.plan is not None and dec.plan.n_copies == 0


def test_close_is_idempotent_and_final():
    model = ToyModel([CPU] * 2, CPU)
    dec = make(model)
    dec.allocate()
    dec.step()
    dec.close()
    dec.close()
    assert dec.n_graphs == 0
    with pytest.raises(LifecycleError, match="closed"):
        dec.step()
    with pytest.raises(LifecycleError, match="closed"):
        dec.allocate()


def test_context_manager_closes_and_does_not_allocate():
    model = ToyModel([CPU] * 2, CPU)
    with make(model) as dec:
        with pytest.raises(LifecycleError, match="allocate"):
            dec.step()
        dec.allocate()
        dec.step()
    with pytest.raises(LifecycleError):
        dec.step()


def test_graph_mode_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = ToyModel([CPU] * 2, CPU)
    with pytest.raises(GraphError) as e:
        make(model, mode="graph")
    assert isinstance(e.value, ModeError)
    msg = str(e.value)
    assert "CUDA" in msg and "mode='eager'" in msg and "Fix" in msg


def test_graph_mode_with_a_cpu_segment_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = ToyModel([CPU] * 2, CPU)
    with pytest.raises(ModeError, match="segment embed is on cpu"):
        make(model, mode="graph")


def test_auto_without_cuda_is_eager(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert make(ToyModel([CPU] * 2, CPU), mode="auto").mode == "eager"


@pytest.mark.parametrize("kw, match", [
    ({"mode": "fast"}, "mode='fast'"), ({"granularity": "layer"}, "granularity='layer'"),
    ({"warmup_iters": -1}, "warmup_iters=-1"), ({"fix_hints": "--mode eager"}, "fix_hints"),
])
def test_bad_arguments_name_field_and_value(kw, match):
    with pytest.raises(ValueError, match=match):
        make(ToyModel([CPU], CPU), **kw)


def test_eager_cpu_path_never_touches_torch_cuda(monkeypatch):
    """The eager CPU path must work on CPU-only torch builds, where torch.cuda.* raise."""
    def boom(*a, **k):
        raise AssertionError("torch.cuda called on the CPU path")
    for name in ("Stream", "Event", "CUDAGraph", "graph", "graph_pool_handle", "current_stream",
                 "synchronize", "device", "stream", "memory_reserved", "memory_allocated",
                 "empty_cache", "mem_get_info", "current_device", "device_count",
                 "set_sync_debug_mode", "get_sync_debug_mode"):
        monkeypatch.setattr(torch.cuda, name, boom)
    model = ToyModel([CPU] * 2, CPU)
    ref_tokens, _ = reference(model, 5)
    with make(model, mode="auto", debug=True) as dec:
        dec.allocate(), dec.warmup(), dec.capture()
        assert run(dec, 5)[0] == ref_tokens


def test_step_makes_no_host_sync_calls(monkeypatch):
    """Nothing in the step path (decoder or toy) calls .item()/.tolist() (host syncs on CUDA)."""
    model = ToyModel([CPU] * 2, CPU)
    dec = make(model)
    dec.allocate(), dec.warmup(), dec.capture()

    def boom(*a, **k):
        raise AssertionError("host sync in the decode step")
    monkeypatch.setattr(torch.Tensor, "item", boom)
    monkeypatch.setattr(torch.Tensor, "tolist", boom)
    for _ in range(3):
        dec.step()
    dec.step(token=5, pos=[2])


def test_debug_mode_detects_a_rebound_buffer():
    model = ToyModel([CPU] * 2, CPU)
    segs = model.segments()
    dec = CUDAGraphDecoder(segs, model.inputs(), model.outputs(), debug=True, reset_fn=model.reset)
    dec.allocate(), dec.warmup(), dec.capture()
    dec.step()
    segs[1].reads["h"].set_(torch.zeros(1, 16))  # storage swapped under the plan
    with pytest.raises(DebugPointerError) as e:
        dec.step()
    msg = str(e.value)
    assert "layer0.reads[h]" in msg and "step 1" in msg and "eager" in msg


def test_debug_mode_off_does_not_check():
    model = ToyModel([CPU] * 2, CPU)
    segs = model.segments()
    dec = CUDAGraphDecoder(segs, model.inputs(), model.outputs(), reset_fn=model.reset)
    dec.allocate()
    segs[1].writes["acc0"].set_(torch.zeros(1, 16))
    dec.step()


def test_failing_segment_is_a_replay_error_naming_step_and_segment():
    model = ToyModel([CPU] * 2, CPU)
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("kernel exploded")
    segs = model.segments()
    segs.insert(2, Segment("probe", CPU, flaky, reads={}, writes={}))
    dec = CUDAGraphDecoder(segs, model.inputs(), model.outputs(), warmup_iters=0,
                           fix_hints=("--max-seq-len 32768", "--mode eager"))
    dec.allocate(), dec.capture()
    dec.step(), dec.step()
    with pytest.raises(ReplayError) as e:
        dec.step()
    msg = str(e.value)
    assert "step 2" in msg and "probe" in msg and "kernel exploded" in msg
    assert "1) --max-seq-len 32768 2) --mode eager" in msg
    assert "CUDA_LAUNCH_BLOCKING" not in msg  # CPU: the advice would mislead


def test_unknown_host_input_is_rejected():
    model = ToyModel([CPU], CPU)
    dec = make(model)
    dec.allocate()
    with pytest.raises(GraphError, match=r"unknown input\(s\) \['tok'\].*'token', 'pos'"):
        dec.step(tok=1)
    with pytest.raises(GraphError, match="takes 1 value"):
        dec.step(token=[1, 2])


def test_nvtx_ranges_in_the_given_domain(monkeypatch):
    import graphs.capture
    fake = FakeNvtx()
    monkeypatch.setattr(graphs.capture, "_nvtx", fake)
    model = ToyModel([CPU] * 2, CPU)
    dec = make(model, nvtx_domain="dsv4", warmup_iters=0)
    dec.allocate()
    dec.step()
    assert [m for _, m in fake.events] == [
        "eager/cpu/embed", ")", "eager/cpu/layer0", ")", "eager/cpu/layer1", ")",
        "eager/cpu/head", ")"]
    assert {d for d, _ in fake.events} == {"dsv4"}


def test_nvtx_missing_is_a_no_op(monkeypatch):
    import graphs.capture
    monkeypatch.setattr(graphs.capture, "_nvtx", None)
    ranges = graphs.capture.Ranges("graphs")
    assert not ranges.enabled
    ranges.push("x"), ranges.pop()
    model = ToyModel([CPU] * 2, CPU)
    dec = make(model)
    dec.allocate()
    assert run(dec, 3)[0] == reference(model, 3)[0]
