"""dsv4.kernels under the Triton interpreter (CPU) at small, awkward shapes vs the plain-torch references.

Runs only with TRITON_INTERPRET=1 (set before triton is imported); test_decode_kernels.py launches it in
a subprocess: `TRITON_INTERPRET=1 python -m pytest tests/dsv4/kernels/test_decode_kernels_interp.py -q`.
"""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests run in a subprocess from test_decode_kernels.py", allow_module_level=True)
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from dsv4.weights.formats import e2m1_decode  # noqa: E402
from dsv4.kernels import common  # noqa: E402
from dsv4.kernels.decode.bf16_linear import (bf16_linear, bf16_linear_multi,  # noqa: E402
                                      bf16_linear_reference)
from dsv4.kernels.common import Config  # noqa: E402
from dsv4.kernels.decode.fp4_experts import (fp4_experts_down, fp4_experts_down_reference,  # noqa: E402
                                      fp4_experts_up, fp4_experts_up_reference)
from dsv4.kernels.decode.fp8_linear import (fp8_linear, fp8_linear2, fp8_linear_reference,  # noqa: E402
                                     fp8_swiglu, fp8_swiglu_reference)
from dsv4.kernels.decode.route import route_decode, route_reference  # noqa: E402
from dsv4.numerics.quant import fp8_quant_dequant  # noqa: E402

from test_decode_kernels import (assert_close_bf16, assert_close_f32, fp4_bank,  # noqa: E402
                          fp4_swiglu_absdot, fp8_weight, fresh_gen, poisoned, spiky_x)

GEN = fresh_gen()
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # silu(-large)


# ---- the bit-level helpers, exactly -------------------------------------------------------------

@triton.jit
def _helpers_kernel(x_ptr, q_ptr, b_ptr, NB: tl.constexpr):
    off = tl.arange(0, NB)[:, None] * 128 + tl.arange(0, 128)[None, :]
    x = tl.load(x_ptr + off)
    tl.store(q_ptr + off, common.quant_dequant(x, common.block_exponent(x)[:, None]))
    tl.store(b_ptr + off, common.round_bf16(x))


@triton.jit
def _decode_kernel(u8_ptr, e4_ptr, w_ptr, nib_ptr, sc_ptr):
    i = tl.arange(0, 256)
    b = tl.load(u8_ptr + i)
    tl.store(e4_ptr + i, common.e4m3_to_f32(b, False) * 256.0)
    tl.store(sc_ptr + i, common.e8m0_to_f32(b))
    v = common.e2m1_word_to_f32(tl.load(w_ptr + i), False)
    for r in tl.static_range(8):
        tl.store(nib_ptr + r * 256 + i, v[r] * 16384.0)


def test_act_quant_and_bf16_rounding_are_bit_exact():
    nb = 16
    x = torch.randn(nb, 128, generator=GEN) * torch.logspace(-8, 8, nb)[:, None]
    x[0] = 0.0                                                 # all-zero block (amax floor)
    x[1, ::2] = -0.0
    x[2] = torch.randn(128, generator=GEN) * 1e-6              # amax below the 1e-4 floor
    # exact e4m3 ties (x / s with 4 mantissa bits, last one set) and subnormal-range values
    x[3] = torch.tensor([1.0 + (2 * k + 1) / 16 for k in range(8)] * 16) * 2.0 ** torch.arange(
        -12, 4).repeat_interleave(8)
    x[4, :64] = 448.0 * 2.0 ** -12 * torch.arange(64) / 64
    x = x.flatten()
    q, b = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    _helpers_kernel[(1,)](x, q, b, NB=nb)
    ref = fp8_quant_dequant(x, 128)
    assert torch.equal(q, ref), (q - ref).abs().max()
    assert torch.equal(b, x.to(torch.bfloat16).float())
    hi = torch.randint(0, 0x7F7F, (nb * 128,), generator=GEN, dtype=torch.int32)
    lo = torch.where(torch.arange(nb * 128) % 2 == 0, 0x8000,          # exact bf16 ties
                     torch.randint(0, 0x10000, (nb * 128,), generator=GEN, dtype=torch.int32))
    sign = torch.randint(0, 2, (nb * 128,), generator=GEN, dtype=torch.int32) << 31
    ties = ((hi << 16) | lo | sign).view(torch.float32)
    _helpers_kernel[(1,)](ties, q, b, NB=nb)
    assert torch.equal(b, ties.to(torch.bfloat16).float())


