"""Fused hyper-connection kernels for decode tokens (one, or the speculative step's few rows, one
binary per row): hc_pre + Sinkhorn split + RMSNorm in two
launches (the second one's two programs compute x and the Sinkhorn side by side; inside a
captured step the Sinkhorn program is a launch of its own on a side stream, off the main chain,
as only hc_post needs it), hc_post in one, hc_head + final norm in two (instead of ~250 torch ops
per sublayer). The finish and post kernels take a row grid dimension, which the rows of a
prefill chunk use (dsv4.kernels.prefill.mhc).

h [c, D] bf16 (c = hc_mult = 4), fn [M, c*D] f32 (M = 24, or 4 for the head), x/out bf16.
References: dsv4.numerics.mhc (hc_pre, hc_post, hc_head, rms_norm). Test: tests/dsv4/kernels/test_mhc_kernels.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...numerics import mhc as torch_mhc
from ..common import launch_args, pdl_wait, round_bf16

BK = 256       # flattened-h elements per program of the partial mix GEMV
FINISH_WARPS = 8   # warps of the one-program finish (Sinkhorn, weighted sum, RMSNorm)


@triton.jit
def _mix_partial_kernel(h_ptr, fn_ptr, part_ptr, K: tl.constexpr, M: tl.constexpr,
                        MP: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    # part[pid, :M] = fn[:, chunk] @ h[chunk]; part[pid, M] = sum(h[chunk]^2)   (float32);
    # program_id(1): the decode row (one binary for any number of rows: the same bits)
    pid = tl.program_id(0)
    row = tl.program_id(1)
    h_ptr += row * K
    part_ptr += row * (tl.num_programs(0) * (MP + 1))
    kk = pid * BK + tl.arange(0, BK)
    m = tl.arange(0, MP)
    f = tl.load(fn_ptr + m[:, None] * K + kk[None, :], mask=(m < M)[:, None], other=0.0)
    pdl_wait(PDL)    # fn is a weight: loaded before the wait
    h = tl.load(h_ptr + kk).to(tl.float32)
    dots = tl.sum(f * h[None, :], axis=1)
    tl.store(part_ptr + pid * (MP + 1) + m, dots)
    tl.store(part_ptr + pid * (MP + 1) + MP, tl.sum(h * h, axis=0))


@triton.jit
def _reduce(part_ptr, idx, NCH: tl.constexpr, NCHP: tl.constexpr, MP: tl.constexpr):
    """Sum the per-chunk partials of the mixes at `idx` ([n] int32): one 2-D load, fixed order."""
    c = tl.arange(0, NCHP)
    v = tl.load(part_ptr + c[:, None] * (MP + 1) + idx[None, :], mask=(c < NCH)[:, None], other=0.0)
    return tl.sum(v, axis=0)


@triton.jit(do_not_specialize=["first"])
def _pre_finish_kernel(h_ptr, part_ptr, scale_ptr, base_ptr, normw_ptr, x_ptr, post_ptr, comb_ptr,
                       first, D: tl.constexpr, C: tl.constexpr, NCH: tl.constexpr,
                       NCHP: tl.constexpr, MP: tl.constexpr,
                       BD: tl.constexpr, ITERS: tl.constexpr, norm_eps, hc_eps,
                       ROUND: tl.constexpr, PDL: tl.constexpr):
    # mixes -> (pre, post, comb) -> x = sum_k pre_k h_k -> RMSNorm(x) * w. Program first + pid:
    # 0: x; 1 (hc_pre, not the head's one-program launch): post and comb (the Sinkhorn), side by
    # side in a launch of two programs, or each a launch of one. `first` is a runtime argument
    # that is never specialized: one binary for all three launches (compiled by the eager
    # warm-up, not during capture), the same code and so the same bits.
    pdl_wait(PDL)
    row = tl.program_id(1)            # rows of a prefill chunk (decode: one row, 0)
    h_ptr += row * (C * D)
    part_ptr += row * (NCH * (MP + 1))
    x_ptr += row * D
    post_ptr += row * C
    comb_ptr += row * (C * C)
    rho = tl.rsqrt(_reduce(part_ptr, tl.full([1], MP, tl.int32), NCH, NCHP, MP) / (C * D)
                   + norm_eps)
    kc = tl.arange(0, C)
    if tl.program_id(0) + first == 1:
        post = 2.0 * tl.sigmoid(_reduce(part_ptr, C + kc, NCH, NCHP, MP) * rho
                                * tl.load(scale_ptr + 1) + tl.load(base_ptr + C + kc))
        tl.store(post_ptr + kc, post)
        ij = 2 * C + kc[:, None] * C + kc[None, :]                      # row-major [C, C]
        flat = 2 * C + tl.arange(0, C * C)
        cm = tl.reshape(_reduce(part_ptr, flat, NCH, NCHP, MP), (C, C))
        cm = cm * rho * tl.load(scale_ptr + 2) + tl.load(base_ptr + ij)
        cm = tl.exp(cm - tl.max(cm, axis=1)[:, None])
        cm = cm / tl.sum(cm, axis=1)[:, None] + hc_eps
        cm = cm / (tl.sum(cm, axis=0)[None, :] + hc_eps)
        for _ in range(ITERS - 1):
            cm = cm / (tl.sum(cm, axis=1)[:, None] + hc_eps)
            cm = cm / (tl.sum(cm, axis=0)[None, :] + hc_eps)
        tl.store(comb_ptr + kc[:, None] * C + kc[None, :], cm)
    else:
        s0 = tl.load(scale_ptr)
        pre = tl.sigmoid(_reduce(part_ptr, kc, NCH, NCHP, MP) * rho * s0
                         + tl.load(base_ptr + kc)) + hc_eps
        d = tl.arange(0, BD)
        dm = d < D
        h = tl.load(h_ptr + kc[:, None] * D + d[None, :], mask=dm[None, :], other=0.0)
        x = tl.sum(pre[:, None] * h.to(tl.float32), axis=0)
        if ROUND:
            x = round_bf16(x)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / D + norm_eps)
        y = tl.load(normw_ptr + d, mask=dm, other=0.0) * (x * r)
        if ROUND:
            y = round_bf16(y)
        tl.store(x_ptr + d, y.to(x_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _post_kernel(x_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, D: tl.constexpr, C: tl.constexpr,
                 BD: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr):
    # out[j, d] = post_j * x[d] + sum_i comb[i, j] * res[i, d]; program_id(1): the row
    pdl_wait(PDL)
    row = tl.program_id(1)
    x_ptr += row * D
    res_ptr += row * (C * D)
    post_ptr += row * C
    comb_ptr += row * (C * C)
    out_ptr += row * (C * D)
    d = tl.program_id(0) * BD + tl.arange(0, BD)
    dm = d < D
    kc = tl.arange(0, C)
    x = tl.load(x_ptr + d, mask=dm, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + kc[:, None] * D + d[None, :], mask=dm[None, :], other=0.0).to(tl.float32)
    comb = tl.load(comb_ptr + kc[:, None] * C + kc[None, :])                 # [i, j]
    y = tl.load(post_ptr + kc)[:, None] * x[None, :] + tl.sum(comb[:, :, None] * res[:, None, :], axis=0)
    if ROUND:
        y = round_bf16(y)
    tl.store(out_ptr + kc[:, None] * D + d[None, :], y.to(out_ptr.dtype.element_ty), mask=dm[None, :])


@triton.jit
def _post_mix_kernel(x_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, fn_ptr, part_ptr,
                     D: tl.constexpr, C: tl.constexpr, BD: tl.constexpr, M: tl.constexpr,
                     MP: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr):
    # _post_kernel's out (the same expression), then the next hc_pre's partial mixes of it, a
    # chunk per stream j and program p (BD columns; chunk j * (D / BD) + p of the flattened
    # streams, in their order): part[chunk, :M] = fn[:, chunk] @ out[j, cols], part[chunk, MP] =
    # sum(out[j, cols]^2) (float32; _mix_partial_kernel's expressions on chunks of BD elements)
    p = tl.program_id(0)
    row = tl.program_id(1)
    NP: tl.constexpr = D // BD
    K: tl.constexpr = C * D
    d = p * BD + tl.arange(0, BD)
    kc = tl.arange(0, C)
    m = tl.arange(0, MP)
    # fn is a weight: its tiles (C x [MP, BD]) are loaded before the wait
    f = tl.load(fn_ptr + m[None, :, None] * K + kc[:, None, None] * D + d[None, None, :],
                mask=(m < M)[None, :, None], other=0.0)                      # [C, MP, BD]
    pdl_wait(PDL)
    x_ptr += row * D
    res_ptr += row * (C * D)
    post_ptr += row * C
    comb_ptr += row * (C * C)
    out_ptr += row * (C * D)
    part_ptr += row * (C * NP * (MP + 1))
    x = tl.load(x_ptr + d).to(tl.float32)
    res = tl.load(res_ptr + kc[:, None] * D + d[None, :]).to(tl.float32)
    comb = tl.load(comb_ptr + kc[:, None] * C + kc[None, :])                 # [i, j]
    y = (tl.load(post_ptr + kc)[:, None] * x[None, :]
         + tl.sum(comb[:, :, None] * res[:, None, :], axis=0))
    if ROUND:
        y = round_bf16(y)
    y = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + kc[:, None] * D + d[None, :], y)
    h = y.to(tl.float32)                                                     # [C, BD], as stored
    dots = tl.sum(f * h[:, None, :], axis=2)                                 # [C, MP]
    sq = tl.sum(h * h, axis=1)                                               # [C]
    chunk = kc * NP + p
    tl.store(part_ptr + chunk[:, None] * (MP + 1) + m[None, :], dots)
    tl.store(part_ptr + chunk * (MP + 1) + MP, sq)


def _mix(h2, fn, pdl=True):
    """h2 [T, c*D] (decode rows) -> the partial mixes [T, nch, MP + 1]."""
    T, K = h2.shape
    M = fn.shape[0]
    MP = triton.next_power_of_2(M)
    nch = K // BK
    part = torch.empty(T, nch, MP + 1, dtype=torch.float32, device=h2.device)
    _mix_partial_kernel[(nch, T)](h2, fn, part, K=K, M=M, MP=MP, BK=BK, num_warps=4,
                                  **launch_args(part, pdl))
    return part, nch, MP


def hc_pre_norm(h, fn, scale, base, norm_w, norm_eps, hc_eps, iters, branch=None, pdl=True,
                mixed=None):
    """h [T, c, D] -> (RMSNorm(hc_pre(h)) [T, D] in h's dtype, post [T, c], comb [T, c, c] f32).
    T = 1 in decoding; T decode rows (the speculative verify rows) run one binary per row, so
    row t has the bits of a one-row call. branch: an overlap.Branch made with fork=False; when it
    is on (capturing), it forks after the mix and the Sinkhorn (post, comb) runs as a launch of its
    own on its side stream, so the main chain waits for x only; join it before post / comb are
    read. Otherwise both in one launch (the same bits). pdl: launch with PDL where the device has
    it (the backend's switch; as every decode kernel's `pdl`). mixed: the partial mixes of h
    already made (hc_post_mix's (part, nch, MP), the launch that wrote h): no mix launch."""
    T, C, D = h.shape
    if mixed is None and (C * D) % BK:
        raise ValueError(f"hc_pre_norm: c*D = {C * D} must be a multiple of {BK}")
    h2 = h.reshape(T, C * D).contiguous()
    part, nch, MP = mixed if mixed is not None else _mix(h2, fn, pdl)
    x = torch.empty(T, D, dtype=h.dtype, device=h.device)
    post = torch.empty(T, C, dtype=torch.float32, device=h.device)
    comb = torch.empty(T, C, C, dtype=torch.float32, device=h.device)
    kw = dict(D=D, C=C, NCH=nch, NCHP=triton.next_power_of_2(nch), MP=MP,
              BD=triton.next_power_of_2(D), ITERS=iters, norm_eps=norm_eps, hc_eps=hc_eps,
              ROUND=h.dtype == torch.bfloat16, num_warps=FINISH_WARPS, **launch_args(x, pdl))
    args = (h2, part, scale, base, norm_w, x, post, comb)
    if branch is None or not branch.on:
        _pre_finish_kernel[(2, T)](*args, 0, **kw)
        return x, post, comb
    branch.fork()   # after the mix: the Sinkhorn reads its partials
    _pre_finish_kernel[(1, T)](*args, 0, **kw)
    with branch.side():
        _pre_finish_kernel[(1, T)](*args, 1, **kw)
    branch.hold(part)   # the side launch reads it: keep it from the allocator until the join
    return x, post, comb


def hc_head_norm(h, fn, scale, base, norm_w, norm_eps, hc_eps, pdl=True):
    """h [T, c, D] -> RMSNorm(hc_head(h)) [T, D] in h's dtype (the head's sigmoid mix, no
    Sinkhorn); row t with the bits of a one-row call."""
    T, C, D = h.shape
    h2 = h.reshape(T, C * D).contiguous()
    part, nch, MP = _mix(h2, fn, pdl)
    x = torch.empty(T, D, dtype=h.dtype, device=h.device)
    _pre_finish_kernel[(1, T)](h2, part, scale, base, norm_w, x, x, x, 0, D=D, C=C, NCH=nch,
                             NCHP=triton.next_power_of_2(nch), MP=MP,
                             BD=triton.next_power_of_2(D), ITERS=1, norm_eps=norm_eps,
                             hc_eps=hc_eps, ROUND=h.dtype == torch.bfloat16,
                             num_warps=8, **launch_args(x, pdl))
    return x


def hc_post(x, res, post, comb, out=None, pdl=True):
    """x [T, D], res [T, c, D], post [T, c], comb [T, c, c] -> [T, c, D] in x's dtype (into `out`
    when given: contiguous, res's shape and dtype, not overlapping res); T = 1 in decoding, each
    of T rows with the bits of a one-row call."""
    T, C, D = res.shape
    if out is None:
        out = torch.empty_like(res)
    elif (out.shape != res.shape or out.dtype != res.dtype or not out.is_contiguous()
          or out.data_ptr() == res.data_ptr()):
        raise ValueError(f"hc_post: out must be a contiguous {tuple(res.shape)} {res.dtype} "
                         "tensor apart from res")
    bd = 256
    _post_kernel[(triton.cdiv(D, bd), T)](x, res.contiguous(), post, comb, out, D=D, C=C, BD=bd,
                                           ROUND=x.dtype == torch.bfloat16, num_warps=4,
                                           **launch_args(out, pdl))
    return out


POST_MIX_BD = 64    # columns a program of hc_post_mix (64 programs for Flash's 4,096)


def post_mix_fits(D: int, M: int) -> bool:
    """hc_post_mix takes streams of D columns and a mix of M outputs."""
    return D % POST_MIX_BD == 0 and M <= 32


def hc_post_mix(x, res, post, comb, fn, pdl=True):
    """hc_post and the partial mixes of its output for the next hc_pre (fn [M, c*D]) in one
    launch: -> (out [T, c, D] as hc_post's, the mixed argument of hc_pre_norm). The partials are
    on chunks of POST_MIX_BD elements (c * D / 64 of them), not _mix's 256: hc_pre_norm's x,
    post and comb from them are within rounding of the two-launch path's, not its bits; each of T
    rows has the bits of a one-row call."""
    T, C, D = res.shape
    M = fn.shape[0]
    if not post_mix_fits(D, M) or tuple(fn.shape) != (M, C * D):
        raise ValueError(f"hc_post_mix: D = {D}, fn {tuple(fn.shape)}; expected D a multiple of "
                         f"{POST_MIX_BD} and fn [<= 32, {C * D}]")
    MP = triton.next_power_of_2(M)
    nch = C * D // POST_MIX_BD
    out = torch.empty_like(res)
    part = torch.empty(T, nch, MP + 1, dtype=torch.float32, device=res.device)
    _post_mix_kernel[(D // POST_MIX_BD, T)](x, res.contiguous(), post, comb, out, fn, part, D=D,
                                             C=C, BD=POST_MIX_BD, M=M, MP=MP,
                                             ROUND=x.dtype == torch.bfloat16, num_warps=4,
                                             **launch_args(out, pdl))
    return out, (part, nch, MP)


def post_streams(post: tuple, rows: int, D: int, who: str, out_dtype, out) -> torch.Tensor:
    """The `post` argument of a kernel that writes the block's mHC post of its output (`who`),
    (res, post, comb, streams), checked -> streams: res and streams [rows, 4, D] bf16 apart, post
    [rows, 4] and comb [rows, 4, 4] float32, all contiguous; the call's out_dtype bf16 and no out
    (the post writes the streams instead)."""
    if out_dtype != torch.bfloat16 or out is not None:
        raise ValueError(f"{who}(post=...): out_dtype {out_dtype}, out "
                         f"{'given' if out is not None else 'None'}; the post writes the streams "
                         f"(out_dtype bfloat16, no out)")
    res, pw, comb, streams = post
    C, bf16 = 4, torch.bfloat16
    ok = (res.dtype == streams.dtype == bf16
          and tuple(res.shape) == tuple(streams.shape) == (rows, C, D)
          and tuple(pw.shape) == (rows, C) and tuple(comb.shape) == (rows, C, C)
          and pw.dtype == comb.dtype == torch.float32
          and all(t.is_contiguous() for t in (res, pw, comb, streams))
          and streams.data_ptr() != res.data_ptr())
    if not ok:
        raise ValueError(f"{who}(post=...): res / streams {tuple(res.shape)} / "
                         f"{tuple(streams.shape)} bf16, post {tuple(pw.shape)}, comb "
                         f"{tuple(comb.shape)} float32, contiguous, apart; expected [{rows}, {C}, "
                         f"{D}], [{rows}, {C}], [{rows}, {C}, {C}]")
    return streams


def hc_pre_norm_reference(h, fn, scale, base, norm_w, norm_eps, hc_eps, iters):
    x, post, comb = torch_mhc.hc_pre(h, fn, scale, base, norm_eps, hc_eps, iters)
    return torch_mhc.rms_norm(x, norm_w, norm_eps), post, comb


def hc_head_norm_reference(h, fn, scale, base, norm_w, norm_eps, hc_eps):
    return torch_mhc.rms_norm(torch_mhc.hc_head(h, fn, scale, base, norm_eps, hc_eps), norm_w,
                              norm_eps)


def hc_post_reference(x, res, post, comb):
    return torch_mhc.hc_post(x, res, post, comb)
