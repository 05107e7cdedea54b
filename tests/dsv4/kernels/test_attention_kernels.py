"""Fused attention-side decode kernels (dsv4/kernels/{attention,compressor,indexer}_decode.py) against
the torch code they replace: the Triton interpreter on the CPU at small shapes (in a subprocess, as
TRITON_INTERPRET must be set before triton is imported), CUDA at the real Flash / Pro shapes, and
Attention.decode fused vs torch over consecutive positions. Fresh random inputs every run; outputs
poisoned with NaN first. `python -m pytest tests/dsv4/kernels/test_attention_kernels.py [-m cuda] -s`
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, input_seed, needs_interpreter
from test_decode_kernels import capture_step

SMALL_POS = (0, 3, 5, 15, 16, 17, 31, 40, 47, 63)            # capacity 64, W = 16, r = 4 / 16


# ---- tolerance helpers -----------------------------------------------------------------------

def poisoned(*shape, dtype=torch.bfloat16, device="cpu"):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_bf16_close(out, ref, what, ulps=4):
    """Max abs diff within `ulps` bf16 ulps of the tensor's scale (max |ref|); -inf where ref is."""
    o, r = out.float(), ref.float()
    inf = torch.isinf(r)
    assert torch.equal(torch.isinf(o), inf), f"{what}: -inf pattern differs"
    o, r = o[~inf], r[~inf]
    assert torch.isfinite(o).all(), f"{what}: non-finite values (unwritten output?)"
    if not r.numel():
        return
    scale = r.abs().max().clamp_min(1e-30)
    d = (o - r).abs().max()
    assert d <= ulps * 2 ** -8 * scale, f"{what}: max diff {d:.3g} > {ulps} bf16 ulps of {scale:.3g}"


def assert_attention_close(out, ref, values, what):
    """Two bf16 attention outputs over the same rows `values`: the kernel's online softmax rounds
    its bf16 probabilities against a running maximum, the torch path against the final one, so
    each probability sits within one bf16 rounding (2^-8 relative) of the exact one on either
    path and P.V / denominator moves by up to 2^-8 max|v| per path, plus each output's own
    rounding. (The scale of the output alone is no bound: averaging rows makes max|o| far smaller
    than max|v| when no row dominates.)"""
    o, r = out.float(), ref.float()
    assert torch.isfinite(o).all(), f"{what}: non-finite values (unwritten output?)"
    tol = 2 * 2 ** -8 * values.float().abs().max() + 2 * 2 ** -8 * r.abs().max()
    d = (o - r).abs().max()
    assert d <= tol, f"{what}: max diff {d:.3g} > {tol:.3g} (2^-7 of max|v| + 2^-7 of max|o|)"


def assert_quant_close(out, ref, what, mant_bits, ulps=4, frac=0.02):
    """Fake-quantized values: within bf16 ulps, except a few elements one grid step apart (the
    quantizer rounding the other way after a 1-ulp difference upstream)."""
    o, r = out.float(), ref.float()
    assert torch.isfinite(o).all(), f"{what}: non-finite values (unwritten output?)"
    d = (o - r).abs()
    big = d > ulps * 2 ** -8 * r.abs().max()
    assert big.float().mean() <= frac, f"{what}: {int(big.sum())} of {d.numel()} values differ"
    m = torch.maximum(o.abs(), r.abs())[big]
    step = torch.exp2(torch.floor(torch.log2(m)) - mant_bits + 1)
    assert (d[big] <= step).all(), f"{what}: diffs beyond one grid step: {d[big].max():.3g}"


