"""The CUDA C++ decode kernels (csrc/ via dsv4.kernels.cuda.lib) against the plain-torch
references at the real Flash / Pro shapes and odd ones: FP8 GEMV (every config; two matrices, SwiGLU;
the per-shape test of both backends is test_decode_kernels.py::test_fp8_linear_cuda), the routed FP4 experts (both e2m1 decodes, every steps-per-warp
and depth variant), the indexer top-k, determinism, CUDA-graph capture, PDL on / off (the routing
kernel: test_decode_kernels.py::test_route_decode_cuda). CPU: the config choice and the fallback.
GPU: `python -m pytest tests/dsv4/kernels/test_cuda_kernels.py -q -m cuda`.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the 'dev' extra brings it)")

from dsv4.kernels import common  # noqa: E402
from dsv4.kernels.cuda import lib as cuda_cpp  # noqa: E402
from dsv4.kernels.common import CudaConfig  # noqa: E402

from test_decode_kernels import (EXPERTS, FP8_SHAPES, SEED, assert_close_bf16, capture_step,
                          fp4_bank, fp4_swiglu_absdot, fp8_weight, fresh_gen, poisoned, spiky_x,
                          swiglu_absdot)  # noqa: E402


def _need_lib():
    st = cuda_cpp.status("cuda")
    if st != "ok":
        pytest.skip(f"CUDA C++ kernels unavailable: {st}")


# ---- CPU ----------------------------------------------------------------------------------------

def test_cuda_config_fits_the_real_shapes():
    """Every FP8 GEMV of the Flash / Pro decode gets a CUDA config whose CTA rows divide its
    segments and scale blocks, and whose warps x lanes x chunks cover K exactly."""
    from dsv4.kernels.cuda.fp8 import cuda_config
    for name, (n, k, g) in FP8_SHAPES.items():
        ng = n // g if g > 1 else 0
        for nm in (1, 2):
            c = cuda_config(n, k, (n,), ng, nm)
            assert c is not None, name
            assert c.warps * c.lc * c.cpl * 16 == k and 1 <= c.warps <= 16, (name, c)
            assert 128 % c.rows == 0 and n % c.rows == 0 and (ng == 0 or ng % c.rows == 0), (name, c)
            assert c.rpl * c.cpl * nm <= 16, (name, c)
    c = cuda_config(1536, 4096, (1024, 512), 0, 1)          # wq_a + wkv in one launch
    assert 512 % c.rows == 0
    assert cuda_config(128, 100 * 16, (128,), 0, 1) is None  # K not a multiple of 128


def test_every_measured_config_fits_its_shape():
    """The measured tables (one-GPU and tensor-parallel shard shapes) hold configs the launchers
    accept for their keys: a CUDA-core config covers K and divides the rows, scale blocks and x
    groups; a tensor-core one tiles K; a shape TUNED_MMA leaves to the CUDA-core kernel has a
    CUDA-core config; an expert config is an instantiated variant whose warps split K."""
    from dsv4.kernels.cuda import experts as ex
    from dsv4.kernels.cuda.fp8 import (MMA_VARIANTS, TUNED_CUDA, TUNED_MMA, cuda_config,
                                       mma_config)
    for (n, k, ng, nm), c in TUNED_CUDA.items():
        assert c.warps * c.lc * c.cpl * 16 == k and 1 <= c.warps <= 16, ((n, k, ng, nm), c)
        assert 128 % c.rows == 0 and n % c.rows == 0 and (ng == 0 or ng % c.rows == 0), (n, c)
        assert c.rpl * c.cpl * nm <= 16, ((n, k, ng, nm), c)
    for (n, k, ng, nm), c in TUNED_MMA.items():
        got = mma_config(n, k, (n,), ng, nm, True, torch.bfloat16)
        assert got == c, (n, k, ng, nm)
        if c is None:
            assert cuda_config(n, k, (n,), ng, nm) == TUNED_CUDA[(n, k, ng, nm)]
        else:
            assert c.warps * 128 * c.spw == k and (c.spw, nm == 2) in MMA_VARIANTS, (n, k, c)
    for (kk, inter, dim), c in ex.TUNED_CUDA_UP.items():
        assert ex.cuda_spw_fits(dim, c.spw) and kk <= ex.UP_STREAM_MAX_K, c
        assert (c.ctas == 0 or (c.spw, c.ctas) in ex.CUDA_UP_STREAM_VARIANTS
                or c in ex.up_wg_variants(inter, dim)), c
        assert ex.cuda_expert_config(dim, ex.TUNED_CUDA_UP, (kk, inter, dim)) == c
    for (kk, inter, dim), c in ex.TUNED_CUDA_DOWN.items():
        assert ex.cuda_spw_fits(inter, c.spw), c
        if c.ctas:   # the ring kernel
            assert c in ex.down_ring_variants(kk, inter), c
            assert ex.down_all_config(kk, inter).ctas == 0
        else:
            variants = ([(k6, s, d) for k6, s, d in ex.CUDA_DOWN_ALL_VARIANTS if k6 == kk]
                        if c.all_experts else ex.CUDA_DOWN_VARIANTS)
            key = (kk, c.spw, c.depth) if c.all_experts else (c.spw, c.dec, c.depth or c.spw)
            assert key in variants, c
        assert ex.cuda_down_config(kk, inter, dim) == c


def test_wgmma_up_serves_the_real_shapes():
    """The wgmma up kernel's shared memory (csrc/fp4_up_wg.cu: UpWgSmem) fits Flash's up for every
    verify row count and Pro's for two rows (its B operand grows with D); it serves sm_90 GPUs
    only (wgmma)."""
    from dsv4.kernels.cuda import experts as ex
    _, fi, fd = EXPERTS["flash"]
    _, pi, pd = EXPERTS["pro"]
    assert all(ex.up_wg_fits(t, fi, fd, (9, 0)) for t in (1, 2, 3, 4))
    assert ex.up_wg_smem(4, fd) == 2 * 32 * 1024 + 8 * 64 * 272 + 4 * 32 * 4 + 2048 + 128
    assert ex.up_wg_fits(2, pi, pd, (9, 0)) and not ex.up_wg_fits(3, pi, pd, (9, 0))
    assert not ex.up_wg_fits(5, fi, fd, (9, 0))                 # at most 4 rows
    for cap in ((8, 9), (10, 0), (12, 0)):                      # no wgmma there
        assert not ex.up_wg_fits(1, fi, fd, cap)
    assert not ex.up_wg_fits(1, fi + 16, fd, (9, 0))            # 32-row tiles
    assert not ex.up_wg_fits(1, fi, fd + 128, (9, 0))           # 512-wide units
    assert [c.ctas for c in ex.up_wg_variants(fi, fd)] == list(ex.CUDA_UP_WG_VARIANTS)


def test_expert_config_and_cpu_fallback():
    from dsv4.kernels.cuda.experts import cuda_expert_config
    assert cuda_expert_config(4096, {}, ()).spw == 4          # Flash up: 8 warps
    assert cuda_expert_config(7168, {}, ()).spw == 4          # Pro up: 14 warps
    assert cuda_expert_config(384, {}, ()).spw == 1           # 3 warps
    assert cuda_expert_config(100, {}, ()) is None
    assert cuda_cpp.status("cpu") == "not a CUDA device"
    assert not cuda_cpp.usable(torch.zeros(4))


def test_switch_turns_the_library_off(monkeypatch):
    """DSV4_CUDA_KERNELS=0: the backend of a CUDA device takes the Triton kernels and says why
    (the library is not even loaded); resolved here as on a GPU machine."""
    from dsv4.backend import decision as backend
    opts = backend.Options.from_env({"DSV4_CUDA_KERNELS": "0"})
    assert opts.cuda_kernels is False and backend.Options().cuda_kernels is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backend, "_triton_importable", lambda: True)
    monkeypatch.setattr(backend, "_cuda_status", lambda *a: pytest.fail("library loaded"))
    be = backend.resolve(torch.device("cuda", 0), options=opts)
    assert be.kernels and be.cuda_status == "DSV4_CUDA_KERNELS=0" and be.gemv == "triton"


def test_pick_cuda_or_triton_on_cpu():
    """One choice for every kernel: Triton when asked ("triton") or when the CUDA kernel does not fit
    or is not usable; a strict caller (a CUDA config, a test) gets a ValueError naming the reason,
    from each entry."""
    from dsv4.kernels.cuda.experts import ExpertCudaConfig
    from dsv4.kernels.decode.fp4_experts import fp4_experts_down, fp4_experts_up
    from dsv4.kernels.decode.fp8_linear import fp8_linear
    from dsv4.kernels.decode.route import route_decode
    t = torch.zeros(4)
    for impl in ("triton", "cuda"):                  # CPU tensors: never the CUDA kernel
        assert not cuda_cpp.pick("x", impl, t)
        assert not cuda_cpp.pick("x", impl, t, fits=False)
    assert not cuda_cpp.pick("x", "cuda", t, declined=True, strict=True)
    with pytest.raises(ValueError, match="x: the CUDA kernel is unavailable.*not a CUDA"):
        cuda_cpp.pick("x", "cuda", t, strict=True)
    with pytest.raises(ValueError, match="impl = 'auto'; expected one of"):
        cuda_cpp.pick("x", "auto", t)
    w, s = fp8_weight(128, 128, fresh_gen())
    with pytest.raises(ValueError, match="fp8 GEMV: the CUDA kernel is unavailable"):
        fp8_linear(torch.zeros(1, 128, dtype=torch.bfloat16), w, s, impl="cuda", strict=True)
    with pytest.raises(ValueError, match="route_decode: the CUDA kernel is unavailable"):
        route_decode(torch.zeros(1, 8), 2, "sqrtsoftplus", 1.0, bias=torch.zeros(8),
                     impl="cuda", strict=True)
    with pytest.raises(ValueError, match="route_decode: the CUDA kernel is unavailable"):
        route_decode(torch.zeros(1, 1024), 2, "sqrtsoftplus", 1.0, bias=torch.zeros(1024),
                     impl="cuda", strict=True)       # E > 512: does not fit either
    e = torch.zeros(2, 128, 64, dtype=torch.int8), torch.zeros(2, 128, 4, dtype=torch.int8)
    idx, x = torch.zeros(1, dtype=torch.int64), torch.zeros(1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp4 experts: the CUDA kernel is unavailable"):
        fp4_experts_up(x, idx, torch.ones(1), *e, *e, 0.0, impl="cuda", strict=True)
    with pytest.raises(ValueError, match="fp4 experts: the CUDA kernel is unavailable"):
        fp4_experts_down(x, idx, *e, config=ExpertCudaConfig(1))


# ---- CUDA ---------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("name", ["flash.wq_b", "flash.wo_b", "flash.wo_a", "pro.wkv", "odd"])
def test_fp8_every_cuda_config_agrees(name):
    """Every instantiated config of a shape (lanes per row, rows and chunks per lane, warps) gives
    the reference's values: the butterfly and the warp sums cover each product exactly once."""
    from dsv4.bench.kernels import _cuda_neighbours
    from dsv4.kernels.cuda.fp8 import cuda_config
    from dsv4.kernels.decode.fp8_linear import fp8_linear, fp8_linear_reference
    _need_lib()
    import math
    n, k, G = FP8_SHAPES[name]
    dev, gen = torch.device("cuda"), fresh_gen("cuda")
    w, s = fp8_weight(n, k, gen, device=dev)
    gk = k if G > 1 else None
    ng = n // G if G > 1 else 0
    x = spiky_x(k * G, gen, torch.bfloat16, dev)
    ref = fp8_linear_reference(x, w, s, quant_act=G == 1, group_k=gk)
    cfgs = _cuda_neighbours(cuda_config(n, k, (n,), ng, 1), k, 1,
                            math.gcd(128, n, *([ng] if ng else [])))
    assert len(cfgs) >= 3
    for cfg in cfgs:
        y = fp8_linear(x, w, s, quant_act=G == 1, group_k=gk, config=cfg,
                       out=poisoned(1, n, device=dev))
        assert_close_bf16(y, ref, x, w, s, G == 1, group_k=gk)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["flash.wq_b", "flash.wo_b", "flash.wo_a", "pro.wq_a", "odd",
                                  "odd.grouped", "small"])
