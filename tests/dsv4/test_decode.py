"""Decode-step contracts on the CPU: prefill+decode == token-by-token, reset, capture-readiness
(no host syncs in a decode step), sampling determinism."""
import pytest
import torch

from conftest import parity_case_dir
from dsv4.runtime.config import RuntimeConfig
from dsv4.runtime.sampling import SamplingParams, sample, uniform_noise
from dsv4.runtime.session import Session, load_model
from helpers import GAP, SMALL3, small_checkpoint


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {"bf16": small_checkpoint(root, "bf16", cfg=SMALL3),
            "fp8": small_checkpoint(root, "fp8", cfg=SMALL3)}


def _model(path, dtype=torch.float32, cap=256):
    m, ck = load_model(path, RuntimeConfig(max_seq_len=cap, dtype=dtype))
    ck.close()
    return m


def _token_by_token(m, ids, first):
    m.reset()
    out = []
    for p, t in enumerate(ids):
        lg = m.decode_step(torch.tensor([t]), torch.tensor([p]))
        if p >= first - 1:
            out.append(lg)
    return torch.stack(out)


def _prefill_then_decode(m, ids, n_prompt):
    out = [m.prefill(torch.tensor(ids[:n_prompt]))]
    for p in range(n_prompt, len(ids)):
        out.append(m.decode_step(torch.tensor([ids[p]]), torch.tensor([p])))
    return torch.stack(out)


@pytest.mark.parametrize("n_prompt", [1, 17, 64])
def test_prefill_then_decode_equals_token_by_token(ckpts, n_prompt, no_fake_quant, near_ties):
    """float32, bf16 weights: 100 positions cross 6 window wraps, ratio-4/16 emissions and
    indexer saturation (top-8 of up to 25 entries); no top-k near-tie (near_ties), so float32
    noise is all that differs, on any CPU."""
    m = _model(ckpts["bf16"])
    g = torch.Generator().manual_seed(n_prompt)
    ids = torch.randint(0, m.cfg.vocab_size, (100,), generator=g).tolist()
    err = _rel_err(_prefill_then_decode(m, ids, n_prompt), _token_by_token(m, ids, n_prompt))
    assert near_ties.min_gap > GAP, f"a top-k near-tie ({near_ties.min_gap:.2g}): other inputs"
    assert err.max() < 1e-5, f"max relative error {err.max():.3g}"


@pytest.mark.parametrize("n_prompt", [17, 64])
def test_prefill_then_decode_with_fake_quant(ckpts, n_prompt):
    """The real forward (fake-quant on): rows sit at float32 noise until a rounding flip lands in a
    cached KV entry (where depends on the CPU's summation order); from then on they stay within
    ~1e-4 (a flip changes one element by 1/16)."""
    m = _model(ckpts["bf16"])
    g = torch.Generator().manual_seed(n_prompt)
    ids = torch.randint(0, m.cfg.vocab_size, (100,), generator=g).tolist()
    err = _rel_err(_prefill_then_decode(m, ids, n_prompt), _token_by_token(m, ids, n_prompt))
    assert err.median() < 1e-3 and err.max() < 5e-3, err


def _rel_err(a, b):
    return (a - b).norm(dim=1) / b.norm(dim=1)


def test_parity_case_prefill_decode_consistency():
    d = parity_case_dir("p1-bf16-3layer")
    m = _model(d)
    ids = list(range(300, 420))
    err = (_prefill_then_decode(m, ids, 40) - _token_by_token(m, ids, 40))
    assert err.abs().max() < 1e-4


def test_two_sequences_equal_fresh_runs(ckpts):
    a_ids, b_ids = list(range(5, 45)), list(range(900, 930))
    s = Session(_model(ckpts["fp8"], torch.bfloat16), SamplingParams(temperature=0.8, seed=3))
    first = s.generate(a_ids, 24, keep_logits=True)
    second = s.generate(b_ids, 24, keep_logits=True)
    fresh = Session(_model(ckpts["fp8"], torch.bfloat16), SamplingParams(temperature=0.8, seed=3))
    again = fresh.generate(b_ids, 24, keep_logits=True)
    assert second.output_ids == again.output_ids
    assert torch.equal(second.logits, again.logits)
    assert fresh.generate(a_ids, 24).output_ids == first.output_ids


