"""find_host_syncs: the CPU-side check that a step reads no device value on the host (no GPU needed)."""
from __future__ import annotations

import torch
from graphs_toy import ToyModel

from graphs import CUDAGraphDecoder, find_host_syncs

CPU = torch.device("cpu")


def test_reports_each_syncing_op_with_its_count():
    x = torch.tensor([0.0, 1.0, 2.0])

    def step():
        float(x.sum())                 # .item() under another name
        if x[0] > 0:                   # a Python branch on a tensor value
            pass
        torch.nonzero(x)
        x[x > 0]                       # boolean indexing: data-dependent size

    # boolean indexing runs a nonzero too
    assert find_host_syncs(step) == ["aten::_local_scalar_dense x2", "aten::nonzero x2"]


def test_clean_step_and_the_toy_decoder_report_nothing():
    x, idx = torch.zeros(4), torch.tensor([1])
    assert find_host_syncs(lambda: x.index_add_(0, idx, torch.ones(1)).argmax()) == []
    model = ToyModel([CPU] * 2, CPU)
    dec = CUDAGraphDecoder(model.segments(), model.inputs(), model.outputs(), reset_fn=model.reset)
    dec.allocate(), dec.capture()
    assert find_host_syncs(dec.eager_step) == []
    assert dec.steps_run == 1                     # it ran the step for real
