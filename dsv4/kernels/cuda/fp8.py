"""The CUDA C++ FP8 GEMVs behind `fp8_linear` (csrc/fp8_gemv.cu, fp8_mma.cu via dsv4.kernels.cuda.lib): their launch
configs (measured tables and heuristics) and launchers, for both kernels:

* the CUDA-core kernel (`dsv4_fp8_gemv`, `CudaConfig`): lanes decode e4m3 weights to float32 and
  sum exact products in float32; any K that is a multiple of 128, x bf16 or float32, act quant on
  or off;
* the tensor-core kernel (`dsv4_fp8_gemv_mma`, `MmaConfig`): mma.m16n8k16 with f16 operands (e4m3
  weights and act-quantized activations are exact in f16; bf16 x without act quant is scaled per
  128-block into f16, exactly), float32 accumulation; B's columns are the activation rows, so the
  speculative verify rows cost about one row's time (T = 2: ~1.1x a one-row launch, the CUDA-core
  kernel ~1.5x), and a row's bits never depend on the others.

`mma_config` picks the tensor-core kernel by shape only (never by the number of rows), so a row's
bits are the same in a plain decode step and in the verify rows.
Tests: tests/dsv4/kernels/test_cuda_kernels.py (-m cuda).
"""
from __future__ import annotations

import math

import torch

from ..common import CudaConfig, MmaConfig, on_device, pdl
from . import lib as cuda_cpp

# CUDA C++ kernel configs measured best on an H200 (bench_kernels --sweep --backend cuda) for the
# Flash shapes, keyed (rows, K, rows per x group or 0, matrices per row); others: cuda_config.
TUNED_CUDA: dict[tuple, CudaConfig] = {
    (1536, 4096, 0, 1): CudaConfig(32, 16, 1, 8),     # wq_a + wkv   3.8 -> 3.2 us
    (32768, 1024, 0, 1): CudaConfig(8, 8, 2, 4),      # wq_b        12.2 -> 11.3 us
    (8192, 1024, 0, 1): CudaConfig(8, 8, 2, 4),       # indexer wq_b 4.2 -> 3.6 us
    (8192, 4096, 1024, 1): CudaConfig(32, 8, 2, 4),   # wo_a (G=8)  12.5 -> 11.5 us
    (4096, 8192, 0, 1): CudaConfig(32, 8, 2, 8),      # wo_b        13.4 -> 12.0 us
    (2048, 4096, 0, 2): CudaConfig(32, 8, 1, 8),      # shared w1+w3 (SwiGLU) 7.6 -> 7.2 us
    (4096, 2048, 0, 1): CudaConfig(32, 16, 1, 4),     # shared w2    4.0 -> 3.7 us
    # a tensor-parallel rank's shard shapes (bench_kernels --sweep --tp N, one H100, 2026-11-27;
    # the tensor-core default in brackets; TUNED_MMA leaves these shapes to this kernel)
    (4096, 4096, 1024, 1): CudaConfig(16, 8, 1, 16),  # TP2 wo_a (G=4)    (7.66) 7.41 us
    (1024, 4096, 0, 2): CudaConfig(32, 8, 1, 8),      # TP2 shared w1+w3  (4.84) 4.26 us
    (4096, 1024, 0, 1): CudaConfig(16, 16, 1, 4),     # TP2 shared w2     (3.26) 2.74 us
    (2048, 4096, 1024, 1): CudaConfig(32, 8, 1, 8),   # TP4 wo_a (G=2)    (4.84) 4.25 us
    (512, 4096, 0, 2): CudaConfig(32, 8, 1, 8),       # TP4 shared w1+w3  (3.21) 2.90 us
    (4096, 512, 0, 1): CudaConfig(8, 8, 1, 4),        # TP4 shared w2     (2.49) 2.19 us
}

CUDA_TARGET_CTAS = 264       # ~2 CTAs per SM on H100/H200 before a CTA takes more rows


