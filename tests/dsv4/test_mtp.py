"""The MTP block against the official reference (p3-mtp goldens) and self-speculative decoding:
greedy output equals plain decoding, the state after accepted and rejected drafts equals plain
decoding's, and the speculative sampler draws from the plain sampling distribution."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import parity_case_dir
from dsv4.runtime.config import RuntimeConfig
from dsv4.runtime.sampling import SamplingParams, filtered_probs, uniform_noise
from dsv4.runtime.session import Session, load_model
from dsv4.runtime.speculative.policy import DEFAULT_MIN_ACCEPTANCE
from dsv4.runtime.speculative.verify import accept, draft, oracle_draft, oracle_table, stream_seed

DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def rel_err(a, b):
    return np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)


def mtp_logits_teacher_forced(model, tokens, s):
    """MTP logits of every position 0..len(tokens)-2 along `tokens` (the golden's alignment):
    prefill of the prompt rows, then one decode step per later position."""
    dev = model.head_device
    tok = torch.tensor(tokens, dtype=torch.int64, device=dev)
    mtp, rows = model.mtp, []
    h = model.hidden(tok[:s], 0).to(dev)                                  # main rows 0..s-1
    hm = mtp.prefill(h, model.embed.index_select(0, tok[1:s + 1]), tok[1:s + 1], 0)
    rows += [model.logits(hm[i:i + 1], head=mtp.head()) for i in range(s)]
    for t in range(s, len(tokens) - 1):
        pos = torch.tensor([t], device=dev)
        h = model.decode_hidden(tok[t:t + 1], pos).to(dev)
        nxt = tok[t + 1:t + 2]
        hm = mtp.decode(h, model.embed.index_select(0, nxt), nxt, pos)
        rows.append(model.logits(hm, head=mtp.head()))
    return torch.stack(rows).float().cpu().numpy()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_mtp_parity(mode, device):
    d = parity_case_dir("p3-mtp")
    case = json.loads((d / "case.json").read_text())
    g = np.load(d / f"golden-mtp-{mode}.npz")
    golden, tokens = g["mtp_logits"], g["tokens"].tolist()
    rt = RuntimeConfig(max_seq_len=128, dtype=DTYPE[mode], devices=(device,), mtp=True)
    model, ck = load_model(d, rt)
    ck.close()
    with torch.inference_mode():
        got = mtp_logits_teacher_forced(model, tokens, len(case["prompt_ids"]))
    assert got.shape == golden.shape
    err = rel_err(got, golden)
    tol = case["modes"][mode]["mtp"]["tolerance"]
    med, p95 = float(np.median(err)), float(np.percentile(err, 95))
    assert med < tol["median"] and p95 < tol["p95"], (med, p95, tol)
    if mode == "fp32":
        top2 = np.sort(golden, axis=1)[:, -2:]
        sure = (top2[:, 1] - top2[:, 0]) > 1e-3
        assert not np.any(sure & (got.argmax(1) != golden.argmax(1)))


@pytest.mark.parametrize("device", DEVICES)
def test_drafts_from_the_heads_e4m3_copy(device):
    """The MTP block drafts through an e4m3 copy of the head (Transformer.ensure_draft_head: the
    checkpoint's FP8 format, half the bf16 head's bytes): its weights within e4m3's rounding of
    the head's, its logits within a few percent of the MTP head's exact ones and with their top
    token where that leads clearly (on CUDA through the FP8 GEMV, within float32 summation of
    the torch reference, the same bits twice); DSV4_DRAFT_FP8=0 (Options.draft_fp8) keeps the
    exact ones."""
    from dsv4.backend.options import Options
    from dsv4.weights.formats import dequantize_fp8_weight
    d = parity_case_dir("p3-mtp")
    case = json.loads((d / "case.json").read_text())
    tokens = np.load(d / "golden-mtp-fp32.npz")["tokens"].tolist()
    m, ck = load_model(d, RuntimeConfig(max_seq_len=128, dtype=torch.float32, mtp=True,
                                        devices=(device,)))
    ck.close()
    assert m.draft_head is None                          # made for a speculative step only
    m.ensure_draft_head()
    w = m.draft_head
    assert w is not None and w.weight.dtype == torch.float8_e4m3fn
    deq = dequantize_fp8_weight(w.weight, w.scale)
    head = m.head.float()
    blockmax = head.abs().reshape(head.shape[0] // 128, 128, -1, 128).amax(dim=(1, 3))
    bound = blockmax.repeat_interleave(128, 0).repeat_interleave(128, 1) * 2 ** -8 + \
        head.abs() * 2 ** -4                             # e4m3: 3 mantissa bits, subnormals
    assert ((deq - head).abs() <= bound).all()
    s, tok = len(case["prompt_ids"]), torch.tensor(tokens, device=device)
    with torch.inference_mode():
        hm = m.mtp.prefill(m.hidden(tok[:s], 0), m.embed.index_select(0, tok[1:s + 1]),
                           tok[1:s + 1], 0)
        exact = torch.stack([m.logits(hm[i:i + 1], head=m.mtp.head()) for i in range(s)])
        draft = torch.stack([m.draft_logits(hm[i:i + 1]) for i in range(s)])
        assert ((draft - exact).norm(dim=1) <= 0.06 * exact.norm(dim=1)).all()
        top2 = exact.topk(2, dim=1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.1 * exact.std()
        assert clear.sum() >= s // 2
        assert torch.equal(draft.argmax(1)[clear], exact.argmax(1)[clear])
        if device == "cuda":                             # the FP8 GEMV against the reference
            x = m.head_in_rows(hm[:4], m.mtp.head())
            got = torch.cat([m.draft_matmul(x[i:i + 1]) for i in range(4)])
            ref = m.draft_matmul_reference(x)
            assert (got - ref).abs().max() <= 1e-5 * ref.abs().max() * x.shape[1] ** 0.5
            assert torch.equal(got[:1], m.draft_matmul(x[:1]))
        # the switch off: the MTP head's exact logits
        m2, ck = load_model(d, RuntimeConfig(max_seq_len=128, dtype=torch.float32, mtp=True,
                                              devices=(device,),
                                              options=Options(draft_fp8=False)))
        ck.close()
        m2.ensure_draft_head()
        assert m2.draft_head is None
        assert torch.equal(m2.draft_logits(hm[:1]), m2.logits(hm[:1], head=m2.mtp.head()))


# ---- speculative decoding ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """SMALL's first three layers, one of each kind (the hash layer, window-only; ratio 4 with the
    indexer; ratio 16) and its MTP block: every kind of state a rejected row writes and the
    journal restores (SMALL's fourth layer is a second ratio-4 layer: a quarter of each step's
    time, no state of another kind)."""
    from helpers import SMALL3, small_checkpoint
    root = tmp_path_factory.mktemp("mtp")
    return {w: small_checkpoint(root, w, cfg=SMALL3) for w in ("fp8", "bf16")}


def _model(path, cap=320, dtype=torch.float32, sharpen=30.0):
    """The model with its head scaled by `sharpen`: the same greedy tokens, but the random
    model's logits stop being near-ties every few rows (margins x 30)."""
    m, ck = load_model(path, RuntimeConfig(max_seq_len=cap, dtype=dtype, mtp=True))
    ck.close()
    m.head.mul_(sharpen)
    return m


