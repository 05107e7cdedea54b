"""Fused compressor decode step (one launch per compressor) and the jit helpers shared by the
attention-side decode kernels: in-kernel RoPE, FP8 (block 64) / FP4 (block 32) fake-quant, Hadamard.
State [c*r, c*dc] f32, cache rows [n+1, dc] bf16. Test: tests/dsv4/test_kernels_attention.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import FP4_AMAX_FLOOR, FP4_MAX, FP4_MAX_INV
from .common import (RNE_MAGIC, block_exponent, launch_args, on_device, pdl_wait,
                     pow2, quant_dequant, round_bf16)

E2M1_MAX = tl.constexpr(FP4_MAX)
E2M1_MAX_INV = tl.constexpr(FP4_MAX_INV)
E2M1_AMAX_FLOOR = tl.constexpr(FP4_AMAX_FLOOR)
NEG_INF = tl.constexpr(float("-inf"))


# ---- shared jit helpers (float32 in, float32 out; "pairs" = the (even, odd) dims of RoPE) -------

@triton.jit
def load_pos(pos_ptr):
    """The decode position (int64 [1] on the device) as an int32 scalar."""
    return tl.load(pos_ptr).to(tl.int32)


@triton.jit
def rope_cos_sin(pos_f, freqs_ptr, pair, NOPE_PAIRS: tl.constexpr):
    """cos/sin of fp32(pos) * freqs[pair - NOPE_PAIRS] (as dsv4.rope.cos_sin); 1/0 on nope pairs."""
    f = tl.load(freqs_ptr + (pair - NOPE_PAIRS), mask=pair >= NOPE_PAIRS, other=0.0)
    ang = pos_f * f
    return tl.cos(ang), tl.sin(ang)


@triton.jit
def rope_pairs(a, b, cos, sin, is_rope, INVERSE: tl.constexpr):
    """Rotate the pairs (a, b) = (x[2i], x[2i+1]) where is_rope, in fp32, result rounded to bf16
    (dsv4.rope.apply_rope on bf16 tensors). a, b [..., P]; cos, sin, is_rope broadcast to them."""
    if INVERSE:
        sin = -sin
    ra = round_bf16(a * cos - b * sin)
    rb = round_bf16(a * sin + b * cos)
    return tl.where(is_rope, ra, a), tl.where(is_rope, rb, b)


@triton.jit
def to_pairs(x, SHAPE0: tl.constexpr, P: tl.constexpr):
    """[SHAPE0, 2P] -> (even, odd) [SHAPE0, P]."""
    return tl.split(tl.reshape(x, [SHAPE0, P, 2]))


@triton.jit
def from_pairs(a, b, SHAPE0: tl.constexpr, P: tl.constexpr):
    """(even, odd) [SHAPE0, P] -> [SHAPE0, 2P] interleaved."""
    return tl.reshape(tl.join(a, b), [SHAPE0, 2 * P])


@triton.jit
def fp8_fake_quant_rows(x, ROWS: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr):
    """x [ROWS, D] (bf16 values) -> e4m3 fake-quant per 64-block of the first NOPE dims (ue8m0,
    dsv4.quant.fp8_quant_dequant(x, 64)); the other dims unchanged."""
    xb = tl.reshape(x, [ROWS * (D // 64), 64])
    q = quant_dequant(xb, block_exponent(xb)[:, None])
    blk = (tl.arange(0, ROWS * (D // 64)) % (D // 64))[:, None]
    return tl.reshape(tl.where(blk < NOPE // 64, q, xb), [ROWS, D])


@triton.jit
def round_e2m1(v):
    """Round float32 |v| <= 6 onto the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, nearest-even."""
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127          # floor(log2|v|)
    e = tl.maximum(e, 0) - 1                                           # log2 of the quantum
    r = ((a * pow2(-e) + RNE_MAGIC) - RNE_MAGIC) * pow2(e)
    return tl.where(v < 0, -r, r)


@triton.jit
def fp4_fake_quant_rows(x, ROWS: tl.constexpr, D: tl.constexpr):
    """x [ROWS, D] -> e2m1 fake-quant per 32-block, ue8m0 scales (dsv4.quant.fp4_quant_dequant)."""
    xb = tl.reshape(x, [ROWS * (D // 32), 32])
    amax = tl.maximum(tl.max(tl.abs(xb), axis=1), E2M1_AMAX_FLOOR)
    bits = (amax * E2M1_MAX_INV).to(tl.int32, bitcast=True)
    e = (((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32))[:, None]
    v = tl.minimum(tl.maximum(xb * pow2(-e), -E2M1_MAX), E2M1_MAX)
    return tl.reshape(round_e2m1(v) * pow2(e), [ROWS, D])


@triton.jit
def sylvester(i, j):
    """Entries (-1)^popcount(i & j) of the Sylvester Hadamard matrix (indices < 2^10), float32."""
    v = i & j
    v = v ^ (v >> 8)
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return 1.0 - 2.0 * (v & 1).to(tl.float32)


@triton.jit
def hadamard_pairs_row(a, b, P: tl.constexpr):
    """Normalized Hadamard of one row x [2P] given as pairs (a, b) [P]: H_2P[2p+u, 2q+v] =
    H_P[p, q] (-1)^(uv), so y[2q] = H_P(a+b)[q], y[2q+1] = H_P(a-b)[q]; scale (2P)^-1/2, bf16."""
    p = tl.arange(0, P)
    h = sylvester(p[:, None], p[None, :])
    scale = (2 * P) ** -0.5
    ya = tl.sum((a + b)[:, None] * h, axis=0) * scale
    yb = tl.sum((a - b)[:, None] * h, axis=0) * scale
    return round_bf16(ya), round_bf16(yb)


@triton.jit
def dot_bf16(a, b, F32: tl.constexpr):
    """tl.dot of bf16-valued operands with fp32 accumulation; F32 (the interpreter, whose bf16
    dot is wrong) multiplies the same values as float32 (exact products either way)."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))


