"""Fused compressor decode step (one launch per compressor; its online-softmax pooling `_pool` is
shared with the prefill chunk's entry kernel). State [c*r, c*dc] f32, cache rows [n+1, dc] bf16.
Reference: compressor_decode_reference below. Test: tests/dsv4/kernels/test_attention_kernels.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import (
    NEG_INF,
    fp4_fake_quant_rows,
    fp8_fake_quant_rows,
    from_pairs,
    hadamard_pairs_row,
    launch_args,
    load_pos,
    on_device,
    pdl_wait,
    rope_cos_sin,
    rope_pairs,
    round_bf16,
    to_pairs,
)

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
                       ROTATE: tl.constexpr, NOPE: tl.constexpr, RB: tl.constexpr, T: tl.constexpr,
                       PDL: tl.constexpr):
    # one program, the T rows' steps in turn (row t at pos + t, its kv / sc row t): each as a
    # one-row launch does it, a barrier between them (row t + 1 reads what row t wrote)
    pdl_wait(PDL)
    CD: tl.constexpr = 2 * DC if OVERLAP else DC
    pos0 = load_pos(pos_ptr)
    for t in range(T):
        if t > 0:
            tl.debug_barrier()
        _compressor_step(kv_ptr + t * CD, sc_ptr + t * CD, ape_ptr, skv_ptr, ssc_ptr, norm_ptr,
                         freqs_ptr, pos0 + t, cache_ptr, eps, R, DC, OVERLAP, ROTATE, NOPE, RB)


@triton.jit
def _compressor_step(kv_ptr, sc_ptr, ape_ptr, skv_ptr, ssc_ptr, norm_ptr, freqs_ptr, pos,
                     cache_ptr, eps, R: tl.constexpr, DC: tl.constexpr, OVERLAP: tl.constexpr,
                     ROTATE: tl.constexpr, NOPE: tl.constexpr, RB: tl.constexpr):
    # one row: state row write; on emit ((pos+1) % R == 0) pool, shift, finish, cache write
    CD: tl.constexpr = 2 * DC if OVERLAP else DC
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
                      nope: int, pdl: bool = True) -> None:
    """Decode steps of a compressor after its projections: kv, sc [T, c*dc] f32 (c = 2 for ratio
    4), the rows of positions pos .. pos + T - 1 (T = 1: one decode step; T > 1: the speculative
    verify rows, in turn, each with the bits of its one-row launch after the rows before it).
    Updates state_kv/state_score [c*r, c*dc] in place; when (p+1) % ratio == 0 writes the
    finished entry (bf16) to cache[p // ratio] (cache [n+1, dc]). Unlike the torch path,
    non-emitting steps skip the pooling and leave the scratch row (cache[-1]) alone.
    Capture-safe (pos [1] int64 on the device), one program, deterministic."""
    overlap = ratio == 4
    c = 2 if overlap else 1
    dc = cache.shape[-1]
    T = kv.numel() // (c * dc)
    if kv.shape[-1] != c * dc or sc.shape != kv.shape or not kv.is_contiguous() \
            or not sc.is_contiguous() or T < 1 \
            or tuple(state_kv.shape) != (c * ratio, c * dc) or dc & (dc - 1) \
            or ratio & (ratio - 1) or cache.dtype != torch.bfloat16 or dc % 64:
        raise ValueError(f"compressor_decode: kv {tuple(kv.shape)}, sc {tuple(sc.shape)}, state "
                         f"{tuple(state_kv.shape)}, cache {tuple(cache.shape)} {cache.dtype}, "
                         f"ratio {ratio}; expected contiguous [T, {c}*dc], "
                         f"[{c}*r, {c}*dc], bf16 [n+1, dc] with dc, r powers of two "
                         f"(DSV4_KERNELS=0 runs the torch path)")
    rb = min(ratio, 16)
    with on_device(cache):
        _compressor_kernel[(1,)](kv, sc, ape, state_kv, state_score, norm, freqs, pos, cache, eps,
                                 R=ratio, DC=dc, OVERLAP=overlap, ROTATE=rotate, NOPE=nope, RB=rb,
                                 T=T, num_warps=4 if dc <= 128 else 8, **launch_args(cache, pdl))


def compressor_decode_reference(comp, x: torch.Tensor, pos: torch.Tensor, st, cache: torch.Tensor,
                                freqs: torch.Tensor) -> None:
    """The torch path it replaces: dsv4.model.compressor.Compressor.decode (projections included)."""
    comp.decode(x, pos, st, cache, freqs, fused=False)
