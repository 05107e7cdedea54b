"""Sampling parameters as device tensors (dsv4.runtime.sampling.SamplingKnobs): the same bits as fixed
SamplingParams for every kind of parameter (greedy, temperature, top-k, top-p, both, edge values),
in the sampler, the speculative draft / accept, and a whole per-request-sampling Session; a
knob step reads no tensor value on the host; a token of probability 0 (masked, or outside top-p)
is never drawn, even where the noise's draw is the largest below 1."""
import pytest
import torch

from dsv4.runtime.config import RuntimeConfig
from dsv4.runtime.sampling import (
    SamplingKnobs,
    SamplingParams,
    filtered_probs,
    race,
    sample,
    uniform_noise,
)
from dsv4.runtime.session import Session, load_model
from dsv4.runtime.speculative.verify import accept, draft
from helpers import small_checkpoint

PARAMS = [SamplingParams(), SamplingParams(0.7, seed=3), SamplingParams(1.0, top_p=0.9, seed=4),
          SamplingParams(0.5, top_k=5, seed=5), SamplingParams(1.3, 0.5, 20, seed=2 ** 40 + 7),
          SamplingParams(1.0, top_p=1e-6, seed=1), SamplingParams(0.9, top_k=10 ** 6, seed=8),
          SamplingParams(1e-30, seed=9), SamplingParams(1.0, top_p=1 - 1e-9, seed=10),
          SamplingParams(0.8, top_k=10 ** 20, seed=11)]     # past int64: every token (was 500)


def _logits(seed, n=3, V=4096):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * 4


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_knobs_give_the_fixed_parameters_bits(params):
    knobs = SamplingKnobs("cpu", SamplingParams(0.3, 0.2, 2, seed=99))   # overwritten by set
    knobs.set(params)
    for i, lg in enumerate(_logits(1)):
        pos = torch.tensor([17 + 31 * i])
        assert torch.equal(sample(lg, pos, knobs), sample(lg, pos, params))
        if not params.greedy:
            for norm in (True, False):
                assert torch.equal(filtered_probs(lg, knobs, norm),
                                   filtered_probs(lg, params, norm))


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_speculative_draft_and_accept_with_knobs(params):
    knobs = SamplingKnobs("cpu", params)
    lg = _logits(2, 3)
    pos = torch.tensor([40])
    d_fixed, q_fixed = draft(lg[0], pos, params)
    d_knobs, q_knobs = draft(lg[0], pos, knobs)
    assert torch.equal(d_fixed, d_knobs)
    if q_fixed is not None:
        assert torch.equal(q_fixed, q_knobs)
    limit, eos = torch.tensor([3]), torch.tensor([-1])
    for drafts in (d_fixed, lg[1].argmax().reshape(1), torch.tensor([5])):
        q = q_knobs[None]
        y0, k0 = accept(lg[1:], drafts, q if q_fixed is not None else None, pos, params, limit,
                        eos)
        y1, k1 = accept(lg[1:], drafts, q, pos, knobs, limit, eos)
        assert torch.equal(k0, k1) and torch.equal(y0[:int(k0) + 1], y1[:int(k1) + 1])


# (seed, position, index) of draws whose noise was 2^31 - 64 or above: 1.0 in float32, so
# race's -log u was 0 and a token of probability 0 there came out NaN and won the argmax
# (about one position in 200 over the DSV4 vocabulary; found by scanning positions 0..3000)
TOP_DRAWS = [(0, 51, 44702), (0, 273, 21090), (0, 659, 59127)]


@pytest.mark.parametrize("seed,pos,index", TOP_DRAWS)
def test_a_token_of_probability_0_is_never_drawn(seed, pos, index):
    V = 129280
    p = torch.tensor([pos])
    u = uniform_noise(seed, p, V)
    assert float(u.max()) < 1.0 and float(u.min()) > 0.0
    one_hot = torch.zeros(V)
    one_hot[7] = 1.0
    assert int(race(one_hot, seed, p)) == 7          # drew `index` (probability 0) before
    # a grammar's mask (every token but two at -inf) and a top-p nucleus alike
    logits = torch.full((V,), float("-inf"))
    logits[[3, 9]] = torch.tensor([0.5, 0.25])
    for params in (SamplingParams(1.0, seed=seed), SamplingParams(0.7, top_p=0.9, seed=seed)):
        assert int(sample(logits, p, params)) in (3, 9)
        knobs = SamplingKnobs("cpu", params)
        assert int(sample(logits, p, knobs)) in (3, 9)
    nucleus = torch.linspace(0, -30, V)       # top_p keeps the first ~3,000; `index` is out
    params = SamplingParams(1.0, top_p=0.5, seed=seed)
    kept = filtered_probs(nucleus, params) > 0
    assert not kept[index] and kept[int(sample(nucleus, p, params))]


def test_knobs_reject_a_seed_past_int64():
    with pytest.raises(ValueError, match="2\\*\\*63"):
        SamplingKnobs("cpu", SamplingParams(seed=2 ** 63))


@pytest.mark.parametrize("t", [float("inf"), float("nan"), -1.0])
def test_a_temperature_must_be_a_finite_number(t):
    with pytest.raises(ValueError, match="finite number >= 0"):
        SamplingParams(t)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp("knobs"), "fp8")


