"""Log-probabilities (dsv4.runtime.logprobs): the step's entries equal the log-softmax of the
logits the step sampled from (the host-branch and the captured knob paths), asking for them
changes no token, the prompt's entries (Session.score) equal the teacher-forced decode logits, a
LogprobStep reads no tensor value on the host; on CUDA graph replay gives eager's entries."""
import pytest
import torch

from dsv4.runtime.config import RuntimeConfig
from dsv4.runtime.logprobs import TOP_MAX, LogprobBuffers, write_logprobs
from dsv4.runtime.sampling import SamplingParams
from dsv4.runtime.session import Session, load_model
from helpers import small_checkpoint

PROMPT = list(range(40, 52))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp("logprobs"), "fp8")


def _model(path, device="cpu"):
    m, ck = load_model(path, RuntimeConfig(max_seq_len=96, dtype=torch.float32,
                                           devices=(device,)))
    ck.close()
    return m


def test_write_logprobs_is_the_log_softmax_and_its_top():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4096, generator=g) * 4
    out = LogprobBuffers.allocate("cpu")
    write_logprobs(logits, torch.tensor([17]), out)
    ref = torch.log_softmax(logits.double(), -1)
    assert out.values[0].item() == pytest.approx(ref[17].item(), abs=1e-5)
    top = ref.topk(TOP_MAX)
    assert out.ids.tolist() == top.indices.tolist()
    torch.testing.assert_close(out.values[1:].double(), top.values, atol=1e-5, rtol=0)


@pytest.mark.parametrize("on_host", [True, False])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(1.0, top_p=0.9, seed=3)],
                         ids=str)
def test_step_entries_are_the_sampled_logits_and_change_no_token(ckpt, on_host, params):
    s = Session(_model(ckpt), SamplingParams(), per_request_sampling=True)
    s.knobs.on_host = on_host                 # False: the path graph mode captures, run eagerly
    plain = s.generate(PROMPT, 6, sampling=params).output_ids
    got = []
    res = s.generate(PROMPT, 6, sampling=params, on_logprobs=got.append, keep_logits=True)
    assert res.output_ids == plain and [e.token for e in got] == plain
    assert res.logprobs == got
    ref = torch.log_softmax(res.logits.double(), -1)
    for i, e in enumerate(got):
        assert e.logprob == pytest.approx(ref[i, e.token].item(), abs=1e-5)
        assert [t for t, _ in e.top] == ref[i].topk(TOP_MAX).indices.tolist()
        if params.greedy:
            assert e.top[0][0] == e.token


def test_score_equals_the_teacher_forced_decode_logits(ckpt, no_fake_quant):
    s = Session(_model(ckpt), SamplingParams(), per_request_sampling=True)
    entries = s.score(PROMPT)
    assert entries[0] is None and [e.token for e in entries[1:]] == PROMPT[1:]
    forced = s.generate(PROMPT[:1], len(PROMPT) - 1, force_ids=PROMPT[1:], keep_logits=True)
    ref = torch.log_softmax(forced.logits.double(), -1)
    for i, e in enumerate(entries[1:]):
        assert e.logprob == pytest.approx(ref[i, PROMPT[i + 1]].item(), abs=1e-4)
    # the state holds the prompt: going on from it equals a plain generation after it
    s.score(PROMPT)
    after = s.generate([], 4, continue_sequence=True).output_ids
    assert after == s.generate(PROMPT, 4).output_ids


def test_logprobs_need_a_per_request_session_and_no_forced_ids(ckpt):
    m = _model(ckpt)
    with pytest.raises(ValueError, match="per_request_sampling"):
        Session(m, SamplingParams()).generate(PROMPT, 2, on_logprobs=lambda e: None)
    with pytest.raises(ValueError, match="force_ids"):
        Session(m, SamplingParams(), per_request_sampling=True).generate(
            PROMPT, 2, force_ids=[1, 2], on_logprobs=lambda e: None)


def test_logprob_step_and_masked_sample_have_no_host_sync(ckpt, monkeypatch):
    s = Session(_model(ckpt), SamplingParams(), per_request_sampling=True)
    s.knobs.on_host = False
    s.generate(PROMPT, 3, sampling=SamplingParams(0.9, 0.8, 4, seed=1),
               on_logprobs=lambda e: None)

    def boom(*a, **k):
        raise AssertionError("host sync in a captured pass")
    for name in ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    monkeypatch.setattr(torch, "nonzero", boom)
    s.mask.graph = True                       # the captured step: the bias is always added
    for _ in range(3):
        s.decoder.step()
        s.lp.run()


@pytest.mark.cuda
def test_graph_replay_gives_eager_entries_on_cuda(ckpt):
    params = SamplingParams(1.0, top_p=0.9, seed=5)
    runs = []
    for mode in ("eager", "graph"):
        s = Session(_model(ckpt, "cuda:0"), SamplingParams(), mode=mode,
                    per_request_sampling=True)
        if mode == "eager":
            s.knobs.on_host = False           # the same ops as the captured step
        got = []
        out = s.generate(PROMPT, 8, sampling=params, on_logprobs=got.append).output_ids
        runs.append((out, [(e.token, e.logprob, e.top) for e in got]))
        s.close()
    assert runs[0] == runs[1]
