"""FP8 (e4m3, 128x128 ue8m0) GEMV for one activation row: W8A8 `fp8_linear`, the fused shared-expert
`fp8_swiglu`, and grouped wo_a (no act quant). x [1, K] -> y [1, N]; weights w [N, K], s [N/128, K/128].
Test: `python -m pytest tests/dsv4/test_kernels.py`; bench: `python scripts/bench_kernels.py`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import FP8_BLOCK, dequantize_fp8_weight
from ..quant import fp8_quant_dequant
from .common import (Config, block_exponent, e4m3_to_f32, e8m0_to_f32, interpreting, on_device,
                     pick_config, quant_dequant, round_bf16)

TILE_BYTES = 16384   # weight bytes per program and step (one matrix); half of it for fp8_swiglu


@triton.jit
def _fp8_step(acc, xb, w_ptr, s_ptr, rows, k0, K: tl.constexpr, srow, NATIVE: tl.constexpr, NB: tl.constexpr,
              EVEN_K: tl.constexpr):
    """acc [BN, C] += 16-wide partial dots of rows x K-chunk [k0, k0 + NB*128) (C = NB*8)."""
    C: tl.constexpr = NB * 8
    kb = tl.arange(0, NB)
    cc = tl.arange(0, C)
    ii = tl.arange(0, 16)
    koff = k0 + cc[:, None] * 16 + ii[None, :]                                   # [C, 16]
    if EVEN_K:
        sw = e8m0_to_f32(tl.load(s_ptr + srow + k0 // 128 + kb))                 # [NB]
        w = tl.load(w_ptr + rows[:, None, None] * K + koff[None, :, :])          # [BN, C, 16] u8
    else:
        sw = e8m0_to_f32(tl.load(s_ptr + srow + k0 // 128 + kb, mask=k0 + kb * 128 < K, other=0))
        w = tl.load(w_ptr + rows[:, None, None] * K + koff[None, :, :],
                    mask=(koff < K)[None, :, :], other=0)
    xe = tl.reshape(xb * sw[:, None], [C, 16])                                  # x * weight scale
    return acc + tl.sum(e4m3_to_f32(w, NATIVE) * xe[None, :, :], axis=2)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, w3_ptr, s3_ptr, y_ptr, limit, K: tl.constexpr,
                     NG: tl.constexpr,
                     QUANT: tl.constexpr, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr,
                     NATIVE: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                     EVEN_K: tl.constexpr):
    # x [G*K] (G = N / NG groups: rows [g*NG, (g+1)*NG) read x[g*K, (g+1)*K)); w, w3 [N, K] u8;
    # s, s3 [N/128, K/128] u8; y [N]. One program: BN rows (inside one 128-row scale block).
    n0 = tl.program_id(0) * BN
    rows = n0 + tl.arange(0, BN)
    xg = x_ptr + (n0 // NG) * K
    srow = (n0 // 128) * (K // 128)
    C: tl.constexpr = NB * 8
    acc = tl.zeros([BN, C], tl.float32)
    acc3 = tl.zeros([BN, C], tl.float32)
    kb = tl.arange(0, NB)
    for k0 in range(0, K, NB * 128):
        xoff = k0 + kb[:, None] * 128 + tl.arange(0, 128)[None, :]               # [NB, 128]
        if EVEN_K:
            xb = tl.load(xg + xoff).to(tl.float32)
        else:
            xb = tl.load(xg + xoff, mask=xoff < K, other=0).to(tl.float32)
        if QUANT:   # act_quant per 128: exact e4m3 * 2^e values
            xb = quant_dequant(xb, block_exponent(xb)[:, None])
        if not NATIVE:
            xb = xb * 256.0   # the bit-path decode returns w * 2^-8
        acc = _fp8_step(acc, xb, w_ptr, s_ptr, rows, k0, K, srow, NATIVE, NB, EVEN_K)
        if SWIGLU:
            acc3 = _fp8_step(acc3, xb, w3_ptr, s3_ptr, rows, k0, K, srow, NATIVE, NB, EVEN_K)
    y = tl.sum(acc, axis=1)
    if SWIGLU:   # fp8_gemm outputs bf16; the clamped SwiGLU runs in fp32 on those values
        g = round_bf16(y)
        u = round_bf16(tl.sum(acc3, axis=1))
        if HAS_LIMIT:
            u = tl.minimum(tl.maximum(u, -limit), limit)
            g = tl.minimum(g, limit)
        y = g / (1.0 + tl.exp(-g)) * u
    if y_ptr.dtype.element_ty == tl.bfloat16:
        y = round_bf16(y)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))


# Configs measured best on an H200 by `scripts/bench_kernels.py --sweep` (2026-11-22) for the
# Flash shapes, keyed (N, K, rows per group, dual); other shapes use the heuristic below.
TUNED = {
    (1024, 4096, 1024, False): Config(4, 32, 8),    # wq_a        4.9 -> 3.7 us
    (1536, 4096, 1536, False): Config(4, 32, 8),    # wq_a+wkv    5.9 -> 4.3 us
    (8192, 4096, 1024, False): Config(16, 16, 8),   # wo_a G=8   15.6 -> 14.4 us
    (4096, 8192, 4096, False): Config(4, 8, 4),     # wo_b       23.9 -> 15.5 us
    (2048, 4096, 2048, True): Config(4, 16, 4),     # shared w1+w3 8.1 -> 7.9 us
    (4096, 2048, 4096, False): Config(4, 8, 4),     # shared w2   5.9 -> 5.2 us
}


def fp8_config(n: int, k: int, ng: int, dual: bool = False) -> Config:
    """Launch config for N = n output rows (groups of ng rows), K = k (per group)."""
    if (n, k, ng, dual) in TUNED:
        return TUNED[(n, k, ng, dual)]
    return pick_config(min(n, ng, 128), k, TILE_BYTES // (2 if dual else 1), 1.0,
                       programs_per_row=max(1, n // min(n, ng, 128)))


def _launch(x, w, s, w3, s3, out, limit, quant, group_k, out_dtype, config, native):
    N, K = w.shape
    if w.dtype != torch.float8_e4m3fn or N % FP8_BLOCK or K % FP8_BLOCK:
        raise ValueError(f"fp8 GEMV: weight {tuple(w.shape)} {w.dtype}; expected float8_e4m3fn "
                         f"with both dims multiples of {FP8_BLOCK}")
    if tuple(s.shape) != (N // FP8_BLOCK, K // FP8_BLOCK):
        raise ValueError(f"fp8 GEMV: scale {tuple(s.shape)}; expected {(N // 128, K // 128)}")
    G = 1 if group_k is None else x.numel() // group_k
    if group_k is not None and (group_k != K or x.numel() % K or N % (G * FP8_BLOCK)):
        raise ValueError(f"grouped fp8 GEMV: x {tuple(x.shape)}, group_k {group_k}, weight "
                         f"{tuple(w.shape)}; need group_k == K and N a multiple of 128 * G")
    if x.numel() != G * K:
        raise ValueError(f"fp8 GEMV: x {tuple(x.shape)} has {x.numel()} values; expected {G * K}")
    if N * K >= 2 ** 31:
        raise ValueError(f"fp8 GEMV: weight {tuple(w.shape)} too large for int32 offsets")
    ng = N // G
    cfg = config or fp8_config(N, K, ng, dual=w3 is not None)
    if out is None:
        out = torch.empty(1, N, dtype=out_dtype, device=x.device)
    native = (not interpreting()) if native is None else native
    w3 = w if w3 is None else w3
    s3 = s if s3 is None else s3
    with on_device(out):
        _fp8_gemv_kernel[(N // cfg.bn,)](
            x.contiguous(), w.view(torch.uint8), s.view(torch.uint8), w3.view(torch.uint8),
            s3.view(torch.uint8), out, float(limit), K=K, NG=ng,
            QUANT=quant, SWIGLU=w3 is not w, HAS_LIMIT=limit > 0, NATIVE=native, BN=cfg.bn,
            NB=cfg.nb, EVEN_K=K % (cfg.nb * 128) == 0, num_warps=cfg.num_warps)
    return out


def fp8_linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, *, quant_act: bool = True,
               out_dtype: torch.dtype = torch.bfloat16, group_k: int | None = None,
               out: torch.Tensor | None = None, config: Config | None = None,
               native: bool | None = None) -> torch.Tensor:
    """y [1, N] = x [1, K] @ dequant(w)^T with float32 accumulation, rounded to out_dtype.

    quant_act: W8A8 as the official linear (x -> e4m3 per 128 with ue8m0 scales); off for wo_a.
    group_k: rows [g*N/G, (g+1)*N/G) read x[g*group_k, (g+1)*group_k) (x [1, G*group_k], w
    [N, group_k]): the grouped wo_a in one launch. x bf16 or float32. Capture-safe, deterministic.
    """
    return _launch(x, w, s, None, None, out, 0.0, quant_act, group_k, out_dtype, config, native)


def fp8_swiglu(x: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor,
               s3: torch.Tensor, limit: float, *, out: torch.Tensor | None = None,
               config: Config | None = None, native: bool | None = None) -> torch.Tensor:
    """a [1, I] bf16 = bf16(silu(g) * u), g = bf16(w1 x), u = bf16(w3 x) (W8A8), clamped as the
    shared expert (u to +-limit, g from above; limit 0 = none). One launch. Capture-safe."""
    if w3.shape != w1.shape or s3.shape != s1.shape:
        raise ValueError(f"fp8_swiglu: w1 {tuple(w1.shape)} / w3 {tuple(w3.shape)} differ")
    return _launch(x, w1, s1, w3, s3, out, limit, True, None, torch.bfloat16, config, native)


# ---- plain-torch references ---------------------------------------------------------------------

def fp8_linear_reference(x, w, s, *, quant_act=True, out_dtype=torch.bfloat16, group_k=None):
    """fp8_linear in plain torch (float64 sums of the exact operands, then rounded)."""
    xf = x.reshape(-1).to(torch.float32)
    if quant_act:
        xf = fp8_quant_dequant(xf, FP8_BLOCK)
    wd = dequantize_fp8_weight(w, s, torch.float64)
    if group_k is None:
        y = wd @ xf.double()
    else:
        G = xf.numel() // group_k
        y = torch.einsum("grk,gk->gr", wd.view(G, -1, group_k), xf.double().view(G, group_k))
    return y.reshape(1, -1).to(torch.float32).to(out_dtype)


def fp8_swiglu_reference(x, w1, s1, w3, s3, limit):
    """fp8_swiglu in plain torch (as MoE._ffn up to the bf16 cast of a)."""
    g = fp8_linear_reference(x, w1, s1).float()
    u = fp8_linear_reference(x, w3, s3).float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    return (torch.nn.functional.silu(g) * u).to(torch.bfloat16)
