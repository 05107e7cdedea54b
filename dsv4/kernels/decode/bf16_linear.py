"""bf16-weight GEMV for a few activation rows (router gate, compressor, indexer weights_proj, LM
head; the head on the CUDA C++ kernel where the backend has it, kernels/cuda/bf16.py): x [T, K]
(bf16 or float32 values) @ w [N, K] bf16 -> [T, N], float32 accumulation, any N (T = 1 in
decoding; T > 1: the speculative verify rows, each with the bits of a one-row launch; a program
takes up to 4 rows, reading its weight tile once for them).
Test: `python -m pytest tests/dsv4/kernels/test_decode_kernels.py`; bench: `python scripts/bench_kernels.py`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import Config, launch_args, on_device, pdl_wait, pick_config, round_bf16
from ..cuda import bf16 as bf16_cuda
from ..cuda import lib as cuda_cpp
from ..cuda.bf16 import Bf16CudaConfig

TILE_BYTES = 16384   # weight bytes per program and step
BN_MAX = 16
# products and sums rounded each (no FMA contraction): the contraction the compiler picks can
# differ between a one-row and a T-row program, and so would a row's bits
FP_FUSION = False


@triton.jit
def _bf16_wload(wrow, kk, K: tl.constexpr, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(wrow + kk[None, :, :])
    return tl.load(wrow + kk[None, :, :], mask=(kk < K)[None, :, :], other=0)


@triton.jit
def _bf16_fma(acc, x_ptr, kk, w, K: tl.constexpr, EVEN_K: tl.constexpr):
    if EVEN_K:
        x = tl.load(x_ptr + kk).to(tl.float32)
    else:
        x = tl.load(x_ptr + kk, mask=kk < K, other=0).to(tl.float32)
    return acc + tl.sum(w.to(tl.float32) * x[None, :, :], axis=2)


@triton.jit
def _bf16_rows(x_ptr, w_ptr, y_ptr, pid, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, EVEN_K: tl.constexpr, TR: tl.constexpr, PDL: tl.constexpr):
    """Program `pid` of one matrix: y[r, rows] = w[rows] @ x[r] for the TR activation rows r at
    x_ptr + r * K (y_ptr + r * N), BN rows, K in steps of BK as [C, 8] 16-byte chunks (rows past
    N are clamped for the loads and not stored). Each weight tile is loaded once for the TR rows;
    every row has its own accumulator and the same operations as a one-row program (TR = 1),
    hence its bits. The caller has moved x_ptr / y_ptr to its first activation row."""
    rows = pid * BN + tl.arange(0, BN)
    EVEN_N: tl.constexpr = N % BN == 0
    if not EVEN_N:
        rows_ld = tl.minimum(rows, N - 1)     # clamp instead of masking the weight loads
    else:
        rows_ld = rows
    C: tl.constexpr = BK // 8
    koff = tl.arange(0, C)[:, None] * 8 + tl.arange(0, 8)[None, :]                # [C, 8]
    wrow = w_ptr + rows_ld[:, None, None] * K
    w = _bf16_wload(wrow, koff, K, EVEN_K)     # immutable: loads before the PDL wait
    pdl_wait(PDL)
    zero = tl.zeros([BN, C], tl.float32)
    acc0, acc1, acc2, acc3 = _bf16_fma_rows(zero, zero, zero, zero, x_ptr, koff, w, K, EVEN_K, TR)
    for k0 in range(BK, K, BK):
        kk = k0 + koff
        acc0, acc1, acc2, acc3 = _bf16_fma_rows(acc0, acc1, acc2, acc3, x_ptr, kk,
                                                _bf16_wload(wrow, kk, K, EVEN_K), K, EVEN_K, TR)
    _bf16_store(y_ptr, rows, acc0, N, EVEN_N)
    if TR > 1:
        _bf16_store(y_ptr + N, rows, acc1, N, EVEN_N)
    if TR > 2:
        _bf16_store(y_ptr + 2 * N, rows, acc2, N, EVEN_N)
    if TR > 3:
        _bf16_store(y_ptr + 3 * N, rows, acc3, N, EVEN_N)


@triton.jit
def _bf16_fma_rows(acc0, acc1, acc2, acc3, x_ptr, kk, w, K: tl.constexpr, EVEN_K: tl.constexpr,
                   TR: tl.constexpr):
    """One K step of the TR rows at x_ptr + r * K (r < TR; the others' accumulators unused)."""
    acc0 = _bf16_fma(acc0, x_ptr, kk, w, K, EVEN_K)
    if TR > 1:
        acc1 = _bf16_fma(acc1, x_ptr + K, kk, w, K, EVEN_K)
    if TR > 2:
        acc2 = _bf16_fma(acc2, x_ptr + 2 * K, kk, w, K, EVEN_K)
    if TR > 3:
        acc3 = _bf16_fma(acc3, x_ptr + 3 * K, kk, w, K, EVEN_K)
    return acc0, acc1, acc2, acc3


@triton.jit
def _bf16_store(y_ptr, rows, acc, N: tl.constexpr, EVEN_N: tl.constexpr):
    y = tl.sum(acc, axis=1)
    if y_ptr.dtype.element_ty == tl.bfloat16:
        y = round_bf16(y)
    if EVEN_N:
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))
    else:
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _bf16_gemv_kernel(x_ptr, w0, y0, w1, y1, w2, y2, w3, y3, w4, y4,
                      N0: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr, N3: tl.constexpr,
                      N4: tl.constexpr, NSEG: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, EVEN_K: tl.constexpr, TR: tl.constexpr, PDL: tl.constexpr):
    # x [T, K]; up to 5 matrices wi [Ni, K] bf16 -> yi [T, Ni] on the same x, one after the other
    # along grid axis 1 (cdiv(Ni, BN) programs each); axis 0: the group of TR activation rows
    # (T / TR groups). A program loads each weight tile once for its TR rows; each row keeps the
    # operations, hence the bits, of a one-row launch. (TR = 1 for T rows ran T programs a tile,
    # neighbours in launch order: the tile came from DRAM about once, but the verify rows' head
    # took ~1.75x the one-row head's time on an H200.)
    t = tl.program_id(0) * TR
    pid = tl.program_id(1)
    x_ptr += t * K
    y0 += t * N0
    y1 += t * N1
    y2 += t * N2
    y3 += t * N3
    y4 += t * N4
    P0: tl.constexpr = (N0 + BN - 1) // BN
    P1: tl.constexpr = P0 + (N1 + BN - 1) // BN
    P2: tl.constexpr = P1 + (N2 + BN - 1) // BN
    P3: tl.constexpr = P2 + (N3 + BN - 1) // BN
    if NSEG == 1:
        _bf16_rows(x_ptr, w0, y0, pid, N0, K, BN, BK, EVEN_K, TR, PDL)
    else:   # unused trailing matrices have N = 0: their branch is never taken
        if pid < P0:
            _bf16_rows(x_ptr, w0, y0, pid, N0, K, BN, BK, EVEN_K, TR, PDL)
        elif pid < P1:
            _bf16_rows(x_ptr, w1, y1, pid - P0, N1, K, BN, BK, EVEN_K, TR, PDL)
        elif pid < P2:
            _bf16_rows(x_ptr, w2, y2, pid - P1, N2, K, BN, BK, EVEN_K, TR, PDL)
        elif pid < P3:
            _bf16_rows(x_ptr, w3, y3, pid - P2, N3, K, BN, BK, EVEN_K, TR, PDL)
        else:
            _bf16_rows(x_ptr, w4, y4, pid - P3, N4, K, BN, BK, EVEN_K, TR, PDL)


