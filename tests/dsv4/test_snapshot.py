"""Snapshots of the decode state (dsv4/snapshot.py, Session.save / restore): after a save at
length S, any detour (a longer continuation, another sequence sharing the first S tokens), then a
restore and a continuation give the tokens, logits and live state of a fresh run that fed the
same pieces, bit for bit, in float32 and bfloat16, plain and speculative, at restore points on
and off the compressors' block boundaries and across window wraps."""
import pytest
import torch

from dsv4.runtime.config import RuntimeConfig
from dsv4.runtime.sampling import SamplingParams
from dsv4.runtime.session import Session, load_model
from dsv4.runtime.snapshot import StateSnapshot
from helpers import SMALL3, small_checkpoint

CAP = 128


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp("snap"), "fp8", cfg=SMALL3)


def _session(path, dtype, speculative=0, params=SamplingParams(0.9, top_p=0.95, seed=5)):
    m, ck = load_model(path, RuntimeConfig(max_seq_len=CAP, dtype=dtype, mtp=bool(speculative)))
    ck.close()
    return Session(m, params, speculative=speculative)


def _ids(seed, n):
    return torch.randint(0, 2048, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def live_state(m, length):
    """What a continuation at `length` reads: ring, compressor rows, and the compressed / index
    entries of the blocks completed before `length` (later entries are masked by position)."""
    states = [(st, blk.ratio) for blk, st in zip(m.layers, m.states)]
    if m.mtp is not None:
        states.append((m.mtp.state, m.mtp.block.ratio))
    W, out = m.cfg.window_size, []
    for st, r in states:
        out.append(st.kv_cache[:W])
        if r:
            out.append(st.kv_cache[W:W + length // r])
        if st.index_cache is not None:
            out.append(st.index_cache[:length // 4])
        for c in (st.compressor, st.index_compressor):
            if c is not None:
                out += [c.kv, c.score]
    return [t.clone() for t in out]


def _same(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"state tensor {i} differs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("S", [7, 16, 33])
def test_restore_then_continue_equals_a_fresh_run(ckpt, dtype, S):
    """S = 16 closes a block of every compressor (ratios 4 and 16) and a window wrap (W = 16);
    the detours run 40+ positions past S, then from S again (a regenerate) with other tokens."""
    s = _session(ckpt, dtype)
    ids, detour, cont = _ids(S, S), _ids(100 + S, 6), _ids(200 + S, 5)
    snap = StateSnapshot(s.model)
    s.prefill(ids)
    s.save(snap)
    s.generate(detour, 36, continue_sequence=True)
    s.restore(snap)
    s.generate(_ids(300 + S, 9), 8, continue_sequence=True)
    s.restore(snap)
    a = s.generate(cont, 6, continue_sequence=True, keep_logits=True)
    state_a = live_state(s.model, s.length)
    s.prefill(ids)                                      # a fresh run: the same two pieces
    b = s.generate(cont, 6, continue_sequence=True, keep_logits=True)
    assert a.output_ids == b.output_ids
    assert torch.equal(a.logits, b.logits)
    _same(state_a, live_state(s.model, s.length))


def test_restore_with_held_logits_and_with_a_pending_token(ckpt):
    """A save right after a prefill keeps the prompt's logits: generate([]) after the restore
    samples from them (== prompt and generate in one call). A save after a generate keeps the
    pending token: the continuation feeds it first (an empty one is refused: nothing to
    sample from)."""
    s = _session(ckpt, torch.float32)
    prompt = _ids(1, 21)
    one_call = s.generate(prompt, 5, keep_logits=True)
    snap, snap2 = StateSnapshot(s.model), StateSnapshot(s.model)
    s.prefill(prompt)
    s.save(snap)
    s.generate(_ids(2, 30), 3, continue_sequence=True)
    s.restore(snap)
    again = s.generate([], 5, continue_sequence=True, keep_logits=True)
    assert again.output_ids == one_call.output_ids and torch.equal(again.logits, one_call.logits)
    s.save(snap2)                                       # pending token, no logits
    assert snap2.pending == again.output_ids[-1] and not snap2.has_logits
    with pytest.raises(ValueError, match="empty prompt"):
        s.generate([], 2, continue_sequence=True)
    direct = s.generate([7], 4, continue_sequence=True, keep_logits=True)
    s.generate(_ids(3, 9), 2, continue_sequence=True)
    s.restore(snap2)
    resumed = s.generate([7], 4, continue_sequence=True, keep_logits=True)
    assert resumed.output_ids == direct.output_ids and torch.equal(resumed.logits, direct.logits)


def test_restore_in_a_speculative_session(ckpt):
    """The MTP block's state and place come back too: greedy speculation after a restore gives
    the tokens and logits of a fresh run."""
    s = _session(ckpt, torch.float32, speculative=1, params=SamplingParams())
    s.model.head.mul_(30.0)                 # fewer near-ties in the random model
    prompt, cont = _ids(4, 19), _ids(5, 4)
    snap = StateSnapshot(s.model)
    s.prefill(prompt)
    s.save(snap)
    s.generate(_ids(6, 7), 10, continue_sequence=True)
    s.restore(snap)
    a = s.generate(cont, 8, continue_sequence=True, keep_logits=True)
    s.prefill(prompt)
    b = s.generate(cont, 8, continue_sequence=True, keep_logits=True)
    assert a.output_ids == b.output_ids and torch.equal(a.logits, b.logits)


def test_snapshot_errors_and_size(ckpt):
    s = _session(ckpt, torch.float32)
    snap = StateSnapshot(s.model)
    with pytest.raises(ValueError, match="save"):
        s.restore(snap)
    with pytest.raises(ValueError, match="empty prompt"):
        s.generate([], 2, continue_sequence=True)      # nothing held to go on from
    cfg = s.model.cfg
    ring = cfg.window_size * cfg.head_dim * 4 * cfg.n_layers                    # float32 rings
    assert ring < snap.nbytes() < ring + 2 ** 20, snap.nbytes()   # + compressor rows, logits