# ---- the compressor step --------------------------------------------------------------------

@triton.jit
def _pool(m, l, acc, kvt, sct):
    """Online softmax over rows, per channel: kvt, sct [rows, dc] f32; m, l, acc [dc]."""
    m_new = tl.maximum(m, tl.max(sct, axis=0))
    m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(sct - m_safe[None, :])
    return m_new, l * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(kvt * p, axis=0)


@triton.jit
def _compressor_kernel(kv_ptr, sc_ptr, ape_ptr, skv_ptr, ssc_ptr, norm_ptr, freqs_ptr, pos_ptr,
                       cache_ptr, eps, R: tl.constexpr, DC: tl.constexpr, OVERLAP: tl.constexpr,
                       ROTATE: tl.constexpr, NOPE: tl.constexpr, RB: tl.constexpr, PDL: tl.constexpr):
    # one program: state row write; on emit ((pos+1) % R == 0) pool, shift, finish, cache write
    pdl_wait(PDL)
    CD: tl.constexpr = 2 * DC if OVERLAP else DC
    pos = load_pos(pos_ptr)
    slot = pos % R
    row = slot + R if OVERLAP else slot
    ch = tl.arange(0, CD)
    tl.store(skv_ptr + row * CD + ch, tl.load(kv_ptr + ch))
    tl.store(ssc_ptr + row * CD + ch, tl.load(sc_ptr + ch) + tl.load(ape_ptr + slot * CD + ch))
    tl.debug_barrier()                       # the row is read back by other threads below
    if (pos + 1) % R == 0:
        d = tl.arange(0, DC)
        m = tl.full([DC], NEG_INF, tl.float32)
        l = tl.zeros([DC], tl.float32)
        acc = tl.zeros([DC], tl.float32)
        if OVERLAP:   # rows 0..R-1: previous block's first half; R..2R-1: this block's second
            rr = tl.arange(0, R)
            lo = rr[:, None] * CD + d[None, :]
            hi = (R + rr)[:, None] * CD + DC + d[None, :]
            m, l, acc = _pool(m, l, acc, tl.load(skv_ptr + lo), tl.load(ssc_ptr + lo))
            m, l, acc = _pool(m, l, acc, tl.load(skv_ptr + hi), tl.load(ssc_ptr + hi))
            full = (R + rr)[:, None] * CD + ch[None, :]
            kv_cur = tl.load(skv_ptr + full)
            sc_cur = tl.load(ssc_ptr + full)
            tl.debug_barrier()               # all reads of rows 0..R-1 before the shift
            tl.store(skv_ptr + full - R * CD, kv_cur)
            tl.store(ssc_ptr + full - R * CD, sc_cur)
        else:
            for i in range(R // RB):
                off = (i * RB + tl.arange(0, RB))[:, None] * CD + d[None, :]
                m, l, acc = _pool(m, l, acc, tl.load(skv_ptr + off), tl.load(ssc_ptr + off))
        # _finish: RMSNorm(bf16(c)) -> RoPE at pos+1-R -> FP8 (nope dims) or Hadamard + FP4
        c = round_bf16(acc / l)
        rs = tl.rsqrt(tl.sum(c * c, axis=0) / DC + eps)
        e = round_bf16(tl.load(norm_ptr + d) * (c * rs))
        a, b = to_pairs(e[None, :], 1, DC // 2)
        pair = tl.arange(0, DC // 2)[None, :]
        cos, sin = rope_cos_sin(tl.maximum(pos + 1 - R, 0).to(tl.float32), freqs_ptr, pair,
                                NOPE // 2)
        a, b = rope_pairs(a, b, cos, sin, pair >= NOPE // 2, False)
        if ROTATE:
            ya, yb = hadamard_pairs_row(tl.reshape(a, [DC // 2]), tl.reshape(b, [DC // 2]), DC // 2)
            out = fp4_fake_quant_rows(from_pairs(ya[None, :], yb[None, :], 1, DC // 2), 1, DC)
        else:
            out = fp8_fake_quant_rows(from_pairs(a, b, 1, DC // 2), 1, DC, NOPE)
        tl.store(cache_ptr + (pos // R) * DC + d[None, :], out.to(cache_ptr.dtype.element_ty))


def compressor_decode(kv: torch.Tensor, sc: torch.Tensor, ape: torch.Tensor, state_kv: torch.Tensor,
                      state_score: torch.Tensor, norm: torch.Tensor, freqs: torch.Tensor,
                      pos: torch.Tensor, cache: torch.Tensor, eps: float, ratio: int, rotate: bool,
                      nope: int) -> None:
    """One decode step of a compressor after its projections: kv, sc [1, c*dc] f32 (c = 2 for
    ratio 4). Updates state_kv/state_score [c*r, c*dc] in place; when (pos+1) % ratio == 0 writes
    the finished entry (bf16) to cache[pos // ratio] (cache [n+1, dc]). Unlike the torch path,
    non-emitting steps skip the pooling and leave the scratch row (cache[-1]) alone.
    Capture-safe (pos [1] int64 on the device), one program, deterministic."""
    overlap = ratio == 4
    c = 2 if overlap else 1
    dc = cache.shape[-1]
    if kv.numel() != c * dc or tuple(state_kv.shape) != (c * ratio, c * dc) or dc & (dc - 1) \
            or ratio & (ratio - 1) or cache.dtype != torch.bfloat16 or dc % 64:
        raise ValueError(f"compressor_decode: kv {tuple(kv.shape)}, state {tuple(state_kv.shape)}, "
                         f"cache {tuple(cache.shape)} {cache.dtype}, ratio {ratio}; expected "
                         f"[1, {c}*dc], [{c}*r, {c}*dc], bf16 [n+1, dc] with dc, r powers of two "
                         f"(DSV4_KERNELS=0 runs the torch path)")
    rb = min(ratio, 16)
    with on_device(cache):
        _compressor_kernel[(1,)](kv, sc, ape, state_kv, state_score, norm, freqs, pos, cache, eps,
                                 R=ratio, DC=dc, OVERLAP=overlap, ROTATE=rotate, NOPE=nope, RB=rb,
                                 num_warps=4 if dc <= 128 else 8, **launch_args(cache))


def compressor_decode_reference(comp, x: torch.Tensor, pos: torch.Tensor, st, cache: torch.Tensor,
                                freqs: torch.Tensor) -> None:
    """The torch path it replaces: dsv4.compressor.Compressor.decode (projections included)."""
    comp.decode(x, pos, st, cache, freqs, fused=False)
