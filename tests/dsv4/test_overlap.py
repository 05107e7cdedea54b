"""dsv4.backend.branches on the CPU: the switch (DSV4_OVERLAP, read by dsv4.backend.Options), and that
branches are no-ops off CUDA and never touch torch.cuda (the graph-replay bits with branches on
and off: tests/dsv4/kernels/test_decode_kernels.py, CUDA)."""
from __future__ import annotations

import pytest
import torch

from dsv4.backend import branches
from dsv4.backend.decision import BRANCHES, Options


ALL = {"moe", "attn", "mhc"}


@pytest.mark.parametrize("value,on", [(None, ALL), ("1", ALL), ("0", set()), ("moe", {"moe"}),
                                      ("mhc", {"mhc"}), ("sinkhorn", set()),
                                      (" attn , moe ", {"moe", "attn"})])
def test_switch(value, on):
    env = {} if value is None else {"DSV4_OVERLAP": value}
    assert set(Options.from_env(env).overlap) == on
    assert set(Options().overlap) == ALL == set(BRANCHES)       # unset: every branch


def test_branch_is_a_no_op_off_cuda(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the CPU path touched torch.cuda")
    monkeypatch.setattr(torch.cuda, "Stream", boom)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", boom)
    monkeypatch.setattr(torch.cuda, "current_stream", boom)
    branches.prepare("cpu")
    x = torch.ones(3)
    br = branches.Branch(x, "moe", frozenset(BRANCHES))
    assert not br.on
    with br.side():
        y = x * 2                     # runs in order, on the current (CPU) stream
    br.hold(y)                        # nothing to keep: no side stream
    assert br._held == []
    br.join()
    assert torch.equal(y, torch.full((3,), 2.0))
