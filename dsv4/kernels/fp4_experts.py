"""Routed FP4 experts of one decode token in two launches: `fp4_experts_up` (w1, w3, clamped SwiGLU,
route weight) -> a [k, I] bf16, and `fp4_experts_down` (w2, per-expert bf16, fp32 sum in order) ->
y [1, D] float32. Weights [E, out, in/2] int8 (e2m1 pairs) + [E, out, in/32] ue8m0. Test:
`python -m pytest tests/dsv4/test_kernels.py`; bench: `python scripts/bench_kernels.py`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..formats import FP4_BLOCK, dequantize_fp4_weight
from ..quant import fp8_quant_dequant
from .common import (Config, block_exponent, e2m1_pair_to_f32, e8m0_to_f32, launch_args,
                     on_device, pdl_wait, pick_config, quant_dequant, round_bf16)

# Sized from the sm_90 SASS (python -m dsv4.kernels.aot): ~5.6 (up) / ~6.5 (down) instructions per
# weight element with <= 128 registers, so several programs per SM keep two steps of loads in flight.
UP_TILE_BYTES = 4096     # packed bytes per program, step and matrix (w1 and w3: twice that)
DOWN_TILE_BYTES = 8192
BN_MAX = 16              # rows per program: more rows amortize the act quant, fewer keep programs many
DOWN_TARGET = 256        # the down kernel keeps BN = 16 (x work per row) over more programs


@triton.jit
def _x_quant(x_ptr, k0, K: tl.constexpr, NB: tl.constexpr, EVEN_K: tl.constexpr):
    """act_quant of the chunk [k0, k0 + NB*128) in a compact layout (each value quantized once),
    split by position inside the 8-element words: lo[p] / hi[p] [G, 4] hold elements 8q+p /
    8q+p+4 of word q = 4g+w, times 2^14 (e2m1_pair_to_f32 returns value * 2^-14)."""
    G: tl.constexpr = NB * 4
    xoff = k0 + tl.arange(0, NB)[:, None] * 128 + tl.arange(0, 128)[None, :]
    if EVEN_K:
        xb = tl.load(x_ptr + xoff).to(tl.float32)
    else:
        xb = tl.load(x_ptr + xoff, mask=xoff < K, other=0).to(tl.float32)
    xq = quant_dequant(xb, block_exponent(xb)[:, None]) * 16384.0             # [NB, 128]
    x5 = tl.reshape(xq, [G, 4, 2, 2, 2])          # [g, w, a, b, c]: element 8q + 4a + 2b + c
    c0, c1 = tl.split(x5)
    c0b0, c0b1 = tl.split(c0)
    c1b0, c1b1 = tl.split(c1)
    l0, h0 = tl.split(c0b0)
    l1, h1 = tl.split(c1b0)
    l2, h2 = tl.split(c0b1)
    l3, h3 = tl.split(c1b1)
    return (l0, l1, l2, l3), (h0, h1, h2, h3)


@triton.jit
def _w_load(w_ptr, s_ptr, wrow, srow, k0, K: tl.constexpr, NB: tl.constexpr,
            EVEN_K: tl.constexpr):
    """Words [BN, G, 4] (int32, 8 e2m1 each) and scales [BN, G] (float32) of the K-chunk at k0."""
    G: tl.constexpr = NB * 4
    gg = tl.arange(0, G)
    wo = (k0 // 8 + gg[:, None] * 4 + tl.arange(0, 4)[None, :])[None, :, :]   # [1, G, 4]
    so = (k0 // 32 + gg)[None, :]
    if EVEN_K:
        w = tl.load(w_ptr + wrow[:, None, None] + wo)
        s = tl.load(s_ptr + srow[:, None] + so)
    else:
        w = tl.load(w_ptr + wrow[:, None, None] + wo, mask=wo < K // 8, other=0)
        s = tl.load(s_ptr + srow[:, None] + so, mask=so < K // 32, other=0)
    return w, e8m0_to_f32(s)


@triton.jit
def _nibble_fma(t, w, p: tl.constexpr, xlo, xhi):
    """t [BN, G, 4] += e2m1(nibble p) * xlo + e2m1(nibble p+4) * xhi for every word of w."""
    lo, hi = e2m1_pair_to_f32(w >> (4 * p))
    return t + lo * xlo[None, :, :] + hi * xhi[None, :, :]


@triton.jit
def _fp4_up_kernel(x_ptr, idx_ptr, rw_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, a_ptr, limit,
                   I: tl.constexpr, D: tl.constexpr, HAS_LIMIT: tl.constexpr, BN: tl.constexpr,
                   NB: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    # x [D] bf16; idx [k] int64; rw [k] f32; w1, w3 [E, I, D/8] int32; s1, s3 [E, I, D/32] u8;
    # a [k, I] bf16. Program (i, j): rows [i*BN, (i+1)*BN) of expert idx[j].
    pdl_wait(PDL)
    j = tl.program_id(1)
    e = tl.load(idx_ptr + j).to(tl.int64)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    wrow = e * I * (D // 8) + rows * (D // 8)
    srow = e * I * (D // 32) + rows * (D // 32)
    G: tl.constexpr = NB * 4
    BK: tl.constexpr = NB * 128
    STEPS: tl.constexpr = (D + BK - 1) // BK
    acc1 = tl.zeros([BN, G], tl.float32)
    acc3 = tl.zeros([BN, G], tl.float32)
    w1n, s1n = _w_load(w1_ptr, s1_ptr, wrow, srow, 0, D, NB, EVEN_K)
    w3n, s3n = _w_load(w3_ptr, s3_ptr, wrow, srow, 0, D, NB, EVEN_K)
    for st in range(STEPS):
        k0 = st * BK
        w1, sc1, w3, sc3 = w1n, s1n, w3n, s3n
        if st + 1 < STEPS:   # prefetch: the next chunk's loads overlap this chunk's math
            w1n, s1n = _w_load(w1_ptr, s1_ptr, wrow, srow, k0 + BK, D, NB, EVEN_K)
            w3n, s3n = _w_load(w3_ptr, s3_ptr, wrow, srow, k0 + BK, D, NB, EVEN_K)
        xl, xh = _x_quant(x_ptr, k0, D, NB, EVEN_K)
        t1 = tl.zeros([BN, G, 4], tl.float32)
        t3 = tl.zeros([BN, G, 4], tl.float32)
        for p in tl.static_range(4):
            t1 = _nibble_fma(t1, w1, p, xl[p], xh[p])
            t3 = _nibble_fma(t3, w3, p, xl[p], xh[p])
        acc1 += tl.sum(t1, axis=2) * sc1      # per-32 weight scale on each group's partial dot
        acc3 += tl.sum(t3, axis=2) * sc3
    g = round_bf16(tl.sum(acc1, axis=1))      # fp4_gemm outputs bf16
    u = round_bf16(tl.sum(acc3, axis=1))
    if HAS_LIMIT:
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
    a = g / (1.0 + tl.exp(-g)) * u * tl.load(rw_ptr + j)
    tl.store(a_ptr + j * I + rows, round_bf16(a).to(tl.bfloat16))


@triton.jit
def _down_load(idx_ptr, w2_ptr, s2_ptr, rows, t, D: tl.constexpr, I: tl.constexpr,
               NB: tl.constexpr, STEPS: tl.constexpr, EVEN_K: tl.constexpr):
    """Words and scales of flattened step t = (expert slot t // STEPS, K-chunk t % STEPS)."""
    e = tl.load(idx_ptr + t // STEPS).to(tl.int64)
    wrow = e * D * (I // 8) + rows * (I // 8)
    srow = e * D * (I // 32) + rows * (I // 32)
    return _w_load(w2_ptr, s2_ptr, wrow, srow, (t % STEPS) * (NB * 128), I, NB, EVEN_K)


@triton.jit
def _fp4_down_kernel(a_ptr, idx_ptr, w2_ptr, s2_ptr, y_ptr, D: tl.constexpr, I: tl.constexpr,
                     TOPK: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                     EVEN_K: tl.constexpr, PDL: tl.constexpr):
    # a [k, I] bf16; idx [k] int64; w2 [E, D, I/8] int32; s2 [E, D, I/32] u8; y [D] f32.
    # One program: BN output rows, all k experts in slot order (fixed fp32 summation order);
    # the (expert, K-chunk) steps run as one loop so the next step's weights load during this one.
    pdl_wait(PDL)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    G: tl.constexpr = NB * 4
    STEPS: tl.constexpr = (I + NB * 128 - 1) // (NB * 128)
    y = tl.zeros([BN], tl.float32)
    acc = tl.zeros([BN, G], tl.float32)
    wn, sn = _down_load(idx_ptr, w2_ptr, s2_ptr, rows, 0, D, I, NB, STEPS, EVEN_K)
    for t in range(TOPK * STEPS):
        w, sc = wn, sn
        if t + 1 < TOPK * STEPS:
            wn, sn = _down_load(idx_ptr, w2_ptr, s2_ptr, rows, t + 1, D, I, NB, STEPS, EVEN_K)
        xl, xh = _x_quant(a_ptr + (t // STEPS) * I, (t % STEPS) * (NB * 128), I, NB, EVEN_K)
        tt = tl.zeros([BN, G, 4], tl.float32)
        for p in tl.static_range(4):
            tt = _nibble_fma(tt, w, p, xl[p], xh[p])
        acc += tl.sum(tt, axis=2) * sc
        if t % STEPS == STEPS - 1:             # expert done: its output is bf16, summed in fp32
            y += round_bf16(tl.sum(acc, axis=1))
            acc = tl.zeros([BN, G], tl.float32)
    tl.store(y_ptr + rows, y)


# measured best on an H200 by `bench_kernels.py --sweep` (2026-11-22) for Flash (k, I, D)
TUNED_UP = {(6, 2048, 4096): Config(16, 2, 4)}      # 37.0 -> 32.7 us
TUNED_DOWN = {(6, 2048, 4096): Config(16, 16, 8)}   # 24.4 -> 21.4 us


def up_config(k: int, inter: int, dim: int) -> Config:
    if (k, inter, dim) in TUNED_UP:
        return TUNED_UP[(k, inter, dim)]
    return pick_config(inter, dim, UP_TILE_BYTES, 0.5, programs_per_row=k, bn_max=BN_MAX)


def down_config(k: int, inter: int, dim: int) -> Config:
    if (k, inter, dim) in TUNED_DOWN:
        return TUNED_DOWN[(k, inter, dim)]
    return pick_config(dim, inter, DOWN_TILE_BYTES, 0.5, bn_max=BN_MAX, target=DOWN_TARGET)


def _check(w, s, what):
    E, n, kh = w.shape
    if w.dtype != torch.int8 or tuple(s.shape) != (E, n, kh * 2 // FP4_BLOCK) or (kh * 2) % 128:
        raise ValueError(f"{what}: weight {tuple(w.shape)} {w.dtype}, scale {tuple(s.shape)}; "
                         f"expected int8 [E, out, in/2] and [E, out, in/32] with in % 128 == 0")
    return E, n, kh * 2


def fp4_experts_up(x: torch.Tensor, idx: torch.Tensor, route_w: torch.Tensor, w1: torch.Tensor,
                   s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor, limit: float, *,
                   out: torch.Tensor | None = None, config: Config | None = None) -> torch.Tensor:
    """x [1, D] bf16, idx [k] int64 (device), route_w [k] f32 -> a [k, I] bf16 with
    a[j] = bf16(silu(g) * u * route_w[j]), g/u = bf16(W8A8 w1/w3 of expert idx[j] at x), u clamped
    to +-limit and g from above (limit 0: none). Capture-safe (experts read on device)."""
    E, I, D = _check(w1, s1, "fp4_experts_up w1")
    if _check(w3, s3, "fp4_experts_up w3") != (E, I, D) or x.numel() != D:
        raise ValueError(f"fp4_experts_up: w3 {tuple(w3.shape)} or x {tuple(x.shape)} does not "
                         f"match w1 {tuple(w1.shape)}")
    k = idx.numel()
    cfg = config or up_config(k, I, D)
    if out is None:
        out = torch.empty(k, I, dtype=torch.bfloat16, device=x.device)
    with on_device(out):
        _fp4_up_kernel[(I // cfg.bn, k)](
            x.contiguous(), idx, route_w.to(torch.float32), w1.view(torch.int32),
            s1.view(torch.uint8), w3.view(torch.int32), s3.view(torch.uint8), out, float(limit),
            I=I, D=D,
            HAS_LIMIT=limit > 0, BN=cfg.bn, NB=cfg.nb, EVEN_K=D % (cfg.nb * 128) == 0,
            num_warps=cfg.num_warps, **launch_args(out))
    return out


def fp4_experts_down(a: torch.Tensor, idx: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, *,
                     out: torch.Tensor | None = None, config: Config | None = None) -> torch.Tensor:
    """a [k, I] bf16, idx [k] int64 -> y [1, D] float32 = sum_j bf16(W8A8 w2[idx[j]] @ a[j]), summed
    in fp32 in slot order j = 0..k-1 (pass idx sorted to match the reference). Capture-safe."""
    E, D, I = _check(w2, s2, "fp4_experts_down w2")
    k = idx.numel()
    if tuple(a.shape) != (k, I):
        raise ValueError(f"fp4_experts_down: a {tuple(a.shape)}; expected {(k, I)}")
    cfg = config or down_config(k, I, D)
    if out is None:
        out = torch.empty(1, D, dtype=torch.float32, device=a.device)
    with on_device(out):
        _fp4_down_kernel[(D // cfg.bn,)](
            a.contiguous(), idx, w2.view(torch.int32), s2.view(torch.uint8), out, D=D, I=I, TOPK=k,
            BN=cfg.bn, NB=cfg.nb, EVEN_K=I % (cfg.nb * 128) == 0, num_warps=cfg.num_warps,
            **launch_args(out))
    return out


# ---- plain-torch references ---------------------------------------------------------------------

def _w8a8(x, w, s):
    """bf16(fp32 dot of the exact operands): what fp4_gemm returns. x [n], w [E?, out, in/2]."""
    return (dequantize_fp4_weight(w, s, torch.float64) @ fp8_quant_dequant(x.float(), 128).double()
            ).float().to(torch.bfloat16)


def fp4_experts_up_reference(x, idx, route_w, w1, s1, w3, s3, limit):
    rows = []
    for j in range(idx.numel()):
        e = int(idx[j])
        g = _w8a8(x.reshape(-1), w1[e], s1[e]).float()
        u = _w8a8(x.reshape(-1), w3[e], s3[e]).float()
        if limit > 0:
            u = u.clamp(-limit, limit)
            g = g.clamp(max=limit)
        rows.append((route_w[j].float() * (F.silu(g) * u)).to(torch.bfloat16))
    return torch.stack(rows)


def fp4_experts_down_reference(a, idx, w2, s2):
    y = torch.zeros(1, w2.shape[1], dtype=torch.float32, device=a.device)
    for j in range(idx.numel()):
        e = int(idx[j])
        y = y + _w8a8(a[j], w2[e], s2[e]).float()
    return y
