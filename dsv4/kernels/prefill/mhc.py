"""The hyper-connection kernels of a prefill chunk's rows: one tiled mix kernel (tensor cores,
tiles of rows x chunks of K), then the decode kernels' finish and post (dsv4.kernels.decode.mhc)
with a row grid dimension, so row t has a decode row's arithmetic.

h [s, c, D] bf16 (c = hc_mult = 4), fn [M, c*D] f32 (M = 24), x/out bf16.
References: dsv4.kernels.decode.mhc (*_reference). Test: tests/dsv4/kernels/test_mhc_kernels.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import interpreting, on_device
from ..decode.mhc import FINISH_WARPS, _post_kernel, _pre_finish_kernel


@triton.jit
def _mix_rows_kernel(h_ptr, fn_ptr, part_ptr, S, K: tl.constexpr, M: tl.constexpr,
                     MP: tl.constexpr, RB: tl.constexpr, KC: tl.constexpr, BK: tl.constexpr,
                     NCH: tl.constexpr, F32: tl.constexpr):
    # program (row block, K chunk c): part[r, c, :M] = fn[:, chunk] @ h[r, chunk],
    # part[r, c, MP] = sum(h[r, chunk]^2); the finish kernel sums the NCH chunks. On tensor
    # cores: h is bf16 (exact) and fn = f1 + f2 + f3 in bf16 (a float32 split to 24 bits), so
    # three bf16 MMAs with float32 accumulation give the float32 products (F32: the interpreter,
    # one exact float32 dot).
    r = tl.program_id(0) * RB + tl.arange(0, RB)
    c = tl.program_id(1)
    rm = r < S
    m = tl.arange(0, MP)
    acc = tl.zeros([RB, MP], tl.float32)
    sq = tl.zeros([RB], tl.float32)
    for k0 in range(c * KC, c * KC + KC, BK):
        kk = k0 + tl.arange(0, BK)
        h = tl.load(h_ptr + r[:, None].to(tl.int64) * K + kk[None, :], mask=rm[:, None], other=0.0)
        f = tl.load(fn_ptr + m[:, None] * K + kk[None, :], mask=(m < M)[:, None], other=0.0)
        hf = h.to(tl.float32)
        sq += tl.sum(hf * hf, axis=1)
        if F32:
            acc += tl.dot(hf, tl.trans(f), input_precision="ieee")
        else:
            f1 = f.to(tl.bfloat16)
            rest = f - f1.to(tl.float32)
            f2 = rest.to(tl.bfloat16)
            f3 = (rest - f2.to(tl.float32)).to(tl.bfloat16)
            hb = h.to(tl.bfloat16)
            acc = tl.dot(hb, tl.trans(f1), acc)
            acc = tl.dot(hb, tl.trans(f2), acc)
            acc = tl.dot(hb, tl.trans(f3), acc)
    base = part_ptr + (r[:, None].to(tl.int64) * NCH + c) * (MP + 1)
    tl.store(base + m[None, :], acc, mask=rm[:, None])
    tl.store(part_ptr + (r.to(tl.int64) * NCH + c) * (MP + 1) + MP, sq, mask=rm)


ROWS_RB, ROWS_BK = 64, 64      # rows and K step of a _mix_rows_kernel program
ROWS_NCH = 16                   # K chunks per row block (partial sums the finish kernel adds)
GRID_Y = 32768                  # rows per launch of the row-grid finish / post kernels


def hc_pre_norm_rows(h, fn, scale, base, norm_w, norm_eps, hc_eps, iters):
    """Prefill: h [s, c, D] bf16 -> (RMSNorm(hc_pre(h)) [s, D] bf16, post [s, c], comb [s, c, c]
    f32) in two launches: partial mixes of every row (tensor cores, tiles of rows x chunks of
    K), then the decode's finish kernel (which adds the chunks in order) per row."""
    S, C, D = h.shape
    K = C * D
    if K % ROWS_BK:
        raise ValueError(f"hc_pre_norm_rows: c*D = {K} must be a multiple of {ROWS_BK}")
    h2 = h.reshape(S, K).contiguous()
    M = fn.shape[0]
    MP = max(16, triton.next_power_of_2(M))
    nch = max(1, min(ROWS_NCH, K // ROWS_BK))         # K chunks: programs for short chunks
    while K % (nch * ROWS_BK):
        nch -= 1
    part = torch.empty(S, nch, MP + 1, dtype=torch.float32, device=h.device)
    x = torch.empty(S, D, dtype=h.dtype, device=h.device)
    post = torch.empty(S, C, dtype=torch.float32, device=h.device)
    comb = torch.empty(S, C, C, dtype=torch.float32, device=h.device)
    with on_device(x):
        _mix_rows_kernel[(triton.cdiv(S, ROWS_RB), nch)](h2, fn, part, S, K=K, M=M, MP=MP,
                                                         RB=ROWS_RB, KC=K // nch, BK=ROWS_BK,
                                                         NCH=nch, F32=interpreting(),
                                                         num_warps=4)
        for r in range(0, S, GRID_Y):     # rows on the grid's second axis (at most 65535)
            n = min(GRID_Y, S - r)
            _pre_finish_kernel[(2, n)](h2[r:], part[r:], scale, base, norm_w, x[r:], post[r:],
                                       comb[r:], 0, D=D, C=C, NCH=nch,
                                       NCHP=triton.next_power_of_2(nch), MP=MP,
                                       BD=triton.next_power_of_2(D), ITERS=iters,
                                       norm_eps=norm_eps, hc_eps=hc_eps,
                                       ROUND=h.dtype == torch.bfloat16, num_warps=FINISH_WARPS,
                                       PDL=False)
    return x, post, comb


def hc_post_rows(x, res, post, comb):
    """Prefill: x [s, D], res [s, c, D], post [s, c], comb [s, c, c] -> [s, c, D] in x's dtype."""
    S, C, D = res.shape
    out = torch.empty_like(res)
    bd = 256
    x, res = x.contiguous(), res.contiguous()
    with on_device(out):
        for r in range(0, S, GRID_Y):
            n = min(GRID_Y, S - r)
            _post_kernel[(triton.cdiv(D, bd), n)](x[r:], res[r:], post[r:], comb[r:], out[r:],
                                                  D=D, C=C, BD=bd,
                                                  ROUND=x.dtype == torch.bfloat16, num_warps=4,
                                                  PDL=False)
    return out
