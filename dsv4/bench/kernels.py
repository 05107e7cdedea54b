"""Microbenchmark of the decode GEMV / expert kernels at the real Flash / Pro shapes on CUDA: each
kernel in a CUDA graph (rotating weight copies so L2 does not serve them) vs the measured copy
bandwidth and vs the torch path; and the indexer's selection of a decode row (its scores against
the index cache, their top-k) and a ratio-128 layer's attention at a 4K and a 1M-token context.
Run: `python scripts/bench_kernels.py [--preset pro] [--sweep]`.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from ..kernels.common import INDEX_SCORES_TRANS, Config, CudaConfig
from ..kernels.cuda.bf16 import Bf16CudaConfig
from ..kernels.cuda.bf16 import fits as bf16_cuda_fits
from ..kernels.cuda.experts import (
    CUDA_DOWN_VARIANTS,
    CUDA_UP_VARIANTS,
    TUNED_CUDA_UP,
    ExpertCudaConfig,
    cuda_down_config,
    cuda_expert_config,
    cuda_spw_fits,
    down_all_variants,
    down_ring_variants,
    up_stream_variants,
    up_wg_variants,
)
from ..kernels.cuda.fp8 import cuda_config, mma_config, mma_configs, mma_stream_configs
from ..kernels.decode.bf16_linear import bf16_config, bf16_linear
from ..kernels.decode.fp4_experts import (
    down_config,
    fp4_experts_down,
    fp4_experts_up,
    up_config,
)
from ..kernels.decode.fp8_linear import fp8_config, fp8_linear, fp8_swiglu
from ..kernels.decode.indexer import (
    SCORES_STAGES,
    SCORES_WARPS,
    index_scores,
    index_scores_reference,
    index_topk,
    scores_tiles,
)
from ..numerics.quant import fp8_quant_dequant
from ..numerics.sparse import topk_lowest
from ..weights.formats import dequantize_fp4_weight, dequantize_fp8_weight
from ..weights.presets import get_preset

L2_SAFE_BYTES = 128 << 20    # below this, rotate weight copies (H100/H200 L2 is 50-60 MB)
ROTATE_BYTES = 256 << 20     # the copies of one case span at least this much
MAX_COPIES = 64


@dataclass
class Case:
    """One benchmark row: make(copy, config) -> a call; torch(copy) -> the torch-path call."""
    name: str
    shape: str
    nbytes: int                                   # weight + scale bytes one call reads
    make: Callable
    config: Config | tuple
    torch: Callable | None = None
    copies: int = 1
    sweep: list = field(default_factory=list)     # alternative configs for --sweep
    cuda: object = None                           # the CUDA C++ kernel's config (None: no CUDA path)
    cuda_sweep: list = field(default_factory=list)


def n_copies(nbytes: int) -> int:
    if nbytes >= L2_SAFE_BYTES:
        return 1
    return min(MAX_COPIES, max(3, math.ceil(ROTATE_BYTES / nbytes)))


def copy_bandwidth(device, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), median of `reps` copies."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    return 2 * nbytes / statistics.median(ts)


def time_calls(calls: list, reps: int) -> tuple[float, float, float]:
    """Capture `calls` back to back in one CUDA graph (after a warm-up that compiles them), replay
    `reps` times; (median, min, max) microseconds per call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    for _ in range(3):
        g.replay()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / len(calls))
    del g
    return statistics.median(ts), min(ts), max(ts)


# ---- random weights in the stored formats, generated on the device ------------------------------

