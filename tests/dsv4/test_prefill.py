"""Chunked prefill at any position: the same logits and decode state as one chunk and as
token-by-token decoding (float32 mode), continuation of a sequence through Session, capacity and
input errors. CPU; the GPU kernels of the chunk path are tested in test_prefill_kernels.py."""
import pytest
import torch

from dsv4.errors import CapacityError, InputError
from dsv4.runtime.config import RuntimeConfig
from dsv4.runtime.sampling import SamplingParams
from dsv4.runtime.session import Session, load_model
from helpers import GAP, SMALL3, live_state, small_checkpoint
from helpers import assert_state_close as _assert_state_close


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {"bf16": small_checkpoint(root, "bf16", cfg=SMALL3),
            "fp8": small_checkpoint(root, "fp8", cfg=SMALL3)}


def _model(path, dtype=torch.float32, cap=256, chunk=4096):
    m, ck = load_model(path, RuntimeConfig(max_seq_len=cap, dtype=dtype, prefill_chunk=chunk))
    ck.close()
    return m


def _ids(m, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, m.cfg.vocab_size, (n,), generator=g)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _token_by_token(m, ids):
    m.reset()
    out = []
    for p, t in enumerate(ids.tolist()):
        out.append(m.decode_step(torch.tensor([t]), torch.tensor([p])))
    return torch.stack(out)


@pytest.mark.parametrize("chunk", [1, 3, 7, 16, 64])
def test_chunked_prefill_equals_one_chunk(ckpts, chunk, no_fake_quant, near_ties):
    """100 positions: window wraps (W = 16), ratio-4 / 16 emissions across chunk edges, indexer
    saturation (top-8 of up to 25 entries). Float32 noise apart (~1e-6 here), on any CPU: every
    top-k choice of these inputs has a gap far above that noise (near_ties)."""
    m = _model(ckpts["bf16"])
    ids = _ids(m, 100, chunk)
    one = m.prefill(ids)
    ref_state = live_state(m)
    got = m.prefill(ids, chunk=chunk)
    assert near_ties.min_gap > GAP, f"a top-k near-tie ({near_ties.min_gap:.2g}): other inputs"
    assert _rel(got, one) < 1e-5
    _assert_state_close(live_state(m), ref_state)


@pytest.mark.parametrize("first,chunk", [(1, 5), (37, 11), (50, 64), (96, 3)])
def test_prefill_at_offset_equals_token_by_token(ckpts, first, chunk, no_fake_quant, near_ties):
    m = _model(ckpts["bf16"])
    ids = _ids(m, 100, first)
    tbt = _token_by_token(m, ids)
    ref_state = live_state(m)
    m.prefill(ids[:first])
    got = m.prefill(ids[first:], start=first, chunk=chunk)
    assert near_ties.min_gap > GAP, f"a top-k near-tie ({near_ties.min_gap:.2g}): other inputs"
    assert _rel(got, tbt[-1]) < 1e-5
    _assert_state_close(live_state(m), ref_state)


@pytest.mark.parametrize("start", [0, 21])
def test_the_indexer_of_some_rows_gives_those_rows_of_the_whole(ckpts, start, no_fake_quant,
                                                                 near_ties):
    """A tensor-parallel chunk split by rows has each rank select its own rows' compressed
    entries (Indexer.prefill's rows; Attention.attended all-gathers them): rows (r0, r1) give
    rows r0..r1 of the whole chunk's selection, and the index compressor, which takes every row
    either way, leaves the same state. Every ratio-4 layer, at the sequence's start and after
    21 positions (entries before the chunk)."""
    import copy
    from dsv4.numerics.rope import cos_sin
    m = _model(ckpts["bf16"])
    ids = _ids(m, start + 16, 3)
    m.prefill(ids[:start]) if start else m.reset()
    g = torch.Generator().manual_seed(start)
    layers = [(b, st) for b, st in zip(m.layers, m.states) if b.attn.ratio == 4]
    assert layers
    for blk, st in layers:
        a, s = blk.attn, 16
        x = torch.randn(s, m.cfg.dim, generator=g)
        qr = torch.randn(s, m.cfg.q_lora_rank, generator=g)
        cs = cos_sin(start + torch.arange(s), a.freqs)
        whole_st, part_st = copy.deepcopy(st), copy.deepcopy(st)
        whole = a.indexer.prefill(x, qr, cs, whole_st, a.freqs, start, offset=5)
        assert whole.shape[1] > 0
        for r0, r1 in ((0, 8), (8, 16), (4, 12)):
            part_st = copy.deepcopy(st)
            part = a.indexer.prefill(x, qr, cs, part_st, a.freqs, start, offset=5, rows=(r0, r1))
            assert torch.equal(part, whole[r0:r1]), (r0, r1)
            assert torch.equal(part_st.index_cache, whole_st.index_cache)
            assert torch.equal(part_st.index_compressor.kv, whole_st.index_compressor.kv)
    assert near_ties.min_gap > GAP, f"a top-k near-tie ({near_ties.min_gap:.2g}): other inputs"