def test_fp8_every_mma_config_agrees(name):
    """The tensor-core GEMV, every config of a shape (blocks per warp x warps), against the
    reference: W8A8 (bf16 and float32 x: the act-quantized operands are exact in f16) and, for bf16
    x, without act quant (the grouped wo_a: x scaled per block by a power of two into f16), bf16
    and float32 outputs; 11 rows in one call (two launches of <= 8) give each row the bits of its
    one-row launch; float32 x without act quant is refused (not exact in f16)."""
    from dsv4.kernels.cuda.fp8 import mma_configs
    from dsv4.kernels.decode.fp8_linear import fp8_linear, fp8_linear_reference
    from test_decode_kernels import assert_close_f32
    _need_lib()
    n, k, G = FP8_SHAPES[name]
    dev, gen = torch.device("cuda"), fresh_gen("cuda")
    w, s = fp8_weight(n, k, gen, device=dev)
    gk = k if G > 1 else None
    cfgs = mma_configs(k, 1)
    assert cfgs
    T = 11
    for quant, xdt in ([(False, torch.bfloat16)] if G > 1 else
                       [(True, torch.bfloat16), (True, torch.float32), (False, torch.bfloat16)]):
        x = torch.cat([spiky_x(k * G, gen, xdt, dev) for _ in range(T)])
        for cfg in cfgs:
            y = fp8_linear(x, w, s, quant_act=quant, group_k=gk, config=cfg,
                           out=poisoned(T, n, device=dev))
            yf = fp8_linear(x, w, s, quant_act=quant, group_k=gk, config=cfg,
                            out_dtype=torch.float32,
                            out=poisoned(T, n, dtype=torch.float32, device=dev))
            for t in (0, 7, 8, 10):
                xt = x[t:t + 1]
                ref = fp8_linear_reference(xt, w, s, quant_act=quant, group_k=gk)
                assert_close_bf16(y[t:t + 1], ref, xt, w, s, quant, group_k=gk)
                reff = fp8_linear_reference(xt, w, s, quant_act=quant, group_k=gk,
                                            out_dtype=torch.float32)
                assert_close_f32(yf[t:t + 1], reff, xt, w, s, quant, group_k=gk)
                one = fp8_linear(xt, w, s, quant_act=quant, group_k=gk, config=cfg)
                assert torch.equal(y[t:t + 1], one), (cfg, quant, xdt, t)
    with pytest.raises(ValueError, match="tensor-core config"):
        fp8_linear(spiky_x(k * G, gen, torch.float32, dev), w, s, quant_act=False, group_k=gk,
                   config=cfgs[0])


