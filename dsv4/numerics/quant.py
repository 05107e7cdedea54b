"""Activation quantization inside the forward: the official act_quant (FP8, ue8m0) and fp4_act_quant.

All of it is fake-quant or W8A8 prep in float32 with the official rounding: block amax floored,
scale = 2^ceil(log2(amax * fp32(1/max))) from the float32 bit pattern, values clamped and rounded
to nearest-even onto the e4m3 / e2m1 grid. Capture-safe (no host syncs, fixed shapes).
"""
from __future__ import annotations

import torch

from ..weights.formats import (
    ACT_AMAX_FLOOR,
    FP4_AMAX_FLOOR,
    FP4_MAX,
    FP4_MAX_INV,
    FP8_MAX,
    FP8_MAX_INV,
    pow2_scale,
    round_e2m1,
)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"activation quant: last dim {x.shape[-1]} is not a multiple of {block}")
    return x.to(torch.float32).unflatten(-1, (x.shape[-1] // block, block))


def fp8_quant_dequant(x: torch.Tensor, block: int = 128, out_dtype: torch.dtype | None = None
                      ) -> torch.Tensor:
    """x -> e4m3 per `block` with ue8m0 scales -> dequantized values, in `out_dtype` (default x's).

    As the official `act_quant(..., scale_fmt="ue8m0")`: the in-place form (fake-quant of the KV,
    block 64) and, with block 128, the exact operand of an FP8/FP4 GEMM (W8A8): e4m3 x 2^k is
    exact in bf16 and float32, so a matmul over these values equals fp8_gemm up to summation order.
    """
    xb = _blocks(x, block)                                              # [..., nb, block]
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp_min(ACT_AMAX_FLOOR)
    s = pow2_scale(amax, FP8_MAX_INV)
    q = (xb / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return (q * s).flatten(-2).to(out_dtype or x.dtype)


def fp4_quant_dequant(x: torch.Tensor, block: int = 32, out_dtype: torch.dtype | None = None
                      ) -> torch.Tensor:
    """x -> e2m1 per `block` with ue8m0 scales -> dequantized values (official fp4_act_quant, in place)."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp_min(FP4_AMAX_FLOOR)
    s = pow2_scale(amax, FP4_MAX_INV)
    q = round_e2m1((xb / s).clamp(-FP4_MAX, FP4_MAX))
    return (q * s).flatten(-2).to(out_dtype or x.dtype)


def hadamard_matrix(n: int, device=None) -> torch.Tensor:
    """Sylvester-ordered n x n Hadamard matrix (entries ±1, float32); n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def hadamard(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Normalized Walsh-Hadamard over the last dim (fast_hadamard_transform with scale n^-1/2):
    float32 compute, result in x's dtype. `h` from `hadamard_matrix` (symmetric)."""
    n = x.shape[-1]
    return ((x.to(torch.float32) @ h) * (n ** -0.5)).to(x.dtype)
