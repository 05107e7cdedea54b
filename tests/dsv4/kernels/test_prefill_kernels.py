"""The prefill kernels (dsv4/kernels/prefill/gemm.py, moe.py, attention.py, the row
variants in mhc.py) against their torch references: bit for bit where the arithmetic allows it, else within
the stated float32 / rounding bound; and the whole chunk path of each layer against the torch path
on the same inputs. Triton interpreter on the CPU (a subprocess: TRITON_INTERPRET must be set
before triton is imported) and CUDA (real Flash shapes too).
GPU: `python -m pytest tests/dsv4/kernels/test_prefill_kernels.py -m cuda`."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, input_seed, needs_interpreter, subprocess_threads

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (the 'dev' extra brings it)")


def _fmt_weight(fmt, n, k, gen, dev, lead=(), spread=0.05):
    """Random weights of a format, drawn and quantized on `dev` (a generator seeded from `gen`:
    a Flash expert bank drawn and quantized on the host took minutes)."""
    from dsv4.weights.formats import quantize_fp4_weight, quantize_fp8_weight
    seed = int(torch.randint(0, 2 ** 62, (1,), generator=gen))
    m = torch.randn(*lead, n, k, device=dev,
                    generator=torch.Generator(device=dev).manual_seed(seed)) * spread
    if fmt == "bf16":
        return m.bfloat16().to(dev), None
    q = quantize_fp8_weight if fmt == "fp8" else quantize_fp4_weight
    pairs = [q(t) for t in m.reshape(-1, n, k)]
    w = torch.stack([p[0] for p in pairs]).reshape(*lead, *pairs[0][0].shape)
    s = torch.stack([p[1] for p in pairs]).reshape(*lead, *pairs[0][1].shape)
    return w.to(dev), s.to(dev)


def _absdot(x, w, fmt, s, group_k=0):
    """|x| @ |W|^T in float64: the scale of a float32 summation error."""
    from dsv4.kernels.prefill.gemm import dequantize
    wd = dequantize(fmt, w, s).abs().double()
    xa = x.double().abs()
    if group_k:
        G = x.shape[1] // group_k
        return torch.einsum("mgk,gnk->mgn", xa.view(-1, G, group_k),
                            wd.view(G, -1, group_k)).flatten(1).cpu()
    return (xa @ wd.t()).cpu()


def _tol(fmt, rows=None, tuning=None):
    """Summation error bound relative to |x| @ |W|: float32 (the interpreter: 1e-5); the bf16
    tensor cores, whose float32 accumulation aligns products first (2^-14 measured at K = 8192 on
    an H200: 1.6e-5); the FP8 tensor cores, which align a group's products to ~14 bits before
    adding them (as the official fp8_gemm), 2^-11."""
    from dsv4.kernels.prefill.gemm import DEFAULT, interpreting, mma_path
    if interpreting():
        return 1e-5
    return 2 ** -11 if mma_path(fmt, rows, tuning or DEFAULT) == "fp8" else 2 ** -14


def _every(fmt, rows, quant_act=True):
    return True


def _both_paths(fn):
    """Run fn(tuning, fresh) under the default tensor-core path of each format and under the other
    one (the GEMMs' switches as the backend passes them: DSV4_PREFILL_MMA="fp4=fp8,fp8=bf16").
    fresh(fmt, rows, quant_act=True): whether a check runs format fmt's GEMMs over `rows` rows in
    this pass: always, but for the interpreter's second pass only where the path differs from
    the first pass's (where it does not, the second pass would launch the kernel variants of the
    first again, on fresh numbers: minutes of the interpreter; the GPU runs them both)."""
    from dsv4.backend.decision import Options
    from dsv4.kernels.prefill.gemm import Tuning, interpreting, mma_path
    first, second = (Tuning(mma=Options.from_env({"DSV4_PREFILL_MMA": setting}).prefill_mma)
                     for setting in ("", "fp4=fp8,fp8=bf16"))
    fn(first, _every)
    fn(second, lambda fmt, rows, quant_act=True: not interpreting() or (
        quant_act and mma_path(fmt, rows, second) != mma_path(fmt, rows, first)))


def check_linear(dev, gen, M=70, N=384, K=256, tuning=None, fresh=_every):
    from dsv4.kernels.prefill import gemm as P
    from dsv4.numerics.quant import fp8_quant_dequant
    tuning = tuning or P.DEFAULT
    x = torch.randn(M, K, generator=gen).bfloat16().to(dev)
    x[3, :128] *= 50                                        # blocks of very different scales
    x[5, 128:] *= 1e-6                                      # e4m3 subnormals
    x8, xs = P.act_quant8(x)
    assert torch.equal(P.dequant8(x8, xs), fp8_quant_dequant(x, 128).float()), "act_quant8"
    for fmt in ("bf16", "fp8", "fp4"):
        if not fresh(fmt, M):
            continue
        w, s = _fmt_weight(fmt, N, K, gen, dev)
        xq = fp8_quant_dequant(x, 128) if fmt != "bf16" else x
        bound = _tol(fmt, M, tuning) * _absdot(xq, w, fmt, s)
        for od in (torch.float32, torch.bfloat16):
            out = P.linear(x, w, s, fmt, out_dtype=od, tuning=tuning)
            ref = P.linear_reference(x, w, s, fmt, out_dtype=torch.float64).cpu()
            err = (out.cpu().double() - ref).abs()
            lim = bound + (ref.abs() * 2 ** -8 if od == torch.bfloat16 else 0)
            assert (err <= lim).all(), f"linear {fmt} {od}: {(err - lim).max():.3g} over the bound"
    # the grouped wo_a: no act quant, group g reads its own K columns
    if not fresh("fp8", M, quant_act=False):
        return
    o = torch.randn(M, 2 * K, generator=gen).bfloat16().to(dev)
    w, s = _fmt_weight("fp8", 256, K, gen, dev)
    out = P.linear(o, w, s, "fp8", out_dtype=torch.float32, quant_act=False, group_k=K,
                   tuning=tuning)
    ref = P.linear_reference(o, w, s, "fp8", out_dtype=torch.float64, quant_act=False,
                             group_k=K).cpu()
    assert ((out.cpu().double() - ref).abs() <= _tol("bf16") * _absdot(o, w, "fp8", s, K)).all(), \
        "wo_a"


def check_linear_exact(dev, gen, M=40, N=256, K=256, tuning=None, fresh=_every):
    """Exactly representable partial sums (small-integer activations, e2m1 / e4m3 weights with
    unit scales): every summation order gives the same float32, so kernel == reference bit for
    bit (bf16 output included)."""
    from dsv4.kernels.prefill import gemm as P
    tuning = tuning or P.DEFAULT
    x = (torch.randint(-8, 9, (M, K), generator=gen).float() / 16).bfloat16().to(dev)
    from dsv4.weights.formats import quantize_fp4_weight, quantize_fp8_weight
    grid = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6])
    for fmt in ("fp8", "fp4"):
        if not fresh(fmt, M):
            continue
        sign = torch.randint(0, 2, (N, K), generator=gen) * 2 - 1
        m = grid[torch.randint(0, 8, (N, K), generator=gen)] * sign
        w, s = (quantize_fp8_weight if fmt == "fp8" else quantize_fp4_weight)(m)
        w, s = w.to(dev), s.to(dev)
        if P.mma_path(fmt, tuning=tuning) == "fp8" and not P.interpreting():
            continue                     # the FP8 tensor cores' alignment: check_linear's bound
        for od in (torch.float32, torch.bfloat16):
            out = P.linear(x, w, s, fmt, out_dtype=od, tuning=tuning).cpu()
            assert torch.equal(out, P.linear_reference(x.cpu(), w.cpu(), s.cpu(), fmt,
                                                       out_dtype=od)), f"exact {fmt} {od}"


def check_wo_a(dev, gen, M, G=8, K=4096, R=1024):
    """The grouped wo_a (no act quant, group g reads its own K columns) with bf16 output, on
    whichever path linear takes for M rows (from GROUPED_DENSE_MIN_ROWS: dequantized weights
    and cuBLAS), against the float64 reference: the bf16 tensor cores' float32 summation bound
    plus the output's bf16 rounding."""
    from dsv4.kernels.prefill import gemm as P
    o = torch.randn(M, G * K, generator=gen).bfloat16().to(dev)
    for fmt in ("fp8", "bf16"):
        w, s = _fmt_weight(fmt, G * R, K, gen, dev)
        out = P.linear(o, w, s, fmt, out_dtype=torch.bfloat16, quant_act=False, group_k=K).cpu()
        ref = P.linear_reference(o, w, s, fmt, out_dtype=torch.float64, quant_act=False,
                                 group_k=K).cpu()
        lim = _tol("bf16") * _absdot(o, w, fmt, s, K) + ref.abs() * 2 ** -8
        assert ((out.double() - ref).abs() <= lim).all(), f"wo_a {fmt}, {M} rows"