def test_decoders_cover_every_code():
    u8 = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (256,), generator=GEN, dtype=torch.int64).to(torch.int32)
    words[:16] = torch.tensor([0x76543210, -0x01234568] * 8, dtype=torch.int32)  # every code
    e4, sc = torch.full((256,), float("nan")), torch.full((256,), float("nan"))
    nib = torch.full((8, 256), float("nan"))
    _decode_kernel[(1,)](u8, e4, words, nib, sc)
    ref = u8.view(torch.float8_e4m3fn).float()
    finite = ~ref.isnan()
    assert torch.equal(e4[finite], ref[finite])
    assert torch.equal(sc[1:255], (u8[1:255].int() << 23).view(torch.float32))
    for r in range(8):     # nibble r = element r of the word (low nibble first)
        assert torch.equal(nib[r], e2m1_decode((words >> (4 * r)) & 0xF)), r


# ---- fp8_linear / fp8_swiglu ---------------------------------------------------------------------

@pytest.mark.parametrize("n,k,cfg", [(256, 384, Config(64, 2)),    # K tail masked (384 % 256)
                                     (256, 640, Config(128, 2, 4, True)),   # prefetch, K tail
                                     (128, 384, Config(64, 1, 4, True)),    # prefetch, even K
                                     (384, 256, Config(128, 2)),   # N = 3 * 128 (concatenated)
                                     (128, 640, None)])            # default heuristic config
def test_fp8_linear(n, k, cfg):
    w, s = fp8_weight(n, k, GEN)
    many = cfg is not None      # the default config launches ~N programs: slow in the interpreter
    for xdt in (torch.bfloat16, torch.float32) if many else (torch.bfloat16,):
        x = spiky_x(k, GEN, xdt)
        for quant in (True, False) if many else (True,):
            out = poisoned(1, n)
            y = fp8_linear(x, w, s, quant_act=quant, out=out, config=cfg)
            assert y is out
            assert_close_bf16(y, fp8_linear_reference(x, w, s, quant_act=quant), x, w, s, quant)
    if not many:
        return
    y = fp8_linear(x, w, s, out=poisoned(1, n, dtype=torch.float32), out_dtype=torch.float32,
                   config=cfg)
    assert_close_f32(y, fp8_linear_reference(x, w, s, out_dtype=torch.float32), x, w, s, True)


def test_fp8_linear_concatenated_rows_equal_separate_calls():
    (wa, sa), (wb, sb) = fp8_weight(128, 384, GEN), fp8_weight(256, 384, GEN)
    x = spiky_x(384, GEN, torch.bfloat16)
    cat = fp8_linear(x, torch.cat((wa, wb)), torch.cat((sa.view(torch.uint8), sb.view(torch.uint8))
                                                       ).view(torch.float8_e8m0fnu),
                     config=Config(64, 1))
    sep = torch.cat((fp8_linear(x, wa, sa, config=Config(64, 1)),
                     fp8_linear(x, wb, sb, config=Config(64, 1))), dim=1)
    assert torch.equal(cat, sep)


def test_fp8_linear2_and_add_epilogue():
    (wa, sa), (wb, sb) = fp8_weight(256, 384, GEN), fp8_weight(128, 384, GEN)
    x = spiky_x(384, GEN, torch.bfloat16)
    cfg = Config(64, 2)
    ya, yb = fp8_linear2(x, wa, sa, wb, sb, config=cfg)
    assert torch.equal(ya, fp8_linear(x, wa, sa, config=cfg))
    assert torch.equal(yb, fp8_linear(x, wb, sb, config=cfg))
    add = torch.randn(1, 256, generator=GEN) * 4
    y = fp8_linear(x, wa, sa, add=add, out=poisoned(1, 256), config=cfg)
    ref = (add + fp8_linear(x, wa, sa, config=cfg).float()).to(torch.bfloat16)
    assert torch.equal(y, ref)
    with pytest.raises(ValueError, match="second weight"):
        fp8_linear2(x, wa, sa, *fp8_weight(128, 256, GEN))


