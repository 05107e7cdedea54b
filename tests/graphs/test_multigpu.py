"""Two GPUs: the toy model split over cuda:0 and cuda:1 (head on cuda:0), graph == eager bit for bit."""
from __future__ import annotations

import pytest
import torch
from graphs_toy import START_TOKEN, ToyModel, assert_graph_equals_eager, reference, run

from graphs import CUDAGraphDecoder

N_STEPS = 50
pytestmark = [pytest.mark.cuda, pytest.mark.multigpu]


def split_model() -> ToyModel:
    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    return ToyModel([d0, d0, d1, d1], d0)


def build(model: ToyModel, **kw) -> CUDAGraphDecoder:
    dec = CUDAGraphDecoder(model.segments(), model.inputs(), model.outputs(),
                           reset_fn=model.reset, **kw)
    dec.allocate(), dec.warmup(), dec.capture()
    return dec


@pytest.mark.parametrize("granularity", ["segment", "device", "staged"])
def test_split_graph_equals_eager(granularity):
    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    eager = build(split_model(), mode="eager")
    graph = build(split_model(), mode="graph", granularity=granularity)
    assert graph.devices == [d0, d1]
    assert graph.placement == {"embed": d0, "layer0": d0, "layer1": d0, "layer2": d1,
                               "layer3": d1, "head": d0}
    # h and pos go to cuda:1 once (pos is not re-copied for layer3); h comes back for the head
    cross = [(h.name, h.consumer) for b in graph.plan.before for h in b if h.cross_device]
    assert cross == [("h", "layer2"), ("pos", "layer2"), ("h", "head")]
    # staged: [embed, layer0] [layer1] on cuda:0, [layer2, layer3] on cuda:1, [head]
    assert graph.n_graphs == {"segment": 6, "device": 3, "staged": 4}[granularity]
    assert set(graph.capture_seconds) == {"cuda:0", "cuda:1"}
    assert all(s > 0 for s in graph.capture_seconds.values())
    assert_graph_equals_eager(eager, graph, N_STEPS)


def test_split_graph_matches_cpu_reference():
    model = split_model()
    ref_tokens, ref_logits = reference(model, N_STEPS)
    with build(model, mode="graph") as dec:
        _, logits = run(dec, N_STEPS, forced=[START_TOKEN] + ref_tokens[:-1])
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


def test_inputs_on_cuda1_with_head_there():
    """The primary device need not be cuda:0: inputs and head on cuda:1, layers on both."""
    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    e = build(ToyModel([d0, d1, d0], d1), mode="eager")
    g = build(ToyModel([d0, d1, d0], d1), mode="graph", granularity="device")
    assert g.devices == [d1, d0]
    e_tok, e_log = run(e, 30)
    g_tok, g_log = run(g, 30)
    assert torch.equal(g_tok, e_tok) and torch.equal(g_log, e_log)
    e.close(), g.close()