def check_swiglu_split(dev, gen, M=40, N=256, K=512, cublas=False):
    """The shared expert's up as two plain GEMMs and swiglu_quant8 == gemm8's fused SwiGLU
    epilogue, bytes and scales (cublas: the GEMMs through torch._scaled_mm, then the plain FP8
    linear too)."""
    from dsv4.kernels.prefill import gemm as P
    x8, xs = P.act_quant8((torch.randn(M, K, generator=gen) * 3).bfloat16().to(dev))
    w1, s1 = _fmt_weight("fp8", N, K, gen, dev)
    w3, s3 = _fmt_weight("fp8", N, K, gen, dev)
    fused = (torch.empty(M, N, dtype=torch.uint8, device=dev),
             torch.empty(M, N // 128, dtype=torch.float32, device=dev))
    P.gemm8(x8, xs, w1, s1, "fp8", fused[0], w3=w3, s3=s3, limit=0.5, out_scale=fused[1],
            bm=64, warps=8, cublas=False)
    if cublas:
        split = (torch.empty_like(fused[0]), torch.empty_like(fused[1]))
        P.gemm8(x8, xs, w1, s1, "fp8", split[0], w3=w3, s3=s3, limit=0.5, out_scale=split[1],
                bm=64, warps=8)
        for w, s in ((w1, s1), _fmt_weight("fp8", 4 * N, K, gen, dev)):
            o = [P.gemm8(x8, xs, w, s, "fp8", torch.empty(M, w.shape[0], dtype=torch.bfloat16,
                                                          device=dev), bm=64, warps=4,
                         cublas=c) for c in (True, False)]
            assert torch.equal(o[0], o[1]), "torch._scaled_mm vs gemm8"
    else:
        g, u = (P.gemm8(x8, xs, w, s, "fp8", torch.empty(M, N, dtype=torch.bfloat16,
                                                         device=dev), bm=64, warps=4,
                        cublas=False) for w, s in ((w1, s1), (w3, s3)))
        split = (torch.empty_like(fused[0]), torch.empty_like(fused[1]))
        P.swiglu_quant8(g, u, 0.5, *split)
    assert torch.equal(split[0], fused[0]) and torch.equal(split[1], fused[1]), "SwiGLU split"


def check_split_k(dev, gen, M=3, N=256, K=512):
    """K split into 1..8 parts (the few-row GEMMs): exactly representable sums, so every split
    gives the reference's bits, plain and with the SwiGLU + act-quant epilogue; linear() on a few
    rows splits by itself."""
    from dsv4.weights.formats import quantize_fp4_weight, quantize_fp8_weight
    from dsv4.kernels.prefill import gemm as P
    x = (torch.randint(-8, 9, (M, K), generator=gen).float() / 16).bfloat16().to(dev)
    grid = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6])
    mats = {}
    for fmt in ("bf16", "fp8", "fp4"):
        ws = []
        for _ in range(2):
            sign = torch.randint(0, 2, (N, K), generator=gen) * 2 - 1
            m = grid[torch.randint(0, 8, (N, K), generator=gen)] * sign
            if fmt == "bf16":
                ws.append((m.bfloat16().to(dev), None))
            else:
                w, sc = (quantize_fp8_weight if fmt == "fp8" else quantize_fp4_weight)(m)
                ws.append((w.to(dev), sc.to(dev)))
        mats[fmt] = ws
    assert P.k_split(3, 8) > 1, "a 3-program GEMM should split K"
    for fmt, ((w, sc), (w3, s3)) in mats.items():
        for od in (torch.float32, torch.bfloat16):
            ref = P.linear_reference(x.cpu(), w.cpu(), None if sc is None else sc.cpu(), fmt,
                                     out_dtype=od, quant_act=False)
            for split in (1, 2, 4, 8):
                out = torch.empty(M, N, dtype=od, device=dev)
                P.gemm16(x, w, sc, fmt, out, bm=16, split=split)
                assert torch.equal(out.cpu(), ref), f"split {split} {fmt} {od}"
            out = P.linear(x, w, sc, fmt, out_dtype=od).cpu()    # auto split; x is act_quant-exact
            assert torch.equal(out, ref), f"linear {fmt} {od} (auto split)"
        outs = []
        for split in (1, 2, 8):
            out = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
            P.gemm16(x, w, sc, fmt, out, bm=16, w3=w3, s3=s3, limit=7.0, quant=fmt != "bf16",
                     split=split)
            outs.append(out.cpu())
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), f"split SwiGLU {fmt}"
        assert outs[0].abs().sum() > 0
    # grouped experts (gathered rows, route weights): the same bits for every split
    from dsv4.kernels.prefill import moe as Q
    T, E, k = 5, 4, 2
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).sort(1).values
    wt = torch.rand(T, k, generator=gen).to(dev)
    xt = (torch.randint(-8, 9, (T, K), generator=gen).float() / 16).bfloat16().to(dev)  # T rows
    for fmt in ("fp8", "fp4"):
        (w, sc), (w3, s3) = mats[fmt]
        bank = [t[None].repeat(E, *([1] * t.dim())) for t in (w, sc, w3, s3)]
        plan = Q.expert_plan(idx.to(dev), wt, E, fmt)
        tile = plan.tile
        outs = []
        for split in (1, 2, 4):
            out = torch.empty(T * k, N, dtype=torch.bfloat16, device=dev)
            P.gemm16(xt, bank[0], bank[1], fmt, out, rows=plan.token, w3=bank[2], s3=bank[3],
                     rw=plan.weight, limit=7.0, quant=True, bm=tile.bm, bn=128, bk=64,
                     warps=tile.warps, split=split, **plan.launch())
            outs.append(out.cpu())
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), f"grouped split {fmt}"
        assert outs[0].abs().sum() > 0