@pytest.mark.parametrize("groups,cfg", [(2, Config(64, 2)), (3, Config(128, 1))])
def test_fp8_linear_grouped_wo_a(groups, cfg):
    kg = 256
    w, s = fp8_weight(groups * 128, kg, GEN)
    x = spiky_x(groups * kg, GEN, torch.bfloat16)
    y = fp8_linear(x, w, s, quant_act=False, group_k=kg, out=poisoned(1, groups * 128), config=cfg)
    ref = fp8_linear_reference(x, w, s, quant_act=False, group_k=kg)
    assert_close_bf16(y, ref, x, w, s, False, group_k=kg)


@pytest.mark.parametrize("clamp", [False, True])
def test_fp8_swiglu(clamp):
    (w1, s1), (w3, s3) = fp8_weight(256, 384, GEN, gain=8.0), fp8_weight(256, 384, GEN, gain=8.0)
    x = spiky_x(384, GEN, torch.bfloat16)
    # a limit inside the data's range, so the clamp always bites (random data; 0 = no limit)
    limit = float(fp8_linear_reference(x, w1, s1).float().max()) / 2 if clamp else 0.0
    a = fp8_swiglu(x, w1, s1, w3, s3, limit, out=poisoned(1, 256), config=Config(128, 1))
    ref = fp8_swiglu_reference(x, w1, s1, w3, s3, limit)
    # the prefetch pipeline changes no bit (same accumulation order)
    assert torch.equal(a, fp8_swiglu(x, w1, s1, w3, s3, limit, config=Config(128, 1, 4, True)))
    if limit:
        g = fp8_linear_reference(x, w1, s1).float()
        assert (g > limit).any(), "test data should exercise the clamp"
    assert_close_bf16(a, ref, rtol=2 ** -5)


# ---- bf16_linear ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k,cfg", [(100, 384, Config(16, 2)), (64, 256, Config(64, 2)),
                                     (5, 128, None)])
def test_bf16_linear(n, k, cfg):
    w = (torch.randn(n, k, generator=GEN) * k ** -0.5).to(torch.bfloat16)
    w[0, :7] = -0.0
    for xdt in (torch.float32, torch.bfloat16):
        x = spiky_x(k, GEN, xdt)
        for odt in (torch.float32, torch.bfloat16):
            y = bf16_linear(x, w, out_dtype=odt, out=poisoned(1, n, dtype=odt), config=cfg)
            ref = bf16_linear_reference(x, w, out_dtype=odt)
            absdot = (w.double().abs() @ x.reshape(-1).double().abs()).reshape(1, -1)
            if odt == torch.float32:
                assert (y - ref).abs().le(1e-6 * absdot + 1e-30).all()
            else:
                assert_close_bf16(y, ref, absdot=absdot)


def test_bf16_linear_multi_equals_separate_calls():
    ns, k = [100, 64, 5, 128, 33], 384
    ws = [(torch.randn(n, k, generator=GEN) * k ** -0.5).to(torch.bfloat16) for n in ns]
    x = spiky_x(k, GEN, torch.bfloat16)
    dts = [torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16]
    cfg = Config(16, 2)
    outs = bf16_linear_multi(x, ws, dts, config=cfg)
    for y, w, dt in zip(outs, ws, dts):
        assert y.dtype == dt and torch.equal(y, bf16_linear(x, w, out_dtype=dt, config=cfg))
    two = bf16_linear_multi(x, ws[:2], dts[:2], config=cfg)
    assert all(torch.equal(a, b) for a, b in zip(two, outs[:2]))
    with pytest.raises(ValueError, match="expected 1..5"):
        bf16_linear_multi(x, ws + ws[:1], dts + dts[:1])


