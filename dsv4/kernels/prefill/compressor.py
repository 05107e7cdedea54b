"""The compressor entries a prefill chunk completes, in one launch: each program pools one block
(softmax over its rows per channel, in overlap mode with the previous block's first channel half),
then finishes the entry as the decode kernel does (RMSNorm of bf16(c), RoPE at the block's first
position, FP8 fake-quant of the nope dims, or Hadamard + FP4 fake-quant for the indexer's) and
writes it to the cache. `ext` is the open block's state rows (rolled so that they end just before
the chunk) followed by the chunk's rows; the chunk's first position comes from a device tensor, so
the launch (a fixed grid bound; programs past the completed blocks exit) is capture-safe at any
position. Around it, one launch each: `compress_ext` builds ext from the state and the chunk (the
scores with the positional bias added), `compress_state` leaves the state as s decode steps would
(the caller's torch ops before: a dozen launches before and two dozen after, each a host issue).

Legend: r = ratio, dc = entry dim, c = 2 in overlap mode (r = 4) else 1, s = chunk rows,
o = start % r (state rows of the open block before the chunk).
Reference: the torch path of Compressor.prefill. Test: tests/dsv4/kernels/test_prefill_kernels.py.
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
    on_device,
    rope_cos_sin,
    rope_pairs,
    round_bf16,
    to_pairs,
)
from ..decode.compressor import _pool


@triton.jit
def _compress_rows_kernel(ekv_ptr, esc_ptr, pkv_ptr, psc_ptr, norm_ptr, freqs_ptr, cache_ptr,
                          pos_ptr, S, eps, R: tl.constexpr, DC: tl.constexpr,
                          OVERLAP: tl.constexpr, ROTATE: tl.constexpr, NOPE: tl.constexpr,
                          RB: tl.constexpr):
    # the chunk starts at position start = pos[0], o = start % R rows into block j0 = start // R;
    # ext row R - o is that block's first row. Program j: block j of the chunk (ext rows
    # [R - o + j*R, R - o + (j+1)*R)) -> cache[j0 + j], if it completes ((j+1)*R <= o + S);
    # overlap mode also pools the first channel half of block j-1 (of the state's previous
    # block, pkv / psc, for j = 0)
    j = tl.program_id(0)
    start = tl.load(pos_ptr)
    o = start % R
    if (j + 1) * R > o + S:
        return
    j0 = start // R
    base = R - o
    CD: tl.constexpr = 2 * DC if OVERLAP else DC
    d = tl.arange(0, DC)
    m = tl.full([DC], NEG_INF, tl.float32)
    l = tl.zeros([DC], tl.float32)
    acc = tl.zeros([DC], tl.float32)
    if OVERLAP:
        rr = tl.arange(0, R)
        if j == 0:
            p0 = rr[:, None].to(tl.int64) * CD + d[None, :]
            kvt = tl.load(pkv_ptr + p0)
            sct = tl.load(psc_ptr + p0)
        else:
            p1 = (base + (j - 1) * R + rr)[:, None].to(tl.int64) * CD + d[None, :]
            kvt = tl.load(ekv_ptr + p1)
            sct = tl.load(esc_ptr + p1)
        m, l, acc = _pool(m, l, acc, kvt, sct)
        hi = (base + j * R + rr)[:, None].to(tl.int64) * CD + DC + d[None, :]
        m, l, acc = _pool(m, l, acc, tl.load(ekv_ptr + hi), tl.load(esc_ptr + hi))
    else:
        for i in range(R // RB):
            off = (base + j * R + i * RB + tl.arange(0, RB))[:, None].to(tl.int64) * CD \
                + d[None, :]
            m, l, acc = _pool(m, l, acc, tl.load(ekv_ptr + off), tl.load(esc_ptr + off))
    # RMSNorm(bf16(c)) -> RoPE at the block's first position -> FP8 (nope dims) or Hadamard + FP4
    c = round_bf16(acc / l)
    rs = tl.rsqrt(tl.sum(c * c, axis=0) / DC + eps)
    e = round_bf16(tl.load(norm_ptr + d) * (c * rs))
    a, b = to_pairs(e[None, :], 1, DC // 2)
    pair = tl.arange(0, DC // 2)[None, :]
    cos, sin = rope_cos_sin(((j0 + j) * R).to(tl.float32), freqs_ptr, pair, NOPE // 2)
    a, b = rope_pairs(a, b, cos, sin, pair >= NOPE // 2, False)
    if ROTATE:
        ya, yb = hadamard_pairs_row(tl.reshape(a, [DC // 2]), tl.reshape(b, [DC // 2]), DC // 2)
        out = fp4_fake_quant_rows(from_pairs(ya[None, :], yb[None, :], 1, DC // 2), 1, DC)
    else:
        out = fp8_fake_quant_rows(from_pairs(a, b, 1, DC // 2), 1, DC, NOPE)
    tl.store(cache_ptr + (j0 + j).to(tl.int64) * DC + d[None, :],
             out.to(cache_ptr.dtype.element_ty))


def compress_rows(ext_kv: torch.Tensor, ext_sc: torch.Tensor, prev_kv: torch.Tensor,
                  prev_sc: torch.Tensor, pos0: torch.Tensor, norm: torch.Tensor,
                  freqs: torch.Tensor, cache: torch.Tensor, eps: float, ratio: int,
                  rotate: bool, nope: int) -> None:
    """Pool and finish the blocks a chunk completes into the cache (bf16 [n+1, dc]): ext_kv /
    ext_sc [r + s, c*dc] f32 (scores with ape added) = the open block's r state rows rolled so
    that ext row r - o + i is the block's row i (o = pos0 % r), then the chunk's s rows at
    positions pos0.. ([1] int64, device); block j (ext rows from r - o + j*r) -> cache[pos0 // r
    + j] when it completes. prev_*: the state's previous-block rows [r, c*dc] (overlap mode).
    One launch of the (s + r - 1) // r programs a chunk may complete; capture-safe."""
    dc = cache.shape[-1]
    if dc & (dc - 1) or ratio & (ratio - 1) or dc % 64 or cache.dtype != torch.bfloat16:
        raise ValueError(f"compress_rows: dc = {dc}, ratio {ratio}, cache {cache.dtype}; expected "
                         f"powers of two, dc % 64 == 0, a bf16 cache")
    s = ext_kv.shape[0] - ratio
    with on_device(cache):
        _compress_rows_kernel[((s + ratio - 1) // ratio,)](
            ext_kv.contiguous(), ext_sc.contiguous(), prev_kv, prev_sc, norm, freqs, cache, pos0,
            s, eps, R=ratio, DC=dc, OVERLAP=ratio == 4, ROTATE=rotate, NOPE=nope,
            RB=min(ratio, 16), num_warps=4 if dc <= 128 else 8)


@triton.jit
def _ext_kernel(kv_ptr, sc_ptr, ape_ptr, skv_ptr, ssc_ptr, ekv_ptr, esc_ptr, pos_ptr,
                R: tl.constexpr, CUR: tl.constexpr, CD: tl.constexpr, BC: tl.constexpr):
    # program i: ext row i. i < R: the state's open-block row CUR + (i + o) % R; else the chunk's
    # row t = i - R, its score plus ape[(start + t) % R]
    i = tl.program_id(0).to(tl.int64)
    start = tl.load(pos_ptr)
    c = tl.arange(0, BC)
    for c0 in range(0, CD, BC):
        m = c0 + c < CD
        if i < R:
            src = CUR + (i + start % R) % R
            kv = tl.load(skv_ptr + src * CD + c0 + c, mask=m)
            sc = tl.load(ssc_ptr + src * CD + c0 + c, mask=m)
        else:
            t = i - R
            kv = tl.load(kv_ptr + t * CD + c0 + c, mask=m)
            sc = tl.load(sc_ptr + t * CD + c0 + c, mask=m) + \
                tl.load(ape_ptr + ((start + t) % R) * CD + c0 + c, mask=m)
        tl.store(ekv_ptr + i * CD + c0 + c, kv, mask=m)
        tl.store(esc_ptr + i * CD + c0 + c, sc, mask=m)


@triton.jit
def _state_kernel(ekv_ptr, esc_ptr, skv_ptr, ssc_ptr, pos_ptr, S, R: tl.constexpr,
                  CUR: tl.constexpr, CD: tl.constexpr, BC: tl.constexpr):
    # program q: state row q. q < CUR (overlap mode): the previous block's row q = the chunk's
    # last completed block's (ext rows from max(R - o + (nb - 1) R, 0)), if it completed one;
    # else open-block row j = q - CUR = the chunk's latest position p == j (mod R), if any (ext
    # row R + d + R ((S - 1 - d) // R), d = (j - start) mod R)
    q = tl.program_id(0).to(tl.int64)
    start = tl.load(pos_ptr)
    o = start % R
    if q < CUR:
        nb = (o + S) // R
        src = tl.maximum(R - o + (nb - 1) * R, 0) + q
        write = nb > 0
    else:
        d = ((q - CUR - start) % R + R) % R
        src = R + tl.minimum(d + R * (tl.maximum(S - 1 - d, 0) // R), S - 1)
        write = d < S
    if write:
        c = tl.arange(0, BC)
        for c0 in range(0, CD, BC):
            m = c0 + c < CD
            tl.store(skv_ptr + q * CD + c0 + c, tl.load(ekv_ptr + src * CD + c0 + c, mask=m), mask=m)
            tl.store(ssc_ptr + q * CD + c0 + c, tl.load(esc_ptr + src * CD + c0 + c, mask=m), mask=m)


def _block(cd: int) -> int:
    return min(triton.next_power_of_2(cd), 1024)


def compress_ext(kv: torch.Tensor, sc: torch.Tensor, ape: torch.Tensor, st_kv: torch.Tensor,
                 st_sc: torch.Tensor, pos0: torch.Tensor, ratio: int, cur: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """compress_rows' ext for the chunk kv, sc [s, c*dc] f32 at positions pos0.. ([1] int64,
    device): the state's open-block rows st_* [cur + r] (cur = r in overlap mode, else 0) from
    row cur rolled by o = pos0 % r, then the chunk's rows, the scores plus ape[(pos0 + t) % r]
    -> (ext_kv, ext_sc) [r + s, c*dc] f32. One launch; capture-safe."""
    s, cd = kv.shape
    ext_kv = torch.empty((ratio + s, cd), dtype=torch.float32, device=kv.device)
    ext_sc = torch.empty_like(ext_kv)
    with on_device(kv):
        _ext_kernel[(ratio + s,)](kv.contiguous(), sc.contiguous(), ape.contiguous(), st_kv, st_sc,
                                  ext_kv, ext_sc, pos0, R=ratio, CUR=cur, CD=cd, BC=_block(cd))
    return ext_kv, ext_sc


def compress_state(ext_kv: torch.Tensor, ext_sc: torch.Tensor, st_kv: torch.Tensor,
                   st_sc: torch.Tensor, pos0: torch.Tensor, ratio: int, cur: int) -> None:
    """The state rows st_* [cur + r, c*dc] f32 as the chunk's s decode steps leave them, from
    ext (compress_ext's, s = its rows - r): in overlap mode (cur = r) rows [0, r) = the chunk's
    last completed block, if any; rows [cur, cur + r) = for each block row j, the chunk's latest
    row at a position == j (mod r), if any; the others unchanged. One launch; capture-safe."""
    s, cd = ext_kv.shape[0] - ratio, ext_kv.shape[1]
    with on_device(ext_kv):
        _state_kernel[(cur + ratio,)](ext_kv, ext_sc, st_kv, st_sc, pos0, s, R=ratio, CUR=cur,
                                      CD=cd, BC=_block(cd))