def _fp8(n, k, dev, gen):
    b = torch.randint(0, 256, (n, k), dtype=torch.uint8, device=dev, generator=gen)
    b[(b & 0x7F) == 0x7F] -= 1                                            # no NaN codes
    s = torch.randint(116, 121, (n // 128, k // 128), dtype=torch.uint8, device=dev, generator=gen)
    return b.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu)


def _fp4(E, n, k, dev, gen):
    w = torch.randint(-128, 128, (E, n, k // 2), dtype=torch.int8, device=dev, generator=gen)
    s = torch.randint(121, 126, (E, n, k // 32), dtype=torch.uint8, device=dev, generator=gen)
    return w, s.view(torch.float8_e8m0fnu)


def _x(k, dev, gen, dtype=torch.bfloat16, rows=1):
    return torch.randn(rows, k, device=dev, generator=gen).to(dtype)


def _neighbours(cfg: Config, bn_max: int = 128, prefetch=(False,)) -> list[Config]:
    out = []
    for bn in (cfg.bn // 2, cfg.bn, cfg.bn * 2):
        for nb in (cfg.nb // 2, cfg.nb, cfg.nb * 2):
            for nw in (4, 8):
                for pf in prefetch:
                    if 1 <= bn <= bn_max and 1 <= nb <= 32:
                        out.append(Config(bn, nb, nw, pf))
    return out


def _cuda_neighbours(cfg: CudaConfig | None, k: int, nm: int, div: int) -> list:
    """CUDA FP8 configs around cfg: rows per lane 1..16, chunks per lane 1-2, 8/16/32 lanes per row."""
    if cfg is None:
        return []
    out = []
    for lc in (32, 16, 8):
        for cpl in (1, 2):
            if (k // 16) % (lc * cpl):
                continue
            warps = k // 16 // (lc * cpl)
            for rpl in (1, 2, 4, 8, 16):
                if 1 <= warps <= 16 and rpl * cpl * nm <= 16 and div % ((32 // lc) * rpl) == 0:
                    out.append(CudaConfig(lc, rpl, cpl, warps))
    return out


def fp8_case(name, n, k, dev, gen, groups=1, dual=False) -> Case:
    nbytes = n * k * (2 if dual else 1) + (n // 128) * (k // 128) * (2 if dual else 1)
    copies = n_copies(nbytes)
    ws = [_fp8(n, k, dev, gen) for _ in range(copies * (2 if dual else 1))]
    x = _x(k * groups, dev, gen)
    gk = k if groups > 1 else None
    cfg = fp8_config(n, k, n // groups, dual)

    def make(c, config):
        if dual:
            (w1, s1), (w3, s3) = ws[2 * c], ws[2 * c + 1]
            return lambda: fp8_swiglu(x, w1, s1, w3, s3, 10.0, config=config)
        w, s = ws[c]
        return lambda: fp8_linear(x, w, s, quant_act=groups == 1, group_k=gk, config=config)

    def torch_path(c):
        if dual:
            (w1, s1), (w3, s3) = ws[2 * c], ws[2 * c + 1]

            def up():
                xq = fp8_quant_dequant(x, 128)
                g = F.linear(xq, dequantize_fp8_weight(w1, s1, torch.bfloat16)).float()
                u = F.linear(xq, dequantize_fp8_weight(w3, s3, torch.bfloat16)).float()
                return (F.silu(g.clamp(max=10.0)) * u.clamp(-10.0, 10.0)).to(torch.bfloat16)
            return up
        w, s = ws[c]
        if groups > 1:
            return lambda: torch.einsum("sgd,grd->sgr", x.view(1, groups, k),
                                        dequantize_fp8_weight(w, s, torch.bfloat16).view(groups, -1, k))
        return lambda: F.linear(fp8_quant_dequant(x, 128), dequantize_fp8_weight(w, s, torch.bfloat16))
    shape = f"[{n}, {k}]" + (f" G={groups}" if groups > 1 else "") + (" x2 (w1+w3)" if dual else "")
    ng = n // groups if groups > 1 else 0
    nm = 2 if dual else 1
    core = cuda_config(n, k, (n,), ng, nm)
    ccfg = mma_config(n, k, (n,), ng, nm, groups == 1, torch.bfloat16) or core  # the model's pick
    return Case(name, shape, nbytes, make, cfg, torch_path, copies,
                _neighbours(cfg, prefetch=(False, True)), ccfg,
                _cuda_neighbours(core, k, nm, math.gcd(128, n, *([ng] if ng else [])))
                + (mma_configs(k, nm) + mma_stream_configs(n, k, nm) if ng % 16 == 0 else []))


def bf16_case(name, n, k, dev, gen, x_dtype=torch.bfloat16, rows=1) -> Case:
    """rows: activation rows a launch (2: the speculative verify's head, the weight read once)."""
    nbytes = n * k * 2
    copies = n_copies(nbytes)
    ws = [(torch.randn(n, k, device=dev, generator=gen) / 64).to(torch.bfloat16)
          for _ in range(copies)]
    x = _x(k, dev, gen, x_dtype, rows)
    cfg = bf16_config(n, k)

    def torch_path(c):
        w = ws[c]
        if n > 16384:   # the model's chunked float32 head
            return lambda: torch.cat([x.float() @ w[i:i + 16384].float().T
                                      for i in range(0, n, 16384)], dim=1)
        return lambda: F.linear(x.float(), w.float())
    # the CUDA C++ kernel where the backend's head takes it (kernels/cuda/bf16.py); its sweep: the
    # fixed grid's CTAs (one to four an SM of an H100 / H200), which change no bit
    cuda = Bf16CudaConfig() if bf16_cuda_fits(n, k, rows, torch.float32, x_dtype) else None
    return Case(name, f"[{n}, {k}]", nbytes, lambda c, config: (lambda: bf16_linear(
        x, ws[c], config=config)), cfg, torch_path, copies, _neighbours(cfg, 16), cuda,
        [Bf16CudaConfig(c) for c in (132, 264, 396, 528)] if cuda else [])


def expert_cases(E, inter, dim, k, dev, gen) -> list[Case]:
    w1, s1 = _fp4(E, inter, dim, dev, gen)
    w3, s3 = _fp4(E, inter, dim, dev, gen)
    w2, s2 = _fp4(E, dim, inter, dev, gen)
    sets = [torch.randperm(E, device=dev, generator=gen)[:k].sort().values for _ in range(8)]
    x = _x(dim, dev, gen)
    rw = torch.rand(k, device=dev, generator=gen)
    a = torch.randn(k, inter, device=dev, generator=gen).to(torch.bfloat16)
    per = inter * dim // 2 + inter * dim // 32
    ucfg, dcfg = up_config(k, inter, dim), down_config(k, inter, dim)

    def up(c, config):
        return lambda: fp4_experts_up(x, sets[c], rw, w1, s1, w3, s3, 10.0, config=config)

    def down(c, config):
        return lambda: fp4_experts_down(a, sets[c], w2, s2, config=config)

    def step(c, config):
        cu, cd = config
        return lambda: fp4_experts_down(fp4_experts_up(x, sets[c], rw, w1, s1, w3, s3, 10.0,
                                                       config=cu), sets[c], w2, s2, config=cd)
    cu = cuda_expert_config(dim, TUNED_CUDA_UP, (k, inter, dim))
    cd = cuda_down_config(k, inter, dim)

    def esweep(kd, variants):
        return [ExpertCudaConfig(*v) for v in variants if cuda_spw_fits(kd, v[0])]

    def torch_step(c):
        idx = sets[c]

        def run():   # MoE.decode's per-expert loop over dequantized weights
            y = torch.zeros(1, dim, dtype=torch.float32, device=dev)
            xq = fp8_quant_dequant(x, 128)
            for j in range(k):
                e = idx[j:j + 1]
                d = [dequantize_fp4_weight(w.index_select(0, e), s.index_select(0, e),
                                           torch.bfloat16)[0] for w, s in ((w1, s1), (w3, s3), (w2, s2))]
                g = F.linear(xq, d[0]).float().clamp(max=10.0)
                u = F.linear(xq, d[1]).float().clamp(-10.0, 10.0)
                h = (rw[j:j + 1].unsqueeze(-1) * (F.silu(g) * u)).to(torch.bfloat16)
                y = y + F.linear(fp8_quant_dequant(h, 128), d[2]).float()
            return y
        return run
    shp = f"E={E} I={inter} D={dim} k={k}"
    return [Case("experts.up", shp, 2 * k * per, up, ucfg, None, len(sets), _neighbours(ucfg), cu,
                 esweep(dim, CUDA_UP_VARIANTS) + up_stream_variants(dim)
                 + up_wg_variants(inter, dim)),
            Case("experts.down", shp, k * per, down, dcfg, None, len(sets), _neighbours(dcfg), cd,
                 esweep(inter, CUDA_DOWN_VARIANTS) + down_all_variants(k, inter)
                 + down_ring_variants(k, inter)),
            Case("experts.step", shp, 3 * k * per, step, (ucfg, dcfg), torch_step, len(sets),
                 cuda=(cu, cd) if cu is not None and cd is not None else None)]


INDEX_CONTEXTS = (4096, 1_040_000)   # the bench's 4K and 1M contexts


def attention_cases(cfg, dev, gen, contexts=INDEX_CONTEXTS, tp: int = 1) -> list[Case]:
    """A ratio-128 layer's sparse attention of one decode row (the window and every visible
    compressed entry; the split pass and its combine; a rank's heads of tp) at each context, all
    entries visible: reads the window and context / 128 rows of the KV cache. config:
    attn_config's pick for those entries, the tile grid and the other pick swept (the splits and
    tiles change the merge order: each config is its own bits)."""
    from ..kernels.decode.attention import (
        LONG_ATTN_CONFIG,
        AttnConfig,
        attn_config,
        plan_attention,
        sparse_attention_decode,
    )
    from ..numerics.rope import rope_frequencies
    H, Dh, W, r = cfg.n_heads // tp, cfg.head_dim, cfg.window_size, 128
    freqs = rope_frequencies(cfg, r, dev)
    sink = torch.randn(H, device=dev, generator=gen)
    q = torch.randn(1, H * Dh, device=dev, generator=gen).to(torch.bfloat16)
    grid = [AttnConfig(hb=hb, bn=bn, rows_per_split=rps, num_warps=nw)
            for hb in (16, 32) for bn in (32, 64) for rps in (32, 64, 128) for nw in (4, 8)]
    cases = []
    for ctx in contexts:
        n = ctx // r
        base = attn_config(H, n)   # the library's pick for these entries
        sweep = [c for c in dict.fromkeys(grid + [AttnConfig(), LONG_ATTN_CONFIG]) if c != base]
        nbytes = (W + n) * Dh * 2
        copies = n_copies(nbytes)
        caches = [torch.randn(W + n + 1, Dh, device=dev, generator=gen).to(torch.bfloat16)
                  for _ in range(copies)]
        pos = torch.tensor([ctx - 1], device=dev)
        pl = plan_attention(H, Dh, W, n, base)
        cases.append(Case(
            "attention.r128", f"ctx {ctx}: {H} heads, {W} + {n} rows, {pl['nsplit']} splits",
            nbytes,
            lambda c, config, caches=caches, pos=pos, n=n: (lambda: sparse_attention_decode(
                q, caches[c], sink, pos, freqs, Dh ** -0.5, H, W, r, n, config=config)),
            base, None, copies, sweep))
    return cases


def index_cases(cfg, dev, gen, contexts=INDEX_CONTEXTS) -> list[Case]:
    """The indexer's selection of one decode row at each context (a ratio-4 layer:
    context / 4 cache entries, all visible): its scores against the index cache (reads the cache;
    config: the tiles a program, the tiles in flight, the warps, the orientation; swept), then
    their top-k (reads the scores the first wrote, which L2 holds as it does in the step; the CUDA
    radix select against torch's)."""
    H, DI, k = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    cases = []
    for ctx in contexts:
        n = ctx // 4
        nbytes = n * DI * 2
        copies = n_copies(nbytes)
        keys = [torch.randn(n, DI, device=dev, generator=gen).to(torch.bfloat16)
                for _ in range(copies)]
        q = torch.randn(1, H * DI, device=dev, generator=gen).to(torch.bfloat16)
        w = torch.randn(1, H, device=dev, generator=gen).to(torch.bfloat16)
        pos = torch.tensor([ctx - 1], device=dev)
        wscale = H ** -0.5 * DI ** -0.5
        name = f"ctx {ctx}: {n} entries"
        default = (scores_tiles(n), min(SCORES_STAGES, scores_tiles(n)), SCORES_WARPS,
                   INDEX_SCORES_TRANS)
        sweep = [(t, st, wp, tr) for t in (1, 4, 8) for st in (1, 2, 3) for wp in (4, 8)
                 for tr in (False, True) if (t, st, wp, tr) != default and st <= t]
        cases.append(Case(
            "index.scores", f"{name} x {H} heads", nbytes,
            lambda c, config, keys=keys, q=q, w=w, pos=pos: (lambda: index_scores(
                q, w, keys[c], pos, wscale, tiles=config[0], stages=config[1],
                warps=config[2], trans=config[3])),
            default,
            lambda c, keys=keys, q=q, w=w, pos=pos: (lambda: index_scores_reference(
                q, w, keys[c], pos, wscale)),
            copies, sweep))
        sc = index_scores(q, w, keys[0], pos, wscale)
        kk = min(k, n)
        cases.append(Case(
            "index.topk", f"{name}, k {kk}", n * 2,
            lambda c, config, sc=sc, kk=kk: (lambda: index_topk(sc, kk, impl=config)), "cuda",
            lambda c, sc=sc, kk=kk: (lambda: topk_lowest(sc, kk)), 1))
    return cases


def build_cases(preset: str, dev, only=(), seed: int = 0, tp: int = 1,
                contexts=INDEX_CONTEXTS):
    """Yield the benchmark cases of `preset` one at a time (weights of one case live at once);
    `only`: substrings of the names to keep; contexts: the index and attention cases' (tokens);
    tp > 1: a tensor-parallel rank's shard shapes
    (dsv4.model.sharding: its heads' wq_b / wo_a / wo_b, 1 / tp of the shared and routed experts'
    inter dim, its vocabulary rows of the head; the rest whole)."""
    cfg = get_preset(preset)
    if tp > 1:
        from ..model.sharding import check_degree
        check_degree(cfg, tp)
    gen = torch.Generator(device=dev).manual_seed(seed)
    D, Rq, Dh = cfg.dim, cfg.q_lora_rank, cfg.head_dim
    H, G, R = cfg.n_heads // tp, cfg.o_groups // tp, cfg.o_lora_rank
    I, E = cfg.moe_inter_dim // tp, cfg.n_routed_experts
    makers = [
        ("wq_a", lambda: [fp8_case("wq_a", Rq, D, dev, gen)]),
        ("wkv", lambda: [fp8_case("wkv", Dh, D, dev, gen)]),
        ("wq_a+wkv", lambda: [fp8_case("wq_a+wkv", Rq + Dh, D, dev, gen)]),
        ("wq_b", lambda: [fp8_case("wq_b", H * Dh, Rq, dev, gen)]),
        ("idx.wq_b", lambda: [fp8_case("idx.wq_b", cfg.index_n_heads * cfg.index_head_dim, Rq,
                                       dev, gen)]),
        ("wo_a", lambda: [fp8_case("wo_a", G * R, H * Dh // G, dev, gen, groups=G)]),
        ("wo_b", lambda: [fp8_case("wo_b", D, G * R, dev, gen)]),
        ("shared.w1", lambda: [fp8_case("shared.w1", I, D, dev, gen)]),
        ("shared.w1+w3", lambda: [fp8_case("shared.w1+w3", I, D, dev, gen, dual=True)]),
        ("shared.w2", lambda: [fp8_case("shared.w2", D, I, dev, gen)]),
        ("gate", lambda: [bf16_case("gate", E, D, dev, gen)]),
        ("compressor.wkv", lambda: [bf16_case("compressor.wkv", 2 * Dh, D, dev, gen)]),
        # the ratio-4 side projections' launch (compressor + indexer compressor wkv/wgate,
        # weights_proj) has the programs of one matrix of their summed rows
        ("side.r4", lambda: [bf16_case("side.r4", 4 * Dh + 4 * cfg.index_head_dim
                                       + cfg.index_n_heads, D, dev, gen)]),
        ("weights_proj", lambda: [bf16_case("weights_proj", cfg.index_n_heads, D, dev, gen)]),
        ("head head.T2", lambda: [bf16_case(name, -(-cfg.vocab_size // tp), D, dev, gen,
                                            torch.float32, rows)
                                  for name, rows in (("head", 1), ("head.T2", 2))]),
        # the head's e4m3 copy the MTP block drafts from (Transformer.ensure_draft_head)
        ("draft_head", lambda: [fp8_case("draft_head", 128 * -(-cfg.vocab_size // tp // 128),
                                         D, dev, gen)]),
        ("experts.up experts.down experts.step",
         lambda: expert_cases(E, I, D, cfg.n_activated_experts, dev, gen)),
        ("index.scores index.topk", lambda: index_cases(cfg, dev, gen, contexts)),
        ("attention.r128", lambda: attention_cases(cfg, dev, gen, contexts, tp)),
    ]
    for names, make in makers:
        if only and not any(o in n for o in only for n in names.split()):
            continue
        for case in make():
            if not only or any(o in case.name for o in only):
                yield case
        torch.cuda.empty_cache()


def run_case(case: Case, copy_bw: float, reps: int, sweep: bool, with_torch: bool,
             impl: str = "triton") -> dict:
    """One row: the case timed with the Triton config (impl "triton") or the CUDA C++ kernel's
    ("cuda"; rows without a CUDA path are skipped: None); --sweep times the config's neighbours."""
    if impl == "cuda":
        if case.cuda is None:
            return None
        case = Case(case.name + " [cuda]", case.shape, case.nbytes, case.make, case.cuda, None,
                    case.copies, case.cuda_sweep)
    calls_n = max(case.copies, 8)
    med, lo, hi = time_calls([case.make(i % case.copies, case.config) for i in range(calls_n)], reps)
    row = {"kernel": case.name, "shape": case.shape, "bytes": case.nbytes, "us": med,
           "us_min": lo, "us_max": hi, "tbps": case.nbytes / med * 1e-6,
           "pct_copy": 100 * case.nbytes / (med * 1e-6) / copy_bw, "config": str(case.config),
           "copies": case.copies}
    if with_torch and case.torch is not None:
        row["torch_us"] = time_calls([case.torch(i % case.copies) for i in range(calls_n)],
                                     max(10, reps // 5))[0]
    if sweep and case.sweep:
        best, row["sweep"] = (med, case.config), []
        for cfg in case.sweep:
            try:
                t = time_calls([case.make(i % case.copies, cfg) for i in range(calls_n)],
                               max(10, reps // 5))[0]
            except Exception as e:   # a config that does not compile or fit: report, go on
                print(f"  {case.name} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                continue
            row["sweep"].append((str(cfg), t))   # every config's time, for the JSON
            if t < best[0]:
                best = (t, cfg)
        row["best_us"], row["best_config"] = best[0], str(best[1])
    return row


def format_row(r: dict) -> str:
    torch_us = f"{r['torch_us']:9.1f}" if "torch_us" in r else f"{'-':>9}"
    s = (f"{r['kernel']:<15} {r['shape']:<28} {r['bytes'] / 1e6:9.2f} {r['us']:9.1f} "
         f"[{r['us_min']:.1f}-{r['us_max']:.1f}] {r['tbps']:6.2f} {r['pct_copy']:6.1f}% {torch_us}")
    if "best_us" in r:
        s += f"  best {r['best_us']:.1f} us {r['best_config']}"
    return s


HEADER = (f"{'kernel':<15} {'shape':<28} {'MB':>9} {'us':>9} [min-max] {'TB/s':>6} {'%copy':>7} "
          f"{'torch us':>9}")
