"""Fused q/kv prep kernels for decode tokens, ahead of the sparse attention (attention.py):
q_norm RMSNorm (1 launch), then q's per-head RMSNorm + RoPE and kv's RMSNorm + RoPE + FP8
fake-quant with the ring write (1; the verify rows: every row's q and kv without the ring write).
References: dsv4.model.attention (_q_kv), attention_prep_reference below.
Test: tests/dsv4/kernels/test_attention_kernels.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...numerics.mhc import rms_norm
from ...numerics.quant import fp8_quant_dequant
from ...numerics.rope import apply_rope, cos_sin
from ..common import (
    fp8_fake_quant_rows,
    from_pairs,
    launch_args,
    load_pos,
    on_device,
    pdl_wait,
    rope_cos_sin,
    rope_pairs,
    round_bf16,
    to_pairs,
)

HATCH = "DSV4_KERNELS=0 runs the torch path"


# ---- q_norm (RMSNorm with weight of one row) -----------------------------------------------

@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, eps, D: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr):
    # program r: row r (decode: one row; prefill: a chunk's rows)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_ptr += row * D
    y_ptr += row * D
    d = tl.arange(0, BD)
    x = tl.load(x_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    rs = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = round_bf16(tl.load(w_ptr + d, mask=d < D, other=0.0) * (x * rs))
    tl.store(y_ptr + d, y.to(y_ptr.dtype.element_ty), mask=d < D)


def rms_norm_rows(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """dsv4.numerics.mhc.rms_norm of bf16 rows x [s, D] (f32 weight) -> [s, D] bf16: one launch (prefill)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    D = x.shape[-1]
    with on_device(x):
        _rms_norm_kernel[(x.shape[0],)](x, w, y, eps, D=D, BD=triton.next_power_of_2(D),
                                        num_warps=4, PDL=False)
    return y


def rms_norm_row(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor | None = None,
                 pdl: bool = True) -> torch.Tensor:
    """dsv4.numerics.mhc.rms_norm for decode rows x [T, D] bf16 (one, or the speculative verify rows; f32
    weight) -> [T, D] bf16, one program per row. Capture-safe."""
    y = torch.empty_like(x) if out is None else out
    D = x.shape[-1]
    with on_device(x):
        _rms_norm_kernel[(x.shape[0],)](x, w, y, eps, D=D, BD=triton.next_power_of_2(D),
                                        num_warps=4, **launch_args(y, pdl))
    return y


# ---- q / kv prep ---------------------------------------------------------------------------

