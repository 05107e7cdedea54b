"""Static buffers: specs with fill values, decoder-owned inputs, overlap and pointer checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from graphs import BufferError, BufferSpec, StaticInputs, allocate_all
from graphs.buffers import PointerTable, overlaps, same_buffer


def test_buffer_spec_allocates_filled():
    spec = BufferSpec("topk_idx", [2, 3], torch.int32, "cpu", fill=-1)
    t = spec.allocate()
    assert spec.shape == (2, 3) and spec.device == torch.device("cpu")
    assert t.dtype == torch.int32 and torch.equal(t, torch.full((2, 3), -1, dtype=torch.int32))


def test_buffer_spec_rejects_bad_shape_and_duplicates():
    with pytest.raises(BufferError, match="shape"):
        BufferSpec("x", (2, -1), torch.float32, "cpu")
    with pytest.raises(BufferError, match="'x'"):
        allocate_all([BufferSpec("x", (1,), torch.float32, "cpu")] * 2)
    bufs = allocate_all([BufferSpec("len", (1,), torch.int32, "cpu", 1),
                         BufferSpec("pos", (1,), torch.int64, "cpu", 1)])
    assert list(bufs) == ["len", "pos"] and int(bufs["len"][0]) == 1


def test_static_inputs_write_accepts_host_values():
    tok = torch.zeros(1, dtype=torch.int64)
    ids = torch.zeros(2, 2, dtype=torch.int64)
    inp = StaticInputs({"token": tok, "ids": ids})
    inp.allocate_staging()  # a no-op on CPU
    inp.write("token", 7)
    assert int(tok[0]) == 7
    inp.write("token", torch.tensor([[9]]))
    assert int(tok[0]) == 9
    inp.write("ids", [1, 2, 3, 4])
    assert ids.tolist() == [[1, 2], [3, 4]]
    inp.write("ids", np.arange(4).reshape(2, 2))
    assert ids.tolist() == [[0, 1], [2, 3]]
    with pytest.raises(BufferError, match="'ids' takes 4 value.*got 3"):
        inp.write("ids", [1, 2, 3])


def test_static_inputs_snapshot_restore():
    tok = torch.tensor([5])
    inp = StaticInputs({"token": tok})
    snap = inp.snapshot()
    tok.fill_(1)
    inp.restore(snap)
    assert int(tok[0]) == 5 and inp.names == ["token"] and inp.device == torch.device("cpu")


def test_same_buffer_and_overlaps():
    a = torch.zeros(8)
    assert same_buffer(a, a) and same_buffer(a, a.view(8))
    assert not same_buffer(a, a.view(2, 4)) and overlaps(a, a.view(2, 4))
    assert overlaps(a[0:4], a[3:6]) and not overlaps(a[0:4], a[4:8])
    assert not overlaps(a, torch.zeros(8))
    assert not overlaps(a[:0], a)


def test_pointer_table_sees_rebinding_and_set_():
    bufs = {"h": torch.zeros(2), "k": torch.zeros(2)}
    table = PointerTable([("seg.reads[h]", bufs, "h"), ("seg.reads[k]", bufs, "k")])
    assert len(table) == 2 and table.moved() == []
    old = bufs["h"].data_ptr()
    bufs["h"] = torch.zeros(2)
    bufs["k"].set_(torch.zeros(4))
    moved = table.moved()
    assert [m[0] for m in moved] == ["seg.reads[h]", "seg.reads[k]"] and moved[0][1] == old
    del bufs["h"]
    assert table.moved()[0] == ("seg.reads[h]", old, 0)


class _Holder:
    """Stands in for a library object that owns a state tensor as an attribute (a KV cache layer)."""

    def __init__(self):
        self.keys = torch.zeros(4)


def test_live_buffers_read_attributes_at_each_lookup():
    from graphs import LiveBuffers
    obj, h = _Holder(), torch.zeros(2)
    live = LiveBuffers({"h": h, "k": (obj, "keys")})
    assert list(live) == ["h", "k"] and len(live) == 2
    assert live["h"] is h and live["k"] is obj.keys
    obj.keys = torch.ones(4)                      # rebound by its owner
    assert live["k"] is obj.keys and live.get("missing") is None
    del obj.keys
    assert live["k"] is None                      # gone: the planner / debug mode report it
    with pytest.raises(BufferError, match="'x'.*tensor or an \\(object, 'attribute'\\) pair"):
        LiveBuffers({"x": 3})


def test_lazily_allocated_state_is_named_at_allocate():
    from graphs import CUDAGraphDecoder, LiveBuffers, Segment
    obj = _Holder()
    obj.keys = None                               # a cache before its first update
    seg = Segment("layer0", "cpu", lambda: None, reads=LiveBuffers({"k": (obj, "keys")}),
                  writes={})
    dec = CUDAGraphDecoder([seg], {}, {}, mode="eager")
    with pytest.raises(BufferError, match=r"layer0\.reads\['k'\] is None.*lazily.*before "
                                          r"allocate\(\)"):
        dec.allocate()


def test_debug_mode_sees_a_rebound_attribute_that_a_dict_snapshot_hides():
    from graphs import CUDAGraphDecoder, DebugPointerError, LiveBuffers, Segment
    obj, x = _Holder(), torch.zeros(4)

    def step():
        obj.keys.add_(x)

    for live, caught in ((True, True), (False, False)):
        state = {"k": (obj, "keys")} if live else {"k": obj.keys}
        seg = Segment("s", "cpu", step, reads=LiveBuffers({"x": x, **state}),
                      writes=LiveBuffers(state))
        dec = CUDAGraphDecoder([seg], {"x": x}, {"k": obj.keys}, debug=True)
        dec.allocate(), dec.capture()
        dec.step()
        obj.keys = torch.zeros(4)                 # what a cache does on reorder/offload/re-init
        if caught:
            with pytest.raises(DebugPointerError, match=r"s\.reads\[k\]"):
                dec.step()
        else:
            dec.step()                            # the snapshot still holds the old tensor
        dec.close()
