"""Linears of a prefill chunk over the stored weight formats, on tensor cores. One Triton GEMM reads
bf16, FP8 (e4m3, 128x128 ue8m0 scales) or packed FP4 (e2m1 pairs, per-32 ue8m0 scales) weights,
decodes each tile to bf16 in registers (exact: an e4m3 / e2m1 value times a power of two) and
multiplies it with bf16 activations that `act_quant` already put on the e4m3 grid (exact too), so
products are exact and sums float32: the official W8A8 semantics up to summation order.

Entry points: `linear` (attention, shared-expert, compressor, indexer and gate projections;
`group_k` for the grouped wo_a), and the routed experts grouped by expert: `expert_plan` (sort the
(token, expert) pairs by expert into row tiles, on the device, no host sync), `moe_up` (w1, w3,
clamped SwiGLU, route weight, and the down input's act quant in the epilogue), `moe_down`, and
`moe_combine` (each token's expert outputs in ascending expert order, then the shared expert's, in
float32, as the reference's loop). Only experts that got tokens are read; no dense weight copy.

Legend: m = rows, n = output features, k = input features, e = experts, p = (token, expert) pairs.
Plain-torch references: `*_reference`. Test: tests/dsv4/test_prefill_kernels.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..formats import FP8_BLOCK, dequantize_fp4_weight, dequantize_fp8_weight
from ..quant import fp8_quant_dequant
from .common import block_exponent, e4m3_to_f32, e8m0_to_f32, interpreting, on_device, \
    quant_dequant, round_bf16

FORMATS = {"bf16": 0, "fp8": 1, "fp4": 2}
BM, BN, BK = 64, 128, 64          # row tile, output-feature tile, K step (BN = the act-quant block)
WARPS, STAGES = 8, 3
QROWS = 16                        # rows per act_quant program


@triton.jit
def _w_load(w_ptr, s_ptr, e, n, nm, k0, N: tl.constexpr, K: tl.constexpr, FMT: tl.constexpr,
            BK: tl.constexpr):
    """The stored bytes of rows n [BN] (nm: n < N) x columns k0 .. k0+BK of weight matrix e (k0
    may be K: all masked, the prefetch past the end): (values or codes, scales)."""
    row = (e * N + n).to(tl.int64)
    live = nm & (k0 < K)
    if FMT == 0:
        kk = k0 + tl.arange(0, BK)
        return tl.load(w_ptr + row[:, None] * K + kk[None, :], mask=live[:, None], other=0.0), 0
    elif FMT == 1:
        kk = k0 + tl.arange(0, BK)
        b = tl.load(w_ptr + row[:, None] * K + kk[None, :], mask=live[:, None], other=0)
        s = tl.load(s_ptr + (e * (N // 128) + n // 128) * (K // 128) + k0 // 128, mask=live,
                    other=0)
        return b, s
    else:
        kb = k0 // 2 + tl.arange(0, BK // 2)
        b = tl.load(w_ptr + row[:, None] * (K // 2) + kb[None, :], mask=live[:, None], other=0)
        ks = k0 // 32 + tl.arange(0, BK // 32)
        s = tl.load(s_ptr + row[:, None] * (K // 32) + ks[None, :], mask=live[:, None], other=0)
        return b, s


@triton.jit
def _w_decode(b, s, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              NATIVE: tl.constexpr):
    """_w_load's bytes -> [BN, BK] bf16, the exact dequantized weights."""
    if FMT == 0:
        w = b.to(tl.float32)
    elif FMT == 1:
        v = e4m3_to_f32(b, NATIVE)                       # value, or value * 2^-8 (interpreter)
        if not NATIVE:
            v = v * 256.0
        w = v * e8m0_to_f32(s)[:, None]
    else:
        c = b.to(tl.int32) & 0xFF
        c = tl.reshape(tl.join(c & 15, c >> 4), (BN, BK))   # low nibble = even element
        h = ((c & 7) << 9) | ((c & 8) << 12)                # fp16 bits of the value * 2^-14
        v = h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        sf = ((s.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)    # 2^(s-127) * 2^14
        w = tl.reshape(tl.reshape(v, (BN, BK // 32, 32)) * sf[:, :, None], (BN, BK))
    return w.to(tl.bfloat16)


@triton.jit
def _mma(acc, w, a, F32: tl.constexpr):
    """acc + w [BN, BK] @ a [BM, BK]^T with bf16 operands, float32 accumulation. The decoded
    weight tile is the register operand, the activation tile the shared-memory one (F32: the
    interpreter, whose bf16 dot is wrong: the same values as float32, exact products)."""
    if F32:
        return acc + tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
    else:
        return tl.dot(w, tl.trans(a.to(tl.bfloat16)), acc)


@triton.jit
def _gemm_kernel(a_ptr, rows_ptr, w_ptr, s_ptr, w3_ptr, s3_ptr, out_ptr, rw_ptr, tile_e_ptr,
                 tile_r_ptr, M, limit, N: tl.constexpr, K: tl.constexpr, LDA: tl.constexpr,
                 GROUP_N: tl.constexpr, FMT: tl.constexpr, GROUPED: tl.constexpr,
                 GATHER: tl.constexpr, SWIGLU: tl.constexpr, LIMIT: tl.constexpr,
                 ROUTE_W: tl.constexpr, QUANT: tl.constexpr, OUT_F32: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr,
                 NATIVE: tl.constexpr):
    # program (row tile, n tile) computes out[rows, n]^T = W[n] @ A[rows]^T as acc [BN, BM].
    # GROUPED: row tile t covers rows tile_r[t] of expert tile_e[t] (-1: an unused tile of the
    # fixed grid). GATHER: A row of output row i is rows[i]. GROUP_N: output features
    # [g*GROUP_N, (g+1)*GROUP_N) read A columns [g*K, (g+1)*K) (the grouped wo_a). The next K
    # step's weight bytes are loaded before this step's decode and MMAs (one step in flight).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:
        e = tl.load(tile_e_ptr + pid_m)
        if e < 0:
            return
        r0 = tl.load(tile_r_ptr + 2 * pid_m)
        r1 = tl.load(tile_r_ptr + 2 * pid_m + 1)
    else:
        e = 0
        r0 = pid_m * BM
        r1 = M
    rows = r0 + tl.arange(0, BM)
    rm = rows < r1
    if GATHER:
        arow = tl.load(rows_ptr + rows, mask=rm, other=0).to(tl.int64)
    else:
        arow = rows.to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    nm = n < N
    acol = 0
    if GROUP_N > 0:
        acol = (pid_n * BN // GROUP_N) * K
    acc = tl.zeros([BN, BM], tl.float32)
    acc3 = tl.zeros([BN, BM], tl.float32)
    b, s = _w_load(w_ptr, s_ptr, e, n, nm, 0, N, K, FMT, BK)
    b3, s3 = b, s
    if SWIGLU:
        b3, s3 = _w_load(w3_ptr, s3_ptr, e, n, nm, 0, N, K, FMT, BK)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + arow[:, None] * LDA + acol + kk[None, :], mask=rm[:, None], other=0.0)
        bn, sn = _w_load(w_ptr, s_ptr, e, n, nm, k0 + BK, N, K, FMT, BK)
        acc = _mma(acc, _w_decode(b, s, FMT, BN, BK, NATIVE), a, F32)
        b, s = bn, sn
        if SWIGLU:
            bn3, sn3 = _w_load(w3_ptr, s3_ptr, e, n, nm, k0 + BK, N, K, FMT, BK)
            acc3 = _mma(acc3, _w_decode(b3, s3, FMT, BN, BK, NATIVE), a, F32)
            b3, s3 = bn3, sn3
    acc = tl.trans(acc)                                                         # [BM, BN]
    optr = out_ptr + rows[:, None].to(tl.int64) * N + n[None, :]
    om = rm[:, None] & nm[None, :]
    if SWIGLU:
        # the GEMMs' bf16 outputs, clamped SwiGLU in float32 (u both ways, g from above), times
        # the route weight, rounded to bf16; QUANT: then act_quant per 128 (BN = 128) for down
        g = round_bf16(acc)
        u = round_bf16(tl.trans(acc3))
        if LIMIT:
            u = tl.minimum(tl.maximum(u, -limit), limit)
            g = tl.minimum(g, limit)
        y = g * tl.sigmoid(g) * u
        if ROUTE_W:
            y = y * tl.load(rw_ptr + rows, mask=rm, other=0.0)[:, None]
        y = round_bf16(y)
        if QUANT:
            y = quant_dequant(y, block_exponent(y)[:, None])
        tl.store(optr, y.to(out_ptr.dtype.element_ty), mask=om)
    elif OUT_F32:
        tl.store(optr, acc, mask=om)
    else:
        tl.store(optr, round_bf16(acc).to(out_ptr.dtype.element_ty), mask=om)


@triton.jit
def _act_quant_kernel(x_ptr, y_ptr, M, K: tl.constexpr, R: tl.constexpr):
    # program (row block, 128-column block): the official act_quant (ue8m0, e4m3) -> exact values
    r = tl.program_id(0) * R + tl.arange(0, R)
    c = tl.program_id(1) * 128 + tl.arange(0, 128)
    m = (r < M)[:, None]
    off = r[:, None].to(tl.int64) * K + c[None, :]
    x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + off, quant_dequant(x, block_exponent(x)[:, None]).to(y_ptr.dtype.element_ty),
             mask=m)


@triton.jit
def _combine_kernel(o_ptr, inv_ptr, sh_ptr, y_ptr, D: tl.constexpr, KE: tl.constexpr,
                    BD: tl.constexpr, SHARED: tl.constexpr):
    # y[t] = bf16(sum_j o[inv[t, j]] (+ shared[t])) in float32, j in ascending expert order
    t = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    acc = tl.zeros([BD], tl.float32)
    for j in tl.static_range(KE):
        p = tl.load(inv_ptr + t * KE + j).to(tl.int64)
        acc += tl.load(o_ptr + p * D + d).to(tl.float32)
    if SHARED:
        acc += tl.load(sh_ptr + t.to(tl.int64) * D + d).to(tl.float32)
    tl.store(y_ptr + t.to(tl.int64) * D + d, round_bf16(acc).to(y_ptr.dtype.element_ty))


# ---- host side ----------------------------------------------------------------------------------

def _u8(t: torch.Tensor | None) -> torch.Tensor | None:
    """FP8 / e8m0 / packed-FP4 tensors as raw bytes (Triton reads the bits)."""
    if t is None or t.dtype in (torch.bfloat16, torch.float32):
        return t
    return t.view(torch.uint8)


def _launch(a, w, s, out, *, fmt, grid_m, M, N, K, lda, group_n=0, rows=None, tiles=None,
            w3=None, s3=None, rw=None, limit=0.0, quant=False):
    if K % BK or (fmt != "bf16" and K % 128):
        raise ValueError(f"prefill GEMM: K = {K} must be a multiple of {BK} (and of 128 for "
                         f"quantized weights)")
    if quant and N % BN:
        raise ValueError(f"prefill GEMM: act quant of the output needs N = {N} % {BN} == 0")
    dummy = out
    tile_e, tile_r = tiles if tiles is not None else (dummy, dummy)
    with on_device(out):
        _gemm_kernel[(grid_m, triton.cdiv(N, BN))](
            a, rows if rows is not None else dummy, _u8(w), _u8(s) if s is not None else dummy,
            _u8(w3) if w3 is not None else dummy, _u8(s3) if s3 is not None else dummy, out,
            rw if rw is not None else dummy, tile_e, tile_r, M, float(limit),
            N=N, K=K, LDA=lda, GROUP_N=group_n, FMT=FORMATS[fmt], GROUPED=tiles is not None,
            GATHER=rows is not None, SWIGLU=w3 is not None, LIMIT=limit > 0,
            ROUTE_W=rw is not None, QUANT=quant, OUT_F32=out.dtype == torch.float32,
            BM=BM, BN=BN, BK=BK, F32=interpreting(), NATIVE=not interpreting(),
            num_warps=WARPS, num_stages=STAGES)
    return out


def act_quant(x: torch.Tensor) -> torch.Tensor:
    """x [m, k] bf16 -> the official act_quant (per 128, ue8m0 scales, e4m3) as exact bf16 values
    (== fp8_quant_dequant(x, 128)). One launch."""
    M, K = x.shape
    if K % 128:
        raise ValueError(f"act_quant: k = {K} is not a multiple of 128")
    x = x.contiguous()
    y = torch.empty_like(x)
    with on_device(y):
        _act_quant_kernel[(triton.cdiv(M, QROWS), K // 128)](x, y, M, K=K, R=QROWS, num_warps=4)
    return y


def linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, fmt: str, *,
           out_dtype: torch.dtype, quant_act: bool | None = None, group_k: int = 0
           ) -> torch.Tensor:
    """y = x @ W^T for the rows x [m, k_in] bf16 and a weight in its stored format (bf16 [n, k];
    fp8 [n, k] + [n/128, k/128]; fp4 [n, k/2] + [n, k/32]) -> [m, n] in out_dtype (bf16 or
    float32). quant_act (default: quantized weights): act_quant x first (W8A8). group_k: the
    grouped wo_a, output group g = rows [g*n/G, (g+1)*n/G) reads x[:, g*group_k:(g+1)*group_k]."""
    M = x.shape[0]
    N = w.shape[0]
    K = group_k or x.shape[1]
    if quant_act is None:
        quant_act = fmt != "bf16"
    xq = act_quant(x) if quant_act else x.contiguous()
    gn = 0
    if group_k:
        G = x.shape[1] // group_k
        gn = N // G
        if gn % BN:
            raise ValueError(f"prefill GEMM: wo_a group of {gn} rows is not a multiple of {BN}")
    out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    return _launch(xq, w, scale, out, fmt=fmt, grid_m=triton.cdiv(M, BM), M=M, N=N, K=K,
                   lda=x.shape[1], group_n=gn)


@dataclass
class ExpertPlan:
    """(token, expert) pairs of a chunk sorted by expert (stable: token order within an expert) and
    cut into row tiles of BM pairs of one expert each. Sorted pair i is pair (token[i], slot) with
    route weight weight[i]; inv[t, j] is the sorted position of token t's j-th expert."""
    token: torch.Tensor     # [p] int32: token of each sorted pair
    weight: torch.Tensor    # [p] f32: its route weight
    inv: torch.Tensor       # [t, k] int32
    tile_e: torch.Tensor    # [tiles] int32: expert of each row tile, -1 = unused
    tile_r: torch.Tensor    # [tiles, 2] int32: sorted pairs [r0, r1) of the tile's expert

    @property
    def n_tiles(self) -> int:
        return self.tile_e.shape[0]


def expert_plan(idx: torch.Tensor, w: torch.Tensor, n_experts: int) -> ExpertPlan:
    """idx [t, k] int64 experts (ascending in each row), w [t, k] f32 -> ExpertPlan. Device ops
    only (no host sync); the tile grid has the fixed bound p/BM + min(E, p) tiles."""
    T, k = idx.shape
    P, dev = T * k, idx.device
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts)
    ends = counts.cumsum(0)
    ntile = (counts + BM - 1) // BM
    tcum = ntile.cumsum(0)
    t = torch.arange(P // BM + min(n_experts, P), device=dev)
    te = torch.searchsorted(tcum, t, right=True)
    ok = te < n_experts
    tec = te.clamp(max=n_experts - 1)
    r0 = ends[tec] - counts[tec] + (t - tcum[tec] + ntile[tec]) * BM
    inv = torch.empty(P, dtype=torch.int32, device=dev)
    inv[order] = torch.arange(P, dtype=torch.int32, device=dev)
    return ExpertPlan(token=(order // k).to(torch.int32), weight=w.reshape(-1)[order].float(),
                      inv=inv.view(T, k), tile_e=torch.where(ok, te, -1).to(torch.int32),
                      tile_r=torch.stack((r0, ends[tec]), 1).to(torch.int32).contiguous())


def moe_up(xq: torch.Tensor, plan: ExpertPlan, w1, s1, w3, s3, fmt: str, limit: float,
           quant: bool) -> torch.Tensor:
    """Routed up of every sorted pair: bf16(route_w * SwiGLU(w1 x, w3 x)) [p, I] bf16 (quant:
    act-quantized per 128 for down). xq [t, D]: the tokens, act-quantized for quantized weights."""
    I = w1.shape[1]
    P, D = plan.token.shape[0], xq.shape[1]
    out = torch.empty(P, I, dtype=torch.bfloat16, device=xq.device)
    return _launch(xq, w1, s1, out, fmt=fmt, grid_m=plan.n_tiles, M=P, N=I, K=D, lda=D,
                   rows=plan.token, tiles=(plan.tile_e, plan.tile_r), w3=w3, s3=s3,
                   rw=plan.weight, limit=limit, quant=quant)


def swiglu_up(xq: torch.Tensor, w1, s1, w3, s3, fmt: str, limit: float, quant: bool
              ) -> torch.Tensor:
    """The shared expert's up for rows xq [t, D]: bf16(SwiGLU(w1 x, w3 x)) [t, I] (quant: act-
    quantized per 128 for down)."""
    M, D = xq.shape
    out = torch.empty(M, w1.shape[0], dtype=torch.bfloat16, device=xq.device)
    return _launch(xq, w1, s1, out, fmt=fmt, grid_m=triton.cdiv(M, BM), M=M, N=w1.shape[0],
                   K=D, lda=D, w3=w3, s3=s3, limit=limit, quant=quant)


def moe_down(a: torch.Tensor, plan: ExpertPlan, w2, s2, fmt: str) -> torch.Tensor:
    """Routed down of every sorted pair: a [p, I] (its up output) -> [p, D] bf16."""
    P, I = a.shape
    out = torch.empty(P, w2.shape[1], dtype=torch.bfloat16, device=a.device)
    return _launch(a, w2, s2, out, fmt=fmt, grid_m=plan.n_tiles, M=P, N=w2.shape[1], K=I, lda=I,
                   tiles=(plan.tile_e, plan.tile_r))


def moe_combine(o: torch.Tensor, plan: ExpertPlan, shared: torch.Tensor | None) -> torch.Tensor:
    """Each token's routed outputs o [p, D] in ascending expert order, then shared [t, D], summed
    in float32 -> [t, D] bf16."""
    T, k = plan.inv.shape
    D = o.shape[1]
    bd = 1024 if D % 1024 == 0 else D
    if D % bd or bd & (bd - 1):
        raise ValueError(f"moe_combine: D = {D} must be a power of two or a multiple of 1024")
    y = torch.empty(T, D, dtype=torch.bfloat16, device=o.device)
    with on_device(y):
        _combine_kernel[(T, D // bd)](o, plan.inv, shared if shared is not None else o, y, D=D,
                                      KE=k, BD=bd, SHARED=shared is not None, num_warps=4)
    return y


# ---- plain-torch references (the code the kernels replace) -----------------------------------

def dequantize(fmt: str, w: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    """Stored weight -> float32 values."""
    if fmt == "fp8":
        return dequantize_fp8_weight(w, s, torch.float32)
    if fmt == "fp4":
        return dequantize_fp4_weight(w, s, torch.float32)
    return w.float()


def linear_reference(x, w, scale, fmt, *, out_dtype, quant_act=None, group_k=0):
    """linear in float64 over the same exact operands, rounded to out_dtype at the end."""
    if quant_act is None:
        quant_act = fmt != "bf16"
    xq = (fp8_quant_dequant(x, FP8_BLOCK) if quant_act else x).double()
    wd = dequantize(fmt, w, scale).double()
    if group_k:
        G = x.shape[1] // group_k
        y = torch.einsum("mgk,gnk->mgn", xq.view(-1, G, group_k), wd.view(G, -1, group_k))
        y = y.flatten(1)
    else:
        y = xq @ wd.t()
    return y.to(out_dtype)


def moe_reference(x, idx, w, bank, fmt, limit, shared=None):
    """The routed experts of rows x [t, D] bf16 (idx, w [t, k]) as the official loop: per expert in
    ascending id order, bf16 up outputs, clamped SwiGLU, route weight, bf16, act quant, down ->
    bf16, summed in float32 (+ shared [t, D]) -> bf16. bank: (w1, s1, w3, s3, w2, s2)."""
    w1, s1, w3, s3, w2, s2 = bank
    q = fmt != "bf16"
    xq = fp8_quant_dequant(x, FP8_BLOCK) if q else x
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(idx).tolist():
        rows, slot = torch.where(idx == e)
        xe = xq[rows].float()
        g = (xe @ dequantize(fmt, w1[e], s1[e] if q else None).t()).bfloat16().float()
        u = (xe @ dequantize(fmt, w3[e], s3[e] if q else None).t()).bfloat16().float()
        if limit > 0:
            u, g = u.clamp(-limit, limit), g.clamp(max=limit)
        a = (w[rows, slot].unsqueeze(-1) * F.silu(g) * u).bfloat16()
        a = fp8_quant_dequant(a, FP8_BLOCK) if q else a
        y[rows] += (a.float() @ dequantize(fmt, w2[e], s2[e] if q else None).t()).bfloat16().float()
    if shared is not None:
        y += shared.float()
    return y.bfloat16()