def first_near_tie(logits):
    top2 = logits.topk(2, dim=-1).values
    small_ = ((top2[:, 0] - top2[:, 1]) < 1e-3).nonzero()
    return int(small_[0]) if small_.numel() else logits.shape[0]


@pytest.fixture(scope="module")
def plain_runs(small):
    """Plain greedy decoding of a fresh _model per (weights, prompt, tokens), run once for the
    module: the same deterministic run every speculative case compares against (10 s each)."""
    runs = {}

    def run(weights, prompt, n_new, keep_logits=False):
        key = (weights, tuple(prompt), n_new, keep_logits)
        if key not in runs:
            runs[key] = Session(_model(small[weights]), SamplingParams()).generate(
                prompt, n_new, keep_logits=keep_logits)
        return runs[key]
    return run


# The verify pass runs its rows through the decode path at the same positions as plain decoding
# and the journal restores rejected rows' slots exactly: the logits are plain decoding's, bit for
# bit, whatever was accepted (so the comparison holds past near-ties and through FP8 rounding).
# Lengths: past the window (16) and many ratio-16 emissions (SPEC_LEN: 128 tokens, 8 of them);
# fp8 at a = 0 runs the default policy's whole schedule (probes between plain runs of 16, 32, 64
# and 128 steps: 256 tokens), and every step speculative over the first SPEC_LEN of them (the
# schedule is the default policy's only), whose plain run's first tokens are the shorter runs'
# plain runs (greedy decoding is a prefix)
SPEC_LEN = 128
@pytest.mark.parametrize("weights,a,n_new", [("bf16", 0.0, 96), ("bf16", 0.6, 96),
                                             ("bf16", 1.0, 96), ("fp8", 0.0, 256),
                                             ("fp8", 0.6, 128), ("fp8", 1.0, 128)])