@pytest.mark.parametrize("T", [2, 3, 4, 6, 8])
def test_bf16_rows_equal_one_row_calls(T):
    """T activation rows in one launch (the speculative verify rows; a program takes 2, 3 or 4 of
    them, 6 and 8 in two groups): row t has the bits of a one-row call, single and multi-matrix."""
    ns, k, cfg = [100, 33], 384, Config(16, 2)
    ws = [(torch.randn(n, k, generator=GEN) * k ** -0.5).to(torch.bfloat16) for n in ns]
    x = torch.cat([spiky_x(k, GEN, torch.bfloat16) for _ in range(T)])
    y = bf16_linear(x, ws[0], out=poisoned(T, ns[0], dtype=torch.float32), config=cfg)
    multi = bf16_linear_multi(x, ws, [torch.float32, torch.bfloat16], config=cfg)
    for t in range(T):
        assert torch.equal(y[t:t + 1], bf16_linear(x[t:t + 1], ws[0], config=cfg))
        for yo, w, dt in zip(multi, ws, [torch.float32, torch.bfloat16]):
            assert torch.equal(yo[t:t + 1], bf16_linear(x[t:t + 1], w, out_dtype=dt, config=cfg))
    assert torch.equal(bf16_linear_reference(x, ws[0])[1:2], bf16_linear_reference(x[1], ws[0]))


def test_fp8_rows_equal_one_row_calls():
    """fp8_linear / fp8_linear2 / fp8_swiglu / grouped wo_a on T rows == the one-row calls."""
    T, cfg = 3, Config(64, 2)
    (wa, sa), (wb, sb) = fp8_weight(256, 384, GEN), fp8_weight(128, 384, GEN)
    x = torch.cat([spiky_x(384, GEN, torch.bfloat16) for _ in range(T)])
    y = fp8_linear(x, wa, sa, config=cfg)
    ya, yb = fp8_linear2(x, wa, sa, wb, sb, config=cfg)
    w1, s1 = fp8_weight(256, 384, GEN)
    a = fp8_swiglu(x, wa, sa, w1, s1, 1.5, config=cfg)
    gw, gs = fp8_weight(2 * 128, 256, GEN)
    xg = torch.cat([spiky_x(512, GEN, torch.bfloat16) for _ in range(T)])
    yg = fp8_linear(xg, gw, gs, quant_act=False, group_k=256, config=Config(64, 1))
    assert y.shape == ya.shape == (T, 256) and yb.shape == (T, 128) and yg.shape == (T, 256)
    for t in range(T):
        r = x[t:t + 1]
        assert torch.equal(y[t:t + 1], fp8_linear(r, wa, sa, config=cfg))
        assert torch.equal(ya[t:t + 1], y[t:t + 1])
        assert torch.equal(yb[t:t + 1], fp8_linear(r, wb, sb, config=cfg))
        assert torch.equal(a[t:t + 1], fp8_swiglu(r, wa, sa, w1, s1, 1.5, config=cfg))
        assert torch.equal(yg[t:t + 1], fp8_linear(xg[t:t + 1], gw, gs, quant_act=False,
                                                   group_k=256, config=Config(64, 1)))
    with pytest.raises(ValueError, match="rows of"):
        fp8_linear(x[:, :256], wa, sa)


