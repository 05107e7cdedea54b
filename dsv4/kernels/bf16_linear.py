"""bf16-weight GEMV for one activation row (router gate, compressor, indexer weights_proj, LM head):
x [1, K] (bf16 or float32 values) @ w [N, K] bf16 -> [1, N], float32 accumulation, any N.
Test: `python -m pytest tests/dsv4/test_kernels.py`; bench: `python scripts/bench_kernels.py`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import Config, on_device, pick_config, round_bf16

TILE_BYTES = 16384   # weight bytes per program and step
BN_MAX = 16


@triton.jit
def _bf16_gemv_kernel(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    # x [K]; w [N, K] bf16; y [N]. One program: BN rows, K in steps of BK as [C, 8] 16-byte chunks.
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    if not EVEN_N:
        rows_ld = tl.minimum(rows, N - 1)     # clamp instead of masking the weight loads
    else:
        rows_ld = rows
    C: tl.constexpr = BK // 8
    koff = tl.arange(0, C)[:, None] * 8 + tl.arange(0, 8)[None, :]                # [C, 8]
    acc = tl.zeros([BN, C], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + koff
        if EVEN_K:
            x = tl.load(x_ptr + kk).to(tl.float32)
            w = tl.load(w_ptr + rows_ld[:, None, None] * K + kk[None, :, :])
        else:
            x = tl.load(x_ptr + kk, mask=kk < K, other=0).to(tl.float32)
            w = tl.load(w_ptr + rows_ld[:, None, None] * K + kk[None, :, :],
                        mask=(kk < K)[None, :, :], other=0)
        acc += tl.sum(w.to(tl.float32) * x[None, :, :], axis=2)
    y = tl.sum(acc, axis=1)
    if y_ptr.dtype.element_ty == tl.bfloat16:
        y = round_bf16(y)
    if EVEN_N:
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))
    else:
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


# measured best on an H200 by `bench_kernels.py --sweep` (2026-11-22); other shapes: heuristic
TUNED = {(1024, 4096): Config(1, 16, 4)}            # compressor wkv/wgate 4.7 -> 4.0 us


def bf16_config(n: int, k: int) -> Config:
    """Launch config: BN rows per program (the grid covers N with a clamped tail), BK = nb*128."""
    if (n, k) in TUNED:
        return TUNED[(n, k)]
    padded = -(-n // 128) * 128
    return pick_config(padded, k, TILE_BYTES, 2.0, bn_max=BN_MAX)


def bf16_linear(x: torch.Tensor, w: torch.Tensor, *, out_dtype: torch.dtype = torch.float32,
                out: torch.Tensor | None = None, config: Config | None = None) -> torch.Tensor:
    """y [1, N] = x [1, K] @ w^T, float32 accumulation of the exact products, rounded to out_dtype.
    x is used at its own precision (bf16 or float32). Capture-safe, deterministic."""
    N, K = w.shape
    if w.dtype != torch.bfloat16 or x.numel() != K:
        raise ValueError(f"bf16_linear: weight {tuple(w.shape)} {w.dtype}, x {tuple(x.shape)}; "
                         f"expected a bfloat16 weight [N, K] and K = {K} activation values")
    if N * K >= 2 ** 31:
        raise ValueError(f"bf16_linear: weight {tuple(w.shape)} too large for int32 offsets")
    cfg = config or bf16_config(N, K)
    bk = cfg.nb * 128
    if out is None:
        out = torch.empty(1, N, dtype=out_dtype, device=x.device)
    with on_device(out):
        _bf16_gemv_kernel[(triton.cdiv(N, cfg.bn),)](
            x.contiguous(), w, out, N, K=K, BN=cfg.bn, BK=bk, EVEN_N=N % cfg.bn == 0,
            EVEN_K=K % bk == 0, num_warps=cfg.num_warps)
    return out


def bf16_linear_reference(x, w, *, out_dtype=torch.float32):
    """bf16_linear in plain torch (float64 sums of the exact products, then rounded)."""
    y = w.double() @ x.reshape(-1).double()
    return y.reshape(1, -1).to(torch.float32).to(out_dtype)
