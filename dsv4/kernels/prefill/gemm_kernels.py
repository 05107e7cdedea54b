"""The Triton kernels of the prefill GEMMs (dsv4.kernels.prefill.gemm launches them): the FP8
tensor-core GEMM over e4m3 rows (`_gemm8_kernel`: FP8 / FP4 weights, a fresh MMA per
weight-scale group), the bf16 tensor-core GEMM with the weights decoded in registers
(`_gemm16_kernel`, with its split-K sum), the act-quant kernels and the SwiGLU + act-quant
epilogue of two cuBLAS outputs; each with the row tiles of one expert (`tiles`), gathered rows
and the SwiGLU epilogue. Legend: m = rows, n = output features, k = input features.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..common import (
    AMAX_FLOOR,
    E4M3_MAX_INV,
    block_exponent,
    e2m1_word_to_f32,
    e4m3_to_f32,
    e8m0_to_f32,
    pow2,
    quant_dequant,
    round_bf16,
    round_e4m3,
)

# ---- pieces shared by both GEMMs --------------------------------------------------------------

@triton.jit
def _tile_rows(rows_ptr, tile_e_ptr, tile_r_ptr, M, GROUPED: tl.constexpr,
               GATHER: tl.constexpr, BM: tl.constexpr):
    """-> (expert, output rows [BM], their mask, their A rows int64); expert -1: nothing to do.
    GROUPED: row tile t covers rows tile_r[t] of expert tile_e[t]. GATHER: A row = rows[i]."""
    pid_m = tl.program_id(0)
    if GROUPED:
        e = tl.load(tile_e_ptr + pid_m)
        r0 = tl.load(tile_r_ptr + 2 * pid_m)
        r1 = tl.load(tile_r_ptr + 2 * pid_m + 1)
    else:
        e = pid_m * 0
        r0 = pid_m * BM
        r1 = M
    rows = r0 + tl.arange(0, BM)
    rm = (rows < r1) & (rows * 0 + e >= 0)      # vector masks only (Triton 3.9's interpreter)
    if GATHER:
        arow = tl.load(rows_ptr + rows, mask=rm, other=0).to(tl.int64)
    else:
        arow = rows.to(tl.int64)
    return e, rows, rm, arow


@triton.jit
def _e4m3_bits(v):
    """Exact e4m3 values (float32) -> their e4m3 bytes (uint8), normal and subnormal."""
    b = v.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    ex = (a >> 23) - 127
    normal = ((ex + 7) << 3) | ((a >> 20) & 7)
    sub = (tl.abs(v) * 512.0).to(tl.int32)                  # m * 2^-9, m < 8
    return (sign | tl.where(ex >= -6, normal, sub)).to(tl.uint8)


@triton.jit
def _quant8(y):
    """act_quant of rows y [R, 128] (float32): (e4m3 bytes [R, 128], scale 2^e [R])."""
    amax = tl.maximum(tl.max(tl.abs(y), axis=1), AMAX_FLOOR)
    b = (amax * E4M3_MAX_INV).to(tl.int32, bitcast=True)
    e = ((b >> 23) & 0xFF) - 127 + ((b & 0x7FFFFF) != 0).to(tl.int32)
    v = tl.minimum(tl.maximum(y * pow2(-e)[:, None], -448.0), 448.0)
    return _e4m3_bits(round_e4m3(v)), pow2(e)


@triton.jit
def _epilogue(acc, acc3, out_ptr, os_ptr, rw_ptr, rows, rm, n, nm, limit, N: tl.constexpr,
              SWIGLU: tl.constexpr, LIMIT: tl.constexpr, ROUTE_W: tl.constexpr,
              QUANT: tl.constexpr, OUT_F32: tl.constexpr):
    """acc, acc3 [BN, BM] -> out[rows, n]. SWIGLU: the GEMMs' bf16 outputs g (acc) and u (acc3),
    clamped (u both ways, g from above), silu(g) * u in float32, times the route weight, rounded
    to bf16; then act-quantized per 128 (BN = 128) when QUANT: 1, as exact bf16 values; 2, e4m3
    bytes to out and 2^e to os[row, n-tile]."""
    acc = tl.trans(acc)                                                     # [BM, BN]
    optr = out_ptr + rows[:, None].to(tl.int64) * N + n[None, :]
    om = rm[:, None] & nm[None, :]
    if SWIGLU:
        g = round_bf16(acc)
        u = round_bf16(tl.trans(acc3))
        if LIMIT:
            u = tl.minimum(tl.maximum(u, -limit), limit)
            g = tl.minimum(g, limit)
        y = g * tl.sigmoid(g) * u
        if ROUTE_W:
            y = y * tl.load(rw_ptr + rows, mask=rm, other=0.0)[:, None]
        y = round_bf16(y)
        if QUANT == 2:
            y8, ys = _quant8(y)
            tl.store(optr, y8, mask=om)
            tl.store(os_ptr + rows.to(tl.int64) * (N // 128) + tl.program_id(1), ys, mask=rm)
        else:
            if QUANT == 1:
                y = quant_dequant(y, block_exponent(y)[:, None])
            tl.store(optr, y.to(out_ptr.dtype.element_ty), mask=om)
    elif OUT_F32:
        tl.store(optr, acc, mask=om)
    else:
        tl.store(optr, round_bf16(acc).to(out_ptr.dtype.element_ty), mask=om)


# ---- FP8 tensor cores: FP8 / FP4 weights, act-quantized rows ------------------------------------

@triton.jit
def _mma8(w8, a8, F32: tl.constexpr):
    """w8 [BN, k] @ a8 [BM, k]^T for e4m3 bytes (uint8) -> float32 [BN, BM], a fresh accumulator
    (F32: the interpreter, the same exact values as float32)."""
    if F32:
        w = e4m3_to_f32(w8, False)                      # value * 2^-8
        a = e4m3_to_f32(a8, False)
        return tl.dot(w, tl.trans(a), input_precision="ieee") * 65536.0
    else:
        return tl.dot(w8.to(tl.float8e4nv, bitcast=True),
                      tl.trans(a8.to(tl.float8e4nv, bitcast=True)))


@triton.jit
def _fp4_group(w_ptr, s_ptr, wrow, nm, g, K: tl.constexpr):
    """Packed e2m1 of rows wrow, K group g (32 values) -> (e4m3 bytes [BN, 32] = value * 2^-6,
    the group's scale * 2^6 [BN] float32). g may be K // 32: all masked (the prefetch)."""
    live = nm & (wrow * 0 + g < K // 32)
    kb = g * 16 + tl.arange(0, 16)
    c = tl.load(w_ptr + wrow[:, None] * (K // 2) + kb[None, :], mask=live[:, None], other=0)
    c = c.to(tl.int32) & 0xFF
    lo = ((c & 7) << 2) | ((c & 8) << 4)                 # e2m1 (s, e1 e0 m) -> e4m3 bits
    hi = ((c & 0x70) >> 2) | (c & 0x80)
    w8 = tl.reshape(tl.join(lo, hi), (wrow.shape[0], 32)).to(tl.uint8)  # low nibble first
    s = tl.load(s_ptr + wrow * (K // 32) + g, mask=live, other=0)
    return w8, ((s.to(tl.int32) + 6) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _gemm8_kernel(a_ptr, as_ptr, rows_ptr, w_ptr, s_ptr, w3_ptr, s3_ptr, out_ptr, os_ptr, rw_ptr,
                  tile_e_ptr, tile_r_ptr, M, limit, N: tl.constexpr, K: tl.constexpr,
                  FP4: tl.constexpr, GROUPED: tl.constexpr, GATHER: tl.constexpr,
                  SWIGLU: tl.constexpr, LIMIT: tl.constexpr, ROUTE_W: tl.constexpr,
                  QUANT: tl.constexpr, OUT_F32: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, F32: tl.constexpr):
    # program (row tile, n tile): out[rows, n]^T = sum over K groups of (W8[n, grp] @ A8[rows,
    # grp]^T) * w_scale[n, grp] * a_scale[rows, grp // 128] as acc [BN, BM] (the weight tile is
    # the register operand). FP8: 128-wide groups, one scale per 128x128 block; FP4: 32-wide
    # groups, the next group's bytes loaded before this group's decode and MMA.
    e, rows, rm, arow = _tile_rows(rows_ptr, tile_e_ptr, tile_r_ptr, M, GROUPED, GATHER, BM)
    if tl.max(rm.to(tl.int32), axis=0) == 0:
        return
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < N
    wrow = (e * N + n).to(tl.int64)
    acc = tl.zeros([BN, BM], tl.float32)
    acc3 = tl.zeros([BN, BM], tl.float32)
    if FP4:
        k32 = tl.arange(0, 32)
        w8, ws = _fp4_group(w_ptr, s_ptr, wrow, nm, 0, K)
        w38, ws3 = w8, ws
        if SWIGLU:
            w38, ws3 = _fp4_group(w3_ptr, s3_ptr, wrow, nm, 0, K)
        for g in range(0, K // 32):
            a8 = tl.load(a_ptr + arow[:, None] * K + g * 32 + k32[None, :], mask=rm[:, None],
                         other=0)
            a_s = tl.load(as_ptr + arow * (K // 128) + g // 4, mask=rm, other=0.0)
            nw8, nws = _fp4_group(w_ptr, s_ptr, wrow, nm, g + 1, K)
            acc += _mma8(w8, a8, F32) * (ws[:, None] * a_s[None, :])
            w8, ws = nw8, nws
            if SWIGLU:
                nw38, nws3 = _fp4_group(w3_ptr, s3_ptr, wrow, nm, g + 1, K)
                acc3 += _mma8(w38, a8, F32) * (ws3[:, None] * a_s[None, :])
                w38, ws3 = nw38, nws3
    else:
        k128 = tl.arange(0, 128)
        srow = e * (N // 128) + n // 128
        for kb in range(0, K // 128):
            a8 = tl.load(a_ptr + arow[:, None] * K + kb * 128 + k128[None, :], mask=rm[:, None],
                         other=0)
            a_s = tl.load(as_ptr + arow * (K // 128) + kb, mask=rm, other=0.0)
            w8 = tl.load(w_ptr + wrow[:, None] * K + kb * 128 + k128[None, :], mask=nm[:, None],
                         other=0)
            ws = e8m0_to_f32(tl.load(s_ptr + srow * (K // 128) + kb, mask=nm, other=0))
            acc += _mma8(w8, a8, F32) * (ws[:, None] * a_s[None, :])
            if SWIGLU:
                w38 = tl.load(w3_ptr + wrow[:, None] * K + kb * 128 + k128[None, :],
                              mask=nm[:, None], other=0)
                ws3 = e8m0_to_f32(tl.load(s3_ptr + srow * (K // 128) + kb, mask=nm, other=0))
                acc3 += _mma8(w38, a8, F32) * (ws3[:, None] * a_s[None, :])
    _epilogue(acc, acc3, out_ptr, os_ptr, rw_ptr, rows, rm, n, nm, limit, N, SWIGLU, LIMIT,
              ROUTE_W, QUANT * 2, OUT_F32)


# ---- bf16 tensor cores: bf16 weights, or FP8 weights on unquantized rows (wo_a) ------------------

@triton.jit
def _w16_load(w_ptr, s_ptr, wrow, n, nm, k0, N: tl.constexpr, K: tl.constexpr,
              FMT: tl.constexpr, BK: tl.constexpr):
    """Stored bytes of rows wrow x columns k0 .. k0+BK (k0 may be K: all masked, the prefetch).
    FP4: int32 words [BN, BK/32, 4] (8 e2m1 each) and their group scales [BN, BK/32]."""
    live = nm & (n * 0 + k0 < K)                  # vector masks only (Triton 3.9's interpreter)
    if FMT == 2:
        G: tl.constexpr = BK // 32
        gg = tl.arange(0, G)
        wo = (k0 // 8 + gg[:, None] * 4 + tl.arange(0, 4)[None, :])[None, :, :]   # [1, G, 4]
        b = tl.load(w_ptr + wrow[:, None, None] * (K // 8) + wo, mask=live[:, None, None],
                    other=0)
        s = tl.load(s_ptr + wrow[:, None] * (K // 32) + (k0 // 32 + gg)[None, :],
                    mask=live[:, None], other=0)
    elif FMT == 1:
        kk = k0 + tl.arange(0, BK)
        b = tl.load(w_ptr + wrow[:, None] * K + kk[None, :], mask=live[:, None], other=0)
        s = tl.load(s_ptr + (wrow // N * (N // 128) + n // 128) * (K // 128) + k0 // 128,
                    mask=live, other=0)
    else:
        kk = k0 + tl.arange(0, BK)
        b = tl.load(w_ptr + wrow[:, None] * K + kk[None, :], mask=live[:, None], other=0)
        s = tl.zeros([1], tl.uint8)
    return b, s


@triton.jit
def _w16_decode(b, s, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                NATIVE: tl.constexpr):
    """-> the exact weights as bf16 [BN, BK]. FP4: the words' 8 e2m1 values (e2m1_word_to_f32:
    3 integer ops per 4 values and the hardware e4m3 -> f16 converts, NATIVE) times the group
    scale, interleaved back into K order (element 32g + 8a + r is value r of word (g, a))."""
    if FMT == 0:
        return b.to(tl.bfloat16)
    elif FMT == 1:
        v = e4m3_to_f32(b, NATIVE)                        # value, or value * 2^-8 (interpreter)
        if not NATIVE:
            v = v * 256.0
        return (v * e8m0_to_f32(s)[:, None]).to(tl.bfloat16)
    else:
        fold = 6 if NATIVE else 14                         # the decode's 2^-6 / 2^-14
        sf = (((s.to(tl.int32) + fold) << 23).to(tl.float32, bitcast=True))[:, :, None]
        v0, v1, v2, v3, v4, v5, v6, v7 = e2m1_word_to_f32(b, NATIVE)
        x0 = tl.join(tl.join(v0 * sf, v4 * sf), tl.join(v2 * sf, v6 * sf))
        x1 = tl.join(tl.join(v1 * sf, v5 * sf), tl.join(v3 * sf, v7 * sf))
        return tl.reshape(tl.join(x0, x1), (BN, BK)).to(tl.bfloat16)


@triton.jit
def _mma16(acc, w, a, F32: tl.constexpr):
    """acc + w [BN, BK] @ a [BM, BK]^T, bf16 operands, float32 accumulation (F32: the interpreter,
    whose bf16 dot is wrong: the same values as float32)."""
    if F32:
        return acc + tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
    else:
        return tl.dot(w, tl.trans(a.to(tl.bfloat16)), acc)


@triton.jit
def _gemm16_kernel(a_ptr, rows_ptr, w_ptr, s_ptr, w3_ptr, s3_ptr, out_ptr, rw_ptr, tile_e_ptr,
                   tile_r_ptr, ws_ptr, M, PLANE, limit, N: tl.constexpr, K: tl.constexpr,
                   LDA: tl.constexpr, GROUP_N: tl.constexpr, FMT: tl.constexpr,
                   GROUPED: tl.constexpr, GATHER: tl.constexpr, SWIGLU: tl.constexpr,
                   LIMIT: tl.constexpr, ROUTE_W: tl.constexpr, QUANT: tl.constexpr,
                   OUT_F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   SPLIT: tl.constexpr, F32: tl.constexpr, NATIVE: tl.constexpr):
    # program (row tile, n tile, K split): acc [BN, BM] = W[n] @ A[rows]^T over the split's K
    # range in BK steps, the next step's weight bytes in flight. GROUP_N: output features
    # [g*GROUP_N, (g+1)*GROUP_N) read A columns [g*K, (g+1)*K) (the grouped wo_a). SPLIT > 1:
    # the float32 partial sums go to ws [SPLIT, 1 + SWIGLU, M, N] (PLANE = M * N; every output
    # row belongs to one live tile) and _splitk_kernel adds them in split order and applies the
    # epilogue.
    e, rows, rm, arow = _tile_rows(rows_ptr, tile_e_ptr, tile_r_ptr, M, GROUPED, GATHER, BM)
    if tl.max(rm.to(tl.int32), axis=0) == 0:
        return
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < N
    wrow = (e * N + n).to(tl.int64)
    acol = 0
    if GROUP_N > 0:
        acol = (tl.program_id(1) * BN // GROUP_N) * K
    KS: tl.constexpr = K // SPLIT
    ks = tl.program_id(2) * KS
    acc = tl.zeros([BN, BM], tl.float32)
    acc3 = tl.zeros([BN, BM], tl.float32)
    b, s = _w16_load(w_ptr, s_ptr, wrow, n, nm, ks, N, K, FMT, BK)
    b3, s3 = b, s
    if SWIGLU:
        b3, s3 = _w16_load(w3_ptr, s3_ptr, wrow, n, nm, ks, N, K, FMT, BK)
    for k0 in range(ks, ks + KS, BK):
        kk = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + arow[:, None] * LDA + acol + kk[None, :], mask=rm[:, None], other=0.0)
        bn, sn = _w16_load(w_ptr, s_ptr, wrow, n, nm, k0 + BK, N, K, FMT, BK)
        acc = _mma16(acc, _w16_decode(b, s, FMT, BN, BK, NATIVE), a, F32)
        b, s = bn, sn
        if SWIGLU:
            bn3, sn3 = _w16_load(w3_ptr, s3_ptr, wrow, n, nm, k0 + BK, N, K, FMT, BK)
            acc3 = _mma16(acc3, _w16_decode(b3, s3, FMT, BN, BK, NATIVE), a, F32)
            b3, s3 = bn3, sn3
    if SPLIT > 1:
        NMAT: tl.constexpr = 2 if SWIGLU else 1
        off = rows[None, :].to(tl.int64) * N + n[:, None]                         # [BN, BM]
        wm = nm[:, None] & rm[None, :]
        plane = tl.program_id(2) * NMAT * PLANE
        tl.store(ws_ptr + plane + off, acc, mask=wm)
        if SWIGLU:
            tl.store(ws_ptr + plane + PLANE + off, acc3, mask=wm)
    else:
        _epilogue(acc, acc3, out_ptr, out_ptr, rw_ptr, rows, rm, n, nm, limit, N, SWIGLU, LIMIT,
                  ROUTE_W, QUANT, OUT_F32)


@triton.jit
def _splitk_kernel(ws_ptr, out_ptr, rw_ptr, M, PLANE, limit, N: tl.constexpr,
                   SPLIT: tl.constexpr, SWIGLU: tl.constexpr, LIMIT: tl.constexpr,
                   ROUTE_W: tl.constexpr, QUANT: tl.constexpr, OUT_F32: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr):
    # program (row tile, n tile): the K splits' partial sums of _gemm16_kernel added in split
    # order (a fixed float32 order: the same bits every run), then its epilogue
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rm = rows < M
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < N
    off = rows[None, :].to(tl.int64) * N + n[:, None]                             # [BN, BM]
    lm = nm[:, None] & rm[None, :]
    NMAT: tl.constexpr = 2 if SWIGLU else 1
    acc = tl.zeros([BN, BM], tl.float32)
    acc3 = tl.zeros([BN, BM], tl.float32)
    for sp in tl.static_range(SPLIT):
        plane = sp * NMAT * PLANE
        acc += tl.load(ws_ptr + plane + off, mask=lm, other=0.0)
        if SWIGLU:
            acc3 += tl.load(ws_ptr + plane + PLANE + off, mask=lm, other=0.0)
    _epilogue(acc, acc3, out_ptr, out_ptr, rw_ptr, rows, rm, n, nm, limit, N, SWIGLU, LIMIT,
              ROUTE_W, QUANT, OUT_F32)


@triton.jit
def _act_quant_kernel(x_ptr, y_ptr, M, K: tl.constexpr, R: tl.constexpr):
    # program (row block, 128-column block): the official act_quant -> the exact values, bf16
    r = tl.program_id(0) * R + tl.arange(0, R)
    c = tl.program_id(1) * 128 + tl.arange(0, 128)
    m = (r < M)[:, None]
    off = r[:, None].to(tl.int64) * K + c[None, :]
    x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + off, quant_dequant(x, block_exponent(x)[:, None]).to(y_ptr.dtype.element_ty),
             mask=m)


@triton.jit
def _act_quant8_kernel(x_ptr, y_ptr, s_ptr, M, K: tl.constexpr, R: tl.constexpr):
    # program (row block, 128-column block): the official act_quant -> e4m3 bytes and 2^e
    r = tl.program_id(0) * R + tl.arange(0, R)
    c = tl.program_id(1) * 128 + tl.arange(0, 128)
    m = r < M
    off = r[:, None].to(tl.int64) * K + c[None, :]
    y8, ys = _quant8(tl.load(x_ptr + off, mask=m[:, None], other=0.0).to(tl.float32))
    tl.store(y_ptr + off, y8, mask=m[:, None])
    tl.store(s_ptr + r.to(tl.int64) * (K // 128) + tl.program_id(1), ys, mask=m)




@triton.jit
def _swiglu_quant8_kernel(g_ptr, u_ptr, y_ptr, s_ptr, M, limit, N: tl.constexpr,
                          LIMIT: tl.constexpr, R: tl.constexpr):
    # program (row block, 128-column block): the SwiGLU epilogue of _epilogue (QUANT 2) over
    # the bf16 GEMM outputs g, u
    r = tl.program_id(0) * R + tl.arange(0, R)
    c = tl.program_id(1) * 128 + tl.arange(0, 128)
    m = r < M
    off = r[:, None].to(tl.int64) * N + c[None, :]
    g = tl.load(g_ptr + off, mask=m[:, None], other=0.0).to(tl.float32)
    u = tl.load(u_ptr + off, mask=m[:, None], other=0.0).to(tl.float32)
    if LIMIT:
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
    y8, ys = _quant8(round_bf16(g * tl.sigmoid(g) * u))
    tl.store(y_ptr + off, y8, mask=m[:, None])
    tl.store(s_ptr + r.to(tl.int64) * (N // 128) + tl.program_id(1), ys, mask=m)