# A flip of one e4m3 rounding (an activation or cached KV value landing on the other side of a
# rounding boundary because another batching summed it in another order) moves the logits of a
# random FP8 model by up to ~7e-2 (measured: token-by-token against one chunk, 24 tokens); a wrong
# position, row or state slot moves them by 0.3 or more (test_prefill_kernels).
FLIP_BOUND = 0.15


def test_chunked_prefill_with_fake_quant(ckpts):
    """The real forward (every fake-quant and W8A8 step on), float32. Which chunkings flip a
    rounding depends on the CPU's summation order (on one machine chunks of 6-10 tokens flipped
    here, on another none), so each chunking only stays within what a flip can do: 1..24-token
    chunks of a 24-token prompt with FP8/FP4 weights, and a longer prompt with bf16 weights (KV
    fake-quant only). The exact agreement of every chunking is asserted with fake-quant off."""
    m = _model(ckpts["fp8"])
    ids = _ids(m, 24, 1)
    one = m.prefill(ids)
    errs = {chunk: _rel(m.prefill(ids, chunk=chunk), one) for chunk in range(1, 25)}
    assert max(errs.values()) < FLIP_BOUND, errs
    m = _model(ckpts["bf16"])
    ids = _ids(m, 100, 2)
    one = m.prefill(ids)
    for chunk in (3, 7, 32):
        assert _rel(m.prefill(ids, chunk=chunk), one) < FLIP_BOUND, chunk


def test_bf16_chunked_prefill_stays_close(ckpts):
    """bfloat16 mode rounds differently per chunking (one chunk vs token-by-token already differs
    by 1-5% here; with FP8 weights 3-10%): a loose bound against gross errors; the float32 tests
    above are the exactness checks."""
    m = _model(ckpts["bf16"], torch.bfloat16)
    ids = _ids(m, 60, 3)
    one = m.prefill(ids)
    assert _rel(m.prefill(ids, chunk=9), one) < 0.05


def test_session_continues_a_sequence(ckpts, no_fake_quant, near_ties):
    """Two turns on one session (the second continues the first, which is not read again) give
    the tokens and logits of one fresh run over the whole sequence."""
    m = _model(ckpts["bf16"])
    a, b = _ids(m, 30, 4).tolist(), _ids(m, 17, 5).tolist()
    s = Session(m, SamplingParams())
    first = s.generate(a, 6)
    assert s.length == 30 + 5 and s.pending == first.output_ids[-1]
    second = s.generate(b, 8, keep_logits=True, continue_sequence=True)
    assert s.length == 30 + 6 + 17 + 7
    fresh = Session(_model(ckpts["bf16"]), SamplingParams())
    whole = fresh.generate(a + first.output_ids + b, 8, keep_logits=True)
    assert near_ties.min_gap > GAP, f"a top-k near-tie ({near_ties.min_gap:.2g}): other inputs"
    assert second.output_ids == whole.output_ids
    assert max(_rel(x, y) for x, y in zip(second.logits, whole.logits)) < 1e-5
    # prefill-only turns, then generate from there
    s2 = Session(_model(ckpts["bf16"]), SamplingParams())
    s2.prefill(a + first.output_ids)
    s2.prefill(b[:10], continue_sequence=True)
    third = s2.generate(b[10:], 8, keep_logits=True, continue_sequence=True)
    assert third.output_ids == whole.output_ids


def test_bad_continuations_lose_nothing(ckpts):
    m = _model(ckpts["fp8"], torch.bfloat16, cap=64)
    s = Session(m, SamplingParams())
    s.generate(list(range(5, 25)), 4)
    length, pending = s.length, s.pending
    kv = m.states[0].kv_cache.clone()
    with pytest.raises(InputError, match="out of range"):
        s.generate([5, m.cfg.vocab_size], 4, continue_sequence=True)
    with pytest.raises(InputError, match="empty prompt"):
        s.prefill([], continue_sequence=True)
    with pytest.raises(CapacityError, match=r"raise RuntimeConfig.max_seq_len to at least \d+ or "
                                            r"lower max_new_tokens$"):    # API words, no flags
        s.generate(list(range(30)), 20, continue_sequence=True)
    assert (s.length, s.pending) == (length, pending) and torch.equal(m.states[0].kv_cache, kv)
    with pytest.raises(CapacityError, match="positions must stay in 0..63"):
        m.prefill(torch.arange(10), start=60)