@pytest.mark.cuda
def test_fp8_mma_stream_gives_the_per_tile_bits():
    """The streaming tensor-core GEMV (fp8_mma_stream_kernel: a fixed grid of CTAs, each taking
    tiles c, c + G, ... with the next weights in flight) gives the per-tile kernel's bits, for every
    per-tile config of a shape on grids that leave some CTAs a tile more than others (7, 61) and on
    the swept ones: the Flash wq_b / wo_b / grouped wo_a / shared w2 (x groups changing between a
    CTA's tiles), odd shapes, 1 and 3 rows, bf16 and float32 outputs (poisoned), act quant on and
    off; two matrices in one launch (wq_a + wkv: tiles of both in one CTA) and the SwiGLU (shared
    w1 + w3); and captured in a graph with PDL, replayed on a new x."""
    from dsv4.kernels.common import MmaConfig
    from dsv4.kernels.cuda.fp8 import mma_configs, mma_stream_configs
    from dsv4.kernels.decode.fp8_linear import fp8_linear, fp8_linear2, fp8_swiglu
    _need_lib()
    dev, gen = torch.device("cuda"), fresh_gen("cuda")

    def grids(c, rows):
        extra = [MmaConfig(c.spw, c.warps, g) for g in (7, 61) if g < rows // 16]
        return extra + [s for s in mma_stream_configs(rows, c.warps * 128 * c.spw, 1)
                        if (s.spw, s.warps) == (c.spw, c.warps)]
    for name in ("flash.wq_b", "flash.wo_b", "flash.wo_a", "flash.shared.w2", "odd",
                 "odd.grouped"):
        n, k, G = FP8_SHAPES[name]
        w, s = fp8_weight(n, k, gen, device=dev)
        gk = k if G > 1 else None
        for T in (1, 3):
            x = torch.cat([spiky_x(k * G, gen, torch.bfloat16, dev) for _ in range(T)])
            for quant in ((False,) if G > 1 else (True, False)):
                for odt in (torch.bfloat16, torch.float32):
                    for cfg in mma_configs(k, 1):
                        want = fp8_linear(x, w, s, quant_act=quant, group_k=gk, config=cfg,
                                          out_dtype=odt)
                        for sc in grids(cfg, n):
                            got = fp8_linear(x, w, s, quant_act=quant, group_k=gk, config=sc,
                                             out_dtype=odt,
                                             out=poisoned(T, n, dtype=odt, device=dev))
                            assert torch.equal(got, want), (name, T, quant, odt, sc)
    (wa, sa), (wb, sb) = fp8_weight(1024, 4096, gen, device=dev), fp8_weight(512, 4096, gen,
                                                                              device=dev)
    (w1, s1), (w3, s3) = fp8_weight(2048, 4096, gen, 8.0, dev), fp8_weight(2048, 4096, gen, 8.0,
                                                                            dev)
    x = torch.cat([spiky_x(4096, gen, torch.bfloat16, dev) for _ in range(3)])
    for cfg in mma_configs(4096, 1):
        ya, yb = fp8_linear2(x, wa, sa, wb, sb, config=cfg)
        for g in (7, 61, 64):     # 96 tiles: 64 of wq_a, 32 of wkv
            za, zb = fp8_linear2(x, wa, sa, wb, sb, config=MmaConfig(cfg.spw, cfg.warps, g))
            assert torch.equal(za, ya) and torch.equal(zb, yb), (cfg, g)
    for cfg in mma_configs(4096, 2):
        want = fp8_swiglu(x, w1, s1, w3, s3, 10.0, config=cfg)
        for g in (7, 61, 64):     # 128 tiles
            got = fp8_swiglu(x, w1, s1, w3, s3, 10.0, config=MmaConfig(cfg.spw, cfg.warps, g),
                             out=poisoned(3, 2048, device=dev))
            assert torch.equal(got, want), (cfg, g)
    n, k, _ = FP8_SHAPES["flash.wo_b"]
    w, s = fp8_weight(n, k, gen, device=dev)
    x = spiky_x(k, gen, torch.bfloat16, dev)
    cfg = MmaConfig(4, 16, 132)
    g, outs = capture_step(lambda: (fp8_linear(x, w, s, config=cfg),))
    x.copy_(spiky_x(k, gen, torch.bfloat16, dev))
    g.replay()
    assert torch.equal(outs[0], fp8_linear(x, w, s, config=MmaConfig(4, 16)))


@pytest.mark.cuda
def test_bf16_head_gemv_cuda():
    """The LM head's GEMV on the CUDA C++ kernel (csrc/bf16_gemv.cu, kernels/cuda/bf16.py), at a
    TP2 rank's head rows, Pro's K with an odd N (a tail tile) and a small K: every output written
    (poisoned out) and within float32 rounding of the float64 sum, for float32 and bf16 x; rows
    1..4 and 6 (two launches) each with the bits of its one-row launch; the same bits on 1, 7 and
    the default number of CTAs; a CUDA graph's replay gives the eager bits; bf16_linear with impl
    "cuda" takes it for a head-sized matrix and leaves a smaller one to Triton."""
    from dsv4.kernels.cuda.bf16 import HEAD_MIN_ELEMENTS, Bf16CudaConfig
    from dsv4.kernels.decode.bf16_linear import bf16_linear, bf16_linear_reference
    _need_lib()
    dev, gen = torch.device("cuda"), fresh_gen("cuda")
    cfg = Bf16CudaConfig()
    for n, k in ((64640, 4096), (4099, 7168), (1000, 512)):
        w = (torch.randn(n, k, generator=gen, device=dev) * k ** -0.5).to(torch.bfloat16)
        for xdt in (torch.float32, torch.bfloat16):
            x = torch.randn(6, k, generator=gen, device=dev).to(xdt)
            y = bf16_linear(x, w, config=cfg, out=poisoned(6, n, dtype=torch.float32, device=dev))
            ref = bf16_linear_reference(x, w).double()
            absdot = x.double().abs() @ w.double().abs().T
            assert not y.isnan().any(), (n, k)
            assert ((y.double() - ref).abs() <= 1e-5 * absdot).all(), (n, k, xdt)
            for T in (1, 2, 3, 4, 6):
                yt = bf16_linear(x[:T], w, config=cfg)
                for t in range(T):
                    assert torch.equal(yt[t], bf16_linear(x[t:t + 1], w, config=cfg)[0]), (n, T, t)
            for ctas in (1, 7):
                assert torch.equal(bf16_linear(x, w, config=Bf16CudaConfig(ctas)), y), (n, ctas)
        if n * k >= HEAD_MIN_ELEMENTS:       # what the backend's head takes by default
            assert torch.equal(bf16_linear(x, w, impl="cuda"), y)
        else:
            assert torch.equal(bf16_linear(x, w, impl="cuda"), bf16_linear(x, w, impl="triton"))
    x1 = x[:2].float().contiguous()
    g, outs = capture_step(lambda: (bf16_linear(x1, w, config=cfg),))
    x1.copy_(torch.randn(2, x1.shape[1], generator=gen, device=dev))   # the replay reads x1 now
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(outs[0], bf16_linear(x1, w, config=cfg))


@pytest.mark.cuda
def test_fp8_mma_two_matrices_and_swiglu():
    """The tensor-core GEMV with two matrices on one x (wq_a + wkv) equals their own launches, and
    its fused SwiGLU meets the reference, for every config, 3 rows."""
    from dsv4.kernels.cuda.fp8 import mma_configs
    from dsv4.kernels.decode.fp8_linear import (fp8_linear, fp8_linear2, fp8_swiglu,
                                         fp8_swiglu_reference)
    _need_lib()
    dev, gen = torch.device("cuda"), fresh_gen("cuda")
    (wa, sa), (wb, sb) = fp8_weight(1024, 4096, gen, device=dev), fp8_weight(512, 4096, gen,
                                                                              device=dev)
    x = torch.cat([spiky_x(4096, gen, torch.bfloat16, dev) for _ in range(3)])
    for cfg in mma_configs(4096, 1):
        ya, yb = fp8_linear2(x, wa, sa, wb, sb, config=cfg)
        assert torch.equal(ya, fp8_linear(x, wa, sa, config=cfg))
        assert torch.equal(yb, fp8_linear(x, wb, sb, config=cfg))
    (w1, s1), (w3, s3) = fp8_weight(2048, 4096, gen, 8.0, dev), fp8_weight(2048, 4096, gen, 8.0,
                                                                            dev)
    for cfg in mma_configs(4096, 2):
        for limit in (0.0, 10.0):
            a = fp8_swiglu(x, w1, s1, w3, s3, limit, config=cfg, out=poisoned(3, 2048, device=dev))
            for t in range(3):
                xt = x[t:t + 1]
                assert_close_bf16(a[t:t + 1], fp8_swiglu_reference(xt, w1, s1, w3, s3, limit),
                                  rtol=2 ** -5, min_equal=0.9,
                                  absdot=swiglu_absdot(xt, w1, s1, w3, s3, limit))


@pytest.mark.cuda
@pytest.mark.parametrize("T", [2, 3, 4])
def test_rows_equal_one_row_launches_cuda(T):
    """The speculative verify rows: T activation rows in one launch (FP8 CUDA kernel: weights
    held in registers across rows; bf16 Triton: a program's weight tile loaded once for its rows)
    give each row the bits of its own one-row launch, at the Flash / Pro decode shapes (tuned
    configs), with two matrices, SwiGLU and the grouped wo_a; the routed experts of T rows (up:
    the tuned kernel (the wgmma one on an sm_90 GPU) against its one-row launches, and the
    streaming and the per-tile kernels over all pairs against each other; down: the all-experts
    kernel with a row grid)."""
    from dsv4.kernels.decode.bf16_linear import bf16_linear, bf16_linear_multi
    from dsv4.kernels.decode.fp8_linear import fp8_linear, fp8_linear2, fp8_swiglu
    from test_decode_kernels import BF16_SHAPES
    _need_lib()
    dev, gen = torch.device("cuda"), fresh_gen("cuda")
    for name in ("flash.wq_b", "flash.wo_a", "flash.wo_b", "flash.shared.w2", "pro.wq_b",
                 "pro.wo_b", "odd"):
        n, k, G = FP8_SHAPES[name]
        w, s = fp8_weight(n, k, gen, device=dev)
        gk = k if G > 1 else None
        x = torch.cat([spiky_x(k * G, gen, torch.bfloat16, dev) for _ in range(T)])
        for odt in (torch.bfloat16, torch.float32):
            y = fp8_linear(x, w, s, quant_act=G == 1, group_k=gk, out_dtype=odt, impl="cuda",
                           strict=True, out=poisoned(T, n, dtype=odt, device=dev))
            for t in range(T):
                one = fp8_linear(x[t:t + 1], w, s, quant_act=G == 1, group_k=gk, out_dtype=odt,
                                 impl="cuda", strict=True)
                assert torch.equal(y[t:t + 1], one), (name, t)
    (wa, sa), (wb, sb) = fp8_weight(1024, 4096, gen, device=dev), fp8_weight(512, 4096, gen,
                                                                              device=dev)
    (w1, s1), (w3, s3) = fp8_weight(2048, 4096, gen, 8.0, dev), fp8_weight(2048, 4096, gen, 8.0,
                                                                            dev)
    x = torch.cat([spiky_x(4096, gen, torch.bfloat16, dev) for _ in range(T)])
    ya, yb = fp8_linear2(x, wa, sa, wb, sb, impl="cuda", strict=True)
    a = fp8_swiglu(x, w1, s1, w3, s3, 10.0, impl="cuda", strict=True)
    for t in range(T):
        oa, ob = fp8_linear2(x[t:t + 1], wa, sa, wb, sb, impl="cuda", strict=True)
        assert torch.equal(ya[t:t + 1], oa) and torch.equal(yb[t:t + 1], ob)
        assert torch.equal(a[t:t + 1], fp8_swiglu(x[t:t + 1], w1, s1, w3, s3, 10.0,
                                                  impl="cuda", strict=True))
    from dsv4.kernels.cuda.experts import ExpertCudaConfig
    from dsv4.kernels.decode.fp4_experts import fp4_experts_down, fp4_experts_up
    E, I, D = EXPERTS["flash"]
    k = 6
    w1, s1, w3, s3, _, _ = fp4_bank(E, I, D, gen, gain=4.0, device=dev)
    *_, w2, s2 = fp4_bank(E, I, D, gen, up=False, device=dev)
    xe = torch.cat([spiky_x(D, gen, torch.bfloat16, dev) for _ in range(T)])
    idx = torch.cat([torch.randperm(E, device=dev)[:k].sort().values for _ in range(T)])
    rw = torch.rand(T * k, generator=gen, device=dev)
    add = torch.randn(T, D, generator=gen, device=dev).bfloat16()
    ae = fp4_experts_up(xe, idx, rw, w1, s1, w3, s3, 10.0)             # tuned, T rows
    st = fp4_experts_up(xe, idx, rw, w1, s1, w3, s3, 10.0,
                        config=ExpertCudaConfig(2, ctas=100))           # streaming, T rows
    pt = fp4_experts_up(xe, idx, rw, w1, s1, w3, s3, 10.0,
                        config=ExpertCudaConfig(2))                     # per tile, T rows
    assert torch.equal(st, pt)
    ye = fp4_experts_down(ae, idx, w2, s2, add=add, out_dtype=torch.bfloat16, rows=T)
    for t in range(T):
        p = slice(t * k, (t + 1) * k)
        one = fp4_experts_up(xe[t:t + 1], idx[p], rw[p], w1, s1, w3, s3, 10.0)   # tuned
        assert torch.equal(ae[p], one), t
        assert torch.equal(ye[t:t + 1], fp4_experts_down(one, idx[p], w2, s2, add=add[t:t + 1],
                                                         out_dtype=torch.bfloat16)), t
    del w1, s1, w3, s3, w2, s2
    for name in ("flash.gate", "compressor", "flash.head", "odd"):
        n, k = BF16_SHAPES[name]
        w = (torch.randn(n, k, generator=gen, device=dev) * k ** -0.5).to(torch.bfloat16)
        xb = torch.randn(T, k, generator=gen, device=dev)
        y = bf16_linear(xb, w)
        ys = bf16_linear_multi(xb.bfloat16(), [w, w[:100]], [torch.float32, torch.bfloat16])
        for t in range(T):
            assert torch.equal(y[t:t + 1], bf16_linear(xb[t:t + 1], w)), name
            o = bf16_linear_multi(xb[t:t + 1].bfloat16(), [w, w[:100]],
                                  [torch.float32, torch.bfloat16])
            assert torch.equal(ys[0][t:t + 1], o[0]) and torch.equal(ys[1][t:t + 1], o[1]), name


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 2, 3])
def test_pro_tuned_experts_rows_cuda(T):
    """Pro's tuned expert kernels (the wgmma up on an sm_90 GPU, the down ring) at Pro's I and D
    (16 experts): within the references' bounds, and each row of a T-row launch with the bits of
    its one-row launch; up's rows past the wgmma kernel's two take the per-tile kernel
    (up_wg_fallback), whose rows have its own one-row bits."""
    from dsv4.kernels.common import device_capability
    from dsv4.kernels.cuda.experts import (TUNED_CUDA_DOWN, TUNED_CUDA_UP, up_wg_fallback,
                                          up_wg_fits)
    from dsv4.kernels.decode.fp4_experts import (fp4_experts_down, fp4_experts_down_reference,
                                                 fp4_experts_up, fp4_experts_up_reference)
    _need_lib()
    _, inter, dim = EXPERTS["pro"]
    E, k = 16, 6
    dev, gen = torch.device("cuda"), fresh_gen("cuda")
    w1, s1, w3, s3, _, _ = fp4_bank(E, inter, dim, gen, gain=4.0, device=dev)
    *_, w2, s2 = fp4_bank(E, inter, dim, gen, up=False, device=dev)
    up_cfg, down_cfg = TUNED_CUDA_UP[(k, inter, dim)], TUNED_CUDA_DOWN[(k, inter, dim)]
    x = torch.cat([spiky_x(dim, gen, torch.bfloat16, dev) for _ in range(T)])
    idx = torch.cat([torch.randperm(E, generator=gen, device=dev)[:k].sort().values
                     for _ in range(T)])
    rw = torch.rand(T * k, generator=gen, device=dev) + 0.5
    a = fp4_experts_up(x, idx, rw, w1, s1, w3, s3, 10.0, out=poisoned(T * k, inter, device=dev))
    wg = up_wg_fits(T, inter, dim, device_capability(dev))
    one_cfg = up_cfg if wg else up_wg_fallback(up_cfg)
    y = fp4_experts_down(a, idx, w2, s2, out=poisoned(T, dim, dtype=torch.float32, device=dev),
                         rows=T)
    for t in range(T):
        p, xt = slice(t * k, (t + 1) * k), x[t:t + 1]
        assert_close_bf16(a[p], fp4_experts_up_reference(xt, idx[p], rw[p], w1, s1, w3, s3, 10.0),
                          rtol=2 ** -5, min_equal=0.9,
                          absdot=fp4_swiglu_absdot(xt, idx[p], rw[p], w1, s1, w3, s3, 10.0,
                                                   eps=2 ** -12 if wg else 1e-5))
        assert torch.equal(a[p], fp4_experts_up(xt, idx[p], rw[p], w1, s1, w3, s3, 10.0,
                                                config=one_cfg)), (T, t)
        ref = fp4_experts_down_reference(a[p], idx[p], w2, s2)
        scale = sum(fp4_experts_down_reference(a[j:j + 1], idx[j:j + 1], w2, s2).abs()
                    for j in range(p.start, p.stop))
        assert ((y[t] - ref[0]).abs() <= 2 ** -7 * scale[0] + 1e-30).all(), (T, t)
        assert torch.equal(y[t:t + 1], fp4_experts_down(a[p], idx[p], w2, s2,
                                                        config=down_cfg)), (T, t)