def test_speculative_greedy_equals_plain(small, plain_runs, weights, n_new, a):
    """Every step speculative (min acceptance 0), and (fp8) the default policy, which turns to
    plain steps with the MTP block following while the drafts fail: the same tokens and
    logits."""
    m = _model(small[weights])
    prompt = list(range(5, 45))
    full = plain_runs(weights, prompt, {"bf16": 96, "fp8": 256}[weights], keep_logits=True)
    plain = SimpleNamespace(output_ids=full.output_ids[:n_new], logits=full.logits[:n_new])
    # a = 1: every draft accepted, so the default policy never turns to plain steps and its run
    # is min acceptance 0's, step for step (the policy there: test_spec_policy, test_bench)
    for min_acc in (0.0, DEFAULT_MIN_ACCEPTANCE) if weights == "fp8" and a < 1 else (0.0,):
        s = Session(m, SamplingParams(), speculative=1, spec_min_acceptance=min_acc)
        if a:   # the MTP block of a random checkpoint never guesses right: an oracle drafts
            s.spec.set_oracle(prompt + plain.output_ids, a)
        n = n_new if min_acc else min(n_new, SPEC_LEN)
        spec = s.generate(prompt, n, keep_logits=True)
        assert spec.output_ids == plain.output_ids[:n], min_acc
        assert torch.equal(spec.logits, plain.logits[:n]), min_acc
        t = spec.timings
        if a == 0:
            assert t["steps"] == n - 1 and t["acceptance_rate"] == 0.0
        # a last step that may output one token only is a plain one
        if min_acc == 0 or a == 1.0:    # never below the bar: every other step drafts
            assert t["speculative_steps"] == t["steps"] - 1, t
        elif a == 0:    # probes of 4 steps between plain runs of 16, 32, 64 and 128 steps;
            # the first probe runs 5: a step's drafts reach the policy two launches later
            # (SpecStep.launch), so the 5th is launched before the 4th is judged
            assert t["speculative_steps"] == 17, t
        if a == 1.0:       # every draft right: two tokens per step (the last step may be single)
            assert t["acceptance_rate"] > 0.99 and t["tokens_per_step"] > 1.95
        if a == 0.6 and min_acc == 0:
            assert 0.35 < t["acceptance_rate"] < 0.85
            assert t["tokens_per_step"] == pytest.approx(1 + t["acceptance_rate"], abs=0.02)


@pytest.mark.parametrize("name", ["p1-bf16-3layer", "p2-fp8-2layer", "p3-mtp"])
def test_speculative_parity_cases(name):
    """float32 greedy with speculation on the parity cases: the reference's tokens up to the first
    near-tie, and the logits that chose them within the float32 tolerance."""
    d = parity_case_dir(name)
    case = json.loads((d / "case.json").read_text())
    g = np.load(d / "golden-fp32.npz")
    m, ck = load_model(d, RuntimeConfig(max_seq_len=128, dtype=torch.float32, mtp=True))
    ck.close()
    out = Session(m, SamplingParams(), speculative=1).generate(
        case["prompt_ids"], case["max_new_tokens"], keep_logits=True)
    golden = g["logits"]
    n = first_near_tie(torch.from_numpy(golden))
    assert out.output_ids[:n] == g["tokens"].tolist()[:n]
    err = rel_err(out.logits.numpy()[:n], golden[:n])
    tol = case["modes"]["fp32"]["tolerance"]
    assert np.median(err) < tol["median"] and np.percentile(err, 95) < tol["p95"]


