"""The speculative step as segments (dsv4/runtime/speculative/step.py): on the CPU, a step reads no tensor value
on the host and the journal puts back exactly the slots of dropped rows; on a GPU, the journal
kernel equals its torch reference, graph replay equals the eager step bit for bit (greedy and
sampled), greedy speculation in graph mode equals plain graph decoding bit for bit, the verify
rows through a layer (Block.decode_rows, the linears reading each weight once) equal that many
decode steps bit for bit, outputs and state, and warm-up, capture and replay make no host sync."""
import pytest
import torch

from dsv4.backend.ops import Ops
from dsv4.runtime.config import RuntimeConfig
from dsv4.runtime.sampling import SamplingParams
from dsv4.runtime.session import Session, load_model
from dsv4.runtime.speculative.journal import Journal
from dsv4.model.state import LayerState
from helpers import SMALL, small_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp("spec"), "fp8")


def _model(path, dtype=torch.float32, device="cpu", cap=320):
    m, ck = load_model(path, RuntimeConfig(max_seq_len=cap, dtype=dtype, devices=(device,),
                                           mtp=True))
    ck.close()
    m.head.mul_(30.0)       # the same greedy tokens, fewer near-ties in the random model
    return m


def test_spec_step_has_no_host_sync(ckpt, monkeypatch):
    """Capture-readiness on the CPU: a speculative step (sampling, accept, rewind, draft) must not
    read tensor values on the host."""
    s = Session(_model(ckpt, torch.bfloat16), SamplingParams(temperature=1.0, top_p=0.9, seed=1),
                speculative=1)
    s.generate(list(range(10, 30)), 3)

    def boom(*a, **k):
        raise AssertionError("host sync in the speculative step")
    for name in ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    monkeypatch.setattr(torch, "nonzero", boom)
    for _ in range(12):                              # crosses emissions of every compressor
        s.spec.decoder.step()
    for _ in range(3):                               # the policy's plain steps and redraft
        s.bufs.token.copy_(s.spec.bufs.pending)
        s.bufs.pos.copy_(s.spec.bufs.pos)
        s.decoder.step()
        s.spec.follow.step()
    s.spec.redraft.step()
    monkeypatch.undo()
    assert int(s.spec.bufs.pos) > 20 + 12 + 3


def _states(cfg, device, cap=64):
    """One random state per compress ratio in use (0, 4 and the config's others)."""
    out = []
    for r in sorted({0, 4, *[x for x in cfg.compress_ratios if x]}):
        st = LayerState.allocate(cfg, r, cap, torch.bfloat16, device)
        for t in st.buffers().values():
            t.copy_(torch.randn(t.shape, dtype=torch.float32).to(t.dtype))
        out.append((st, r))
    return out


def _run_journal(states, T, pos, keep, torch_only):
    """save at pos, overwrite every state tensor, rewind(keep) -> the state tensors."""
    dev = states[0][0].kv_cache.device
    j = Journal(states, SMALL.window_size, T, Ops.for_device(dev))
    if torch_only:
        j.fast = None
    p, k = torch.tensor([pos], device=dev), torch.tensor([keep], device=dev)
    j.save(p)
    g = torch.Generator().manual_seed(10007 + pos * 7 + keep)     # not the states' seed
    for st, _ in states:
        for t in st.buffers().values():
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    j.rewind(p, k)
    return [t.clone() for st, _ in states for t in st.buffers().values()]


