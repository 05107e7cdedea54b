"""The token mask (dsv4.runtime.grammar): a bitmask unpacks into the bias (0 allowed, -inf not),
a constrained generation picks only allowed tokens (greedy and sampled, host-branch and captured
paths alike), a cleared mask changes no token; on CUDA graph replay gives eager's tokens."""
import numpy as np
import pytest
import torch

from dsv4.runtime.config import RuntimeConfig
from dsv4.runtime.grammar import TokenMask
from dsv4.runtime.sampling import SamplingParams
from dsv4.runtime.session import Session, load_model
from helpers import small_checkpoint

PROMPT = list(range(40, 52))


class Allow:
    """A toy constraint: token i of the reply must come from sets[i % len(sets)]."""

    def __init__(self, sets):
        self.sets, self.i, self.seen = sets, 0, []

    def fill(self, bitmask):
        bits = np.zeros(bitmask.shape[0] * 32, dtype=np.uint8)
        bits[list(self.sets[self.i % len(self.sets)])] = 1
        bitmask.copy_(torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32)))

    def accept(self, token):
        self.seen.append(token)
        self.i += 1


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp("grammar"), "fp8")


def _model(path, device="cpu"):
    m, ck = load_model(path, RuntimeConfig(max_seq_len=96, dtype=torch.float32,
                                           devices=(device,)))
    ck.close()
    return m


def test_bitmask_unpacks_into_the_bias():
    V = 1000                                  # not a multiple of 32: the last word is partial
    mask = TokenMask("cpu", V, graph=False)
    allowed = sorted(np.random.default_rng(0).choice(V, 37, replace=False).tolist())
    mask.load(Allow([allowed]))
    want = torch.full((V,), float("-inf"))
    want[allowed] = 0
    assert torch.equal(mask.bias, want) and mask.active
    logits = torch.randn(V)
    assert torch.equal(mask.apply(logits).isfinite().nonzero()[:, 0], torch.tensor(allowed))
    mask.clear()
    assert torch.equal(mask.apply(logits), logits) and not mask.bias.any()


@pytest.mark.parametrize("on_host", [True, False])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(1.0, seed=7),
                                    SamplingParams(1.2, top_k=50, seed=8)], ids=str)
def test_constrained_tokens_are_allowed_ones(ckpt, on_host, params):
    s = Session(_model(ckpt), SamplingParams(), per_request_sampling=True)
    s.knobs.on_host = on_host
    s.mask.graph = not on_host                # the captured step always adds the bias
    free = s.generate(PROMPT, 6, sampling=params).output_ids
    sets = [{3, 5, 7}, {100}, {11, 2000}]
    con = Allow(sets)
    out = s.generate(PROMPT, 6, sampling=params, constraint=con).output_ids
    assert all(t in sets[i % 3] for i, t in enumerate(out)), out
    assert con.seen == out
    assert s.generate(PROMPT, 6, sampling=params).output_ids == free     # cleared: no effect
    assert not s.mask.active and not s.mask.bias.any()


@pytest.mark.cuda
def test_graph_replay_gives_eager_constrained_tokens_on_cuda(ckpt):
    params = SamplingParams(1.0, seed=9)
    sets = [set(range(0, 500, 3)), {7, 8, 9}]
    runs = []
    for mode in ("eager", "graph"):
        s = Session(_model(ckpt, "cuda:0"), SamplingParams(), mode=mode,
                    per_request_sampling=True)
        if mode == "eager":
            s.knobs.on_host, s.mask.graph = False, True
        runs.append(s.generate(PROMPT, 8, sampling=params, constraint=Allow(sets)).output_ids)
        runs.append(s.generate(PROMPT, 8, sampling=params).output_ids)
        s.close()
    assert runs[:2] == runs[2:]
    assert all(t in sets[i % 2] for i, t in enumerate(runs[0]))