def _mtp_state(m):
    st = m.mtp.state
    return [st.kv_cache.clone()]


@pytest.fixture(scope="module")
def decoded_states():
    """The state a model holds after the prompt's prefill and plain decode steps over the same
    tokens, the MTP block along, per (prompt, sequence, length): computed once for the module
    (both policies' runs must reach the same state)."""
    return {}


@pytest.mark.parametrize("min_acc", [0.0, DEFAULT_MIN_ACCEPTANCE])
def test_state_after_rejections_equals_plain(small, plain_runs, decoded_states, min_acc):
    """Bit for bit, FP8 activation quantization on: the kept rows are decode steps, the journal
    restores every slot a dropped row wrote, and (the default policy) plain steps with the MTP
    block following leave the state a speculative step would."""
    from helpers import live_state
    m = _model(small["fp8"])
    prompt = list(range(5, 45))         # the greedy cases' prompt: the first 150 of their plain run
    plain = SimpleNamespace(output_ids=plain_runs("fp8", prompt, 256, keep_logits=True)
                            .output_ids[:150])
    s = Session(m, SamplingParams(), speculative=1, spec_min_acceptance=min_acc)
    s.spec.set_oracle(prompt + plain.output_ids, 0.5)
    out = s.generate(prompt, 150)
    assert out.output_ids == plain.output_ids
    assert 0.3 < out.timings["acceptance_rate"] < 0.7
    t = out.timings
    if min_acc:       # both kinds of step ran
        assert 8 <= t["speculative_steps"] < t["steps"] - 20, t
    L = s.length                                  # positions in the state (pending not fed)
    seq = prompt + out.output_ids
    got, got_mtp = live_state(m), _mtp_state(m)
    # the prompt's prefill (the MTP block following), then plain decode steps over the same
    # tokens, the MTP block along (row t: h_t and token t+1)
    key = (tuple(prompt), tuple(seq), L)
    if key not in decoded_states:
        m.reset()
        P = len(prompt)
        with torch.inference_mode():
            m.prefill(torch.tensor(prompt), 0, mtp=True)
            m.mtp_follow_token(torch.tensor([seq[P]]))
            for t in range(P, L):
                pos = torch.tensor([t])
                h = m.decode_hidden(torch.tensor([seq[t]]), pos)
                nxt = torch.tensor([seq[t + 1]])
                m.mtp.decode(h, m.embed.index_select(0, nxt), nxt, pos)
        decoded_states[key] = live_state(m) + _mtp_state(m)
    want = decoded_states[key]
    assert len(want) == len(got) + len(got_mtp)
    for a, b in zip(got + got_mtp, want):
        assert torch.equal(a, b)


def test_each_request_stops_at_its_own_eos(small, plain_runs):
    """A step's cap and EOS reach the device only when they change (SpecStep.set_stop): requests
    in one session, with different EOS ids or none, each stop where plain decoding does. Every
    draft right (two tokens a step), so one of the EOS positions 9 and 10 is a step's first
    token, where the step must drop its second."""
    m = _model(small["bf16"])
    prompt = list(range(5, 45))
    ids = plain_runs("bf16", prompt, 96, keep_logits=True).output_ids
    s = Session(m, SamplingParams(), speculative=1, spec_min_acceptance=0.0)
    s.spec.set_oracle(prompt + ids, 1.0)
    for eos_at, n in ((9, 30), (10, 30), (None, 30), (None, 7), (9, 30)):
        eos = None if eos_at is None else ids[eos_at]
        end = n if eos is None else min(n, ids.index(eos) + 1)
        out = s.generate(prompt, n, eos_id=eos)
        assert out.output_ids == ids[:end], (eos_at, n)
    s.spec.set_stop(5, None)
    assert int(s.spec.bufs.limit) == 2 and int(s.spec.bufs.eos) == -1   # any cap >= T is T
    s.spec.set_stop(1, ids[3])
    assert int(s.spec.bufs.limit) == 1 and int(s.spec.bufs.eos) == ids[3]