def test_fp4_experts_rows_equal_one_row_calls():
    """The routed experts of T rows (k pairs each) in one call == the one-row calls."""
    E, I, D, k, T = 8, 128, 384, 3, 2
    cu, cd = Config(128, 1), Config(128, 1)
    w1, s1, w3, s3, _, _ = fp4_bank(E, I, D, GEN, gain=4.0)
    *_, w2, s2 = fp4_bank(E, I, D, GEN, up=False)
    x = torch.cat([spiky_x(D, GEN, torch.bfloat16) for _ in range(T)])
    idx = torch.tensor([1, 5, 7, 0, 5, 6])
    rw = torch.rand(T * k, generator=GEN)
    add = torch.randn(T, D, generator=GEN).bfloat16()
    a = fp4_experts_up(x, idx, rw, w1, s1, w3, s3, 3.0, config=cu)
    y = fp4_experts_down(a, idx, w2, s2, add=add, out_dtype=torch.bfloat16, rows=T, config=cd)
    for t in range(T):
        p = slice(t * k, (t + 1) * k)
        one = fp4_experts_up(x[t:t + 1], idx[p], rw[p], w1, s1, w3, s3, 3.0, config=cu)
        assert torch.equal(a[p], one)
        assert torch.equal(y[t:t + 1], fp4_experts_down(one, idx[p], w2, s2, add=add[t:t + 1],
                                                        out_dtype=torch.bfloat16, config=cd))
    with pytest.raises(ValueError, match="rows"):
        fp4_experts_down(a, idx, w2, s2, rows=4)


# ---- MoE routing -------------------------------------------------------------------------------