@pytest.mark.cuda
def test_fp8_two_matrices_and_swiglu_cuda():
    """wq_a + wkv in one CUDA launch equal their own launches with the same config (bit for bit);
    the fused SwiGLU meets its reference."""
    from dsv4.kernels.decode.fp8_linear import (fp8_linear, fp8_linear2, fp8_linear_reference,
                                         fp8_swiglu, fp8_swiglu_reference)
    _need_lib()
    dev, gen = torch.device("cuda"), fresh_gen("cuda")
    (wa, sa), (wb, sb) = fp8_weight(1024, 4096, gen, device=dev), fp8_weight(512, 4096, gen,
                                                                              device=dev)
    x = spiky_x(4096, gen, torch.bfloat16, dev)
    cfg = CudaConfig(32, 4, 1, 8)
    ya, yb = fp8_linear2(x, wa, sa, wb, sb, config=cfg)
    assert torch.equal(ya, fp8_linear(x, wa, sa, config=cfg))
    assert torch.equal(yb, fp8_linear(x, wb, sb, config=cfg))
    ya2, yb2 = fp8_linear2(x, wa, sa, wb, sb, impl="cuda", strict=True)       # the default config
    assert_close_bf16(ya2, fp8_linear_reference(x, wa, sa), x, wa, sa)
    assert_close_bf16(yb2, fp8_linear_reference(x, wb, sb), x, wb, sb)
    for n, k in [(2048, 4096), (3072, 7168), (128, 128)]:
        (w1, s1), (w3, s3) = fp8_weight(n, k, gen, 8.0, dev), fp8_weight(n, k, gen, 8.0, dev)
        xs = spiky_x(k, gen, torch.bfloat16, dev)
        for limit in (0.0, 10.0):
            got = fp8_swiglu(xs, w1, s1, w3, s3, limit, out=poisoned(1, n, device=dev),
                             impl="cuda", strict=True)
            assert_close_bf16(got, fp8_swiglu_reference(xs, w1, s1, w3, s3, limit),
                              rtol=2 ** -5, min_equal=0.9,
                              absdot=swiglu_absdot(xs, w1, s1, w3, s3, limit))