def test_decode_step_has_no_host_sync(ckpts, monkeypatch):
    """Capture-readiness on the CPU: a decode step must not read tensor values on the host."""
    s = Session(_model(ckpts["fp8"], torch.bfloat16), SamplingParams(temperature=1.0, top_p=0.9,
                                                                    top_k=50, seed=1))
    s.generate(list(range(10, 30)), 2)               # prefill may sync; decode below may not

    def boom(*a, **k):
        raise AssertionError("host sync in the decode step")
    for name in ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    monkeypatch.setattr(torch, "nonzero", boom)
    monkeypatch.setattr(torch, "unique", boom)
    for _ in range(20):                              # crosses emissions of every compressor
        s.decoder.step()
    m = s.model
    m.decode_step(torch.tensor([5]), torch.tensor([40]))
    monkeypatch.undo()
    assert int(s.bufs.pos) == 41          # prompt 20, one decode step in generate, 20 more


def test_sampling_seeded_and_modes():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1000, generator=g) * 3
    pos = torch.tensor([7])
    greedy = sample(logits, pos, SamplingParams())
    assert greedy.item() == logits.argmax().item()
    p = SamplingParams(temperature=1.0, seed=11)
    assert sample(logits, pos, p).item() == sample(logits, pos, p).item()
    draws = {sample(logits, torch.tensor([i]), p).item() for i in range(50)}
    assert len(draws) > 5                                        # it does sample
    assert sample(logits, pos, SamplingParams(temperature=1.0, top_k=1, seed=4)).item() == greedy.item()
    assert sample(logits, pos, SamplingParams(temperature=1.0, top_p=1e-6, seed=4)).item() == greedy.item()
    top5 = set(logits.topk(5).indices.tolist())
    assert {sample(logits, torch.tensor([i]), SamplingParams(temperature=2.0, top_k=5, seed=2)).item()
            for i in range(40)} <= top5
    a = [sample(logits, torch.tensor([i]), SamplingParams(temperature=1.0, seed=1)).item() for i in range(20)]
    b = [sample(logits, torch.tensor([i]), SamplingParams(temperature=1.0, seed=2)).item() for i in range(20)]
    assert a != b


def test_exponential_race_follows_softmax():
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    probs = logits.softmax(0)
    p = SamplingParams(temperature=1.0, seed=5)
    counts = torch.bincount(torch.stack([sample(logits, torch.tensor([i]), p)
                                         for i in range(4000)]).flatten(), minlength=4)
    assert torch.allclose(counts / 4000, probs, atol=0.03)
    u = uniform_noise(9, torch.tensor([3]), 100000)
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01


def test_session_seeded_generation_is_reproducible(ckpts):
    m = _model(ckpts["fp8"], torch.bfloat16)
    r = [Session(m, SamplingParams(temperature=1.0, seed=s)).generate(list(range(20)), 16).output_ids
         for s in (1, 1, 2)]
    assert r[0] == r[1] and r[0] != r[2]


# ---- the embedding API's contract ------------------------------------------------------------

def test_session_is_a_context_manager_resolves_auto_and_speaks_api(ckpts):
    m = _model(ckpts["fp8"], torch.bfloat16, cap=64)
    with Session(m, SamplingParams(), mode="auto") as s:
        assert s.mode == "eager" and s.decoder.mode == "eager"      # auto on the CPU
        assert len(s.generate([5, 6, 7], 3).output_ids) == 3
    from graphs import LifecycleError
    with pytest.raises(LifecycleError):                             # closed on exit
        s.decoder.step()
    from dsv4.errors import DeviceError, InputError
    with pytest.raises(DeviceError, match="mode='graph' needs CUDA"):
        Session(m, SamplingParams(), mode="graph")
    with pytest.raises(InputError, match="mode='fast'"):
        Session(m, SamplingParams(), mode="fast")
    # API errors name API parameters
    from dsv4.errors import CapacityError, in_cli_words
    s = Session(m, SamplingParams())
    with pytest.raises(CapacityError) as e:
        s.generate(list(range(10)), 60)
    msg = str(e.value)
    assert "RuntimeConfig.max_seq_len to at least 70" in msg and "max_new_tokens" in msg
    assert "--" not in msg
    # the CLI's wording of the same error
    assert "raise --max-seq-len to at least 70 or lower --max-new-tokens" in in_cli_words(msg)
    with pytest.raises(InputError, match="^max_new_tokens = 0: must be >= 1$"):
        s.generate([1, 2], 0)
    with pytest.raises(InputError, match="^force_ids is empty"):
        s.generate([1, 2], 3, force_ids=[])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_a_typed_error():
    from dsv4.errors import DeviceError
    with pytest.raises(DeviceError, match=r"devices = \('cuda:0',\): this torch build has no CUDA"):
        RuntimeConfig(max_seq_len=64, devices=("cuda:0",))