def test_a_step_launched_past_the_end(small, plain_runs):
    """The speculative loop launches a step before it reads the last one (SpecStep.launch). Where
    that last one ends at the EOS, the step past it feeds the EOS and keeps nothing more: the
    state is plain decoding's after its own one-late step, bit for bit, and both sequences go on
    alike. Where on_token stops, the step past it outputs its tokens too: output_ids ends with
    them and the state holds all but the last, as a continuation shows."""
    from helpers import live_state
    prompt, more = list(range(5, 45)), list(range(60, 66))
    ids = plain_runs("bf16", prompt, 96, keep_logits=True).output_ids
    for a, eos_at in ((1.0, 9), (1.0, 10), (0.5, 17)):
        s = Session(_model(small["bf16"]), SamplingParams(), speculative=1,
                    spec_min_acceptance=0.0)
        s.spec.set_oracle(prompt + ids, a)
        ref = Session(_model(small["bf16"]), SamplingParams())
        eos = ids[eos_at]
        out = s.generate(prompt, 30, eos_id=eos)
        want = ref.generate(prompt, 30, eos_id=eos)
        assert out.output_ids == want.output_ids == ids[:ids.index(eos) + 1]
        assert (s.length, s.pending) == (ref.length, ref.pending) == (
            len(prompt) + len(out.output_ids), None), (a, eos_at)
        for x, y in zip(live_state(s.model), live_state(ref.model)):
            assert torch.equal(x, y), (a, eos_at)
        assert (s.generate(more, 12, continue_sequence=True).output_ids
                == ref.generate(more, 12, continue_sequence=True).output_ids)
    s = Session(_model(small["bf16"]), SamplingParams(), speculative=1, spec_min_acceptance=0.0)
    s.spec.set_oracle(prompt + ids, 1.0)
    seen = []
    out = s.generate(prompt, 30, on_token=lambda t: seen.append(t) or len(seen) == 8)
    assert out.finish_reason == "stopped" and seen == ids[:8]
    assert 8 < len(out.output_ids) <= 8 + 1 + 2 and out.output_ids == ids[:len(out.output_ids)]
    assert (s.length, s.pending) == (len(prompt) + len(out.output_ids) - 1, out.output_ids[-1])
    ref = Session(_model(small["bf16"]), SamplingParams())     # the same tokens, fed by plain steps
    ref.generate(prompt, len(out.output_ids), force_ids=out.output_ids)
    assert (ref.length, ref.pending) == (s.length, s.pending)
    for x, y in zip(live_state(s.model), live_state(ref.model)):
        assert torch.equal(x, y)
    assert (s.generate(more, 12, continue_sequence=True).output_ids
            == ref.generate(more, 12, continue_sequence=True).output_ids)


def test_the_next_step_is_launched_before_the_last_is_read(small):
    """The speculative loop's order of launches and reads (SpecStep.launch / finish): each step
    is launched before the host reads the one before it while 2T or more tokens are left (and
    logits are not kept); the last steps, which may reach the limit, and every step with
    keep_logits are read before the next launch."""
    s = Session(_model(small["bf16"]), SamplingParams(), speculative=1, spec_min_acceptance=0.0)
    order = []
    launch, finish = s.spec.launch, s.spec.finish
    s.spec.launch = lambda *a: (order.append("L"), launch(*a))[1]
    s.spec.finish = lambda run: (order.append("F"), finish(run))[1]
    prompt = list(range(5, 45))
    s.generate(prompt, 12)              # a = 0: one token a step, 11 steps
    # steps 2..9 launched before the read of 1..8 (11..4 tokens left); 10 and 11 after a read
    assert "".join(order) == "LL" + "FL" * 7 + "FF" + "LF" * 2, "".join(order)
    order.clear()
    s.generate(prompt, 12, keep_logits=True)
    assert "".join(order) == "LF" * 11