def _model(path, mtp=False):
    m, ck = load_model(path, RuntimeConfig(max_seq_len=96, dtype=torch.float32, mtp=mtp))
    ck.close()
    return m


@pytest.mark.parametrize("speculative,on_host", [(0, False), (1, False), (0, True)])
def test_per_request_sampling_session_equals_fixed_sessions(ckpt, speculative, on_host):
    """One knob session serves calls with different parameters; each call's tokens equal those of
    a session built with that call's fixed parameters (plain and speculative decoding; the
    device-tensor path that graph mode captures, and the host branches of eager mode)."""
    m = _model(ckpt, mtp=bool(speculative))
    knob_s = Session(m, SamplingParams(), speculative=speculative, per_request_sampling=True)
    assert knob_s.knobs.on_host                  # an eager session branches on the host ...
    knob_s.knobs.on_host = on_host               # ... the captured path, run eagerly here
    prompt, n = list(range(40, 52)), 8 - 2 * speculative
    calls = [SamplingParams(0.8, top_p=0.9, seed=11), SamplingParams(),
             SamplingParams(1.1, top_k=7, seed=12)][:3 - speculative]
    for params in calls:
        got = knob_s.generate(prompt, n, sampling=params).output_ids
        fixed = Session(m, params, speculative=speculative)
        assert fixed.generate(prompt, n).output_ids == got, params
    with pytest.raises(ValueError, match="per_request_sampling"):
        Session(m, SamplingParams(), speculative=speculative).generate(
            prompt, 2, sampling=SamplingParams(1.0))


@pytest.mark.parametrize("speculative", [0, 1])
def test_knob_steps_have_no_host_sync(ckpt, monkeypatch, speculative):
    """Capture-readiness on the CPU: the plain and the speculative steps with knobs (the path
    graph mode captures) read no tensor value on the host."""
    s = Session(_model(ckpt, mtp=bool(speculative)), SamplingParams(), speculative=speculative,
                per_request_sampling=True)
    s.knobs.on_host = False
    s.generate(list(range(10, 20)), 3, sampling=SamplingParams(0.9, 0.8, 4, seed=1))

    def boom(*a, **k):
        raise AssertionError("host sync in a knob step")
    for name in ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    monkeypatch.setattr(torch, "nonzero", boom)
    for _ in range(3):
        (s.spec.decoder if speculative else s.decoder).step()


@pytest.mark.cuda
@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_knobs_give_the_fixed_parameters_bits_on_cuda(params):
    knobs = SamplingKnobs("cuda:0", params)
    for i, lg in enumerate(_logits(3, V=129280).cuda()):
        pos = torch.tensor([5 + 7 * i], device="cuda:0")
        assert torch.equal(sample(lg, pos, knobs), sample(lg, pos, params))
        if not params.greedy:
            assert torch.equal(filtered_probs(lg, knobs), filtered_probs(lg, params))


@pytest.mark.cuda
@pytest.mark.parametrize("top_p", [0.9, 1 - 1e-9])
def test_top_p_gives_the_same_bits_every_run_on_cuda(top_p):
    """The top-p prefix mass over a full vocabulary, 30 times on the same logits: one set of bits
    (a lone-row cumsum on CUDA is a device-wide scan whose float sums vary run to run: an H200
    kept a 1e-12 tail entry in one call and dropped it in the next)."""
    params = SamplingParams(1.0, top_p=top_p, seed=10)
    lg = _logits(5, n=1, V=129280)[0].cuda() * 3
    first = filtered_probs(lg, params)
    for _ in range(30):
        assert torch.equal(filtered_probs(lg, params), first)


@pytest.mark.cuda
def test_greedy_requests_replay_the_greedy_twin_on_cuda(tmp_path_factory):
    """A per-request session in graph mode captures a greedy twin of the step: a greedy request
    replays it (no softmax, sort or scan), with the tokens of a fixed-greedy session; a sampled
    request replays the step that samples, with a fixed session's tokens."""
    path = small_checkpoint(tmp_path_factory.mktemp("twin"), "fp8")
    m, ck = load_model(path, RuntimeConfig(max_seq_len=96, devices=("cuda:0",)))
    ck.close()
    knob_s = Session(m, SamplingParams(), mode="graph", per_request_sampling=True)
    assert knob_s.greedy is not None and knob_s.greedy.mode == "graph"
    prompt, n = list(range(40, 52)), 8
    for params in (SamplingParams(), SamplingParams(0.9, top_p=0.8, seed=3), SamplingParams()):
        twin, sampler = knob_s.greedy.steps_run, knob_s.decoder.steps_run
        got = knob_s.generate(prompt, n, sampling=params).output_ids
        ran = knob_s.greedy if params.greedy else knob_s.decoder
        idle = knob_s.decoder if params.greedy else knob_s.greedy
        assert ran.steps_run - (twin if params.greedy else sampler) == n - 1
        assert idle.steps_run == (sampler if params.greedy else twin)
        with Session(m, params, mode="graph") as fixed:
            assert fixed.generate(prompt, n).output_ids == got, params
    knob_s.close()