@triton.jit
def _prep_q(q_ptr, qo_ptr, hb0, eps, cos, sin, pair, DH: tl.constexpr, HB: tl.constexpr,
            NOPE: tl.constexpr):
    """Heads [hb0, hb0+HB): q * rsqrt(mean(q^2) + eps) with every torch op rounded to bf16, RoPE."""
    off = (hb0 + tl.arange(0, HB))[:, None] * DH + tl.arange(0, DH)[None, :]
    q = tl.load(q_ptr + off).to(tl.float32)                                   # [HB, DH]
    ms = round_bf16(tl.sum(round_bf16(q * q), axis=1) / DH)
    rs = round_bf16(tl.rsqrt(round_bf16(ms + eps)))
    q = round_bf16(q * rs[:, None])
    a, b = to_pairs(q, HB, DH // 2)
    a, b = rope_pairs(a, b, cos, sin, pair >= NOPE // 2, False)
    tl.store(qo_ptr + off, from_pairs(a, b, HB, DH // 2).to(qo_ptr.dtype.element_ty))


@triton.jit
def _prep_kv(kv_ptr, kvw_ptr, cache_ptr, row, eps, cos, sin, pair, DH: tl.constexpr,
             NOPE: tl.constexpr):
    """kv: RMSNorm (f32 weight), RoPE, FP8 fake-quant of the nope dims -> cache[row]."""
    d = tl.arange(0, DH)[None, :]
    x = tl.load(kv_ptr + d).to(tl.float32)                                    # [1, DH]
    rs = tl.rsqrt(tl.sum(x * x, axis=1) / DH + eps)
    e = round_bf16(tl.load(kvw_ptr + d) * (x * rs[:, None]))
    a, b = to_pairs(e, 1, DH // 2)
    a, b = rope_pairs(a, b, cos, sin, pair >= NOPE // 2, False)
    out = fp8_fake_quant_rows(from_pairs(a, b, 1, DH // 2), 1, DH, NOPE)
    tl.store(cache_ptr + row * DH + d, out.to(cache_ptr.dtype.element_ty))


@triton.jit
def _prep_kernel(q_ptr, qo_ptr, kv_ptr, kvw_ptr, cache_ptr, freqs_ptr, pos_ptr, eps,
                 H: tl.constexpr, DH: tl.constexpr, HB: tl.constexpr, W: tl.constexpr,
                 NOPE: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    # programs 0..H/HB-1: q heads; program H/HB: kv, written to ring slot pos % W. ROWS (a
    # prefill chunk): program_id(1) is the row, at position pos + row; its kv goes to row `row`
    # of cache_ptr (the chunk's kv, not the ring)
    pdl_wait(PDL)
    pid = tl.program_id(0)
    pos = load_pos(pos_ptr)
    if ROWS:
        row = tl.program_id(1)
        pos = pos + row
        q_ptr += row.to(tl.int64) * (H * DH)
        qo_ptr += row.to(tl.int64) * (H * DH)
        kv_ptr += row.to(tl.int64) * DH
        slot = row
    else:
        slot = pos % W
    pair = tl.arange(0, DH // 2)[None, :]
    cos, sin = rope_cos_sin(pos.to(tl.float32), freqs_ptr, pair, NOPE // 2)
    if pid < H // HB:
        _prep_q(q_ptr, qo_ptr, pid * HB, eps, cos, sin, pair, DH, HB, NOPE)
    else:
        _prep_kv(kv_ptr, kvw_ptr, cache_ptr, slot, eps, cos, sin, pair, DH, NOPE)


def attention_prep(q: torch.Tensor, kv: torch.Tensor, kv_norm: torch.Tensor,
                   kv_cache: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor, eps: float,
                   n_heads: int, window: int, out: torch.Tensor | None = None,
                   pdl: bool = True) -> torch.Tensor:
    """q [1, h*d] bf16 (wq_b output) -> q [1, h*d] bf16 (per-head RMS, RoPE); kv [1, d] bf16 (wkv
    output) -> RMSNorm(kv_norm), RoPE, FP8 fake-quant -> kv_cache[pos % window]. One launch.
    Capture-safe, deterministic. As Attention._q_kv after the GEMVs, plus the ring write."""
    DH = kv.shape[-1]
    nope = DH - 2 * freqs.numel()
    if q.numel() != n_heads * DH or DH & (DH - 1) or nope % 64 or q.dtype != torch.bfloat16:
        raise ValueError(f"attention_prep: q {tuple(q.shape)} {q.dtype}, kv {tuple(kv.shape)}, "
                         f"{n_heads} heads; expected bf16 [1, h*d], d a power of two, "
                         f"nope % 64 == 0 ({HATCH})")
    hb = min(n_heads, 16)
    if n_heads % hb:
        raise ValueError(f"attention_prep: {n_heads} heads not a multiple of {hb} ({HATCH})")
    qo = torch.empty_like(q) if out is None else out
    with on_device(q):
        _prep_kernel[(n_heads // hb + 1,)](q, qo, kv, kv_norm, kv_cache, freqs, pos, eps,
                                           H=n_heads, DH=DH, HB=hb, W=window, NOPE=nope,
                                           ROWS=False, num_warps=4, **launch_args(qo, pdl))
    return qo


def attention_prep_rows(q: torch.Tensor, kv: torch.Tensor, kv_norm: torch.Tensor,
                        pos0: torch.Tensor, freqs: torch.Tensor, eps: float, n_heads: int,
                        decode: bool = False, pdl: bool = True):
    """attention_prep for the rows of a prefill chunk at positions pos0 + i (pos0 [1] int64):
    q [s, h*d] -> [s, h, d] (per-head RMS, RoPE), kv [s, d] -> [s, d] (RMSNorm, RoPE, FP8
    fake-quant), as Attention._q_kv after the GEMMs. One launch; the ring is not touched. Each row
    has the bits of attention_prep's (decode: the speculative verify rows, launched as the other
    decode kernels)."""
    S, DH = kv.shape
    nope = DH - 2 * freqs.numel()
    hb = min(n_heads, 16)
    if DH & (DH - 1) or nope % 64 or n_heads % hb or q.dtype != torch.bfloat16:
        raise ValueError(f"attention_prep_rows: q {tuple(q.shape)} {q.dtype}, kv "
                         f"{tuple(kv.shape)}, {n_heads} heads ({HATCH})")
    q, kv = q.contiguous(), kv.contiguous()
    qo, kvo = torch.empty_like(q), torch.empty_like(kv)
    with on_device(q):
        _prep_kernel[(n_heads // hb + 1, S)](q, qo, kv, kv_norm, kvo, freqs, pos0, eps,
                                             H=n_heads, DH=DH, HB=hb, W=1, NOPE=nope, ROWS=True,
                                             num_warps=4,
                                             **(launch_args(qo, pdl) if decode else
                                                {"PDL": False}))
    return qo.view(S, n_heads, DH), kvo


# ---- sparse attention ----------------------------------------------------------------------


def attention_prep_reference(q, kv, kv_norm, kv_cache, pos, freqs, eps, n_heads, window):
    """Attention._q_kv after its GEMVs + the ring write of Attention.decode (torch ops)."""
    cs = cos_sin(pos, freqs)
    q = q.unflatten(-1, (n_heads, -1))
    q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)
    q = apply_rope(q, cs)
    kv = apply_rope(rms_norm(kv, kv_norm, eps), cs)
    nope = kv.shape[-1] - 2 * freqs.numel()
    kv = torch.cat((fp8_quant_dequant(kv[:, :nope], 64), kv[:, nope:]), dim=-1)
    kv_cache.index_copy_(0, pos % window, kv)
    return q.flatten(1)