# measured best on an H200 by `bench_kernels.py --sweep` (2026-11-22); other shapes: heuristic
TUNED = {(1024, 4096): Config(1, 16, 8)}            # compressor wkv/wgate 4.7 -> 3.0 us


def bf16_config(n: int, k: int) -> Config:
    """Launch config: BN rows per program (the grid covers N with a clamped tail), BK = nb*128."""
    if (n, k) in TUNED:
        return TUNED[(n, k)]
    padded = -(-n // 128) * 128
    return pick_config(padded, k, TILE_BYTES, 2.0, bn_max=BN_MAX)


MAX_MATRICES = 5
MAX_PROGRAMS = 65535   # grid axis 1
MAX_TR = 4             # activation rows a program (the verify rows of speculative decoding)


def rows_per_program(T: int) -> int:
    """TR: the most activation rows (<= MAX_TR) a program takes that divide T."""
    return next(tr for tr in range(min(T, MAX_TR), 0, -1) if T % tr == 0)


def _rows(x: torch.Tensor, K: int) -> int:
    """Activation rows of x ([T, K] or K values)."""
    if x.numel() == 0 or x.shape[-1] != K:
        raise ValueError(f"bf16_linear: x {tuple(x.shape)}; expected rows of {K} values")
    return x.numel() // K


def bf16_linear_multi(x: torch.Tensor, weights: list, out_dtypes: list, *,
                      config: Config | None = None, pdl: bool = True) -> list:
    """[x @ w^T for w in weights] in one launch (the bf16 projections of one activation row:
    compressor wkv/wgate, the indexer's compressor and weights_proj). Each like bf16_linear with
    its out dtype; the config is that of the concatenated rows."""
    if not 1 <= len(weights) <= MAX_MATRICES or len(out_dtypes) != len(weights):
        raise ValueError(f"bf16_linear_multi: {len(weights)} weights / {len(out_dtypes)} dtypes; "
                         f"expected 1..{MAX_MATRICES} of each")
    K = weights[0].shape[1]
    for w in weights:
        if w.dtype != torch.bfloat16 or w.dim() != 2 or w.shape[1] != K:
            raise ValueError(f"bf16_linear: weight {tuple(w.shape)} {w.dtype}, x {tuple(x.shape)};"
                             f" expected bfloat16 weights [N, {K}]")
        if w.shape[0] * K >= 2 ** 31:
            raise ValueError(f"bf16_linear: weight {tuple(w.shape)} too large for int32 offsets")
    T = _rows(x, K)
    ns = [w.shape[0] for w in weights]
    cfg = config or bf16_config(sum(ns), K)
    bk = cfg.nb * 128
    outs = [torch.empty(T, n, dtype=dt, device=x.device) for n, dt in zip(ns, out_dtypes)]
    pad = MAX_MATRICES - len(weights)
    ws, ys = list(weights) + [weights[0]] * pad, outs + [outs[0]] * pad
    nz = ns + [0] * pad
    tr = rows_per_program(T)
    grid = _grid(T // tr, sum(triton.cdiv(n, cfg.bn) for n in ns))
    with on_device(outs[0]):
        _bf16_gemv_kernel[grid](
            x.contiguous(), ws[0], ys[0], ws[1], ys[1], ws[2], ys[2], ws[3], ys[3], ws[4], ys[4],
            N0=nz[0], N1=nz[1], N2=nz[2], N3=nz[3], N4=nz[4], NSEG=len(weights), K=K, BN=cfg.bn,
            BK=bk, EVEN_K=K % bk == 0, TR=tr, num_warps=cfg.num_warps,
            enable_fp_fusion=FP_FUSION, **launch_args(outs[0], pdl))
    return outs


def bf16_linear(x: torch.Tensor, w: torch.Tensor, *, out_dtype: torch.dtype = torch.float32,
                out: torch.Tensor | None = None, config: Config | Bf16CudaConfig | None = None,
                impl: str = "triton", pdl: bool = True) -> torch.Tensor:
    """y [T, N] = x [T, K] @ w^T, float32 products and sums (each rounded), rounded to out_dtype
    (T = 1 in decoding; each row of a T-row launch has the bits of a one-row launch). x is used
    at its own precision (bf16 or float32). impl "cuda" (the backend's decision): head-sized
    matrices on the CUDA C++ kernel (kernels/cuda/bf16.py: its own fixed order, other bits than
    the Triton kernel's), the rest on Triton; a Bf16CudaConfig asks for the CUDA kernel. pdl:
    launch with PDL where the device has it (the backend's switch). Capture-safe,
    deterministic."""
    N, K = w.shape
    if w.dtype != torch.bfloat16:
        raise ValueError(f"bf16_linear: weight {tuple(w.shape)} {w.dtype}, x {tuple(x.shape)}; "
                         f"expected a bfloat16 weight [N, K]")
    T = _rows(x, K)
    if N * K >= 2 ** 31:
        raise ValueError(f"bf16_linear: weight {tuple(w.shape)} too large for int32 offsets")
    if out is None:
        out = torch.empty(T, N, dtype=out_dtype, device=x.device)
    elif out.numel() != T * N or not out.is_contiguous():
        raise ValueError(f"bf16_linear: out {tuple(out.shape)}; expected a contiguous {T}x{N}")
    asked = isinstance(config, Bf16CudaConfig)
    x = x.contiguous()
    if cuda_cpp.pick("bf16 GEMV", "cuda" if asked else impl, x, w, out, strict=asked,
                     fits=asked or bf16_cuda.fits(N, K, T, out.dtype, x.dtype)):
        return bf16_cuda.launch(x, w, out, config if asked else Bf16CudaConfig(), pdl)
    cfg = config or bf16_config(N, K)
    bk = cfg.nb * 128
    tr = rows_per_program(T)
    with on_device(out):
        _bf16_gemv_kernel[_grid(T // tr, triton.cdiv(N, cfg.bn))](
            x, w, out, w, out, w, out, w, out, w, out, N0=N, N1=0, N2=0, N3=0, N4=0,
            NSEG=1, K=K, BN=cfg.bn, BK=bk, EVEN_K=K % bk == 0, TR=tr, num_warps=cfg.num_warps,
            enable_fp_fusion=FP_FUSION, **launch_args(out, pdl))
    return out


def _grid(T: int, programs: int) -> tuple[int, int]:
    if programs > MAX_PROGRAMS:
        raise ValueError(f"bf16_linear: {programs} programs per row exceed {MAX_PROGRAMS}")
    return T, programs


def bf16_linear_reference(x, w, *, out_dtype=torch.float32):
    """bf16_linear in plain torch (float64 sums of the exact products, then rounded)."""
    y = x.reshape(-1, w.shape[1]).double() @ w.double().T
    return y.to(torch.float32).to(out_dtype)