def test_continue_a_speculative_sequence(small, no_fake_quant):
    m = _model(small["fp8"])
    a, b = list(range(3, 30)), list(range(40, 52))
    ref = Session(m, SamplingParams())
    r1 = ref.generate(a, 20)
    r2 = ref.generate(b, 30, continue_sequence=True)
    s = Session(m, SamplingParams(), speculative=1)
    o1 = s.generate(a, 20)
    o2 = s.generate(b, 30, continue_sequence=True)
    assert (o1.output_ids, o2.output_ids) == (r1.output_ids, r2.output_ids)
    assert s.length == ref.length and s.pending == ref.pending


def test_speculative_needs_an_mtp_block(small):
    from dsv4.errors import ConfigError
    m, ck = load_model(small["fp8"], RuntimeConfig(max_seq_len=64, dtype=torch.float32))
    ck.close()
    with pytest.raises(ConfigError, match="MTP block"):
        Session(m, SamplingParams(), speculative=1)
    m = _model(small["fp8"], cap=64)
    with pytest.raises(ConfigError, match="only 1 draft"):
        Session(m, SamplingParams(), speculative=2)


# ---- the speculative sampler's distribution ---------------------------------------------------
def _chi2(counts, probs):
    n = counts.sum()
    exp = probs * n
    keep = exp > 0
    assert counts[~keep].sum() == 0, "drew a token of probability 0"
    return float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def test_the_oracles_table_is_its_draw_at_each_position():
    """The benchmarks' oracle (SpecStep.set_oracle): its draft of position p, looked up in the
    table made once, is the draw keyed by p alone (seq[p] with probability a, else seq[p] + 1
    mod the vocabulary), as if drawn at p; a step with the oracle off keeps its own draft."""
    V, n = 50, 300
    seq = torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(3))
    seq[-40:] = V - 1                                      # the wrap of a wrong draft
    for a in (0.0, 0.3, 1.0):
        table = oracle_table(seq, a, V)
        right = 0
        for p in range(n):
            u = uniform_noise(stream_seed(0, "oracle"), torch.tensor([p]), 1)
            want = int(seq[p]) if float(u) < a else (int(seq[p]) + 1) % V
            got = oracle_draft(torch.tensor([7]), torch.tensor([p]), table, torch.tensor([True]))
            assert int(got) == want, (a, p)
            right += want == int(seq[p])
        assert right == {0.0: 0, 1.0: n}.get(a, right) and (a != 0.3 or 0.2 * n < right < 0.4 * n)
        off = oracle_draft(torch.tensor([7]), torch.tensor([5]), table, torch.tensor([False]))
        assert int(off) == 7


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=5),
                                    SamplingParams(temperature=0.7, top_k=5, seed=9),
                                    SamplingParams(temperature=1.3, top_p=0.8, seed=2)])
def test_rejection_sampling_keeps_the_distribution(params):
    """Each output token of a step follows plain sampling: the first from the target row given a
    draft from another distribution; the second (after an acceptance) from the next row. (Under
    inference mode, as a Session runs them: 6,000 steps of small ops, ~20% less dispatch.)"""
    g = torch.Generator().manual_seed(0)
    V, N = 8, 6000
    lp = torch.randn(2, V, generator=g) * 1.5            # target rows (pos, pos + 1)
    lq = torch.randn(V, generator=g) * 1.5                # the draft model's row
    p0, p1 = filtered_probs(lp[0], params), filtered_probs(lp[1], params)
    first, second = np.zeros(V), np.zeros(V)
    with torch.inference_mode():
        for i in range(N):
            pos = 10 * i + 3
            d, q = draft(lq, torch.tensor([pos]), params)
            y, keep = accept(lp, d, q[None], torch.tensor([pos]), params, torch.tensor([2]),
                             torch.tensor([-1]))
            first[int(y[0])] += 1
            if int(keep) == 1:
                second[int(y[1])] += 1
    for counts, p in ((first, p0), (second, p1)):
        stat, df = _chi2(counts, p.double().numpy())
        assert stat < CHI2_999[df], (stat, df, counts, p)
    assert 200 < second.sum() < N - 200               # both branches taken
    # the test has power: the draft distribution itself is rejected
    stat, df = _chi2(first, filtered_probs(lq, params).double().numpy() * 0.999 + 0.001 / V)
    assert stat > CHI2_999[min(df, 7)]