def cuda_config(rows: int, k: int, seg_rows: tuple, ng: int, nm: int) -> CudaConfig | None:
    """CUDA launch config for `rows` output rows in segments `seg_rows` (each a matrix of its own),
    K = k, activation groups of ng rows (0: one group), nm matrices per row (2: SwiGLU); None when
    the CUDA kernel cannot take the shape. Lanes read 16-byte chunks: LC lanes per row (32 when K
    allows), up to 16 warps splitting K (2 chunks per lane beyond), then the most rows per CTA with
    at most 8 chunks per lane that still gives ~2 CTAs per SM."""
    key = (rows, k, ng, nm)
    if key in TUNED_CUDA:
        return TUNED_CUDA[key]
    kc = k // 16
    lc = next((c for c in (32, 16, 8) if kc % c == 0), None)
    if lc is None or k % 128:
        return None
    warps, cpl = kc // lc, 1
    if warps > 16 and warps % 2 == 0:
        warps, cpl = warps // 2, 2
    if warps > 16:
        return None
    lr = 32 // lc
    div = math.gcd(128, *seg_rows, *([ng] if ng else []))
    fits = [r for r in (16, 8, 4, 2, 1) if r * cpl * nm <= 16 and div % (lr * r) == 0]
    if not fits:
        return None
    good = [r for r in fits if r * cpl * nm <= 8 and rows // (lr * r) >= CUDA_TARGET_CTAS]
    return CudaConfig(lc, good[0] if good else fits[-1], cpl, warps)


# The tensor-core kernel (fp8_mma_kernel): its instantiations (spw, SwiGLU) and the most activation
# rows per launch.
MMA_VARIANTS = {(1, False), (1, True), (2, False), (2, True), (4, False)}
MMA_MAX_X = 8
MMA_DEFAULT = True    # whether mma_config picks the tensor-core kernel when none is asked for


def mma_configs(k: int, nm: int) -> list[MmaConfig]:
    """Every tensor-core config for K = k with nm matrices per row (most blocks per warp first),
    a CTA a tile."""
    return [MmaConfig(spw, k // (128 * spw)) for spw in (4, 2, 1)
            if (spw, nm == 2) in MMA_VARIANTS and k % (128 * spw) == 0
            and 1 <= k // (128 * spw) <= 16]


# the streaming tensor-core kernel's grids to try (bench_kernels --sweep): one CTA an SM of an H100
# / H200 (132), a divisor of the Flash tile counts (128, 64), half the SMs (66), two an SM (264)
MMA_STREAM_CTAS = (132, 128, 66, 64, 264)


def mma_stream_configs(rows: int, k: int, nm: int) -> list[MmaConfig]:
    """The streaming variants of mma_configs for `rows` output rows: each per-tile config on each
    grid of MMA_STREAM_CTAS below the tile count (fp8_mma_stream_kernel: the same bits)."""
    tiles = rows // 16
    return [MmaConfig(c.spw, c.warps, g) for c in mma_configs(k, nm) for g in MMA_STREAM_CTAS
            if g < tiles]


def mma_config(rows: int, k: int, seg_rows: tuple, ng: int, nm: int, quant: bool,
               x_dtype: torch.dtype) -> MmaConfig | None:
    """The tensor-core config for a launch, or None: rows not in 16-row tiles, K not a fit, x not
    bf16 without act quant (float32 values are not exact in f16); or MMA_DEFAULT off."""
    if (not MMA_DEFAULT or any(r % 16 for r in seg_rows) or ng % 16
            or (not quant and x_dtype != torch.bfloat16)):
        return None
    key = (rows, k, ng, nm)
    if key in TUNED_MMA:
        return TUNED_MMA[key]
    fits = mma_configs(k, nm)
    return fits[0] if fits else None


# Tensor-core configs measured on an H200 (kernel microbenchmark: weights cycled past L2, one graph
# with PDL; us per launch at T = 1 / 2 rows, the CUDA-core kernel's in brackets), keyed as
# TUNED_CUDA; None would leave a shape to the CUDA-core kernel. Alone, the tensor-core launch is up
# to ~1 us slower at T = 1 on some shapes, but the plain decode step is not (Flash 30 layers, one
# H200: 4.141 ms against 4.180, BENCHMARKS.md). The choice depends on the shape only, never on T:
# a row's bits are the same in a plain step and in the verify rows.
TUNED_MMA: dict[tuple, MmaConfig | None] = {
    (1536, 4096, 0, 1): MmaConfig(4, 8),      # wq_a + wkv   3.60 / 3.69  (3.13 / 5.62)
    (32768, 1024, 0, 1): MmaConfig(1, 8),     # wq_b        11.10 / 11.61 (11.16 / 15.96)
    (8192, 1024, 0, 1): MmaConfig(2, 4),      # indexer wq_b 4.20 / 4.30  (3.85 / 5.94)
    (8192, 4096, 1024, 1): MmaConfig(2, 16),  # wo_a (G=8)  11.44 / 13.22 (11.07 / 15.92)
    # wo_b: 256 tiles of 512 threads, one CTA an SM: streamed on 132 CTAs, 14.7 -> 13.0 us alone,
    # 12 Flash layers 2.151 / 2.154 -> 2.134 / 2.135 ms (one H100, 2026-11-28)
    (4096, 8192, 0, 1): MmaConfig(4, 16, 132),  # wo_b      13.51 / 14.68 (11.61 / 18.30)
    (2048, 4096, 0, 2): MmaConfig(2, 16),     # shared w1+w3 6.81 / 7.18  (6.88 / 8.94)
    (4096, 2048, 0, 1): MmaConfig(4, 4),      # shared w2    4.06 / 4.01  (3.79 / 6.17)
    # the draft head (an e4m3 copy of the head the MTP block drafts from: the vocabulary x D):
    # 8,080 tiles streamed on two CTAs an SM (one H200, 2026-11-29, alone: Flash 132.7 -> 121.7
    # us, Pro 251.0 -> 223.9 us in the sweep)
    (129280, 4096, 0, 1): MmaConfig(2, 16, 264),
    (129280, 7168, 0, 1): MmaConfig(4, 14, 264),
    # tensor-parallel shard shapes where the CUDA-core kernel is faster at T = 1 (TUNED_CUDA):
    # a TP rank decodes one row a step (its verify rows would pay the CUDA-core kernel's ~1.5x)
    **{key: None for key in ((4096, 4096, 1024, 1), (1024, 4096, 0, 2), (4096, 1024, 0, 1),
                             (2048, 4096, 1024, 1), (512, 4096, 0, 2), (4096, 512, 0, 1))},
}


def _operands(x, w, s, w3, s3, out, quant, second):
    """The kernels' flags and their second matrix, its scales and output (w1, s1, y1: the second
    matrix, w3 of the SwiGLU, or w itself when unused)."""
    if out.dtype not in (torch.float32, torch.bfloat16) or x.dtype not in (torch.float32,
                                                                           torch.bfloat16):
        raise ValueError(f"fp8 GEMV: x {x.dtype} / out {out.dtype}; expected bfloat16 or float32")
    flags = ((cuda_cpp.FLAG_X_F32 if x.dtype == torch.float32 else 0)
             | (cuda_cpp.FLAG_Y_F32 if out.dtype == torch.float32 else 0)
             | (cuda_cpp.FLAG_QUANT if quant else 0)
             | (cuda_cpp.FLAG_TWO if second is not None else 0))
    u8 = torch.uint8
    if second is not None:
        return flags, (second[0].view(u8), second[1].view(u8), second[2])
    if w3 is not None:
        return flags, (w3.view(u8), s3.view(u8), out)
    return flags, (w.view(u8), s.view(u8), out)


def launch_cuda(x, w, s, w3, s3, out, limit, quant, ng, rows, K, cfg: CudaConfig, second,
                T: int = 1, pdl_on: bool = True):
    """The CUDA-core kernel (dsv4_fp8_gemv) for the launch, T activation rows; pdl_on: the
    backend's PDL switch."""
    n0 = w.shape[0]
    if (rows % cfg.rows or n0 % cfg.rows or 128 % cfg.rows or (ng and ng % cfg.rows)
            or cfg.warps * cfg.lc * cfg.cpl * 16 != K):   # one scale block and x group per CTA
        raise ValueError(f"fp8 GEMV: CUDA config {cfg} does not fit {rows} rows, K = {K}")
    flags, (w1, s1, y1) = _operands(x, w, s, w3, s3, out, quant, second)
    u8 = torch.uint8
    with on_device(out):
        cuda_cpp.fp8_gemv(cuda_cpp.lib_for(out.device), x, w.view(u8), s.view(u8), out, w1, s1, y1,
                          n0=n0, rows=rows, K=K, ng=ng, limit=float(limit), flags=flags,
                          swiglu=w3 is not None, cfg=cfg, pdl=pdl(out, pdl_on), nx=T,
                          xs=x.numel() // T, ys0=out.numel() // T, ys1=y1.numel() // T)


def launch_mma(x, w, s, w3, s3, out, limit, quant, ng, rows, K, cfg: MmaConfig, second, T: int,
               pdl_on: bool = True):
    """The tensor-core kernel (dsv4_fp8_gemv_mma) for the launch: T activation rows in launches
    of at most MMA_MAX_X rows (a row's bits do not depend on the others); pdl_on: the backend's
    PDL switch."""
    n0 = w.shape[0]
    if (rows % 16 or n0 % 16 or ng % 16 or (w3 is not None and second is not None)
            or cfg.warps * 128 * cfg.spw != K or (cfg.spw, w3 is not None) not in MMA_VARIANTS
            or (not quant and x.dtype != torch.bfloat16)):
        raise ValueError(f"fp8 GEMV: tensor-core config {cfg} does not fit {rows} rows, K = {K}, "
                         f"x {x.dtype}{'' if quant else ' without act quant'}")
    flags, (w1, s1, y1) = _operands(x, w, s, w3, s3, out, quant, second)
    u8 = torch.uint8
    xs, ys0, ys1 = x.numel() // T, out.numel() // T, y1.numel() // T
    lib = cuda_cpp.lib_for(out.device)
    with on_device(out):
        for t0 in range(0, T, MMA_MAX_X):
            nx = min(MMA_MAX_X, T - t0)
            cuda_cpp.fp8_gemv_mma(lib, x.view(-1)[t0 * xs:], w.view(u8), s.view(u8),
                                  out.view(-1)[t0 * ys0:], w1, s1, y1.view(-1)[t0 * ys1:], n0=n0,
                                  rows=rows, K=K, ng=ng, limit=float(limit), flags=flags,
                                  swiglu=w3 is not None, cfg=cfg, pdl=pdl(out, pdl_on), nx=nx,
                                  xs=xs, ys0=ys0, ys1=ys1)