def randn(g, *shape, scale=1.0, device="cpu", dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


# ---- kernel checks (shared by the interpreter and CUDA tests) ----------------------------------

def check_prep(dev, g, cfg, ratio, positions):
    from dsv4.kernels.decode import attention_prep as K
    from dsv4.numerics.mhc import rms_norm
    from dsv4.numerics.rope import rope_frequencies
    H, Dh, W = cfg.n_heads, cfg.head_dim, cfg.window_size
    freqs = rope_frequencies(cfg, ratio, dev)
    for p in positions:
        pos = torch.tensor([p], device=dev)
        sc = float(torch.exp(torch.randn(1, generator=g)))
        q, kv = randn(g, 1, H * Dh, scale=sc, device=dev), randn(g, 1, Dh, scale=sc, device=dev)
        w = (1 + 0.1 * torch.randn(Dh, generator=g)).to(dev)
        cache = randn(g, W + 3, Dh, device=dev)
        ref_cache = cache.clone()
        cache[p % W] = float("nan")
        qo = poisoned(1, H * Dh, device=dev)
        K.attention_prep(q, kv, w, cache, pos, freqs, cfg.norm_eps, H, W, out=qo)
        qr = K.attention_prep_reference(q, kv, w, ref_cache, pos, freqs, cfg.norm_eps, H, W)
        assert_bf16_close(qo, qr, f"q prep p={p}")
        assert_quant_close(cache[p % W], ref_cache[p % W], f"kv prep p={p}", mant_bits=3)
        keep = torch.arange(W + 3, device=dev) != p % W
        assert torch.equal(cache[keep], ref_cache[keep]), "prep wrote outside its ring slot"
        assert torch.equal(K.attention_prep(q, kv, w, cache, pos, freqs, cfg.norm_eps, H, W), qo)
        x = randn(g, 1, cfg.q_lora_rank, scale=sc, device=dev)
        y = K.rms_norm_row(x, w.repeat(cfg.q_lora_rank // Dh + 1)[:cfg.q_lora_rank], cfg.norm_eps,
                           out=poisoned(1, cfg.q_lora_rank, device=dev))
        assert_bf16_close(y, rms_norm(x, w.repeat(cfg.q_lora_rank // Dh + 1)[:cfg.q_lora_rank],
                                      cfg.norm_eps), "q_norm", ulps=2)


def check_attention(dev, g, cfg, ratio, capacity, positions, configs=(None,)):
    from dsv4.kernels.decode import attention as K
    from dsv4.numerics.rope import rope_frequencies
    H, Dh, W = cfg.n_heads, cfg.head_dim, cfg.window_size
    n = capacity // ratio if ratio else 0
    freqs = rope_frequencies(cfg, ratio, dev)
    cache = randn(g, W + n + 1, Dh, device=dev) * torch.exp(torch.randn(W + n + 1, 1, generator=g)
                                                            ).to(dev).bfloat16()
    q = randn(g, 1, H * Dh, scale=2.0, device=dev)
    sink = torch.randn(H, generator=g).to(dev)
    for p in positions:
        pos = torch.tensor([p], device=dev)
        idx, nc = None, n
        if ratio == 4:                       # the indexer's raw top-k over masked scores
            nc = min(cfg.index_topk, n)
            s = torch.randn(n, generator=g).to(dev)
            s = s.masked_fill(torch.arange(n, device=dev) >= (p + 1) // 4, float("-inf"))
            idx = s.topk(nc).indices.unsqueeze(0)
        ref = K.sparse_attention_decode_reference(q, cache, sink, pos, freqs, Dh ** -0.5, H, W,
                                                  ratio, nc, idx)
        for c in configs:
            out = poisoned(1, H * Dh, device=dev)
            K.sparse_attention_decode(q, cache, sink, pos, freqs, Dh ** -0.5, H, W, ratio, nc, idx,
                                      config=c, out=out)
            assert_bf16_close(out, ref, f"attention r={ratio} p={p} {c}")
            again = K.sparse_attention_decode(q, cache, sink, pos, freqs, Dh ** -0.5, H, W, ratio,
                                              nc, idx, config=c)
            assert torch.equal(again, out), "sparse attention not deterministic"


def check_attention_rows(dev, g, cfg, ratio, capacity, positions, Ts=(2, 4), configs=(None,)):
    """The speculative verify rows: prep, index query, scores, top-k and attention of T rows at
    pos .. pos+T-1 in one launch each (the ring written after every row's attention) == the
    one-row launches row after row (attention_prep writing the ring first), bit for bit: outputs
    and the whole cache, at positions where the rows' ring slots wrap and overwrite what an
    earlier row's window reads."""
    from dsv4.kernels.decode import attention as K
    from dsv4.kernels.decode import attention_prep as P
    from dsv4.kernels.decode import indexer as KI
    from dsv4.numerics.rope import rope_frequencies
    H, Dh, W, eps = cfg.n_heads, cfg.head_dim, cfg.window_size, cfg.norm_eps
    HI, DI = cfg.index_n_heads, cfg.index_head_dim
    n = capacity // ratio if ratio else 0
    freqs = rope_frequencies(cfg, ratio, dev)
    cache0 = randn(g, W + n + 1, Dh, device=dev) * torch.exp(
        torch.randn(W + n + 1, 1, generator=g)).to(dev).bfloat16()
    sink = torch.randn(H, generator=g).to(dev)
    kvw = (1 + 0.1 * torch.randn(Dh, generator=g)).to(dev)
    keys = randn(g, max(n, 1), DI, device=dev)
    for T in Ts:
        for p in positions:
            if p + T > capacity:
                continue
            pos = torch.tensor([p], device=dev)
            sc = float(torch.exp(torch.randn(1, generator=g)))
            q_raw = randn(g, T, H * Dh, scale=sc, device=dev)
            kv_raw = randn(g, T, Dh, scale=sc, device=dev)
            idx, nc = None, n
            if ratio == 4:                   # the indexer's query, scores and top-k of T rows
                nc = min(cfg.index_topk, n)
                iq_raw, iw = randn(g, T, HI * DI, device=dev), randn(g, T, HI, device=dev)
                iq = KI.index_query(iq_raw, pos, freqs, HI)
                isc = KI.index_scores(iq, iw, keys, pos, DI ** -0.5)
                idx = KI.index_topk(isc, nc)
                for t in range(T):
                    one_q = KI.index_query(iq_raw[t:t + 1], pos + t, freqs, HI)
                    one_s = KI.index_scores(one_q, iw[t:t + 1], keys, pos + t, DI ** -0.5)
                    assert torch.equal(iq[t:t + 1], one_q), f"index query rows T={T} p={p}"
                    assert torch.equal(isc[t:t + 1], one_s), f"index scores rows T={T} p={p}"
                    assert torch.equal(idx[t:t + 1], KI.index_topk(one_s, nc)), \
                        f"index top-k rows T={T} p={p}"
            # the one-row launches row after row: row t's prep (which writes its ring slot) once,
            # then each config's attention of row t (which reads the ring and writes nothing
            # else: the same prep for every config, so it runs once); the rows' prep likewise
            # (attention_prep_rows does not touch the ring)
            cache_a, out_a = cache0.clone(), [[] for _ in configs]
            for t in range(T):
                qt = P.attention_prep(q_raw[t:t + 1], kv_raw[t:t + 1], kvw, cache_a, pos + t,
                                      freqs, eps, H, W)
                for i, c in enumerate(configs):
                    out_a[i].append(K.sparse_attention_decode(
                        qt, cache_a, sink, pos + t, freqs, Dh ** -0.5, H, W, ratio, nc,
                        None if idx is None else idx[t:t + 1], config=c))
            qb, kvb = P.attention_prep_rows(q_raw, kv_raw, kvw, pos, freqs, eps, H, decode=True)
            for i, c in enumerate(configs):
                what = f"attention rows r={ratio} T={T} p={p} {c}"
                cache_b = cache0.clone()
                out_b = K.sparse_attention_decode_rows(
                    qb.view(T, -1), kvb, cache_b, sink, pos, freqs, Dh ** -0.5, H, W, ratio, nc,
                    idx, config=c, out=poisoned(T, H * Dh, device=dev))
                assert torch.equal(out_b, torch.cat(out_a[i])), what
                assert torch.equal(cache_b, cache_a), what + ": ring"


def _compressor(cfg, ratio, dc, rotate, dev, g):
    from dsv4.model.compressor import Compressor
    from dsv4.numerics.quant import hadamard_matrix
    comp = Compressor(cfg, ratio, dc, rotate, dev)
    for lin in (comp.wkv, comp.wgate):
        lin.weight.copy_(randn(g, *lin.weight.shape, scale=cfg.dim ** -0.5))
    comp.ape.copy_(torch.randn(comp.ape.shape, generator=g) * 0.5)
    comp.norm.copy_(1 + 0.1 * torch.randn(dc, generator=g))
    comp.hadamard = hadamard_matrix(dc, dev) if rotate else None
    return comp


def check_compressor(dev, g, cfg, ratio, dc, rotate, capacity, starts, steps):
    from dsv4.backend.fused import compressor as fused_compressor
    from dsv4.backend.ops import Ops
    from dsv4.model.state import CompressorState
    from dsv4.numerics.rope import rope_frequencies
    comp = _compressor(cfg, ratio, dc, rotate, dev, g)
    ops = Ops.for_device(dev, cfg=cfg)
    freqs = rope_frequencies(cfg, ratio, dev)
    n = capacity // ratio
    for start in starts:
        st_f, st_r = (CompressorState.allocate(ratio, dc, dev) for _ in range(2))
        if start:                            # mid-sequence: arbitrary finite state
            st_r.kv.copy_(torch.randn(st_r.kv.shape, generator=g))
            st_r.score.copy_(torch.randn(st_r.score.shape, generator=g))
            st_f.kv.copy_(st_r.kv)
            st_f.score.copy_(st_r.score)
        cache_r = randn(g, n + 1, dc, device=dev)
        cache_f = cache_r.clone()
        for p in range(start, min(start + steps, capacity)):
            pos = torch.tensor([p], device=dev)
            x = randn(g, 1, cfg.dim, device=dev)
            emit = (p + 1) % ratio == 0
            if emit:
                cache_f[p // ratio] = float("nan")
            fused_compressor.decode(comp, ops, x, pos, st_f, cache_f, freqs)
            comp.decode_reference(x, pos, st_r, cache_r, freqs)
            what = f"compressor r={ratio} dc={dc} p={p}"
            assert torch.equal(st_f.kv, st_r.kv) and torch.equal(st_f.score, st_r.score), what
            if emit:
                assert_quant_close(cache_f[p // ratio], cache_r[p // ratio], what,
                                   mant_bits=1 if rotate else 3)
                cache_f[p // ratio] = cache_r[p // ratio]
            assert torch.equal(cache_f[:-1], cache_r[:-1]), f"{what}: wrote another row"


def check_compressor_rows(dev, g, cfg, ratio, dc, rotate, capacity, starts, Ts):
    """T rows' steps in one launch (the verify rows) == T one-row launches in turn, bit for bit:
    the state, and the cache with the entries the rows emit (starts chosen so some do)."""
    from dsv4.backend.fused import compressor as fused_compressor
    from dsv4.backend.ops import Ops
    from dsv4.model.state import CompressorState
    from dsv4.numerics.rope import rope_frequencies
    comp = _compressor(cfg, ratio, dc, rotate, dev, g)
    ops = Ops.for_device(dev, cfg=cfg)
    freqs = rope_frequencies(cfg, ratio, dev)
    c = 2 if ratio == 4 else 1
    for start in starts:
        for T in Ts:
            st_a, st_b = (CompressorState.allocate(ratio, dc, dev) for _ in range(2))
            st_a.kv.copy_(torch.randn(st_a.kv.shape, generator=g))
            st_a.score.copy_(torch.randn(st_a.score.shape, generator=g))
            st_b.kv.copy_(st_a.kv)
            st_b.score.copy_(st_a.score)
            cache_a = torch.full((capacity // ratio + 1, dc), float("nan"), dtype=torch.bfloat16,
                                 device=dev)
            cache_b = cache_a.clone()
            kv = torch.randn(T, c * dc, generator=g).to(dev)
            sc = torch.randn(T, c * dc, generator=g).to(dev)
            x = torch.empty(T, cfg.dim, device=dev)              # unused: proj given
            pos = torch.tensor([start], device=dev)
            fused_compressor.decode(comp, ops, x, pos, st_a, cache_a, freqs, [kv, sc])
            for t in range(T):
                fused_compressor.decode(comp, ops, x[t:t + 1], pos + t, st_b, cache_b, freqs,
                                        [kv[t:t + 1], sc[t:t + 1]])
            what = f"compressor rows r={ratio} dc={dc} start={start} T={T}"
            assert torch.equal(st_a.kv, st_b.kv) and torch.equal(st_a.score, st_b.score), what
            assert torch.equal(cache_a.isnan(), cache_b.isnan()), what
            assert torch.equal(cache_a.nan_to_num(), cache_b.nan_to_num()), what
            emitted = sum((start + t + 1) % ratio == 0 for t in range(T))
            assert (~cache_a.isnan().all(-1)).sum() == emitted, what


def check_indexer(dev, g, cfg, capacity, positions):
    from dsv4.kernels.decode import indexer as K
    from dsv4.numerics.rope import rope_frequencies
    HI, DI = cfg.index_n_heads, cfg.index_head_dim
    n = capacity // 4
    k = min(cfg.index_topk, n)
    freqs = rope_frequencies(cfg, 4, dev)
    keys = randn(g, n, DI, device=dev)
    wscale = DI ** -0.5 * HI ** -0.5
    for p in positions:
        pos = torch.tensor([p], device=dev)
        q_raw = randn(g, 1, HI * DI, device=dev)
        w = randn(g, 1, HI, device=dev)
        q = poisoned(1, HI * DI, device=dev)
        K.index_query(q_raw, pos, freqs, HI, out=q)
        qr = K.index_query_reference(q_raw, pos, freqs, HI)
        assert_quant_close(q, qr, f"index q p={p}", mant_bits=1)
        s = poisoned(1, n, device=dev)
        K.index_scores(qr, w, keys, pos, wscale, out=s)
        sr = K.index_scores_reference(qr, w, keys, pos, wscale)
        assert_bf16_close(s, sr, f"index scores p={p}")
        assert torch.equal(K.index_scores(qr, w, keys, pos, wscale), s), "scores not deterministic"
        # the fused top-k is a top-k of the reference scores, up to ties within bf16 rounding
        vals = sr.float().gather(1, s.topk(k).indices).sort(descending=True).values
        best = sr.float().topk(k).values
        fin = torch.isfinite(best)
        assert torch.equal(torch.isfinite(vals), fin), f"index top-k p={p}: visibility differs"
        tol = 4 * 2 ** -8 * sr.float()[torch.isfinite(sr.float())].abs().max() if fin.any() else 0
        assert ((vals - best)[fin].abs() <= tol).all(), f"index top-k p={p}: different selection"


def check_index_tiles(dev, g, H, DI, n, positions, tiles=(1, 2, 4), configs=()):
    """The score kernel with 1, 2, 4 tiles a program (the query loaded once for them) and the
    (tiles, stages, warps, orientation) of `configs`: within bf16 rounding of the reference and,
    entry for entry, the same bits whatever the tiles, the pipeline's depth and the warps (within
    one orientation: the sum over the heads runs in another order in the other), at visibility 0,
    inside a tile, on a program's edge, past the cache; n not a multiple of a tile."""
    from dsv4.kernels.decode import indexer as K
    keys = randn(g, n, DI, device=dev)
    wscale = DI ** -0.5 * H ** -0.5
    for p in positions:
        pos = torch.tensor([p], device=dev)
        q = randn(g, 1, H * DI, device=dev)
        w = randn(g, 1, H, device=dev)
        sr = K.index_scores_reference(q, w, keys, pos, wscale)
        got = {}
        runs = [(t, min(K.SCORES_STAGES, t), K.SCORES_WARPS, K.INDEX_SCORES_TRANS) for t in tiles]
        for r in runs + list(configs):
            s = poisoned(1, n, device=dev)
            K.index_scores(q, w, keys, pos, wscale, out=s, tiles=r[0], stages=r[1], warps=r[2],
                           trans=r[3])
            first = got.setdefault(r[3], (r, s))
            assert torch.equal(s, first[1]), f"index scores p={p}: {r} differ from {first[0]}"
        for _, s in got.values():
            assert_bf16_close(s, sr, f"index scores p={p}")


# ---- Attention decode: fused (dsv4.backend.fused.attention) vs torch -------------------------

def clone_state(st):
    """A deep copy of a LayerState."""
    comp = lambda c: None if c is None else type(c)(kv=c.kv.clone(), score=c.score.clone())
    return type(st)(kv_cache=st.kv_cache.clone(), compressor=comp(st.compressor),
                    index_cache=None if st.index_cache is None else st.index_cache.clone(),
                    index_compressor=comp(st.index_compressor))


def check_attention_decode(dev, g, capacity=64, steps=36, layers=(0, 1, 2), seed=0):
    """Consecutive decode steps after a short prefill: the attention output (wo_a input) within
    the bf16 rounding of the two softmaxes, wo_a of the fused path's own output within bf16
    rounding, the layer output within the FP8 act-quant of wo_b (a 1-ulp input change can move an
    e4m3 step), and the caches and compressor states of the two paths agree (states to float32
    summation order)."""
    from dsv4.backend.binding import bind_attention
    from dsv4.backend.fused import attention as FA
    from dsv4.backend.ops import Ops
    from dsv4.model.attention import Attention
    from dsv4.model.state import LayerState
    from dsv4.numerics.quant import hadamard_matrix
    from dsv4.weights.device_weights import DeviceWeights
    from helpers import SMALL
    cfg = SMALL.replace(index_topk=capacity // 4)      # select every visible entry: no near-ties
    src = DeviceWeights(cfg, seed)
    had = hadamard_matrix(cfg.index_head_dim, dev)
    ops = Ops.for_device(dev, cfg=cfg)
    fused_out = FA.project_out
    try:
        for l in layers:
            r = cfg.ratio(l)
            attn = Attention(cfg, r, "fp8", dev, had)
            bind_attention(attn, ops)        # the device's own choice for the sublayers inside
            for name, dst in attn.tensors(f"layers.{l}.attn").items():
                src.load_into(name, dst)
            seen, outs, ref = [], [], []
            wo_b, project = attn.wo_b, attn.project_out
            attn.wo_b = lambda z, act: (seen.append(z), wo_b(z, act))[1]
            # the attention output (wo_a's input) of each path: torch (project_out, while in the
            # torch path) and fused (the fused project_out)
            attn.project_out = lambda o, *a: ((outs.append(o.reshape(1, -1)) if ref else None),
                                              project(o, *a))[1]
            FA.project_out = lambda a, ops_, o, rows=False, **kw: (
                outs.append(o.reshape(1, -1)), ref.clear(), fused_out(a, ops_, o, rows, **kw))[2]
            G = cfg.o_groups
            wo_a = attn.wo_a.dense(torch.float32).view(G, cfg.o_lora_rank, -1)
            st_r = LayerState.allocate(cfg, r, capacity, torch.bfloat16, dev)
            s0 = int(torch.randint(1, 7, (1,), generator=g))
            with torch.inference_mode():
                attn.prefill(randn(g, s0, cfg.dim, device=dev), st_r)
                st_f = clone_state(st_r)
                for p in range(s0, min(s0 + steps, capacity)):
                    x, pos = randn(g, 1, cfg.dim, device=dev), torch.tensor([p], device=dev)
                    ref.append(True)
                    y_r = attn.decode_one(x, pos, st_r)
                    ref.clear()
                    y_f = FA.decode_rows(attn, ops, x, pos, st_f)
                    (o_r, o_f), z_f = outs[-2:], seen[-1]
                    what = f"Attention.decode layer {l} (r={r}) p={p}"
                    vis = [st_r.kv_cache[:min(p + 1, cfg.window_size)]]
                    if r:
                        vis.append(st_r.kv_cache[cfg.window_size:][:(p + 1) // r])
                    assert_attention_close(o_f, o_r, torch.cat(vis), what + " attention output")
                    z_ref = torch.einsum("sgd,grd->sgr", o_f.float().view(1, G, -1), wo_a).flatten(1)
                    assert_bf16_close(z_f, z_ref, what + " wo_a", ulps=4)
                    rel = (y_f.float() - y_r.float()).norm() / y_r.float().norm()
                    assert rel <= 0.05, f"{what}: output rel. error {rel:.3g}"
            scratch = -1 if r else None
            assert_quant_close(st_f.kv_cache[:scratch], st_r.kv_cache[:scratch], "kv_cache", 3)
            if r == 4:
                assert_quant_close(st_f.index_cache[:-1], st_r.index_cache[:-1], "index_cache", 1)
            for c in ("compressor", "index_compressor"):
                a, b = getattr(st_f, c), getattr(st_r, c)
                if a is not None:
                    # the fused path computes the projections in one multi-matrix launch: float32
                    # summation order differs from the torch path's separate linears
                    torch.testing.assert_close(a.kv, b.kv, rtol=1e-5, atol=1e-5, msg=c)
                    torch.testing.assert_close(a.score, b.score, rtol=1e-5, atol=1e-5, msg=c)
    finally:
        FA.project_out = fused_out


def check_attention_decode_rows(dev, g, capacity=64, seed=0):
    """Attention.decode_rows of T rows (the speculative verify rows: index query, scores, top-k,
    prep and attention in one launch each) == T one-row decode_rows calls, bit for bit: the layer
    output and every state tensor, for each compress ratio, with the ring wrapping inside the
    rows."""
    from dsv4.backend.binding import bind_attention
    from dsv4.backend.fused import attention as FA
    from dsv4.backend.ops import Ops
    from dsv4.model.attention import Attention
    from dsv4.model.state import LayerState
    from dsv4.numerics.quant import hadamard_matrix
    from dsv4.weights.device_weights import DeviceWeights
    from helpers import SMALL
    cfg = SMALL.replace(index_topk=4)          # fewer than the visible entries: a real top-k
    ops = Ops.for_device(dev, cfg=cfg)
    src = DeviceWeights(cfg, seed)
    had = hadamard_matrix(cfg.index_head_dim, dev)
    for l in (0, 1, 2):
        r = cfg.ratio(l)
        attn = Attention(cfg, r, "fp8", dev, had)
        bind_attention(attn, ops)
        for name, dst in attn.tensors(f"layers.{l}.attn").items():
            src.load_into(name, dst)
        st = LayerState.allocate(cfg, r, capacity, torch.bfloat16, dev)
        with torch.inference_mode():
            attn.prefill(randn(g, 13, cfg.dim, device=dev), st)
            for T, p in ((2, 13), (4, 15), (3, 30)):
                a, b = clone_state(st), clone_state(st)
                x = randn(g, T, cfg.dim, device=dev)
                y = FA.decode_rows(attn, ops, x, torch.tensor([p], device=dev), b)
                ones = [FA.decode_rows(attn, ops, x[t:t + 1], torch.tensor([p + t], device=dev), a)
                        for t in range(T)]
                what = f"Attention.decode_rows layer {l} (r={r}) T={T} p={p}"
                assert torch.equal(y, torch.cat(ones)), what
                for f in ("kv_cache", "index_cache"):
                    if getattr(a, f) is not None:
                        assert torch.equal(getattr(a, f), getattr(b, f)), f"{what}: {f}"
                for c in ("compressor", "index_compressor"):
                    if getattr(a, c) is not None:
                        assert torch.equal(getattr(a, c).kv, getattr(b, c).kv), f"{what}: {c}"
                        assert torch.equal(getattr(a, c).score, getattr(b, c).score), what


# ---- the interpreter (CPU) -------------------------------------------------------------------

def _interp_main(group: str, seed: int) -> None:
    from helpers import SMALL
    g = torch.Generator().manual_seed(seed)
    if group == "kernels":
        for ratio in (0, 4):
            check_prep("cpu", g, SMALL, ratio, (0, 17, 63, 4095))
        from dsv4.kernels.decode.attention import AttnConfig
        split = AttnConfig(rows_per_split=16, hc=2, bd=32)     # force split-K + combine
        for ratio in (0, 4, 16):
            check_attention("cpu", g, SMALL, ratio, 64, SMALL_POS, configs=(None, split))
            check_attention_rows("cpu", g, SMALL, ratio, 64, (0, 14, 29, 60), configs=(None, split))
        check_compressor("cpu", g, SMALL, 4, SMALL.head_dim, False, 64, (0, 40), 12)
        check_compressor("cpu", g, SMALL, 16, SMALL.head_dim, False, 64, (0,), 34)
        check_compressor("cpu", g, SMALL, 4, SMALL.index_head_dim, True, 64, (0, 52), 12)
        check_compressor_rows("cpu", g, SMALL, 4, SMALL.head_dim, False, 64, (2, 5), (2, 4))
        check_compressor_rows("cpu", g, SMALL, 16, SMALL.head_dim, False, 64, (13,), (3, 4))
        check_compressor_rows("cpu", g, SMALL, 4, SMALL.index_head_dim, True, 64, (1,), (3,))
        check_indexer("cpu", g, SMALL, 64, (0, 3, 17, 33, 40, 63))   # visible 0 .. 16 > topk 8
        # visible 0, 1, 256 (a 4-tile program's edge), 275, 600 (all), past the cache
        check_index_tiles("cpu", g, SMALL.index_n_heads, SMALL.index_head_dim, 600,
                          (0, 3, 1023, 1100, 2399, 5000),
                          configs=((4, 2, 8, False), (4, 2, 4, True), (1, 1, 4, True)))
    else:
        check_attention_decode("cpu", g, seed=seed % 7)
        check_attention_decode_rows("cpu", g, seed=seed % 7)
    print("ok")


def _run_interp(group: str, seed: int) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"), str(REPO / "tests/dsv4/kernels")]))
    code = "import sys, test_attention_kernels as T; T._interp_main(sys.argv[1], int(sys.argv[2]))"
    p = subprocess.run([sys.executable, "-c", code, group, str(seed)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "ok" in p.stdout, \
        f"seed {seed}:\n{p.stdout[-2000:]}{p.stderr[-4000:]}"


# Fixed inputs, so that CI is repeatable. Each group runs one seed: the kernel group seed 1, the
# decode group (Attention.decode fused vs torch) 40578, the case where the online softmax's
# rounding moved the output most (layer 2, an r = 16 emission step: the new compressed row takes
# the max). Both groups ran both seeds; a seed draws the values (and the decode group's prefill
# lengths, 1-6 either way), while the positions, ratios, row counts, steps and configs are fixed
# (every mask, ring wrap, emission, split-K and tile path is reached whatever the seed), and each
# second draw cost 19-31 s of the suite's time on a 2-core CPU (DSV4_TEST_SEED=random draws
# others). DSV4_TEST_SEED replaces each group's seed with its one seed. Each group is a test of
# its own (one process), so that pytest-xdist's workers share them.
INTERP_SEEDS = {"kernels": 1, "decode": 40578}


def _interp_seed(group: str) -> int:
    """The group's interpreter seed, or DSV4_TEST_SEED's."""
    if not os.environ.get("DSV4_TEST_SEED"):
        return INTERP_SEEDS[group]
    return input_seed(0)


@needs_interpreter
@pytest.mark.parametrize("group", ["kernels"], ids=[f"seed{INTERP_SEEDS['kernels']}"])
def test_attention_kernels_interpreter(group):
    _run_interp(group, _interp_seed(group))


@needs_interpreter
@pytest.mark.parametrize("group", ["decode"], ids=[f"seed{INTERP_SEEDS['decode']}"])
def test_attention_decode_fused_interpreter(group):
    _run_interp(group, _interp_seed(group))


# ---- CUDA: real shapes, graph capture, kernel counts and timing ---------------------------------

REAL_POS = (0, 5, 127, 128, 1000, 2047, 2048, 4095)


@pytest.mark.cuda
@pytest.mark.parametrize("preset", ["flash", "pro"])
@pytest.mark.parametrize("capacity", [4096, 65536])
def test_attention_kernels_cuda_real_shapes(preset, capacity):
    from dsv4.weights.presets import PRESETS
    cfg = PRESETS[preset]
    g = torch.Generator().manual_seed(input_seed(7))
    pos = tuple(p for p in REAL_POS + (capacity - 1,) if p < capacity)
    for ratio in (0, 4):
        check_prep("cuda", g, cfg, ratio, pos)
    for ratio in (0, 4, 128):
        check_attention("cuda", g, cfg, ratio, capacity, pos)
        check_attention_rows("cuda", g, cfg, ratio, capacity, (0, 126, 4093), Ts=(2, 4))
    check_compressor("cuda", g, cfg, 4, cfg.head_dim, False, capacity, (0, capacity - 9), 9)
    check_compressor("cuda", g, cfg, 4, cfg.index_head_dim, True, capacity, (0, capacity - 9), 9)
    check_compressor("cuda", g, cfg, 128, cfg.head_dim, False, capacity, (capacity - 130,), 130)
    check_compressor_rows("cuda", g, cfg, 4, cfg.head_dim, False, capacity, (2, 5), (2, 3, 4))
    check_compressor_rows("cuda", g, cfg, 4, cfg.index_head_dim, True, capacity, (2,), (2, 4))
    check_compressor_rows("cuda", g, cfg, 128, cfg.head_dim, False, capacity, (126,), (2, 4))
    check_indexer("cuda", g, cfg, capacity, pos)


def test_attention_plan_splits_stay_bounded():
    """Every launch plan's splits stop at MAX_SPLITS (the combine unrolls them: a 16-head rank's
    254 at 1M tokens made a kernel that did not compile in minutes), and attn_config's pick for a
    ratio-128 layer at 1M tokens takes at most 66 splits a head block at every head count."""
    from dsv4.kernels.decode.attention import MAX_SPLITS, AttnConfig, attn_config, plan_attention
    for heads in (8, 16, 32, 64, 128):
        for n in (0, 1, 512, 2048, 4096, 8125, 65_000):
            for c in (None, AttnConfig(), AttnConfig(hb=16, bn=16, rows_per_split=16,
                                                     max_programs=1024)):
                pl = plan_attention(heads, 512, 128, n, c)
                assert 1 <= pl["nsplit"] <= MAX_SPLITS, (heads, n, c, pl)
                assert pl["nsplit"] * pl["bps"] >= 128 // pl["bn"] + -(-n // pl["bn"])
        pl = plan_attention(heads, 512, 128, 8125)
        assert pl["nsplit"] <= 66 and attn_config(heads, 8125).num_warps == 8, (heads, pl)
    assert attn_config(64, 512) == AttnConfig() and attn_config(16, 2048) == AttnConfig()


@pytest.mark.cuda
@pytest.mark.parametrize("heads", [16, 32, 64, 128])
def test_attention_long_context_config_cuda(heads):
    """A ratio-128 layer at ~1M tokens takes attn_config's long-context tiles (64-row tiles, 8
    warps, 16 or 32 heads a program, at most 66 splits a head block) at Flash's heads, a
    tensor-parallel rank's (32, 16) and Pro's (128): against the reference and run twice; Flash's
    also beside the default config, and for verify rows."""
    from dataclasses import replace

    from dsv4.kernels.decode.attention import AttnConfig, attn_config, plan_attention
    from dsv4.weights.presets import PRESETS
    cfg = replace(PRESETS["flash"], n_heads=heads)
    capacity = 1_040_000
    n = capacity // 128
    assert attn_config(heads, n) != AttnConfig()
    assert plan_attention(heads, cfg.head_dim, cfg.window_size, n)["nsplit"] <= 66
    g = torch.Generator().manual_seed(input_seed(11))
    pos = (0, 4095, 600_000, capacity - 1)
    check_attention("cuda", g, cfg, 128, capacity, pos,
                    configs=(None, AttnConfig()) if heads == 64 else (None,))
    if heads == 64:
        check_attention_rows("cuda", g, cfg, 128, capacity, (capacity - 5,), Ts=(2,))


@pytest.mark.cuda
def test_index_scores_tiles_cuda_long_cache():
    """A long cache (~800K positions at ratio 4) at Flash's indexer shape: the default takes 4
    tiles a program there, and 1, 2, 4 tiles, and pipelines of 2-4 tiles in flight on 4 or 8
    warps, give the same bits within bf16 rounding of the reference."""
    from dsv4.kernels.decode.indexer import SCORES_SUB, scores_tiles
    from dsv4.weights.presets import PRESETS
    cfg, n = PRESETS["flash"], 200_003
    assert scores_tiles(n) == SCORES_SUB and scores_tiles(4096) == 1
    g = torch.Generator().manual_seed(input_seed(11))
    check_index_tiles("cuda", g, cfg.index_n_heads, cfg.index_head_dim, n,
                      (0, 4000, 399_999, 800_011, 10 ** 6),
                      configs=((4, 2, 4, False), (8, 3, 8, False), (16, 4, 4, False), (4, 1, 4, True),
                               (8, 3, 8, True), (4, 3, 4, True)))


@pytest.mark.cuda
def test_attention_decode_fused_cuda():
    g = torch.Generator().manual_seed(input_seed(40578))
    check_attention_decode("cuda", g, capacity=256, steps=60)


def _flash_layer(ratio: int, capacity: int, dev="cuda"):
    from dsv4.backend.binding import bind_attention
    from dsv4.backend.ops import Ops
    from dsv4.model.attention import Attention
    from dsv4.model.state import LayerState
    from dsv4.numerics.quant import hadamard_matrix
    from dsv4.weights.device_weights import DeviceWeights
    from dsv4.weights.presets import FLASH
    l = FLASH.compress_ratios.index(ratio)
    attn = Attention(FLASH, ratio, "fp8", dev, hadamard_matrix(FLASH.index_head_dim, dev))
    bind_attention(attn, Ops.for_device(dev, cfg=FLASH))
    DeviceWeights(FLASH, 0).load_many(attn.tensors(f"layers.{l}.attn").items(), progress=False)
    return attn, LayerState.allocate(FLASH, ratio, capacity, torch.bfloat16, dev)


@pytest.mark.cuda
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_attention_decode_fused_graph_capture(ratio):
    """The fused decode captures (no host sync) and replays like eager at moving positions."""
    attn, st = _flash_layer(ratio, 4096)
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    pos = torch.tensor([600], device="cuda")
    with torch.inference_mode():
        graph, y = capture_step(lambda: attn.decode(x, pos, st))
        for p in range(601, 640):
            pos.fill_(p)
            x.normal_()
            twin = clone_state(st)
            graph.replay()
            eager = attn.decode(x, pos, twin)
            assert torch.equal(y, eager), f"graph replay differs from eager at p={p}"
            for (k, v), w in zip(st.buffers().items(), twin.buffers().values()):
                assert torch.equal(v, w), f"state {k} differs after replay at p={p}"


@pytest.mark.cuda
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_attention_decode_bench(ratio):
    """Flash layer, 64K capacity, position 60000 (random state): kernels per attention decode and
    the time of one graph replay, torch path vs fused (printed with -s). Fused launches fewer."""
    import statistics

    from dsv4.bench.common import count_kernels, time_steps
    attn, st = _flash_layer(ratio, 65536)
    for t in st.buffers().values():
        t.normal_()
    dev = [torch.device("cuda")]
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    pos = torch.tensor([60000], device="cuda")
    res = {}
    with torch.inference_mode():
        for fused in (False, True):
            step = attn.decode_rows if fused else attn.decode_one     # bound: the fused path
            graph, _ = capture_step(lambda: step(x, pos, st), strict=False)
            n = count_kernels(lambda: step(x, pos, st), dev)
            res[fused] = (n, statistics.median(time_steps(graph.replay, 200, dev)) * 1e3)
    print(f"\nattention decode r={ratio}: torch {res[False][0]} kernels {res[False][1]:.1f} us | "
          f"fused {res[True][0]} kernels {res[True][1]:.1f} us (graph replay, median of 200)")
    assert res[True][0] < res[False][0]