def _plain_first_two(m, prompt, temperature, seeds):
    """counts [V, V] of the first two tokens of plain sampling, Session(m, SamplingParams(
    temperature, seed)).generate(prompt, 2) for every seed: the tokens those runs output, with one
    run of the model per distinct first token instead of one per seed. Decoding is deterministic:
    the prompt's logits are the same in every run and the second token's logits depend on the
    first token only, and each token is the sampler's draw from its logits with noise keyed by
    (seed, position). So each seed's tokens are drawn here by the sampler the runs use, from the
    logits of a real run (keep_logits) that chose the same first token; every real run's own
    two tokens are checked to be these draws (a wrong position or logits row would fail)."""
    from dsv4.runtime.sampling import sample
    from dsv4.runtime.session import Session as S
    V = m.cfg.vocab_size
    counts = np.zeros((V, V))
    pos0, pos1 = torch.tensor([len(prompt) - 1]), torch.tensor([len(prompt)])
    rows0, rows1 = None, {}                  # the prompt's logits; the second token's, by first
    for seed in seeds:
        params = SamplingParams(temperature=temperature, seed=seed)
        x = None if rows0 is None else int(sample(rows0, pos0, params))
        if x is None or x not in rows1:      # a first token not seen yet: a real plain run
            run = S(m, params).generate(prompt, 2, keep_logits=True)
            if rows0 is None:
                rows0 = run.logits[0]
                x = int(sample(rows0, pos0, params))
            assert torch.equal(run.logits[0], rows0) and run.output_ids[0] == x, seed
            rows1[x] = run.logits[1]
            assert int(sample(rows1[x], pos1, params)) == run.output_ids[1], seed
        counts[x, int(sample(rows1[x], pos1, params))] += 1
    return counts


def test_speculative_sampling_matches_plain_on_a_model():
    """A small-vocabulary model: the second generated token (the first a speculative step
    emits) has the same distribution with and without speculation over many seeds. One main
    layer (SMALL's first, the hash layer) and the MTP block: the runs read 6 positions, where
    the compressed layers hardly take part, and 600 runs of SMALL's four layers took ~45 s (the
    state a rejection leaves: test_state_after_rejections_equals_plain)."""
    from dsv4.runtime.session import Session as S
    from dsv4.weights.presets import truncate_layers
    from dsv4.weights.synthetic import write_checkpoint
    from helpers import SMALL
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(truncate_layers(SMALL.replace(vocab_size=16), 1), tmp,
                                weights="bf16", seed=1)
        m = _model(path, cap=32, sharpen=1.0)
        V = m.cfg.vocab_size
        counts = {0: _plain_first_two(m, [1, 2, 3], 3.0, range(300)), 1: np.zeros((V, V))}
        acc = []
        for seed in range(300):
            s = S(m, SamplingParams(temperature=3.0, seed=seed), speculative=1)
            # two tokens are read; the speculative run asks for three, so that its first step
            # may emit two (a step allowed one token is a plain one)
            out = s.generate([1, 2, 3], 3).output_ids
            counts[1][out[0], out[1]] += 1
            acc.append(s.spec.accepted)
    # the second token given the first (pooled over first tokens with enough draws)
    a, b = counts[0].sum(0), counts[1].sum(0)
    keep = (a + b) >= 10
    exp_a = (a + b)[keep] * a.sum() / (a.sum() + b.sum())
    exp_b = (a + b)[keep] * b.sum() / (a.sum() + b.sum())
    stat = float(((a[keep] - exp_a) ** 2 / exp_a).sum() + ((b[keep] - exp_b) ** 2 / exp_b).sum())
    df = int(keep.sum()) - 1
    crit = {k: v for k, v in CHI2_999.items()}.get(df, df + 3.3 * (2 * df) ** 0.5)
    assert stat < crit, (stat, df)
    assert sum(acc) > 40, "the drafts were never accepted: the test would not exercise acceptance"
