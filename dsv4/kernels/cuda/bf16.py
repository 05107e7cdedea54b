"""The CUDA C++ bf16 GEMV behind `bf16_linear` for the LM head (csrc/bf16_gemv.cu via
dsv4.kernels.cuda.lib): which launches it takes, its config and launcher.

It takes head-sized matrices only (at least HEAD_MIN_ELEMENTS weights: the head and a tensor-
parallel rank's vocabulary rows of it), where the Triton GEMV read at ~81% of copy bandwidth.
The smaller bf16 GEMVs (gate, compressors, the indexer's weights_proj) stay on Triton: their bits
do not move. Semantics of both: float32 products and sums, each rounded (no FMA contraction), in
the kernel's own fixed order; a row's bits do not depend on the other rows of a launch (up to
MAX_X, the speculative verify rows) nor on the grid.
Tests: tests/dsv4/kernels/test_cuda_kernels.py (-m cuda).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common import device_sms, on_device, pdl
from . import lib as cuda_cpp

HEAD_MIN_ELEMENTS = 1 << 26     # 128 MB of bf16: Flash's head is 529.6 M weights, a TP4 rank's 132
SLICE = 512                     # K elements a warp (csrc: BF16_SLICE)
MAX_X = 4                       # activation rows a launch (csrc: BF16_MAX_X)
ROWS = 4                        # rows a tile (csrc: BF16_RT)
CTAS_PER_SM = 2                 # the fixed grid: two CTAs an SM up to 8 warps (K = 4,096; 120
                                # registers a thread), else one (Pro's 7,168: 14 warps)


@dataclass(frozen=True)
class Bf16CudaConfig:
    """The CUDA C++ bf16 GEMV's launch: ctas CTAs streaming the tiles (0: CTAS_PER_SM an SM of
    the device). The grid changes no bit."""
    ctas: int = 0


def _takes(K: int, out_dtype: torch.dtype, x_dtype: torch.dtype) -> bool:
    """What the kernel can run at all: K a multiple of 512 up to 8,192, float32 out, float32 or
    bf16 x."""
    return (K % SLICE == 0 and K // SLICE <= 16 and out_dtype == torch.float32
            and x_dtype in (torch.float32, torch.bfloat16))


def fits(N: int, K: int, T: int, out_dtype: torch.dtype, x_dtype: torch.dtype) -> bool:
    """Whether the CUDA kernel takes y [T, N] out_dtype = x [T, K] @ w [N, K]^T by default: a
    head-sized matrix it can run (_takes; T rows in launches of MAX_X)."""
    return N * K >= HEAD_MIN_ELEMENTS and T >= 1 and _takes(K, out_dtype, x_dtype)


def launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: Bf16CudaConfig,
           pdl_on: bool = True) -> torch.Tensor:
    """out [T, N] float32 = x [T, K] @ w [N, K]^T on the CUDA kernel, T rows in launches of at most
    MAX_X (a row's bits do not depend on the others); pdl_on: the backend's PDL switch."""
    N, K = w.shape
    T = x.numel() // K
    if not _takes(K, out.dtype, x.dtype):
        raise ValueError(f"bf16 GEMV (CUDA): w {tuple(w.shape)}, x {x.dtype}, out {out.dtype}; "
                         f"expected K a multiple of {SLICE} up to {16 * SLICE}, float32 out")
    x = x.contiguous()
    ctas = cfg.ctas or (CTAS_PER_SM if K // SLICE <= 8 else 1) * device_sms(out.device)
    lib = cuda_cpp.lib_for(out.device)
    with on_device(out):
        for t0 in range(0, T, MAX_X):
            nx = min(MAX_X, T - t0)
            cuda_cpp.bf16_gemv(lib, x.view(-1)[t0 * K:], w, out.view(-1)[t0 * N:], nx=nx,
                               ctas=ctas, pdl=pdl(out, pdl_on))
    return out