def test_journal_restores_dropped_rows_only():
    """Rows after keep get their saved slots back (the overwrite is random, so a row equal to its
    saved value was restored); rows up to keep and other slots keep the overwritten values; a block-completing row also gets back the emitted entry and, in overlap
    mode, the previous block."""
    T = 2
    for pos in range(0, 20):
        torch.manual_seed(pos)
        states = _states(SMALL, "cpu")
        saved = [t.clone() for st, _ in states for t in st.buffers().values()]
        kept = _run_journal(states, T, pos, 1, True)           # nothing dropped
        assert not any((x == y).all(dim=-1).any() for x, y in zip(kept, saved))
        torch.manual_seed(pos)
        states = _states(SMALL, "cpu")
        dropped = _run_journal(states, T, pos, 0, True)        # row 1 dropped
        q = pos + 1
        i = 0
        for st, r in states:
            for name, t in st.buffers().items():
                rows = set((dropped[i] == saved[i]).all(dim=-1).nonzero().flatten().tolist())
                want = set()
                W = SMALL.window_size
                if name == "kv_cache":
                    want.add(q % W)
                    if r and (q + 1) % r == 0:
                        want.add(W + q // r)
                elif name == "index_cache":
                    if (q + 1) % r == 0:
                        want.add(q // r)
                else:                                  # compressor rows
                    cur = r if r == 4 else 0
                    want.add(cur + q % r)
                    if r == 4 and (q + 1) % r == 0:
                        want |= set(range(r))
                assert rows == want, (pos, r, name, rows, want)
                i += 1


@pytest.mark.cuda
def test_journal_kernel_equals_torch():
    cfg = SMALL
    for pos in range(0, 40, 3):
        for keep in (0, 1):
            for T in (2, 3, 4):
                torch.manual_seed(pos)
                a = _run_journal(_states(cfg, "cuda"), T, pos, keep, True)
                torch.manual_seed(pos)
                states = _states(cfg, "cuda")
                j = Journal(states, cfg.window_size, T, Ops.for_device("cuda"))
                assert j.fast is not None
                b = _run_journal(states, T, pos, keep, False)
                for x, y in zip(a, b):
                    assert torch.equal(x, y), (pos, keep, T)


def _generate(m, params, mode, prompt, n, spec, oracle=None, min_acc=0.0):
    s = Session(m, params, mode=mode, speculative=1 if spec else 0, spec_min_acceptance=min_acc)
    if oracle is not None:
        s.spec.set_oracle(*oracle)
    out = s.generate(prompt, n, keep_logits=True)
    s.close()
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("min_acc", [0.0, 0.7])
@pytest.mark.parametrize("params", [SamplingParams(),
                                    SamplingParams(temperature=0.8, top_p=0.9, seed=4)])
def test_graph_spec_equals_eager_bitwise(ckpt, params, min_acc):
    """Every step drafting, and the default policy (plain steps with the MTP block following
    between probes: both kinds of step, captured and eager)."""
    m = _model(ckpt, torch.bfloat16, "cuda")
    prompt, n = list(range(5, 45)), 120
    plain = _generate(m, params, "graph", prompt, n, False)
    oracle = (prompt + plain.output_ids, 0.6)
    graph = _generate(m, params, "graph", prompt, n, True, oracle, min_acc)
    eager = _generate(m, params, "eager", prompt, n, True, oracle, min_acc)
    assert graph.output_ids == eager.output_ids
    assert torch.equal(graph.logits, eager.logits)
    assert graph.timings == {**graph.timings, **{k: eager.timings[k] for k in (
        "steps", "speculative_steps", "acceptance_rate")}}
    assert 0.3 < graph.timings["acceptance_rate"] < 0.9
    if min_acc:
        assert 8 <= graph.timings["speculative_steps"] < graph.timings["steps"] - 10
    if params.greedy:        # the kept rows are plain decoding's rows
        assert graph.output_ids == plain.output_ids
        assert torch.equal(graph.logits, plain.logits)


@pytest.mark.cuda
@pytest.mark.parametrize("T,weights", [(2, "fp8"), (3, "fp8"), (4, "fp8"), (2, "bf16")])
def test_decode_rows_equal_decode_steps(tmp_path_factory, T, weights):
    """Every layer (each compress ratio) and the MTP block: T rows in one decode_rows == T
    decode calls at pos .. pos+T-1, outputs and every state tensor bit for bit, on the fused path
    (the T-row GEMV kernels), for the released format and a bf16 checkpoint. Positions cross
    compressor emissions."""
    m = _model(small_checkpoint(tmp_path_factory.mktemp("rows"), weights), torch.bfloat16, "cuda")
    m.prefill(torch.arange(3, 40, device="cuda"))
    c, D = m.cfg.hc_mult, m.cfg.dim
    g = torch.Generator(device="cuda").manual_seed(T)
    h = torch.randn(T, c, D, generator=g, device="cuda").to(torch.bfloat16)
    ids = torch.randint(0, m.cfg.vocab_size, (T,), generator=g, device="cuda")
    assert all(m.binding.ops(blk.device).backend.mhc_decode for blk in m.layers)   # fused
    blocks = [(blk, st) for blk, st in zip(m.layers, m.states)] + [(m.mtp.block, m.mtp.state)]
    for p0 in (37, 38, 39):
        pos = torch.tensor([p0], device="cuda")
        for blk, st in blocks:
            saved = {k: v.clone() for k, v in st.buffers().items()}
            rows = blk.decode_rows(h, ids, pos, st)
            after = {k: v.clone() for k, v in st.buffers().items()}
            for k, v in saved.items():
                st.buffers()[k].copy_(v)
            steps = torch.cat([blk.decode(h[t:t + 1], ids[t:t + 1], pos + t, st)
                               for t in range(T)])
            assert torch.equal(rows, steps), (blk.ratio, p0)
            for k, v in st.buffers().items():
                assert torch.equal(v, after[k]), (blk.ratio, p0, k)
                v.copy_(saved[k])
    x = torch.randn(T, c, D, generator=g, device="cuda").to(torch.bfloat16)
    assert torch.equal(m.logits_rows(x), torch.stack([m.logits(x[t:t + 1]) for t in range(T)]))


@pytest.mark.cuda
def test_spec_capture_and_replay_without_host_sync(ckpt):
    from dsv4.runtime.speculative.step import SpecStep
    m = _model(ckpt, torch.bfloat16, "cuda")
    spec = SpecStep(m, SamplingParams(temperature=1.0, seed=2), mode="graph")
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        spec.capture()
        for _ in range(5):
            spec.decoder.step()
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    spec.close()


def test_profiler_sees_speculative_steps(ckpt, tmp_path):
    """--profile with --speculative: the profiled steps are speculative steps, their segments
    (layers, accept, rewinds, the MTP block) attributed."""
    import json
    from pathlib import Path
    from dsv4.runtime.profiling import Profiler
    s = Session(_model(ckpt), SamplingParams(), speculative=1)
    with Profiler("torch", "2-3", s, out_dir=tmp_path) as prof:
        s.generate(list(range(5, 15)), 8)
    summary = json.loads(Path(prof.summary_path).read_text())
    segs = summary["segments"]
    assert {"layer0", "accept", "rewind0", "mtp"} <= set(segs)
    assert summary["kernels_per_layer"] or summary["unit"] == "aten_ops"
    assert segs["layer0"][f"{summary['unit']}_per_step"] > 0