def _plan_reference(idx, w, n_experts, bm):
    """The torch ops expert_plan's two launches replace (after the stable sort): token, weight,
    inv, tile_e, tile_r."""
    T, k = idx.shape
    P, dev = T * k, idx.device
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=dev).index_add_(
        0, flat, torch.ones_like(flat))
    ends = counts.cumsum(0)
    ntile = (counts + bm - 1) // bm
    tcum = ntile.cumsum(0)
    t = torch.arange(P // bm + min(n_experts, P), device=dev)
    te = torch.searchsorted(tcum, t, right=True)
    tec = te.clamp(max=n_experts - 1)
    r0 = ends[tec] - counts[tec] + (t - tcum[tec] + ntile[tec]) * bm
    inv = torch.empty(P, dtype=torch.int32, device=dev)
    inv[order] = torch.arange(P, dtype=torch.int32, device=dev)
    return ((order // k).to(torch.int32), w.reshape(-1)[order].float(), inv.view(T, k),
            torch.where(te < n_experts, te, -1).to(torch.int32),
            torch.stack((r0, ends[tec]), 1).to(torch.int32))


def check_expert_plan_exact(dev, gen):
    """expert_plan's launches give the torch ops' plan, bit for bit: many and few tokens, experts
    that get none, one expert holding most pairs, tiles of several heights, expert counts not a
    power of two."""
    from dsv4.kernels.prefill import moe as Q
    for T, E, k, bm, skew in ((50, 8, 3, 16, False), (7, 256, 6, 64, False), (300, 24, 2, 16, True),
                              (1, 6, 6, 128, False), (513, 256, 6, 64, True)):
        if skew:        # most rows route to experts 0 .. k - 1
            idx = torch.randint(0, E, (T, E), generator=gen).argsort(1)[:, :k]
            idx[: T * 3 // 4] = torch.arange(k)
        else:
            idx = torch.rand(T, E, generator=gen).argsort(1)[:, :k]
        idx = idx.sort(1).values.to(dev)
        w = torch.rand(T, k, generator=gen).to(dev)
        plan = Q.expert_plan(idx, w, E, bm=bm)
        want = _plan_reference(idx, w, E, plan.tile.bm)
        got = (plan.token, plan.weight, plan.inv, plan.tile_e, plan.tile_r)
        for name, a, b in zip(("token", "weight", "inv", "tile_e", "tile_r"), got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), (T, E, k, bm, name)


def check_moe(dev, gen, T=50, D=256, I=128, E=8, k=3, tuning=None, fresh=_every):
    """expert_plan's invariants; the grouped up / down / combine against the reference loop."""
    from dsv4.kernels.prefill import moe as P
    tuning = tuning or P.DEFAULT
    x = torch.randn(T, D, generator=gen).bfloat16().to(dev)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).sort(1).values
    idx[:5] = torch.arange(k)                                 # one expert gets most pairs
    wt = torch.rand(T, k, generator=gen).to(dev)
    idx = idx.to(dev)
    plan = P.expert_plan(idx, wt, E, tuning=tuning)
    tile_e, tile_r = plan.tile_e.cpu(), plan.tile_r.cpu()
    token, inv = plan.token.cpu(), plan.inv.cpu()
    flat = idx.cpu().reshape(-1)
    srt = torch.empty(T * k, dtype=torch.int64)             # sorted position -> (token, slot)
    srt[inv.reshape(-1).long()] = torch.arange(T * k)
    assert torch.equal(token.long(), srt // k), "token of each sorted pair"
    assert torch.equal(flat[srt].sort(stable=True).values, flat[srt]), "pairs sorted by expert"
    covered = torch.zeros(T * k, dtype=torch.int64)
    for e, (r0, r1) in zip(tile_e.tolist(), tile_r.tolist()):
        if e < 0:
            continue
        rows = torch.arange(r0, min(r0 + plan.tile.bm, r1))
        covered[rows] += 1
        assert (flat[srt[rows]] == e).all(), f"tile of expert {e} holds other pairs"
    assert (covered == 1).all(), "every sorted pair in exactly one tile"
    for fmt in ("fp4", "fp8", "bf16"):
        if not fresh(fmt, T):
            continue
        plan = P.expert_plan(idx, wt, E, fmt, tuning=tuning)
        w1, s1 = _fmt_weight(fmt, I, D, gen, dev, (E,), 0.1)
        w3, s3 = _fmt_weight(fmt, I, D, gen, dev, (E,), 0.1)
        w2, s2 = _fmt_weight(fmt, D, I, gen, dev, (E,), 0.1)
        rows = P.Rows.of(x, fmt, tuning)
        a = P.moe_up(rows, plan, w1, s1, w3, s3, fmt, 10.0)
        o = P.moe_down(a, plan, w2, s2, fmt)
        sh = torch.randn(T, D, generator=gen).bfloat16().to(dev)
        yb = P.moe_combine(o, plan, sh)
        y = yb.float()
        bank = (w1, s1, w3, s3, w2, s2)
        ref = P.moe_reference(x, idx, wt, bank, fmt, 10.0, sh).float()
        err = ((y - ref).norm() / ref.norm()).item()
        # sums in another order (or the FP8 tensor cores' alignment) flip bf16 / e4m3 roundings
        # of intermediates (a quarter of the outputs by one bf16 step), so the bound is the norm
        assert err < 1e-2, f"moe {fmt}: {err:.3g}"
        # the shared expert through the same GEMMs against its dense reference
        ws1, ss1 = _fmt_weight(fmt, I, D, gen, dev, spread=0.1)
        ws3, ss3 = _fmt_weight(fmt, I, D, gen, dev, spread=0.1)
        ws2, ss2 = _fmt_weight(fmt, D, I, gen, dev, spread=0.1)
        got = P.shared_expert(rows, ws1, ss1, ws3, ss3, ws2, ss2, fmt, 10.0,
                              tuning=tuning).float()
        one = torch.zeros(T, 1, dtype=torch.int64, device=dev)
        sb = tuple(t.unsqueeze(0) if t is not None else None
                   for t in (ws1, ss1, ws3, ss3, ws2, ss2))
        want = P.moe_reference(x, one, torch.ones(T, 1, device=dev), sb, fmt, 10.0).float()
        assert ((got - want).norm() / want.norm()) < 1e-2, f"shared {fmt}"
        # combine alone: bit for bit (the sums of the reference's order); yb is that launch's
        # output (moe_combine of these same o, plan and sh)
        want = o.cpu().float()[inv.reshape(-1).long()].view(T, k, D)
        acc = want[:, 0].clone()
        for j in range(1, k):
            acc += want[:, j]
        assert torch.equal(yb.cpu(), (acc + sh.cpu().float()).bfloat16())


def check_attention_rows(dev, gen, S=20, H=4, D=128, n=90, KI=45):
    from dsv4.kernels.prefill.attention import sparse_attention_rows
    from dsv4.numerics.sparse import sparse_attention
    q = torch.randn(S, H, D, generator=gen).bfloat16()
    kv = torch.randn(n, D, generator=gen).bfloat16()
    idx = torch.randint(-1, n, (S, KI), generator=gen)
    idx[:, 0] = torch.arange(S)
    idx[2, 1:] = -1                                            # a query with one valid row
    idx[3, :40] = -1                                           # a whole tile masked (skipped)
    sink = torch.randn(H, generator=gen)
    from dsv4.weights.presets import TINY
    from dsv4.numerics.rope import apply_rope, cos_sin, rope_frequencies
    freqs = rope_frequencies(TINY, 4)
    pos0 = torch.tensor([37])
    got = sparse_attention_rows(q.to(dev), kv.to(dev), idx.to(dev), sink.to(dev), D ** -0.5,
                                freqs.to(dev), pos0.to(dev)).cpu()
    ref = sparse_attention(q.float(), kv.float(), idx, sink, D ** -0.5)
    ref = apply_rope(ref, cos_sin(torch.arange(37, 37 + S), freqs), inverse=True)
    # the probabilities are rounded to bf16 (at the running max, as the official kernel)
    assert (got.float() - ref).abs().max() <= 2 ** -7 * ref.abs().max(), "attention rows"


def check_index_scores_rows(dev, gen, S=19, H=8, DI=64, n=40):
    """The chunk's index scores == the decode kernel's for each row bit for bit (in either
    orientation of the two), and the torch reference (sparse.index_scores + the visibility
    mask) within bf16 rounding."""
    from dsv4.kernels.decode.indexer import index_scores
    from dsv4.kernels.prefill.indexer import index_scores_rows
    from dsv4.numerics.sparse import index_scores as reference
    q = torch.randn(S, H, DI, generator=gen).bfloat16()
    w = torch.randn(S, H, generator=gen).bfloat16()
    keys = torch.randn(n, DI, generator=gen).bfloat16()
    pos0 = 101                             # rows see 25 .. 30 of the 40 entries
    for trans in (True, False):                 # (the default last: `got` is checked below)
        got = index_scores_rows(q.to(dev), w.to(dev), keys.to(dev),
                                torch.tensor([pos0], device=dev), 0.5, trans=trans).cpu()
        for r in range(S):
            one = index_scores(q[r].reshape(1, -1).to(dev), w[r:r + 1].to(dev), keys.to(dev),
                               torch.tensor([pos0 + r], device=dev), 0.5, trans=trans).cpu()
            assert torch.equal(got[r:r + 1], one), f"row {r} != the decode kernel's ({trans})"
    vis = (pos0 + 1 + torch.arange(S)).unsqueeze(1) // 4
    ref = reference(q.float(), (w.float() * 0.5).bfloat16().float(), keys.float())
    ref = ref.masked_fill(torch.arange(n) >= vis, float("-inf"))
    assert torch.equal(torch.isinf(got), torch.isinf(ref)), "index scores: visibility"
    fin = torch.isfinite(ref)
    err = (got.float()[fin] - ref[fin]).abs().max()
    assert err <= 2 ** -6 * ref[fin].abs().max(), f"index scores: {err}"


def check_compressor_rows(dev, gen):
    """Compressor.prefill with the entry kernel == the torch path (same inputs and state): cache
    rows within bf16 rounding (plus an e4m3 / e2m1 step where a rounding flips), state within
    float32 noise."""
    from dsv4.backend.decision import Options
    from dsv4.backend.fused import compressor as fused_compressor
    from dsv4.backend.fused import linear as fused_linear
    from dsv4.backend.ops import Ops
    from dsv4.model.compressor import Compressor
    from dsv4.weights.presets import TINY
    from dsv4.numerics.quant import hadamard_matrix
    from dsv4.numerics.rope import rope_frequencies
    from dsv4.model.state import CompressorState
    env = Options.from_env()              # TRITON_INTERPRET as this process runs
    ops = {"torch": Ops.for_device(dev, cfg=TINY, options=env.replace(kernels="0")),
           "kernel": Ops.for_device(dev, cfg=TINY, options=env.replace(
               kernels="interpret" if dev == "cpu" else "1"))}
    assert ops["kernel"].backend.rows and not ops["torch"].backend.rows
    for ratio, dc, rotate in ((4, 128, False), (4, 128, True), (16, 128, False)):
        comp = Compressor(TINY, ratio, dc, rotate, dev)
        for lin in (comp.wkv, comp.wgate):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * 0.05)
        comp.ape.copy_(torch.randn(comp.ape.shape, generator=gen))
        comp.norm.copy_(1 + 0.1 * torch.randn(dc, generator=gen))
        comp.hadamard = hadamard_matrix(dc, dev)
        freqs = rope_frequencies(TINY, ratio, dev)
        for start, s in ((0, 37), (6, 21), (ratio * 2 + 1, 3)):
            x = torch.randn(s, TINY.dim, generator=gen).bfloat16().to(dev)
            st0 = CompressorState.allocate(ratio, dc, dev)
            st0.kv.normal_(generator=None)
            st0.score.normal_()
            out = {}
            for mode in ("torch", "kernel"):
                fused_compressor.bind(comp, ops[mode])
                for lin in comp.linears():
                    fused_linear.bind(lin, ops[mode])
                st = CompressorState(st0.kv.clone(), st0.score.clone())
                cache = torch.zeros(64, dc, dtype=torch.bfloat16, device=dev)
                comp.prefill(x, st, cache, freqs, start)
                out[mode] = (cache.float(), st.kv, st.score)
            (ct, kt, st_), (ck, kk, sk) = out["torch"], out["kernel"]
            # the projections are the prefill GEMM's float32 sums (another order than torch's)
            assert torch.allclose(kt, kk, rtol=1e-4, atol=1e-4), (ratio, rotate, start, "kv")
            assert torch.allclose(st_, sk, rtol=1e-4, atol=1e-4), (ratio, rotate, start, "score")
            err = (ck - ct).abs().max() / max(ct.abs().max().item(), 1e-6)
            assert err <= (0.5 if rotate else 0.13), (ratio, rotate, start, err)   # one step
            close = ((ck - ct).abs() <= 2 ** -7 * ct.abs() + 1e-6).float().mean()
            assert close > 0.97, (ratio, rotate, start, close)


def _ext_state_reference(kv, sc, ape, st_kv, st_sc, pos0, r, cur):
    """The torch ops compress_ext and compress_state replace (the fused compressor prefill's
    before them): ext, then the state rows in place."""
    s, dev = kv.shape[0], kv.device
    j = torch.arange(r, device=dev)
    o = pos0 % r
    sc = sc + ape.index_select(0, (pos0 + torch.arange(s, device=dev)) % r)
    roll = cur + (j + o) % r
    ext_kv = torch.cat((st_kv.index_select(0, roll), kv))
    ext_sc = torch.cat((st_sc.index_select(0, roll), sc))
    if cur:
        nb = (o + s) // r
        last = (r - o + (nb - 1) * r).clamp_min(0) + j
        done = (nb > 0)[:, None]
        st_kv[:r] = torch.where(done, ext_kv.index_select(0, last), st_kv[:r])
        st_sc[:r] = torch.where(done, ext_sc.index_select(0, last), st_sc[:r])
    d = (j - pos0) % r
    has = (d < s)[:, None]
    src = r + (d + r * ((s - 1 - d).clamp_min(0) // r)).clamp(max=s - 1)
    st_kv[cur:cur + r] = torch.where(has, ext_kv.index_select(0, src), st_kv[cur:cur + r])
    st_sc[cur:cur + r] = torch.where(has, ext_sc.index_select(0, src), st_sc[cur:cur + r])
    return ext_kv, ext_sc


def check_compress_ext_state(dev, gen):
    """compress_ext and compress_state give the bits of the torch ops they replace (copies and
    one float32 add), for chunks that complete no block, one, several, from open blocks at every
    offset, in overlap mode and not."""
    from dsv4.kernels.prefill import compressor as C
    for r, cd in ((4, 256), (16, 128), (128, 96)):
        cur = r if r == 4 else 0
        ape = torch.randn(r, cd, generator=gen).to(dev)
        for start, s in ((0, 1), (0, 37), (1, 2), (r - 1, 1), (r - 1, 3 * r + 2), (2 * r + 3, r),
                         (5 * r, 2 * r)):
            kv = torch.randn(s, cd, generator=gen).to(dev)
            sc = torch.randn(s, cd, generator=gen).to(dev)
            st_kv = torch.randn(cur + r, cd, generator=gen).to(dev)
            st_sc = torch.randn(cur + r, cd, generator=gen).to(dev)
            pos0 = torch.tensor([start], dtype=torch.int64, device=dev)
            rk, rs = st_kv.clone(), st_sc.clone()
            ek, es = _ext_state_reference(kv, sc, ape, rk, rs, pos0, r, cur)
            gk, gs = C.compress_ext(kv, sc, ape, st_kv, st_sc, pos0, r, cur)
            assert torch.equal(gk, ek) and torch.equal(gs, es), (r, start, s, "ext")
            C.compress_state(gk, gs, st_kv, st_sc, pos0, r, cur)
            assert torch.equal(st_kv, rk) and torch.equal(st_sc, rs), (r, start, s, "state")


def check_mhc_rows(dev, gen, S=33, D=128):
    from dsv4.kernels.decode import mhc as K
    from dsv4.kernels.prefill import mhc as R
    h = torch.randn(S, 4, D, generator=gen).bfloat16().to(dev)
    fn = (torch.randn(24, 4 * D, generator=gen) / (4 * D) ** 0.5).to(dev)
    scale = (0.5 + 0.1 * torch.randn(3, generator=gen)).to(dev)
    base = (0.5 * torch.randn(24, generator=gen)).to(dev)
    w = (1 + 0.1 * torch.randn(D, generator=gen)).to(dev)
    x, post, comb = R.hc_pre_norm_rows(h, fn, scale, base, w, 1e-6, 1e-6, 20)
    xr, pr, cr = K.hc_pre_norm_reference(h, fn, scale, base, w, 1e-6, 1e-6, 20)
    assert (x.float() - xr.float()).abs().max() <= 2 ** -7 * xr.float().abs().max(), "mhc x"
    assert torch.allclose(post, pr, atol=1e-5) and torch.allclose(comb, cr, atol=1e-5), "mhc"
    out = R.hc_post_rows(x, h, post, comb)
    ref = K.hc_post_reference(x, h, post, comb)
    assert (out.float() - ref.float()).abs().max() <= 2 ** -7 * ref.float().abs().max(), "post"
    x1, p1, _ = K.hc_pre_norm(h[:1], fn, scale, base, w, 1e-6, 1e-6, 20)
    assert torch.equal(x1, x[:1]), "row 0 == the decode kernel"


def layers_cfg():
    """The model check_layers builds: SMALL's first three layers, one of each kind (the hash
    layer, window-only; ratio 4 with the indexer; ratio 16) and the MTP block. SMALL's fourth
    layer is a second ratio-4 layer with the indexer: the same chunk path on other weights, 25-35
    s of the interpreter (a layer's inputs and state are its own)."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import SMALL3            # (its kinds asserted there)
    return SMALL3


def check_layers(dev, tmp, seed, layers=None):
    """Each layer's chunk path with kernels == without, on the same input and state (bf16, so
    within rounding: a wrong row, position or offset moves it by 0.3 or more), for chunks at
    several offsets, on layers_cfg()'s model (a layer of each kind). `layers`: the layer ids to
    check (None: all; each layer's inputs and state are its own, so checking them in parts checks
    the same things)."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import small_checkpoint
    from dsv4.runtime.config import RuntimeConfig
    from dsv4.runtime.session import load_model
    m, ck = load_model(small_checkpoint(tmp, "fp8", cfg=layers_cfg()),
                       RuntimeConfig(max_seq_len=256, dtype=torch.bfloat16, devices=(dev,)))
    ck.close()
    if layers is not None:                # every layer asked for is one of the model's
        assert set(layers) <= {blk.layer_id for blk in m.layers}, layers
    from dsv4.backend.binding import bind
    from dsv4.backend.decision import Options
    env = Options.from_env()              # TRITON_INTERPRET as this process runs
    torch_path = env.replace(kernels="0")
    kernel_path = env.replace(kernels="interpret" if dev == "cpu" else "1")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, m.cfg.vocab_size, (100,), generator=gen).to(dev)
    # a first chunk over two of the GEMMs' 64-row tiles, past the window (16) and several
    # compressed entries; a second at an offset on no ratio's boundary (66: 2 mod 4, 2 mod 16),
    # of rows enough that one row's flipped top-k choice stays inside the bound (14 were not)
    for start, s in ((0, 66), (66, 34)):
        hin = (torch.randn(s, m.cfg.hc_mult, m.cfg.dim, generator=gen) * 0.5).bfloat16().to(dev)
        for blk, st in zip(m.layers, m.states):
            if layers is not None and blk.layer_id not in layers:
                continue
            saved = {k: v.clone() for k, v in st.buffers().items()}
            bind(m, torch_path)                 # the same weights on the torch path
            ref = blk.prefill(hin, ids[start:start + s], st, start).float()
            ref_state = {k: v.clone() for k, v in st.buffers().items()}
            for k, v in saved.items():
                st.buffers()[k].copy_(v)
            bind(m, kernel_path)
            assert m.binding.ops(blk.device).backend.rows
            got = blk.prefill(hin, ids[start:start + s], st, start).float()
            # the capture-safe form (start on the device: every cache entry a masked candidate)
            # computes the same bits (checked at the offset chunk, where entries precede it)
            got_state = {k: v.clone() for k, v in st.buffers().items()}
            if start:
                for k, v in saved.items():
                    st.buffers()[k].copy_(v)
                start_t = torch.full((1,), start, dtype=torch.int64, device=dev)
                fixed = blk.prefill(hin, ids[start:start + s], st, start_t).float()
                assert torch.equal(fixed, got), f"layer {blk.layer_id} at {start}: device start"
                for k, v in st.buffers().items():
                    assert torch.equal(v, got_state[k]), (blk.layer_id, k, "device start")
            err = ((got - ref).norm() / ref.norm()).item()
            # bf16 rounding in another order flips e4m3 roundings (KV fake-quant, W8A8) and
            # top-k choices: up to ~3% per layer here, as the parity cases' bf16 noise
            assert err < 5e-2, f"layer {blk.layer_id} at {start}+{s}: {err:.3g}"
            for k, v in st.buffers().items():
                fin = torch.isfinite(ref_state[k])
                d = (v.float()[fin] - ref_state[k].float()[fin]).norm()
                assert d <= 2e-2 * ref_state[k].float()[fin].norm() + 1e-6, (blk.layer_id, k)
            if blk.attn.ratio == 4:
                check_indexer_rows(blk, st, saved, hin, start)
            check_route_rows(blk, hin, ids[start:start + s])


def check_indexer_rows(blk, st, saved: dict, hin, start: int) -> None:
    """The chunk kernels' indexer over rows (r0, r1) of a chunk (a tensor-parallel rank's share
    of a chunk split by rows) selects rows r0..r1 of the whole chunk's entries and leaves the
    same index state. Exact under the interpreter; on a GPU the query's GEMM over fewer rows may
    take another library algorithm, so a near-tie may pick another entry: 95% agree."""
    a, s = blk.attn, hin.shape[0]
    x = hin[:, 0].contiguous()
    gen = torch.Generator().manual_seed(blk.layer_id)
    qr = torch.randn(s, blk.cfg.q_lora_rank, generator=gen).to(x.device, x.dtype)

    def run(rows):
        for k, v in saved.items():
            st.buffers()[k].copy_(v)
        out = a.indexer.prefill(x, qr, None, st, a.freqs, start, offset=3, rows=rows)
        return out, {k: v.clone() for k, v in st.buffers().items()}
    whole, whole_state = run(None)
    assert whole.shape == (s, min(blk.cfg.index_topk, (start + s) // 4)), whole.shape
    for r0, r1 in ((0, s // 2), (s // 2, s)):
        part, part_state = run((r0, r1))
        same = (part == whole[r0:r1]).float().mean().item()
        assert same == 1.0 or (x.is_cuda and same >= 0.95), (blk.layer_id, r0, r1, same)
        for k, v in part_state.items():
            assert torch.equal(v, whole_state[k]), (blk.layer_id, k, "indexer rows")


def check_route_rows(blk, hin, ids) -> None:
    """The chunk's routing in one launch (MoE.route_rows, bound to the routing kernel) selects
    MoE.route's experts, each row's in ascending id order, with its weights (float32 rounding:
    the kernel sums them in that order)."""
    moe = blk.ffn
    assert moe.route_rows != moe.route, "the chunk kernels bind the routing kernel"
    x = hin[:, 0].contiguous()
    w, idx = moe.route_rows(x, ids)
    rw, ridx = moe.route(x, ids)
    ridx, order = ridx.sort(dim=-1)
    rw = rw.gather(1, order)
    assert torch.equal(idx, ridx), (blk.layer_id, "experts")
    assert torch.allclose(w, rw, rtol=2e-6, atol=0), (blk.layer_id, (w - rw).abs().max())


def check_parity_bf16(dev):
    """The bfloat16 parity cases through the kernel path (the prefill row of each is the kernels'
    output; decode rows follow from their state) within the cases' tolerances."""
    sys.path.insert(0, str(REPO / "tests" / "integration"))
    from conftest import SHARED
    if not (SHARED / "data" / "parity").is_dir() and not os.environ.get("DSV4_PARITY_DIR"):
        return
    from test_parity import check_logits, load_case
    from dsv4.runtime.config import RuntimeConfig
    from dsv4.runtime.sampling import SamplingParams
    from dsv4.runtime.session import Session, load_model
    for name in ("p1-bf16-3layer", "p2-fp8-2layer"):
        d, case, golden, gtokens = load_case(name, "bf16")
        model, ck = load_model(d, RuntimeConfig(max_seq_len=256, dtype=torch.bfloat16,
                                                devices=(dev,)))
        ck.close()
        got = Session(model, SamplingParams()).generate(case["prompt_ids"], len(gtokens),
                                                        force_ids=gtokens, keep_logits=True)
        check_logits(got.logits.numpy(), golden, case["modes"]["bf16"]["tolerance"],
                     f"{name} through the prefill kernels", exact_argmax=False)


def check_all(dev, seed, tmp, parts=("gemm", "rows", "layers", "parity"), layers=None):
    """Every check; `parts` picks some: the GEMMs / MoE, the row kernels, the layers' chunk paths
    (`layers`: which; None: all), the parity cases (the interpreter test runs them in two
    parallel processes of about equal time)."""
    gen = torch.Generator().manual_seed(seed)
    if "gemm" in parts:
        check_expert_plan_exact(dev, gen)
        check_split_k(dev, gen)
        check_swiglu_split(dev, gen)
        _both_paths(lambda t, fresh: (check_linear(dev, gen, tuning=t, fresh=fresh),
                                      check_linear_exact(dev, gen, tuning=t, fresh=fresh),
                                      check_moe(dev, gen, tuning=t, fresh=fresh),
                                      check_moe(dev, gen, T=150, E=2, k=2, tuning=t,
                                                fresh=fresh)))
    if "rows" in parts:
        if "gemm" not in parts:          # alone: its own stream of inputs
            gen = torch.Generator().manual_seed(seed + 1)
        check_attention_rows(dev, gen)
        check_index_scores_rows(dev, gen)
        check_compressor_rows(dev, gen)
        check_compress_ext_state(dev, gen)
        check_mhc_rows(dev, gen)
    if "layers" in parts:
        check_layers(dev, tmp, seed, layers)
    if "parity" in parts:
        check_parity_bf16(dev)


# the interpreter test's cases, one process each: (parts, layers), of about equal CPU time (on one
# core of a 2-core CPU: layer 0 ~30 s, the GEMMs ~36 s, layers 1 and 2 ~40 and ~33 s, the row
# kernels ~15 s and parity ~45 s), none much longer than the other tests' longest, so that
# pytest-xdist's workers finish together; each process costs ~5 s to start (imports, checkpoint)
INTERP_SPLIT = ((("gemm", "layers"), (0,)), (("layers",), (1, 2)), (("rows", "parity"), ()))


def _interp_main(seed: int, tmp: str, parts: str, layers: str) -> None:
    from pathlib import Path
    check_all("cpu", seed, Path(tmp), tuple(parts.split(",")),
              {int(x) for x in layers.split(",") if x})
    print("ok")


@needs_interpreter
@pytest.mark.parametrize("case", range(len(INTERP_SPLIT)),
                         ids=["+".join(ps) + "-" + ",".join(map(str, ls)) for ps, ls in INTERP_SPLIT])
def test_prefill_kernels_interpreter(tmp_path, case):
    """The checks under Triton's interpreter, one process per INTERP_SPLIT case (single-threaded
    Python each; separate tests, so that pytest-xdist hands them to its workers like any other
    test, instead of one worker running several processes while the other worker runs more
    tests: three busy processes on a 2-core machine); every layer of the model is checked by one
    of them."""
    # the model check_layers builds: each layer once
    assert sorted(sum((ls for _, ls in INTERP_SPLIT), ())) == list(range(layers_cfg().n_layers))
    parts = [p for ps, _ in INTERP_SPLIT for p in ps if p != "layers"]
    assert sorted(parts) == sorted(("gemm", "rows", "parity"))    # every other part, once
    assert all(("layers" in ps) == bool(ls) for ps, ls in INTERP_SPLIT)
    env = dict(os.environ, TRITON_INTERPRET="1", DSV4_KERNELS="interpret",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"),
                                           str(REPO / "tests/dsv4/kernels")]))
    env["OMP_NUM_THREADS"] = subprocess_threads(1)
    seed = str(input_seed(1))
    code = ("import sys, test_prefill_kernels as T; "
            "T._interp_main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])")
    parts, layers = INTERP_SPLIT[case]
    p = subprocess.run([sys.executable, "-c", code, seed, str(tmp_path), ",".join(parts),
                        ",".join(map(str, layers))], env=env, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0 and "ok" in p.stdout, \
        f"{parts}, seed {seed}:\n{p.stdout[-2000:]}{p.stderr[-4000:]}"


# ---- sm_90 compile (no GPU: triton ships ptxas) -----------------------------------------------

def compile_all() -> list:
    """Compile every prefill kernel at the Flash shapes for sm_90 -> [(name, resources)]."""
    from dsv4.kernels.prefill import attention as A
    from dsv4.kernels.prefill import compressor as C
    from dsv4.kernels.prefill import indexer as I
    from dsv4.kernels.prefill import gemm as P
    from dsv4.kernels.prefill import mhc as M
    from dsv4.kernels.prefill import moe as Q
    from dsv4.kernels.aot import compile_variant, resources
    g8 = {"a_ptr": "*u8", "as_ptr": "*fp32", "rows_ptr": "*i32", "w_ptr": "*u8", "s_ptr": "*u8",
          "w3_ptr": "*u8", "s3_ptr": "*u8", "out_ptr": "*bf16", "os_ptr": "*fp32",
          "rw_ptr": "*fp32", "tile_e_ptr": "*i32", "tile_r_ptr": "*i32", "M": "i32",
          "limit": "fp32"}
    b8 = dict(GROUPED=False, GATHER=False, SWIGLU=False, LIMIT=False, ROUTE_W=False,
              QUANT=False, OUT_F32=False, BM=P.BM, BN=P.BN, F32=False)
    up = dict(GROUPED=True, GATHER=True, SWIGLU=True, LIMIT=True, ROUTE_W=True, QUANT=True)
    g16 = {"a_ptr": "*bf16", "rows_ptr": "*i32", "w_ptr": "*u8", "s_ptr": "*u8",
           "w3_ptr": "*u8", "s3_ptr": "*u8", "out_ptr": "*bf16", "rw_ptr": "*fp32",
           "tile_e_ptr": "*i32", "tile_r_ptr": "*i32", "ws_ptr": "*fp32", "M": "i32",
           "PLANE": "i32", "limit": "fp32"}
    b16 = dict(GROUP_N=0, GROUPED=False, GATHER=False, SWIGLU=False, LIMIT=False, ROUTE_W=False,
               QUANT=0, OUT_F32=False, BM=P.BM, BN=P.BN, BK=P.BK, SPLIT=1, F32=False,
               NATIVE=True)
    sk = {"ws_ptr": "*fp32", "out_ptr": "*bf16", "rw_ptr": "*fp32", "M": "i32", "PLANE": "i32",
          "limit": "fp32"}
    jobs = [
        ("fp8 linear (wq_b)", P._gemm8_kernel, g8, dict(b8, N=32768, K=1024, FP4=False), P.WARPS),
        ("fp4 moe up", P._gemm8_kernel, dict(g8, out_ptr="*u8"),
         dict(b8, N=2048, K=4096, FP4=True, **up), P.WARPS),
        ("fp4 moe down", P._gemm8_kernel, g8, dict(b8, N=4096, K=2048, FP4=True, GROUPED=True),
         P.WARPS),
        ("fp8 shared up", P._gemm8_kernel, dict(g8, out_ptr="*u8"),
         dict(b8, N=2048, K=4096, FP4=False, SWIGLU=True, LIMIT=True, QUANT=True), P.WARPS),
        ("bf16 linear -> f32 (compressor)", P._gemm16_kernel,
         dict(g16, w_ptr="*bf16", out_ptr="*fp32"),
         dict(b16, N=1024, K=4096, LDA=4096, FMT=0, OUT_F32=True), P.WARPS),
        ("fp8 grouped wo_a (bf16 MMA)", P._gemm16_kernel, g16,
         dict(b16, N=8192, K=4096, LDA=32768, FMT=1, GROUP_N=1024), P.WARPS),
        ("bf16 moe up", P._gemm16_kernel, dict(g16, w_ptr="*bf16", w3_ptr="*bf16"),
         dict(b16, N=2048, K=4096, LDA=4096, FMT=0, GROUPED=True, GATHER=True, SWIGLU=True,
              LIMIT=True, ROUTE_W=True), P.WARPS),
        ("fp4 moe up (bf16 MMA)", P._gemm16_kernel, dict(g16, w_ptr="*i32", w3_ptr="*i32"),
         dict(b16, N=2048, K=4096, LDA=4096, FMT=2, GROUPED=True, GATHER=True, SWIGLU=True,
              LIMIT=True, ROUTE_W=True, QUANT=1), P.WARPS),
        ("fp4 moe down (bf16 MMA)", P._gemm16_kernel, dict(g16, w_ptr="*i32"),
         dict(b16, N=4096, K=2048, LDA=2048, FMT=2, GROUPED=True), P.WARPS),
        ("fp4 moe up (bf16 MMA, 16-row tiles)", P._gemm16_kernel,
         dict(g16, w_ptr="*i32", w3_ptr="*i32"),
         dict(b16, N=2048, K=4096, LDA=4096, FMT=2, GROUPED=True, GATHER=True, SWIGLU=True,
              LIMIT=True, ROUTE_W=True, QUANT=1, BM=16), P.WARPS),
        ("fp8 linear (bf16 MMA, 128-row tiles)", P._gemm16_kernel, g16,
         dict(b16, N=32768, K=1024, LDA=1024, FMT=1, BM=128), P.WARPS),
        ("fp8 linear (bf16 MMA, 16-row tiles, K split 16)", P._gemm16_kernel, g16,
         dict(b16, N=1024, K=4096, LDA=4096, FMT=1, BM=16, SPLIT=16), P.WARPS),
        ("fp8 shared up (bf16 MMA, K split 8)", P._gemm16_kernel, g16,
         dict(b16, N=2048, K=4096, LDA=4096, FMT=1, BM=16, SPLIT=8, SWIGLU=True, LIMIT=True),
         P.WARPS),
        ("split-K sum (SwiGLU, act quant)", P._splitk_kernel, sk,
         dict(N=2048, SPLIT=8, SWIGLU=True, LIMIT=True, ROUTE_W=True, QUANT=1, OUT_F32=False,
              BM=P.SPLIT_BM, BN=P.BN), 4),
        ("fp4 moe up (FP8 MMA, 16-row tiles)", P._gemm8_kernel, dict(g8, out_ptr="*u8"),
         dict(b8, N=2048, K=4096, FP4=True, **up, BM=16), P.WARPS),
        ("swiglu act_quant8 (shared up after cuBLAS)", P._swiglu_quant8_kernel,
         {"g_ptr": "*bf16", "u_ptr": "*bf16", "y_ptr": "*u8", "s_ptr": "*fp32", "M": "i32",
          "limit": "fp32"}, dict(N=2048, LIMIT=True, R=P.QROWS), 4),
        ("act_quant8", P._act_quant8_kernel, {"x_ptr": "*bf16", "y_ptr": "*u8", "s_ptr": "*fp32",
                                              "M": "i32"}, dict(K=4096, R=P.QROWS), 4),
        ("moe combine", Q._combine_kernel, {"o_ptr": "*bf16", "inv_ptr": "*i32",
                                            "sh_ptr": "*bf16", "y_ptr": "*bf16"},
         dict(D=4096, KE=6, BD=1024, SHARED=True), 4),
        ("attention rows", A._attn_rows_kernel,
         {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "sink_ptr": "*fp32",
          "freqs_ptr": "*fp32", "pos_ptr": "*i64", "o_ptr": "*bf16", "scale": "fp32",
          "KI": "i32"}, dict(H=64, DH=512, HB=A.WIDE[0], BN=A.WIDE[1], NOPE=448, F32=False,
                           SCAN=A.SCAN), A.WIDE[2], A.WIDE[3]),
        ("attention rows, 16 heads", A._attn_rows_kernel,
         {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "sink_ptr": "*fp32",
          "freqs_ptr": "*fp32", "pos_ptr": "*i64", "o_ptr": "*bf16", "scale": "fp32",
          "KI": "i32"}, dict(H=16, DH=512, HB=A.MID[0], BN=A.MID[1], NOPE=448, F32=False,
                           SCAN=A.SCAN), A.MID[2], A.MID[3]),
        ("index scores rows", I._scores_rows_kernel,
         {"q_ptr": "*bf16", "w_ptr": "*bf16", "k_ptr": "*bf16", "pos_ptr": "*i64",
          "out_ptr": "*bf16", "wscale": "fp32", "S": "i32", "N": "i32"},
         dict(H=64, HP=64, DI=128, BT=I.BT, QB=I.QB, TRANS=I.INDEX_SCORES_TRANS, F32=False), 4),
        ("compressor rows (ratio 4)", C._compress_rows_kernel,
         {"ekv_ptr": "*fp32", "esc_ptr": "*fp32", "pkv_ptr": "*fp32", "psc_ptr": "*fp32",
          "norm_ptr": "*fp32", "freqs_ptr": "*fp32", "cache_ptr": "*bf16", "pos_ptr": "*i64", "S": "i32",
          "eps": "fp32"},
         dict(R=4, DC=512, OVERLAP=True, ROTATE=False, NOPE=448, RB=4), 8),
        ("compressor rows (ratio 128)", C._compress_rows_kernel,
         {"ekv_ptr": "*fp32", "esc_ptr": "*fp32", "pkv_ptr": "*fp32", "psc_ptr": "*fp32",
          "norm_ptr": "*fp32", "freqs_ptr": "*fp32", "cache_ptr": "*bf16", "pos_ptr": "*i64", "S": "i32",
          "eps": "fp32"},
         dict(R=128, DC=512, OVERLAP=False, ROTATE=False, NOPE=448, RB=16), 8),
        ("compressor rows (indexer)", C._compress_rows_kernel,
         {"ekv_ptr": "*fp32", "esc_ptr": "*fp32", "pkv_ptr": "*fp32", "psc_ptr": "*fp32",
          "norm_ptr": "*fp32", "freqs_ptr": "*fp32", "cache_ptr": "*bf16", "pos_ptr": "*i64", "S": "i32",
          "eps": "fp32"},
         dict(R=4, DC=128, OVERLAP=True, ROTATE=True, NOPE=64, RB=4), 4),
        ("expert plan pairs", Q._plan_pairs_kernel,
         {"order_ptr": "*i64", "w_ptr": "*fp32", "token_ptr": "*i32", "weight_ptr": "*fp32",
          "inv_ptr": "*i32", "P": "i32"}, dict(K=6, BP=Q.PLAN_BP), 4),
        ("expert plan tiles", Q._plan_tiles_kernel,
         {"se_ptr": "*i64", "P": "i32", "psteps": "i32", "scratch_ptr": "*i64",
          "tile_e_ptr": "*i32", "tile_r_ptr": "*i32", "NT": "i32", "esteps": "i32"},
         dict(E=256, EP=256, BM=64, BT=Q.PLAN_BT), 4),
        ("compressor ext (ratio 4)", C._ext_kernel,
         {"kv_ptr": "*fp32", "sc_ptr": "*fp32", "ape_ptr": "*fp32", "skv_ptr": "*fp32",
          "ssc_ptr": "*fp32", "ekv_ptr": "*fp32", "esc_ptr": "*fp32", "pos_ptr": "*i64"},
         dict(R=4, CUR=4, CD=1024, BC=1024), 4),
        ("compressor state (ratio 4)", C._state_kernel,
         {"ekv_ptr": "*fp32", "esc_ptr": "*fp32", "skv_ptr": "*fp32", "ssc_ptr": "*fp32",
          "pos_ptr": "*i64", "S": "i32"}, dict(R=4, CUR=4, CD=1024, BC=1024), 4),
        ("mhc mix rows", M._mix_rows_kernel, {"h_ptr": "*bf16", "fn_ptr": "*fp32",
                                              "part_ptr": "*fp32", "S": "i32"},
         dict(K=16384, M=24, MP=32, RB=M.ROWS_RB, KC=16384 // M.ROWS_NCH, BK=M.ROWS_BK,
              NCH=M.ROWS_NCH, F32=False), 4),
    ]
    out = []
    for name, kern, sig, ce, nw, *stages in jobs:
        c = compile_variant(kern, sig, ce, nw, num_stages=stages[0] if stages else None)
        out.append((name, {**resources(c), "mma": "wgmma" if "wgmma" in c.asm["ptx"] else
                           "mma.sync" if "mma.sync" in c.asm["ptx"] else "-"}))
    return out


def _compile_main() -> None:
    for name, res in compile_all():
        # the attention epilogue's sin / cos keep a 32-byte frame (as the decode kernel's does),
        # as do the compressor's rows; the 32-head attention program (255 registers) keeps 56
        # bytes and still ran fastest (H200 sweep: kernels/prefill/attention.py)
        frame = 64 if name == "attention rows" else 32 if name.startswith(
            ("attention rows", "compressor rows")) else 0
        assert res.get("local", 0) == 0 and res.get("stack", 0) <= frame, f"{name} spills: {res}"
        print(name, res)
    print("ok")


@needs_triton
def test_prefill_kernels_compile_sm90():
    """Every prefill kernel compiles for sm_90 at the Flash shapes without register spills (here,
    or in a subprocess without the interpreter where it is on: conftest.compile_here_or_apart; no
    GPU needed when triton ships ptxas)."""
    from conftest import compile_here_or_apart
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"),
                                                       str(REPO / "tests/dsv4/kernels")]))
    env.pop("TRITON_INTERPRET", None)
    p = compile_here_or_apart(
        _compile_main, [sys.executable, "-c", "import test_prefill_kernels as T; T._compile_main()"],
        env)
    if p.returncode and "ptxas" in p.stderr and "not found" in p.stderr.lower():
        pytest.skip("no ptxas for an sm_90 compile")
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-4000:]


# ---- CUDA ---------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_prefill_kernels_cuda(tmp_path):
    check_all("cuda", input_seed(2), tmp_path)


@pytest.mark.cuda
def test_scaled_mm_same_bits():
    """Where torch._scaled_mm's blockwise recipe serves (scaled_mm_ok), the FP8 linears and the
    shared expert's SwiGLU up through it give gemm8's bits (Flash shapes, 300 and 1,024 rows)."""
    from dsv4.kernels.prefill import gemm as P
    x8 = torch.zeros(4, 4096, dtype=torch.uint8, device="cuda")
    if not P.scaled_mm_ok(x8, x8[:, :2048].t(), x8):
        pytest.skip("torch._scaled_mm's blockwise FP8 recipe is not available on this device")
    gen = torch.Generator().manual_seed(input_seed(4))
    for M in (300, 1024):
        check_swiglu_split("cuda", gen, M=M, N=2048, K=4096, cublas=True)


@pytest.mark.cuda
def test_fp8_gemm_writes_every_output():
    """The FP8 prefill GEMM as the linears call it (cublas where scaled_mm_ok allows) writes every
    output of a NaN-filled tensor and gives the Triton GEMM's bits, for the small models' shapes
    (k = 128, 256, 384: torch._scaled_mm left rows unwritten there, issue 33) and Flash's, at row
    counts that are no multiple of a tile."""
    from dsv4.kernels.prefill import gemm as P
    gen = torch.Generator().manual_seed(input_seed(5))
    for n, k in ((128, 128), (512, 128), (256, 256), (512, 384), (256, 512), (1024, 4096)):
        w, s = _fmt_weight("fp8", n, k, gen, "cuda")
        for m in (256, 300, 600, 1000):
            x8, xs = P.act_quant8(torch.randn(m, k, generator=gen).bfloat16().cuda())
            got, want = (P.gemm8(x8, xs, w, s, "fp8", torch.full((m, n), float("nan"),
                                                                   dtype=torch.bfloat16,
                                                                   device="cuda"),
                                 bm=P.pick_bm(m), warps=4, cublas=c) for c in (True, False))
            assert not got.isnan().any(), f"{m}x{n}x{k}: unwritten outputs"
            assert torch.equal(got, want), f"{m}x{n}x{k}: torch._scaled_mm vs gemm8"


@pytest.mark.cuda
def test_prefill_gemm_flash_shapes():
    """The Flash linears of a 300-token chunk (odd tile counts) against float64 references."""
    gen = torch.Generator().manual_seed(input_seed(3))
    def run(t, fresh):
        for n, k in ((1024, 4096), (32768, 1024), (512, 4096), (4096, 8192)):
            check_linear("cuda", gen, M=300, N=n, K=k, tuning=t, fresh=fresh)
        # 64 experts, not 256: the float64 references of a whole Flash bank take minutes
        check_wo_a("cuda", gen, M=1100)                                  # the dense path
        flash = dict(D=4096, I=2048, k=6, tuning=t, fresh=fresh)
        check_moe("cuda", gen, T=300, E=64, **flash)             # ~28 rows each
        check_moe("cuda", gen, T=20, E=64, **flash)              # 16-row tiles
        check_moe("cuda", gen, T=600, E=16, **flash)             # 128-row tiles
    _both_paths(run)
