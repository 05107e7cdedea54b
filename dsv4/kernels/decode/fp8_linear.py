"""FP8 (e4m3, 128x128 ue8m0) GEMV for a few activation rows: W8A8 `fp8_linear`, the fused
shared-expert `fp8_swiglu`, and grouped wo_a (no act quant). x [T, K] -> y [T, N]; weights w [N, K],
s [N/128, K/128] (T = 1 in decoding; T > 1, the speculative verify rows, reads each weight once in
the CUDA kernels). Implementations with the same semantics (float32 sums of the exact products, in
different orders): the CUDA C++ kernels (csrc/fp8_gemv.cu, fp8_mma.cu; configs and launchers in
kernels/cuda/fp8.py: the tensor-core kernel for the shapes it fits, else the CUDA-core one; the default
where the library is available) and the Triton kernel below (the fallback, and the interpreter
tests). `impl=` (the backend's decision: "cuda" or "triton") / the config type pick one.
Test: `python -m pytest tests/dsv4/kernels/test_decode_kernels.py`; bench: `python scripts/bench_kernels.py`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...numerics.quant import fp8_quant_dequant
from ...weights.formats import FP8_BLOCK, dequantize_fp8_weight
from ..common import (
    Config,
    CudaConfig,
    MmaConfig,
    block_exponent,
    e4m3_to_f32,
    e8m0_to_f32,
    interpreting,
    launch_args,
    on_device,
    pdl_wait,
    pick_config,
    quant_dequant,
    round_bf16,
)
from ..cuda import lib as cuda_cpp
from ..cuda.fp8 import cuda_config, launch_cuda, launch_mma, mma_config

TILE_BYTES = 16384   # weight bytes per program and step (one matrix); half of it for fp8_swiglu


@triton.jit
def _fp8_wload(w_ptr, s_ptr, rows, k0, K: tl.constexpr, srow, NB: tl.constexpr,
               EVEN_K: tl.constexpr):
    """Weight bytes [BN, C, 16] (u8) and block scales [NB] (f32) of rows x K-chunk [k0, k0+NB*128)."""
    C: tl.constexpr = NB * 8
    kb = tl.arange(0, NB)
    koff = k0 + tl.arange(0, C)[:, None] * 16 + tl.arange(0, 16)[None, :]       # [C, 16]
    if EVEN_K:
        sw = e8m0_to_f32(tl.load(s_ptr + srow + k0 // 128 + kb))
        w = tl.load(w_ptr + rows[:, None, None] * K + koff[None, :, :])
    else:
        sw = e8m0_to_f32(tl.load(s_ptr + srow + k0 // 128 + kb, mask=k0 + kb * 128 < K, other=0))
        w = tl.load(w_ptr + rows[:, None, None] * K + koff[None, :, :],
                    mask=(koff < K)[None, :, :], other=0)
    return w, sw


@triton.jit
def _fp8_x(xg, k0, K: tl.constexpr, NB: tl.constexpr, EVEN_K: tl.constexpr, QUANT: tl.constexpr,
           NATIVE: tl.constexpr):
    """Activation chunk [NB, 128] (float32), act-quantized (QUANT), pre-scaled for the decode."""
    xoff = k0 + tl.arange(0, NB)[:, None] * 128 + tl.arange(0, 128)[None, :]
    if EVEN_K:
        xb = tl.load(xg + xoff).to(tl.float32)
    else:
        xb = tl.load(xg + xoff, mask=xoff < K, other=0).to(tl.float32)
    if QUANT:   # act_quant per 128: exact e4m3 * 2^e values
        xb = quant_dequant(xb, block_exponent(xb)[:, None])
    if not NATIVE:
        xb = xb * 256.0   # the bit-path decode returns w * 2^-8
    return xb


@triton.jit
def _fp8_fma(acc, xb, w, sw, NATIVE: tl.constexpr, NB: tl.constexpr):
    """acc [BN, C] += 16-wide partial dots of the weight chunk w with xb (C = NB*8)."""
    xe = tl.reshape(xb * sw[:, None], [NB * 8, 16])                             # x * weight scale
    return acc + tl.sum(e4m3_to_f32(w, NATIVE) * xe[None, :, :], axis=2)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, w3_ptr, s3_ptr, y_ptr, wb_ptr, sb_ptr, yb_ptr, add_ptr,
                     limit, K: tl.constexpr, NG: tl.constexpr, PA: tl.constexpr,
                     QUANT: tl.constexpr, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr,
                     TWO: tl.constexpr, HAS_ADD: tl.constexpr,
                     NATIVE: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                     EVEN_K: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr):
    # x [G*K] (G = N / NG groups: rows [g*NG, (g+1)*NG) read x[g*K, (g+1)*K)); w, w3 [N, K] u8;
    # s, s3 [N/128, K/128] u8; y [N]. One program: BN rows (inside one 128-row scale block).
    # TWO: programs >= PA compute a second matrix wb/sb -> yb on the same x (ungrouped).
    # HAS_ADD: y = out_dtype(add + bf16(x @ w^T)) with add [N] float32.
    pid = tl.program_id(0)
    wp, sp, yp = w_ptr, s_ptr, y_ptr
    if TWO:
        if pid >= PA:
            pid -= PA
            wp, sp, yp = wb_ptr, sb_ptr, yb_ptr
    n0 = pid * BN
    rows = n0 + tl.arange(0, BN)
    xg = x_ptr + (n0 // NG) * K
    srow = (n0 // 128) * (K // 128)
    BK: tl.constexpr = NB * 128
    # the first weight chunk is immutable: it loads before the PDL wait (overlaps the previous kernel)
    w, sw = _fp8_wload(wp, sp, rows, 0, K, srow, NB, EVEN_K)
    if SWIGLU:
        w3, sw3 = _fp8_wload(w3_ptr, s3_ptr, rows, 0, K, srow, NB, EVEN_K)
    pdl_wait(PDL)
    xb = _fp8_x(xg, 0, K, NB, EVEN_K, QUANT, NATIVE)
    acc = _fp8_fma(tl.zeros([BN, NB * 8], tl.float32), xb, w, sw, NATIVE, NB)
    if SWIGLU:
        acc3 = _fp8_fma(tl.zeros([BN, NB * 8], tl.float32), xb, w3, sw3, NATIVE, NB)
    if PREFETCH:   # software pipeline: the next chunk's weights load during this chunk's math
        if BK < K:
            w, sw = _fp8_wload(wp, sp, rows, BK, K, srow, NB, EVEN_K)
            if SWIGLU:
                w3, sw3 = _fp8_wload(w3_ptr, s3_ptr, rows, BK, K, srow, NB, EVEN_K)
        for k0 in range(BK, K, BK):
            wc, swc = w, sw
            if SWIGLU:
                w3c, sw3c = w3, sw3
            if k0 + BK < K:
                w, sw = _fp8_wload(wp, sp, rows, k0 + BK, K, srow, NB, EVEN_K)
                if SWIGLU:
                    w3, sw3 = _fp8_wload(w3_ptr, s3_ptr, rows, k0 + BK, K, srow, NB, EVEN_K)
            xb = _fp8_x(xg, k0, K, NB, EVEN_K, QUANT, NATIVE)
            acc = _fp8_fma(acc, xb, wc, swc, NATIVE, NB)
            if SWIGLU:
                acc3 = _fp8_fma(acc3, xb, w3c, sw3c, NATIVE, NB)
    else:
        for k0 in range(BK, K, BK):
            xb = _fp8_x(xg, k0, K, NB, EVEN_K, QUANT, NATIVE)
            w, sw = _fp8_wload(wp, sp, rows, k0, K, srow, NB, EVEN_K)
            acc = _fp8_fma(acc, xb, w, sw, NATIVE, NB)
            if SWIGLU:
                w3, sw3 = _fp8_wload(w3_ptr, s3_ptr, rows, k0, K, srow, NB, EVEN_K)
                acc3 = _fp8_fma(acc3, xb, w3, sw3, NATIVE, NB)
    y = tl.sum(acc, axis=1)
    if SWIGLU:   # fp8_gemm outputs bf16; the clamped SwiGLU runs in fp32 on those values
        g = round_bf16(y)
        u = round_bf16(tl.sum(acc3, axis=1))
        if HAS_LIMIT:
            u = tl.minimum(tl.maximum(u, -limit), limit)
            g = tl.minimum(g, limit)
        y = g / (1.0 + tl.exp(-g)) * u
    if HAS_ADD:   # the linear's bf16 output, then the float32 residual sum
        y = round_bf16(y) + tl.load(add_ptr + rows)
    if yp.dtype.element_ty == tl.bfloat16:
        y = round_bf16(y)
    tl.store(yp + rows, y.to(yp.dtype.element_ty))


# Configs measured best on an H200 by `scripts/bench_kernels.py --sweep` (2026-11-22, second sweep
# with PDL and the prefetch variant; times: heuristic default in the first sweep -> best) for the
# Flash shapes, keyed (N, K, rows per group, dual); other shapes use the heuristic below.
TUNED = {
    (1024, 4096, 1024, False): Config(4, 32, 8),          # wq_a          4.9 -> 2.6 us
    (1536, 4096, 1536, False): Config(8, 32, 8),          # wq_a+wkv      5.9 -> 3.6 us
    (32768, 1024, 32768, False): Config(16, 8, 4),        # wq_b         16.2 -> 15.0 us
    (8192, 4096, 1024, False): Config(16, 8, 8),          # wo_a G=8     15.6 -> 14.0 us
    (4096, 8192, 4096, False): Config(4, 16, 8),          # wo_b         23.9 -> 15.2 us
    (2048, 4096, 2048, True): Config(4, 16, 4, True),     # shared w1+w3  8.1 -> 6.8 us
    (4096, 2048, 4096, False): Config(8, 16, 4),          # shared w2     5.9 -> 4.4 us
}


def fp8_config(n: int, k: int, ng: int, dual: bool = False) -> Config:
    """Launch config for N = n output rows (groups of ng rows), K = k (per group)."""
    if (n, k, ng, dual) in TUNED:
        return TUNED[(n, k, ng, dual)]
    return pick_config(min(n, ng, 128), k, TILE_BYTES // (2 if dual else 1), 1.0,
                       programs_per_row=max(1, n // min(n, ng, 128)))


def _check(w, s, what="fp8 GEMV"):
    N, K = w.shape
    if w.dtype != torch.float8_e4m3fn or N % FP8_BLOCK or K % FP8_BLOCK:
        raise ValueError(f"{what}: weight {tuple(w.shape)} {w.dtype}; expected float8_e4m3fn "
                         f"with both dims multiples of {FP8_BLOCK}")
    if tuple(s.shape) != (N // FP8_BLOCK, K // FP8_BLOCK):
        raise ValueError(f"{what}: scale {tuple(s.shape)}; expected {(N // 128, K // 128)}")
    if N * K >= 2 ** 31:
        raise ValueError(f"{what}: weight {tuple(w.shape)} too large for int32 offsets")
    return N, K


def _launch(x, w, s, w3, s3, out, limit, quant, group_k, out_dtype, config, native, second=None,
            add=None, impl="cuda", strict=False, pdl=True):
    """One launch: y = x @ w (+ w3 SwiGLU, + add); second = (wb, sb, outb): programs past the
    first matrix's compute wb on the same x into outb. x [T, G*K]: T activation rows (T > 1: the
    CUDA kernel reads each weight once for all rows; Triton launches once per row)."""
    N, K = _check(w, s)
    L = x.shape[-1] if x.dim() else 0                      # values per activation row
    G = 1 if group_k is None else L // group_k
    if group_k is not None and (group_k != K or L % K or N % (G * FP8_BLOCK)):
        raise ValueError(f"grouped fp8 GEMV: x {tuple(x.shape)}, group_k {group_k}, weight "
                         f"{tuple(w.shape)}; need group_k == K and N a multiple of 128 * G")
    if L != G * K or x.numel() == 0:
        raise ValueError(f"fp8 GEMV: x {tuple(x.shape)} has rows of {L} values; expected {G * K}")
    T = x.numel() // L
    if add is not None and (add.numel() != T * N or add.dtype != torch.float32):
        raise ValueError(f"fp8 GEMV: add {tuple(add.shape)} {add.dtype}; expected {T}x{N} float32")
    ng = N // G
    nb_rows = N
    if second is not None:
        Nb, Kb = _check(second[0], second[1], "fp8 GEMV (second matrix)")
        if Kb != K or G != 1:
            raise ValueError(f"fp8 GEMV: second weight {tuple(second[0].shape)} needs K = {K}")
        if second[2].numel() != T * Nb or not second[2].is_contiguous():
            raise ValueError(f"fp8 GEMV: second output {tuple(second[2].shape)}; expected {T}x{Nb}")
        nb_rows = N + Nb
    if out is None:
        out = torch.empty(T, N, dtype=out_dtype, device=x.device)
    elif out.numel() != T * N or not out.is_contiguous():
        raise ValueError(f"fp8 GEMV: out {tuple(out.shape)}; expected a contiguous {T}x{N}")
    xc = x.contiguous()
    extra = (() if second is None else second) + (() if w3 is None else (w3,))
    # the bit-path decode (native) and the add epilogue are Triton-only
    cuda_cfg = isinstance(config, (CudaConfig, MmaConfig))
    if cuda_cpp.pick("fp8 GEMV", impl, xc, w, out, *extra,
                     declined=isinstance(config, Config) or native is not None or add is not None,
                     strict=strict or cuda_cfg):
        nm = 1 if w3 is None else 2
        seg = (N,) if second is None else (N, nb_rows - N)
        ccfg = config if cuda_cfg else (
            mma_config(nb_rows, K, seg, ng if G > 1 else 0, nm, quant, xc.dtype)
            or cuda_config(nb_rows, K, seg, ng if G > 1 else 0, nm))
        if isinstance(ccfg, MmaConfig):
            launch_mma(xc, w, s, w3, s3, out, limit, quant, ng if G > 1 else 0, nb_rows, K, ccfg,
                       second, T, pdl)
            return out
        if ccfg is not None:
            launch_cuda(xc, w, s, w3, s3, out, limit, quant, ng if G > 1 else 0, nb_rows, K,
                        ccfg, second, T, pdl)
            return out
        if cuda_cfg or strict:
            raise ValueError(f"fp8 GEMV: no CUDA config for {nb_rows} rows, K = {K}")
    if T > 1:   # Triton: one launch per activation row (each weight read T times)
        xr, o2 = xc.view(T, L), out.view(T, N)
        for t in range(T):
            sec = None if second is None else (second[0], second[1], second[2].view(T, -1)[t:t + 1])
            _launch(xr[t:t + 1], w, s, w3, s3, o2[t:t + 1], limit, quant, group_k, out_dtype,
                    config, native, sec, None if add is None else add.view(T, N)[t:t + 1],
                    "triton", pdl)
        return out
    cfg = config or fp8_config(nb_rows, K, nb_rows if second is not None else ng,
                               dual=w3 is not None)
    if N % cfg.bn or nb_rows % cfg.bn:
        raise ValueError(f"fp8 GEMV: config {cfg} does not divide N = {N} / {nb_rows}")
    native = (not interpreting()) if native is None else native
    w3 = w if w3 is None else w3
    s3 = s if s3 is None else s3
    wb, sb, yb = second if second is not None else (w, s, out)
    with on_device(out):
        _fp8_gemv_kernel[(nb_rows // cfg.bn,)](
            xc, w.view(torch.uint8), s.view(torch.uint8), w3.view(torch.uint8),
            s3.view(torch.uint8), out, wb.view(torch.uint8), sb.view(torch.uint8), yb,
            out if add is None else add, float(limit), K=K, NG=ng, PA=N // cfg.bn,
            QUANT=quant, SWIGLU=w3 is not w, HAS_LIMIT=limit > 0, TWO=second is not None,
            HAS_ADD=add is not None, NATIVE=native, BN=cfg.bn,
            NB=cfg.nb, EVEN_K=K % (cfg.nb * 128) == 0, PREFETCH=cfg.prefetch and cfg.nb * 128 < K,
            num_warps=cfg.num_warps, **launch_args(out, pdl))
    return out


def fp8_linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, *, quant_act: bool = True,
               out_dtype: torch.dtype = torch.bfloat16, group_k: int | None = None,
               out: torch.Tensor | None = None, config: Config | CudaConfig | None = None,
               native: bool | None = None, add: torch.Tensor | None = None,
               impl: str = "cuda", strict: bool = False, pdl: bool = True) -> torch.Tensor:
    """y [T, N] = x [T, K] @ dequant(w)^T with float32 accumulation, rounded to out_dtype (T
    activation rows, each with the bits of a one-row call: the speculative step's verify rows).

    quant_act: W8A8 as the official linear (x -> e4m3 per 128 with ue8m0 scales); off for wo_a.
    group_k: rows [g*N/G, (g+1)*N/G) read x[g*group_k, (g+1)*group_k) (x [1, G*group_k], w
    [N, group_k]): the grouped wo_a in one launch. x bf16 or float32. Capture-safe, deterministic.
    add ([1, N] float32): y = out_dtype(add + bf16(x @ w^T)) (Triton only).
    impl: "cuda" (the CUDA kernel where it serves this launch, else Triton) or "triton"; strict:
    the CUDA kernel or a ValueError. pdl: launch with PDL where the device has it (the backend's
    switch).
    """
    return _launch(x, w, s, None, None, out, 0.0, quant_act, group_k, out_dtype, config, native,
                   add=add, impl=impl, strict=strict, pdl=pdl)


def fp8_linear2(x: torch.Tensor, wa: torch.Tensor, sa: torch.Tensor, wb: torch.Tensor,
                sb: torch.Tensor, *, config: Config | CudaConfig | None = None,
                native: bool | None = None, impl: str = "cuda", strict: bool = False,
                pdl: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ wa^T, x @ wb^T), both W8A8 bf16 [T, N], in one launch (wq_a and wkv read the same x).
    Equal to two fp8_linear calls with the same config."""
    yb = torch.empty(x.numel() // x.shape[-1], wb.shape[0], dtype=torch.bfloat16,
                     device=x.device)
    ya = _launch(x, wa, sa, None, None, None, 0.0, True, None, torch.bfloat16, config, native,
                 second=(wb, sb, yb), impl=impl, strict=strict, pdl=pdl)
    return ya, yb


def fp8_swiglu(x: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor,
               s3: torch.Tensor, limit: float, *, out: torch.Tensor | None = None,
               config: Config | CudaConfig | None = None, native: bool | None = None,
               impl: str = "cuda", strict: bool = False, pdl: bool = True) -> torch.Tensor:
    """a [T, I] bf16 (x [T, K]) = bf16(silu(g) * u), g = bf16(w1 x), u = bf16(w3 x) (W8A8), clamped as the
    shared expert (u to +-limit, g from above; limit 0 = none). One launch. Capture-safe."""
    if w3.shape != w1.shape or s3.shape != s1.shape:
        raise ValueError(f"fp8_swiglu: w1 {tuple(w1.shape)} / w3 {tuple(w3.shape)} differ")
    return _launch(x, w1, s1, w3, s3, out, limit, True, None, torch.bfloat16, config, native,
                   impl=impl, strict=strict, pdl=pdl)


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