@pytest.mark.parametrize("score", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_route_decode_score(score):
    E, k = 256, 6
    for trial in range(3):
        logits = torch.randn(1, E, generator=GEN) * 3
        logits[0, :4] = torch.tensor([25.0, -30.0, 20.0, 19.99])   # softplus threshold sides
        bias = torch.randn(E, generator=GEN) * 0.1
        w, idx = route_decode(logits, k, score, 2.5, bias=bias)
        rw, ridx = route_reference(logits, k, score, 2.5, bias=bias)
        assert idx.dtype == torch.int64 and torch.equal(idx, ridx), (idx, ridx)
        assert torch.allclose(w, rw, rtol=2e-6, atol=0), (w, rw)


def test_route_decode_hash_and_ties():
    E, k, V = 64, 6, 50
    tid2eid = torch.stack([torch.randperm(E, generator=GEN)[:k] for _ in range(V)])
    tid2eid[3] = torch.tensor([5, 5, 1, 63, 0, 7])            # duplicates are kept, in id order
    logits = torch.randn(1, E, generator=GEN)
    for tok in (0, 3, 49):
        ids = torch.tensor([tok])
        w, idx = route_decode(logits, k, "sqrtsoftplus", 1.5, tid2eid=tid2eid, ids=ids)
        rw, ridx = route_reference(logits, k, "sqrtsoftplus", 1.5, tid2eid=tid2eid, ids=ids)
        assert torch.equal(idx, ridx) and torch.allclose(w, rw, rtol=2e-6, atol=0)
    flat = torch.zeros(1, E)                                    # all equal: lowest ids win
    w, idx = route_decode(flat, k, "sigmoid", 1.0, bias=torch.zeros(E))
    assert idx.tolist() == list(range(k)) and torch.allclose(w, torch.full((k,), 1 / k))
    nan = torch.full((1, E), float("nan"))
    _, idx = route_decode(nan, k, "sqrtsoftplus", 1.0, bias=torch.zeros(E))
    assert ((idx >= 0) & (idx < E)).all()                     # never an out-of-range expert
    with pytest.raises(ValueError, match="bias"):
        route_decode(logits, k, "sqrtsoftplus", 1.0)


@pytest.mark.parametrize("T", [3, 37])
def test_route_decode_rows_equal_one_token_calls(T):
    """T tokens in one call (the speculative verify rows, a prefill chunk's rows: one launch, a
    program a row): token t's slots == its own call."""
    E, k = 64, 6
    logits, bias = torch.randn(T, E, generator=GEN) * 3, torch.randn(E, generator=GEN)
    tid2eid = torch.stack([torch.randperm(E, generator=GEN)[:k] for _ in range(50)])
    ids = torch.randint(0, 50, (T,), generator=GEN)
    for kw in (dict(bias=bias), dict(tid2eid=tid2eid, ids=ids)):
        w, idx = route_decode(logits, k, "sqrtsoftplus", 2.5, **kw)
        assert w.shape == idx.shape == (T * k,)
        for t in range(T):
            one = dict(kw, ids=ids[t:t + 1]) if "ids" in kw else kw
            w1, i1 = route_decode(logits[t:t + 1], k, "sqrtsoftplus", 2.5, **one)
            assert torch.equal(w[t * k:(t + 1) * k], w1) and torch.equal(idx[t * k:(t + 1) * k], i1)
    with pytest.raises(ValueError, match="one per token"):
        route_decode(logits, k, "sqrtsoftplus", 1.0, tid2eid=tid2eid, ids=ids[:1])


# ---- routed FP4 experts ------------------------------------------------------------------------

@pytest.mark.parametrize("limit,cfg", [(10.0, Config(64, 2)), (0.0, Config(128, 1))])
def test_fp4_experts_up(limit, cfg):
    E, I, D, k = 8, 128, 384, 6
    w1, s1, w3, s3, _, _ = fp4_bank(E, I, D, GEN, gain=4.0)
    x = spiky_x(D, GEN, torch.bfloat16)
    idx = torch.randperm(E, generator=GEN)[:k].sort().values
    rw = torch.rand(k, generator=GEN) + 0.5
    a = fp4_experts_up(x, idx, rw, w1, s1, w3, s3, limit, out=poisoned(k, I), config=cfg)
    ref = fp4_experts_up_reference(x, idx, rw, w1, s1, w3, s3, limit)
    assert_close_bf16(a, ref, rtol=2 ** -5, min_equal=0.9,
                      absdot=fp4_swiglu_absdot(x, idx, rw, w1, s1, w3, s3, limit))


@pytest.mark.parametrize("cfg", [Config(128, 1), Config(64, 4)])   # even K / masked K tail
def test_fp4_experts_down(cfg):
    E, I, D, k = 8, 384, 256, 6
    *_, w2, s2 = fp4_bank(E, I, D, GEN, up=False)
    a = torch.stack([spiky_x(I, GEN, torch.bfloat16)[0] for _ in range(k)])
    idx = torch.tensor([0, 2, 3, 5, 6, 7])
    y = fp4_experts_down(a, idx, w2, s2, out=poisoned(1, D, dtype=torch.float32), config=cfg)
    ref = fp4_experts_down_reference(a, idx, w2, s2)
    scale = sum(fp4_experts_down_reference(a[j:j + 1], idx[j:j + 1], w2, s2).abs()
                for j in range(k))
    assert not y.isnan().any()
    assert (y - ref).abs().le(2 ** -7 * scale + 1e-30).all()
    assert (y == ref).float().mean() >= 0.8
    # the epilogue: + add (the shared expert's bf16 output) in fp32, rounded once to bf16
    add = spiky_x(D, GEN, torch.bfloat16)
    yb = fp4_experts_down(a, idx, w2, s2, add=add, out_dtype=torch.bfloat16,
                          out=poisoned(1, D), config=cfg)
    assert yb.dtype == torch.bfloat16 and torch.equal(yb, (y + add.float()).to(torch.bfloat16))
    with pytest.raises(ValueError, match="out_dtype"):
        fp4_experts_down(a, idx, w2, s2, out_dtype=torch.float16)


# ---- the dispatch points' kernel paths (called directly: dispatch itself needs CUDA) -------------

def test_moe_and_linear_kernel_paths_match_the_torch_path(monkeypatch):
    from dsv4.backend.fused.linear import KernelLinear
    from dsv4.backend.fused.moe import DecodeKernels
    from dsv4.backend.ops import Ops
    from dsv4.kernels.decode import bf16_linear as bl, fp4_experts as fe, fp8_linear as fl
    from dsv4.model.moe import MoE
    from dsv4.weights.device_weights import DeviceWeights
    from dsv4.weights.presets import get_preset
    from test_decode_kernels import SEED
    for mod, name in ((fe, "up_config"), (fe, "down_config"), (fl, "fp8_config"),
                      (bl, "bf16_config")):   # few programs: the interpreter pays per program
        monkeypatch.setattr(mod, name, lambda *a, **k: Config(64, 1))
    cfg = get_preset("tiny")
    layer = cfg.n_hash_layers                                   # a scored (non-hash) layer
    moe = MoE(cfg, layer, "fp8", cfg.expert_format, "cpu")
    src = DeviceWeights(cfg, seed=SEED)
    for name, t in moe.tensors(f"layers.{layer}.ffn").items():
        src.load_into(name, t)
    x = torch.randn(1, cfg.dim, generator=GEN).to(torch.bfloat16)
    ids = torch.tensor([7])
    ref = moe.decode(x, ids)                                    # CPU: the torch loop
    ops = Ops.for_device("cpu", cfg=cfg)                        # the kernels, interpreted
    kernels = DecodeKernels(moe, ops)
    w, idx = kernels.route(x, ids)                              # gate GEMV + route kernel
    rw, ridx = moe.route(x, ids)
    ridx, order = ridx[0].sort()
    assert torch.equal(idx, ridx)
    assert torch.allclose(w, rw[0].index_select(0, order), rtol=1e-6, atol=0)
    got = kernels(x, ids)                                       # routing again, then the experts
    assert got.dtype == ref.dtype == torch.bfloat16 and not got.isnan().any()
    rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 1e-2 and (got == ref).float().mean() >= 0.8, (rel, SEED)
    lin = moe.shared["w2"]
    a = torch.randn(1, lin.in_features, generator=GEN).to(torch.bfloat16)
    assert_close_bf16(KernelLinear(lin, ops, True, False)._gemv(a, torch.bfloat16),
                      lin(a, torch.bfloat16), a, lin.weight, lin.scale, True)
    gate = KernelLinear(moe.gate, ops, True, False)
    g = gate._gemv(x, torch.float32)
    assert torch.allclose(g, moe.gate(x, torch.float32), rtol=1e-5, atol=1e-6)
    assert gate._gemv(x.float(), torch.float32) is None          # float32 mode stays on torch


def test_mtp_input_rows_on_the_kernels(monkeypatch):
    """The MTP block's input of decode rows on the kernels (dsv4.backend.fused.mtp: one RMSNorm
    launch each for enorm / hnorm, one GEMV launch each for e_proj / h_proj over every row) is
    the torch reference's within bf16 rounding, and row t has the bits of a one-row call (the
    plain steps' MTP follow and the speculative step's rows keep one state)."""
    from dsv4.backend.fused import mtp as fused_mtp
    from dsv4.backend.fused.linear import KernelLinear
    from dsv4.backend.ops import Ops
    from dsv4.kernels.decode import fp8_linear as fl
    from dsv4.model.mtp import MTPBlock
    from dsv4.weights.device_weights import DeviceWeights
    from dsv4.weights.presets import get_preset
    from test_decode_kernels import SEED
    monkeypatch.setattr(fl, "fp8_config", lambda *a, **k: Config(64, 1))
    cfg = get_preset("tiny")
    mtp = MTPBlock(cfg, 0, "cpu", 64, torch.bfloat16)
    src = DeviceWeights(cfg, seed=SEED)
    for name, t in mtp.tensors().items():
        if "block" not in name and ".attn." not in name and ".ffn." not in name:
            src.load_into(name, t)
    ops = Ops.for_device("cpu", cfg=cfg)                        # the kernels, interpreted
    for lin in (mtp.e_proj, mtp.h_proj):
        k = KernelLinear(lin, ops, True, False)
        lin.forward, lin.forward_rows = k, k.rows
    T, c, D = 2, cfg.hc_mult, cfg.dim
    h = torch.randn(T, c, D, generator=GEN).to(torch.bfloat16)
    emb = torch.randn(T, D, generator=GEN).to(torch.bfloat16)
    got = fused_mtp.input_rows(mtp, ops, h, emb)
    one = torch.cat([fused_mtp.input_rows(mtp, ops, h[t:t + 1], emb[t:t + 1]) for t in range(T)])
    assert torch.equal(got, one)
    ref = mtp.input_rows_reference(h, emb)
    assert got.shape == ref.shape == (T, c, D) and got.dtype == torch.bfloat16
    rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 1e-2, (rel, SEED)


# ---- the greedy pick ----------------------------------------------------------------------------

def _argmax_cases():
    """Rows where a wrong pick shows: ties inside a block, across blocks and at the edges of the
    two-block step (8,192 / 16,384), -inf rows, NaN (the first wins), -0.0 against 0.0, bf16."""
    from dsv4.kernels.decode.argmax import BLOCK
    g = torch.Generator().manual_seed(3)
    yield torch.randn(3, 20000, generator=g)
    x = torch.randn(129280, generator=g)
    x[[5000, 100000]] = 9.0                          # a tie across blocks: the first
    yield x
    yield torch.full((2, 9000), float("-inf"))
    x = torch.randn(3, 9000, generator=g)
    x[0, [8500, 8600]] = float("nan")
    x[1, 0] = float("nan")
    x[2, [3, 8999]] = float("inf")
    yield x
    x = torch.zeros(17)
    x[3] = -0.0
    yield x
    yield torch.randn(2, 3, 300, generator=g)
    yield torch.randn(4, BLOCK + 1, generator=g).to(torch.bfloat16)
    for V in (1, 2, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 2 * BLOCK + 1, 3 * BLOCK + 1):
        for where in sorted({0, V // 2, V - 1}):
            x = torch.zeros(2, V)
            x[0, where] = 1.0
            x[1, where] = float("nan")
            x[1, V - 1] = float("nan")
            yield x


def test_argmax_rows_is_torchs_argmax():
    from dsv4.kernels.decode.argmax import argmax_reference, argmax_rows
    for x in _argmax_cases():
        got = argmax_rows(x)
        assert got.dtype == torch.int64 and got.shape == (*x.shape[:-1], 1)
        assert torch.equal(got, argmax_reference(x)), (x.shape, x.dtype)


def test_accept_greedy_is_verify_accept():
    """The speculative step's greedy acceptance in one launch (kernels.decode.accept) against
    verify.accept (greedy) and the record the step writes, over T = 2..4 rows: every number of
    matched drafts, an EOS before, at and after the first miss (and none), caps below and above,
    and a pending token that is the EOS (a step launched after the output ended: keep 0) or
    not."""
    from dsv4.kernels.decode.accept import accept_greedy
    from dsv4.runtime.sampling import SamplingParams
    from dsv4.runtime.speculative.verify import accept
    V = 50
    cases = 0
    for T in (2, 3, 4):
        for matched in range(T):
            for eos_row in (-1, *range(T)):
                for limit in (1, 2, T, T + 3):
                    logits = torch.randn(T, V, generator=GEN)
                    am = logits.argmax(-1)
                    drafts = am[:T - 1].clone()
                    if matched < T - 1:                         # the first miss at row `matched`
                        drafts[matched] = (drafts[matched] + 1) % V
                    eos = torch.tensor([int(am[eos_row]) if eos_row >= 0 else -1])
                    lim = torch.tensor([limit])
                    pos = torch.tensor([5])
                    for pending in (torch.tensor([V + 1]), eos.clone()):
                        y_ref, keep_ref = accept(logits, drafts, None, pos, SamplingParams(), lim,
                                                 eos, pending)
                        if int(pending) == int(eos) >= 0:
                            assert int(keep_ref) == 0
                        y, keep = torch.full((T,), -7), torch.full((1,), -7)
                        rec = torch.full((1 + T,), -7)
                        accept_greedy(am.view(T, 1), drafts, lim, eos, pending, y, keep, rec)
                        assert torch.equal(y, y_ref) and torch.equal(keep, keep_ref), \
                            (T, matched, eos_row, limit, int(pending), y, keep, keep_ref)
                        assert torch.equal(rec, torch.cat((keep_ref + 1, y_ref)))
                        cases += 1
    assert cases == sum(2 * T * (T + 1) * 4 for T in (2, 3, 4))