@pytest.mark.cuda
@pytest.mark.parametrize("which", list(EXPERTS))
def test_fp4_experts_cuda_kernels(which):
    """Both e2m1 decodes and every steps-per-warp variant meet the references; the two decodes
    give the same bits (their products and sums differ by exact powers of two only)."""
    from dsv4.kernels.cuda.experts import (CUDA_DOWN_VARIANTS, CUDA_UP_VARIANTS, ExpertCudaConfig,
                                          cuda_spw_fits, down_all_variants, down_ring_variants,
                                          up_stream_variants)
    from dsv4.kernels.decode.fp4_experts import (fp4_experts_down, fp4_experts_down_reference,
                                          fp4_experts_up, fp4_experts_up_reference)
    _need_lib()
    E, inter, dim = EXPERTS[which]
    dev, gen = torch.device("cuda"), fresh_gen("cuda")
    w1, s1, w3, s3, _, _ = fp4_bank(E, inter, dim, gen, gain=4.0, device=dev)
    *_, w2, s2 = fp4_bank(E, inter, dim, gen, up=False, device=dev)
    k = 6
    idx = torch.cat((torch.randperm(E - 1, generator=gen, device=dev)[:k - 1],
                     torch.tensor([E - 1], device=dev))).sort().values
    rw = torch.rand(k, generator=gen, device=dev) + 0.5
    x = spiky_x(dim, gen, torch.bfloat16, dev)
    a_ref = fp4_experts_up_reference(x, idx, rw, w1, s1, w3, s3, 10.0)
    absdot = fp4_swiglu_absdot(x, idx, rw, w1, s1, w3, s3, 10.0)
    ups = [ExpertCudaConfig(*v) for v in CUDA_UP_VARIANTS
           if dim % (128 * v[0]) == 0 and dim // (128 * v[0]) <= 16]
    first = None
    for cfg in ups:
        a = fp4_experts_up(x, idx, rw, w1, s1, w3, s3, 10.0, out=poisoned(k, inter, device=dev),
                           config=cfg)
        assert_close_bf16(a, a_ref, rtol=2 ** -5, min_equal=0.9, absdot=absdot)
        # the other decode and fewer weights in flight: the same arithmetic, the same bits
        assert torch.equal(a, fp4_experts_up(x, idx, rw, w1, s1, w3, s3, 10.0,
                                             config=ExpertCudaConfig(cfg.spw))), cfg
        first = a if first is None else first
    few = [ExpertCudaConfig(2, depth=d, ctas=3) for d in (0, 2, 3)]     # few CTAs: many tiles
    for cfg in up_stream_variants(dim) + few:                      # each, every buffer / stage
        if cuda_spw_fits(dim, cfg.spw):
            got = fp4_experts_up(x, idx, rw, w1, s1, w3, s3, 10.0,
                                 out=poisoned(k, inter, device=dev), config=cfg)
            assert torch.equal(got, fp4_experts_up(x, idx, rw, w1, s1, w3, s3, 10.0,
                                                   config=ExpertCudaConfig(cfg.spw))), cfg
    a = first
    ref = fp4_experts_down_reference(a, idx, w2, s2)
    scale = sum(fp4_experts_down_reference(a[j:j + 1], idx[j:j + 1], w2, s2).abs()
                for j in range(k))
    downs = [ExpertCudaConfig(*v) for v in CUDA_DOWN_VARIANTS
             if inter % (128 * v[0]) == 0 and inter // (128 * v[0]) <= 16]
    for cfg in downs:
        y = fp4_experts_down(a, idx, w2, s2, out=poisoned(1, dim, dtype=torch.float32,
                                                          device=dev), config=cfg)
        assert not y.isnan().any() and ((y - ref).abs() <= 2 ** -7 * scale + 1e-30).all(), \
            (cfg, SEED)
        assert (y == ref).float().mean() >= 0.8, (cfg, SEED)
        for _ in range(3):                         # the semaphores are left ready for the next
            assert torch.equal(y, fp4_experts_down(a, idx, w2, s2, config=cfg)), cfg
        assert torch.equal(y, fp4_experts_down(a, idx, w2, s2,                # as for up
                                               config=ExpertCudaConfig(cfg.spw))), cfg
    # every expert in one CTA: the sums of the per-expert kernel with the same steps per warp
    alls = down_all_variants(k, inter)
    assert alls or inter % 256, "no all-experts down variant for this shape"
    for cfg in alls:
        y = fp4_experts_down(a, idx, w2, s2, out=poisoned(1, dim, dtype=torch.float32,
                                                          device=dev), config=cfg)
        assert torch.equal(y, fp4_experts_down(a, idx, w2, s2,
                                               config=ExpertCudaConfig(cfg.spw))), cfg
    # the ring kernel (a CTA an SM, slots bulk-copied): the all-experts kernel's bits, also on few
    # CTAs (many tiles each: every slot reused many times) with few slots
    rings = down_ring_variants(k, inter) + [ExpertCudaConfig(2, 0, d, True, 3) for d in (2, 3)]
    for cfg in rings:
        y = fp4_experts_down(a, idx, w2, s2, out=poisoned(1, dim, dtype=torch.float32,
                                                          device=dev), config=cfg)
        assert torch.equal(y, fp4_experts_down(a, idx, w2, s2,
                                               config=ExpertCudaConfig(cfg.spw))), cfg
        assert torch.equal(y, fp4_experts_down(a, idx, w2, s2, config=cfg)), cfg
    add = spiky_x(dim, gen, torch.bfloat16, dev)
    for cfg in [downs[0]] + alls + rings[:1]:
        yb = fp4_experts_down(a, idx, w2, s2, add=add, out_dtype=torch.bfloat16, config=cfg)
        y = fp4_experts_down(a, idx, w2, s2, config=cfg)
        assert torch.equal(yb, (y + add.float()).to(torch.bfloat16)), cfg
    # the block's mHC post in the ring kernel's epilogue: the default kernel's streams
    res = torch.randn(1, 4, dim, generator=gen, device=dev).to(torch.bfloat16)
    pw, comb = 2 * torch.rand(1, 4, generator=gen, device=dev), torch.rand(1, 4, 4, generator=gen,
                                                                           device=dev)
    want = fp4_experts_down(a, idx, w2, s2, add=add, out_dtype=torch.bfloat16,
                            post=(res, pw, comb, poisoned(1, 4, dim, device=dev)))
    for cfg in rings[:1]:
        got = fp4_experts_down(a, idx, w2, s2, add=add, out_dtype=torch.bfloat16, config=cfg,
                               post=(res, pw, comb, poisoned(1, 4, dim, device=dev)))
        assert torch.equal(got, want), cfg


@pytest.mark.cuda
@pytest.mark.parametrize("which", ["flash", "pro", "flash/4"])
def test_fp4_up_wgmma(which):
    """The up on Hopper's warpgroup MMA (csrc/fp4_up_wg.cu, an sm_90 GPU): within the reference's
    bounds with the FP8 MMA's accumulation (new bits: 2^-12 of |x||W| allowed where the f16 MMAs
    keep 1e-5), every output written (poisoned), the same bits twice, on any grid, in a CUDA graph,
    and for each pair of a T-row launch those of its one-row launch; an expert id past the bank
    reads zeros (the tensor copies' bounds) instead of memory outside it."""
    from dataclasses import replace

    from dsv4.kernels.common import device_capability
    from dsv4.kernels.cuda.experts import ExpertCudaConfig, up_wg_fits
    from dsv4.kernels.decode.fp4_experts import fp4_experts_up, fp4_experts_up_reference
    _need_lib()
    dev = torch.device("cuda")
    E, inter, dim = {**EXPERTS, "flash/4": (256, 512, 4096)}[which]   # a TP4 rank's slice: 96 tiles
    if not up_wg_fits(1, inter, dim, device_capability(dev)):
        pytest.skip("the wgmma up kernel serves sm_90 GPUs (H100 / H200) only")
    gen = fresh_gen("cuda")
    w1, s1, w3, s3, _, _ = fp4_bank(E, inter, dim, gen, gain=4.0, device=dev)
    k = 6
    idx = torch.cat((torch.randperm(E - 1, generator=gen, device=dev)[:k - 1],
                     torch.tensor([E - 1], device=dev))).sort().values   # the last expert: the map's end
    rw = torch.rand(k, generator=gen, device=dev) + 0.5
    x = spiky_x(dim, gen, torch.bfloat16, dev)
    cfg = ExpertCudaConfig(2, ctas=132, wgmma=True)

    def up(xx, ii, rr, limit=10.0, c=cfg):
        return fp4_experts_up(xx, ii, rr, w1, s1, w3, s3, limit, config=c,
                              out=poisoned(ii.numel(), inter, device=dev))
    for limit in (10.0, 0.0):
        a = up(x, idx, rw, limit)
        assert_close_bf16(a, fp4_experts_up_reference(x, idx, rw, w1, s1, w3, s3, limit),
                          rtol=2 ** -5, min_equal=0.9,
                          absdot=fp4_swiglu_absdot(x, idx, rw, w1, s1, w3, s3, limit, eps=2 ** -12))
        assert torch.equal(a, up(x, idx, rw, limit)), "not deterministic"
    for ctas in (1, 7, 100):                  # a CTA's tiles in turn: the same bits on any grid
        assert torch.equal(a, up(x, idx, rw, 0.0, replace(cfg, ctas=ctas))), ctas
    out = torch.empty_like(a)
    g, _ = capture_step(lambda: fp4_experts_up(x, idx, rw, w1, s1, w3, s3, 0.0, config=cfg,
                                               out=out))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, a), "graph replay != eager"
    for T in (2, 3, 4):
        if not up_wg_fits(T, inter, dim, device_capability(dev)):
            continue
        xe = torch.cat([spiky_x(dim, gen, torch.bfloat16, dev) for _ in range(T)])
        ie = torch.cat([torch.randperm(E, generator=gen, device=dev)[:k].sort().values
                        for _ in range(T)])
        re = torch.rand(T * k, generator=gen, device=dev) + 0.5
        ae = up(xe, ie, re)
        for t in range(T):
            p = slice(t * k, (t + 1) * k)
            assert torch.equal(ae[p], up(xe[t:t + 1], ie[p], re[p])), (T, t)
    bad = idx.clone()
    bad[2] = E + 5
    a = up(x, idx, rw)
    got = up(x, bad, rw)
    assert (got[2] == 0).all() and torch.equal(got[:2], a[:2]) and torch.equal(got[3:], a[3:])


@pytest.mark.cuda
def test_cuda_kernels_capture_and_pdl():
    """Captured in a CUDA graph (under sync debug 'error'), replayed on new inputs: the same bits as
    eager calls; and the same bits without PDL (pdl=False: the backend's DSV4_PDL=0). down with
    idx_early (its weights requested before the PDL wait; idx written before the kernel it waits
    for began) gives down's bits, and so does the ring kernel with and without it."""
    from dsv4.kernels.cuda.experts import ExpertCudaConfig
    from dsv4.kernels.decode.fp4_experts import fp4_experts_down, fp4_experts_up
    from dsv4.kernels.decode.fp8_linear import fp8_linear, fp8_linear2, fp8_swiglu
    _need_lib()
    ring = ExpertCudaConfig(2, 0, 4, True, 132)   # the down ring kernel, 4 slots
    dev, gen = torch.device("cuda"), fresh_gen("cuda")
    w, s = fp8_weight(1024, 4096, gen, device=dev)
    wk, sk = fp8_weight(512, 4096, gen, device=dev)
    wo, so = fp8_weight(4096, 1024, gen, device=dev)
    w1, s1, w3, s3, _, _ = fp4_bank(16, 256, 4096, gen, device=dev)
    *_, w2, s2 = fp4_bank(16, 256, 4096, gen, up=False, device=dev)
    (sw1, ss1), (sw3, ss3) = fp8_weight(2048, 4096, gen, device=dev), fp8_weight(2048, 4096, gen,
                                                                                  device=dev)
    x = spiky_x(4096, gen, torch.bfloat16, dev)
    idx = torch.tensor([1, 4, 5, 9, 12, 15], device=dev)
    rw = torch.rand(6, generator=gen, device=dev)

    def step(pdl=True):
        q, kv = fp8_linear2(x, w, s, wk, sk, pdl=pdl)
        a = fp4_experts_up(x, idx, rw, w1, s1, w3, s3, 10.0, pdl=pdl)
        sh = fp8_swiglu(x, sw1, ss1, sw3, ss3, 10.0, pdl=pdl)
        return (q, kv, fp8_linear(q, wo, so, pdl=pdl), sh,
                fp4_experts_down(a, idx, w2, s2, add=x, out_dtype=torch.bfloat16, pdl=pdl),
                fp4_experts_down(a, idx, w2, s2, add=x, out_dtype=torch.bfloat16, pdl=pdl,
                                 idx_early=True),
                fp4_experts_down(a, idx, w2, s2, add=x, out_dtype=torch.bfloat16, pdl=pdl,
                                 idx_early=True, config=ring),
                fp4_experts_down(a, idx, w2, s2, add=x, out_dtype=torch.bfloat16, pdl=pdl,
                                 config=ring))
    g, outs = capture_step(step)
    x.copy_(spiky_x(4096, gen, torch.bfloat16, dev))
    idx.copy_(torch.tensor([0, 2, 3, 7, 8, 11], device=dev))
    g.replay()
    want = step()
    for got, ref in zip(outs, want):
        assert torch.equal(got, ref)
    for early_or_ring in want[-3:]:
        assert torch.equal(early_or_ring, want[-4])
    if common.pdl(x):
        for got, ref in zip(step(pdl=False), want):
            assert torch.equal(got, ref)


@pytest.mark.cuda
@pytest.mark.parametrize("n,k", [(1088, 512), (16385, 512), (600, 512), (9, 8), (40, 1), (2048, 2048),
                                 (1024, 512), (1023, 512), (1025, 512), (8192, 512), (8200, 512),
                                 (262144, 512), (262139, 512), (300000, 512), (300001, 512)])
def test_index_topk_cuda(n, k):
    """The radix select returns k distinct entries whose scores are the k largest (as a
    multiset, against torch.topk), ties at the threshold resolved to the lowest entries, -inf
    (not yet visible) entries last, in the documented order (those above the threshold in index
    order, then the ties); deterministic. Up to 8,192 scores (1,024 without 16-byte loads) one
    CTA holds the row in registers (1,024: a 4K context's index; 1,023 and 1,025, 8,192 and
    8,200 the edges of that kernel). 262,144: a 1M-token context's ratio-4 index (the
    16-byte-load path); 262,139 and 16,385: rows the scalar path reads; 16,385 to 262,144: the
    cluster kernel that holds its keys in registers, 300,000 and 300,001: the one that reads
    them again each pass (segments of more than 32,768 scores)."""
    from dsv4.kernels.decode.indexer import index_topk
    _need_lib()
    dev, gen = torch.device("cuda"), fresh_gen("cuda")
    sc = torch.randn(1, n, generator=gen, device=dev).to(torch.bfloat16)    # bf16: many ties
    sc[0, n // 2:] = float("-inf")                                           # masked tail
    if n > 4:
        sc[0, 1:4] = sc[0, 0]
    got = index_topk(sc, k)
    assert got.shape == (1, k) and got.dtype == torch.int64
    assert got.unique().numel() == k and int(got.min()) >= 0 and int(got.max()) < n
    want = sc.float().topk(k, dim=-1).values
    assert torch.equal(sc[0, got[0]].float().sort(descending=True).values, want[0])
    thr = want[0, -1]
    picked = set(got[0].tolist())
    ties = (sc[0].float() == thr).nonzero().flatten().tolist()
    n_tie = len([i for i in picked if sc[0, i].float() == thr])
    assert picked >= set(i for i in range(n) if sc[0, i].float() > thr)
    assert [i for i in ties if i in picked] == ties[:n_tie], "ties: not the lowest entries"
    above = (sc[0].float() > thr).nonzero().flatten().tolist()
    assert got[0].tolist() == above + ties[:k - len(above)]
    assert torch.equal(got, index_topk(sc, k))


@pytest.mark.cuda
def test_index_topk_cuda_rows_and_crowded_scores():
    """Several rows (the speculative verify rows), each its own selection; a row whose scores
    all share one value (every key in one histogram bin) and one of a few distinct values."""
    from dsv4.kernels.decode.indexer import index_topk
    _need_lib()
    dev, gen = torch.device("cuda"), fresh_gen("cuda")
    n, k = 32768, 512
    sc = torch.randn(4, n, generator=gen, device=dev).to(torch.bfloat16)
    sc[1] = 0.25
    sc[2] = torch.randint(0, 3, (n,), generator=gen, device=dev).to(torch.bfloat16)
    sc[3, n // 3:] = float("-inf")
    got = index_topk(sc, k)
    for r in range(4):
        row = sc[r].float()
        thr = row.topk(k).values[-1]
        above = (row > thr).nonzero().flatten().tolist()
        ties = (row == thr).nonzero().flatten().tolist()
        assert got[r].tolist() == above + ties[:k - len(above)], r
    assert torch.equal(got, index_topk(sc, k))


@pytest.mark.cuda
@pytest.mark.parametrize("mode", [0, 1])
def test_l2_prefetch_is_a_hint(mode):
    """dsv4_l2_prefetch (csrc/prefetch.cu) over more ranges than one launch takes, odd sizes and
    unaligned starts, eager and captured: it runs without error and changes no byte; bad launch
    configs are refused (ValueError)."""
    _need_lib()
    dev, gen = torch.device("cuda"), fresh_gen("cuda")
    lib = cuda_cpp.lib_for(dev)
    base = torch.randint(0, 255, (3 << 20,), generator=gen, device=dev, dtype=torch.uint8)
    keep = base.clone()
    ts = [base[i * 300_001 + i:(i + 1) * 300_001] for i in range(10)] + [base[-5:], base[:16]]
    cfg = dict(mode=mode, ctas=4, threads=64, piece=4096)
    cuda_cpp.l2_prefetch(lib, ts, **cfg)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cuda_cpp.l2_prefetch(lib, ts, **cfg)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(base, keep)
    for bad in (dict(cfg, piece=100), dict(cfg, mode=2), dict(cfg, ctas=0)):
        with pytest.raises(ValueError):
            cuda_cpp.l2_prefetch(lib, ts, **bad)


@pytest.mark.cuda
def test_read_bytes_reads_every_word_once():
    """dsv4_read_bytes (csrc/prefetch.cu; the read bound of bench --layer-kernels) reads each
    16-byte word once on any grid: the XOR of its CTAs' sinks is the XOR of every word (a word
    read twice or missed would change it), for sizes past and below one grid pass; bad launches
    are refused (ValueError)."""
    import numpy as np
    _need_lib()
    dev, gen = torch.device("cuda"), fresh_gen("cuda")
    lib = cuda_cpp.lib_for(dev)
    x = torch.randint(0, 255, ((5 << 20) + 48,), generator=gen, device=dev, dtype=torch.uint8)
    for n, ctas, threads in ((x.numel(), 132, 512), (x.numel(), 7, 64), (48, 4, 32),
                             (16 * 4099, 264, 1024)):
        sink = torch.full((ctas, 4), -1, dtype=torch.int32, device=dev)
        cuda_cpp.read_bytes(lib, x[:n], sink, ctas, threads)
        words = x[:n].view(torch.int32).view(-1, 4).cpu().numpy()
        got = np.bitwise_xor.reduce(sink.cpu().numpy(), axis=0)
        assert (got == np.bitwise_xor.reduce(words, axis=0)).all(), (n, ctas, threads)
    sink = torch.empty(132, 4, dtype=torch.int32, device=dev)
    for bad in (dict(x=x[1:17]), dict(x=x[:20]), dict(threads=48), dict(ctas=0)):
        kw = dict(dict(x=x[:64], threads=64, ctas=4), **bad)
        with pytest.raises(ValueError):
            cuda_cpp.read_bytes(lib, kw["x"], sink, kw["ctas"], kw["threads"])
