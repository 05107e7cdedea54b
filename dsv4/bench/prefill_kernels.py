"""Microbenchmark of the prefill GEMMs at a preset's real shapes: the routed experts' up and down for a
chunk of T tokens (uniform random routing, k experts each), the largest FP8 linear (wq_b) and the
grouped wo_a, over tile, K-step, warp and tensor-core-path variants. CUDA events, median of REPS
after warm-up; achieved TFLOP/s and the weight bytes read per second. The model's defaults come
from this sweep (prefill_gemm.BK16, pick_bm, MMA; BENCHMARKS.md).
Run: `python -m dsv4.bench.prefill_kernels [flash|pro] [T,T,...] [hot,hot,...]` (hot: see moe_rows;
DSV4_BENCH_QUICK=1: the QUICK variants only; DSV4_BENCH_ONLY=attn: the chunk's sparse attention
instead, `attn_rows`, with DSV4_BENCH_HEADS=64,32,16 for those query heads (a TP rank's share);
all read by main only).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys

import torch

from ..kernels.prefill import gemm as G
from ..kernels.prefill import moe as M
from ..weights.presets import get_preset

REPS = 10
# DSV4_BENCH_QUICK=1: the variants (path, bm, bk, bn, warps, stages) the defaults pick between
QUICK = [("bf16", 128, 64, 64, 4, 3), ("bf16", 128, 64, 64, 4, 2), ("bf16", 128, 64, 64, 4, 4),
         ("bf16", 128, 32, 64, 4, 3), ("bf16", 128, 64, 128, 8, 3), ("bf16", 128, 128, 128, 8, 3),
         ("bf16", 128, 64, 32, 4, 3), ("bf16", 64, 64, 64, 4, 3)]


def _time(fn) -> float:
    for _ in range(2):
        fn()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
           for _ in range(REPS)]
    for a, b in evs:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in evs)


def _bank(E, n, k, gen, dev):
    """A random FP4 bank [E, n, k/2] + scales [E, n, k/32] (scales near 2^-8, e2m1 codes random)."""
    w = torch.randint(-128, 128, (E, n, k // 2), dtype=torch.int8, device=dev, generator=gen)
    s = torch.randint(118, 124, (E, n, k // 32), dtype=torch.uint8, device=dev, generator=gen)
    return w, s.view(torch.float8_e8m0fnu)


def moe_rows(cfg, T, dev, gen, hot=0, quick=False):
    """The routed up / down of T tokens over the tile / path variants; hot > 0: every token
    routes among the first `hot` experts only (the model bench's device-generated router
    concentrates a 4096-token chunk on 17-68 experts per layer); quick: the QUICK variants only."""
    E, k, D, I = cfg.n_routed_experts, cfg.n_activated_experts, cfg.dim, cfg.moe_inter_dim
    w1, s1 = _bank(E, I, D, gen, dev)
    w3, s3 = _bank(E, I, D, gen, dev)
    w2, s2 = _bank(E, D, I, gen, dev)
    x = torch.randn(T, D, device=dev, generator=gen).bfloat16()
    idx = torch.rand(T, hot or E, device=dev, generator=gen).topk(k, dim=-1).indices.sort(-1).values
    wt = torch.rand(T, k, device=dev, generator=gen)
    hit = int(torch.unique(idx).numel())
    flops_up, flops_down = 2 * 2 * T * k * I * D, 2 * T * k * I * D
    up_bytes = hit * 2 * (I * D // 2 + I * D // 32)
    down_bytes = hit * (D * I // 2 + D * I // 32)
    xq, (x8, xs) = G.act_quant(x), G.act_quant8(x)
    a16 = torch.empty(T * k, I, dtype=torch.bfloat16, device=dev)
    a8 = torch.empty(T * k, I, dtype=torch.uint8, device=dev)
    a_s = torch.empty(T * k, I // 128, dtype=torch.float32, device=dev)
    o = torch.empty(T * k, D, dtype=torch.bfloat16, device=dev)
    variants = [("bf16", bm, bk, bn, w, 3) for bm in (16, 32, 64, 128) for bk in (64, 128)
                for bn in (64, 128) for w in (4, 8) if not (bm == 128 and bn == 128)]
    variants += [("fp8", bm, 32, 128, w, 3) for bm in (16, 32, 64) for w in (4, 8)]
    if quick:
        variants = QUICK
    rows = []
    per = T * k / (hot or E)
    for path, bm, bk, bn, warps, stages in variants:
        if (per > 4 * bm and bm < 64) or per < bm / 4:
            continue                            # tiles far from the rows per expert
        plan = M.expert_plan(idx, wt, E, bm=bm)
        kw = dict(bm=bm, tiles=(plan.tile_e, plan.tile_r), grid_m=plan.n_tiles, warps=warps)
        if path == "bf16":                      # bn 64: the act quant in a launch of its own
            def up():
                G.gemm16(xq, w1, s1, "fp4", a16, rows=plan.token, w3=w3, s3=s3, rw=plan.weight,
                         limit=10.0, quant=bn == 128, bk=bk, bn=bn, stages=stages, **kw)
                if bn != 128:
                    G.act_quant(a16)

            def down():
                G.gemm16(a16, w2, s2, "fp4", o, bk=bk, bn=bn, stages=stages, **kw)
        else:
            def up():
                G.gemm8(x8, xs, w1, s1, "fp4", a8, rows=plan.token, w3=w3, s3=s3,
                        rw=plan.weight, limit=10.0, out_scale=a_s, **kw)

            def down():
                G.gemm8(a8, a_s, w2, s2, "fp4", o, **kw)
        try:
            tu, td = _time(up), _time(down)
        except Exception as e:                  # a config the compiler rejects
            print(f"  {path} bm={bm} bk={bk} bn={bn} warps={warps}: {type(e).__name__}",
                  file=sys.stderr)
            continue
        rows.append((f"moe T={T}", path, bm, f"{bk}/{bn}/{stages}", warps, tu, td,
                     flops_up / tu / 1e9,
                     flops_down / td / 1e9, up_bytes / tu / 1e6, down_bytes / td / 1e6))
    return rows, hit


def linear_rows(cfg, T, dev, gen):
    N, K = cfg.n_heads * cfg.head_dim, cfg.q_lora_rank
    from ..weights.formats import quantize_fp8_weight
    w, s = quantize_fp8_weight(torch.randn(N, K, device=dev, generator=gen) * 0.05)
    x = torch.randn(T, K, device=dev, generator=gen).bfloat16()
    out = torch.empty(T, N, dtype=torch.bfloat16, device=dev)
    rows = []
    x8, xs = G.act_quant8(x)
    xq = G.act_quant(x)
    for bm in (64, 128):
        for warps in (4, 8):
            if bm == 64:
                t = _time(lambda: G.gemm8(x8, xs, w, s, "fp8", out, bm=bm, warps=warps,
                                          cublas=False))
                rows.append((f"wq_b T={T}", "fp8", bm, "128", warps, t, 0.0,
                             2 * T * N * K / t / 1e9, 0.0, N * K / t / 1e6, 0.0))
            for bk in (64, 128):
                t = _time(lambda: G.gemm16(xq, w, s, "fp8", out, bm=bm, bk=bk, warps=warps))
                rows.append((f"wq_b T={T}", "bf16", bm, str(bk), warps, t, 0.0,
                             2 * T * N * K / t / 1e9, 0.0, N * K / t / 1e6, 0.0))
    if G.scaled_mm_ok(x8, w, out):              # torch._scaled_mm's blockwise recipe
        t = _time(lambda: G.scaled_mm(x8, xs, w, s, out))
        rows.append((f"wq_b T={T}", "cubl", 0, "128", 0, t, 0.0, 2 * T * N * K / t / 1e9, 0.0,
                     N * K / t / 1e6, 0.0))
    return rows


def wo_a_rows(cfg, T, dev, gen):
    """The grouped wo_a over T rows (FP8 weights on unquantized bf16 rows): the bf16-MMA GEMM
    with the weights decoded in registers, against grouped_dense (the weights dequantized to
    bf16, exact, then cuBLAS; dequantization included)."""
    from ..weights.formats import quantize_fp8_weight
    G_, R = cfg.o_groups, cfg.o_lora_rank
    K = cfg.n_heads * cfg.head_dim // G_
    w, s = quantize_fp8_weight(torch.randn(G_ * R, K, device=dev, generator=gen) * 0.05)
    o = torch.randn(T, G_ * K, device=dev, generator=gen).bfloat16()
    out = torch.empty(T, G_ * R, dtype=torch.bfloat16, device=dev)
    flops = 2 * T * G_ * R * K
    rows = []
    for bm, bn, bk, warps in ((128, 128, 64, 4), (128, 128, 128, 8), (128, 128, 64, 8)):
        t = _time(lambda: G.gemm16(o, w, s, "fp8", out, bm=bm, bn=bn, bk=bk, warps=warps,
                                   group_k=K))
        rows.append((f"wo_a T={T}", "bf16", bm, f"{bk}/{bn}", warps, t, 0.0, flops / t / 1e9,
                     0.0, w.numel() / t / 1e6, 0.0))

    t = _time(lambda: G.grouped_dense(o, w, s, "fp8", K, out))
    rows.append((f"wo_a T={T}", "cubl", 0, "-", 0, t, 0.0, flops / t / 1e9, 0.0,
                 w.numel() / t / 1e6, 0.0))
    return rows


def attn_rows(cfg, T, dev, gen):
    """The chunk's sparse attention (attention_prefill) for T queries at position 0, as the model
    builds its rows: the window (old ring rows masked), then for ratio 4 the indexer's top-k of
    random scores (best first, -1 where not yet visible), for ratio 128 every entry masked by
    position; over head-block / rows / warps / stages variants. TFLOP/s over the valid rows."""
    from ..kernels.prefill.attention import sparse_attention_rows
    from ..model.attention import window_indices
    from ..numerics.rope import rope_frequencies
    from ..numerics.sparse import topk_lowest
    H, Dh, W = cfg.n_heads, cfg.head_dim, cfg.window_size
    freqs = rope_frequencies(cfg, 4).to(dev)
    pos0 = torch.zeros(1, dtype=torch.int64, device=dev)
    q = torch.randn(T, H, Dh, device=dev, generator=gen).bfloat16()
    sink = torch.randn(H, device=dev, generator=gen)
    rows = []
    vis_q = (torch.arange(T, device=dev) + 1).unsqueeze(1)
    for r in (4, 128):
        n = T // r
        kv = torch.randn(W + T + n, Dh, device=dev, generator=gen).bfloat16()
        win = window_indices(0, T, W, dev)
        cols = torch.arange(n, device=dev)
        if r == 4:
            sc = torch.rand(T, n, device=dev, generator=gen).masked_fill(cols >= vis_q // r,
                                                                         float("-inf"))
            top = topk_lowest(sc, min(cfg.index_topk, n))
            comp = torch.where(top >= vis_q // r, -1, top + W + T)
        else:
            comp = torch.where(cols < vis_q // r, cols + W + T, -1)
        idx = torch.cat((win, comp), -1).to(torch.int32)
        valid = int((idx >= 0).sum())
        flops = 4 * H * Dh * valid
        ref = None
        for hb, bn, warps, stages in ((16, 32, 4, 3), (16, 64, 4, 2), (32, 32, 4, 3), (32, 64, 4, 2),
                                      (32, 64, 8, 2), (64, 32, 8, 2), (64, 64, 8, 2),
                                      (64, 64, 8, 3), (64, 64, 16, 2)):
            if hb > max(H, 16):         # sparse_attention_rows takes min(hb, H): a repeat
                continue
            def fn():
                return sparse_attention_rows(q, kv, idx, sink, Dh ** -0.5, freqs, pos0,
                                             config=(hb, bn, warps, stages))
            try:
                t = _time(fn)
            except Exception as e:              # a config the compiler rejects
                print(f"  attn hb={hb} rows={bn}: {type(e).__name__}", file=sys.stderr)
                continue
            o = fn().float()
            ref = o if ref is None else ref
            diff = (o - ref).abs().max().item()
            rows.append((f"attn r{r} H={H}", f"h{hb}", bn, f"{stages}/{diff:.0e}", warps, t, 0.0,
                         flops / t / 1e9, 0.0, valid / T, 0.0))
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = get_preset(argv[0] if argv else "flash")
    tokens = [int(t) for t in argv[1].split(",")] if len(argv) > 1 else [128, 4096]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"{'case':<12}{'path':>5}{'bm':>5}{'bk/bn/st':>12}{'warps':>6}{'up ms':>9}{'down ms':>9}"
          f"{'up TF/s':>9}{'dn TF/s':>9}{'up GB/s':>9}{'dn GB/s':>9}")
    hots = [int(h) for h in argv[2].split(",")] if len(argv) > 2 else [0]
    quick = bool(os.environ.get("DSV4_BENCH_QUICK"))
    attn = os.environ.get("DSV4_BENCH_ONLY") == "attn"
    for T in tokens:
        for hot in hots:
            rows, hit = ([], 0) if attn else moe_rows(cfg, T, dev, gen, hot, quick)
            if attn:
                heads = os.environ.get("DSV4_BENCH_HEADS", str(cfg.n_heads)).split(",")
                rows, hit = [r for h in heads for r in attn_rows(
                    dataclasses.replace(cfg, n_heads=int(h)), T, dev, gen)], 0
            elif not hot:
                rows += linear_rows(cfg, T, dev, gen) + wo_a_rows(cfg, T, dev, gen)
            print(f"# T={T}: {hit} experts hit")
            for r in sorted(rows, key=lambda r: (r[0], r[5] + r[6])):
                print(f"{r[0]:<12}{r[1]:>5}{r[2]:>5}{str(r[3]):>12}{r[4]:>6}{r[5]:>9.3f}"
                      f"{r[6]:>9.3f}{r[7]:>9.0f}{r[8]:>9.0f}{r[9]:>9.0f}{r[10]:>9.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
