"""The lightning indexer's scores for a prefill chunk in one launch: every query row against every
entry of the index cache, sum_h relu(q_h . k_t) * w_h, without the [rows, heads, entries] tensor
the torch path materializes (4,096 rows against a 16K-token cache: 4 GB per layer). Each row
takes the decode kernel's arithmetic (bf16 rounding after each torch op of dsv4.numerics.sparse
.index_scores), so a row's scores equal the decode kernel's for that query bit for bit; -inf for
entries not yet visible to the row (t >= (pos0 + row + 1) // 4).

Legend: s = query rows, h = index heads, di = index_head_dim, n = cache entries.
Reference: dsv4.numerics.sparse.index_scores + the visibility mask. Test: tests/dsv4/kernels/test_prefill_kernels.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import (
    INDEX_SCORES_TRANS,
    NEG_INF,
    index_tile_scores,
    interpreting,
    load_pos,
    on_device,
    round_bf16,
)

BT = 64     # cache entries per program (the decode kernel's tile)
QB = 8      # query rows per program: each loaded key tile serves them all


@triton.jit
def _scores_rows_kernel(q_ptr, w_ptr, k_ptr, pos_ptr, out_ptr, wscale, S, N, H: tl.constexpr,
                        HP: tl.constexpr, DI: tl.constexpr, BT: tl.constexpr, QB: tl.constexpr,
                        TRANS: tl.constexpr, F32: tl.constexpr):
    # program (entry tile, row block): the tile's keys once, then per row the decode kernel's
    # sum_h relu(q_h . k_t) * w_h (bf16 rounding after each op); tiles past a row's visible
    # entries store -inf without computing
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tm = t < N
    hh = tl.arange(0, HP)
    d = tl.arange(0, DI)
    vis0 = load_pos(pos_ptr) + 1
    last = tl.minimum(tl.program_id(1) * QB + QB, S) - 1
    k = tl.load(k_ptr + t[:, None].to(tl.int64) * DI + d[None, :],
                mask=(tm & (t < (vis0 + last) // 4))[:, None], other=0.0)
    for j in range(QB):
        r = tl.program_id(1) * QB + j
        if r < S:
            vis = (vis0 + r) // 4
            s = tl.full([BT], NEG_INF, tl.float32)
            if tl.program_id(0) * BT < vis:
                row = r.to(tl.int64)
                q = tl.load(q_ptr + row * (H * DI) + hh[:, None] * DI + d[None, :],
                            mask=(hh < H)[:, None], other=0.0)
                w = round_bf16(tl.load(w_ptr + row * H + hh, mask=hh < H, other=0.0)
                               .to(tl.float32) * wscale)
                s = tl.where(t < vis, index_tile_scores(q, k, w, TRANS, F32), NEG_INF)
            tl.store(out_ptr + r.to(tl.int64) * N + t, s.to(out_ptr.dtype.element_ty), mask=tm)


def index_scores_rows(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, pos0: torch.Tensor,
                      wscale: float = 1.0, trans: bool = INDEX_SCORES_TRANS) -> torch.Tensor:
    """Index scores [s, n] bf16 of the prepped queries q [s, h, di] (row r at position pos0 + r,
    pos0 [1] int64) against keys [n, di] with head weights w [s, h] * wscale; -inf where
    t >= (pos0 + r + 1) // 4. One launch (trans: the orientation, as the decode kernel's).
    Capture-safe, deterministic."""
    S, H, DI = q.shape
    N = keys.shape[0]
    if keys.dtype != torch.bfloat16 or q.dtype != torch.bfloat16 or DI & (DI - 1) \
            or keys.shape[1] != DI or tuple(w.shape) != (S, H):
        raise ValueError(f"index_scores_rows: q {tuple(q.shape)} {q.dtype}, w {tuple(w.shape)}, "
                         f"keys {tuple(keys.shape)} {keys.dtype}; expected bf16 q [s, h, di] "
                         f"(di a power of two), w [s, h], keys [n, di]")
    out = torch.empty(S, N, dtype=torch.bfloat16, device=q.device)
    with on_device(q):
        _scores_rows_kernel[(triton.cdiv(N, BT), triton.cdiv(S, QB))](
            q.contiguous(), w.contiguous(), keys, pos0, out, wscale, S, N, H=H,
            HP=max(16, triton.next_power_of_2(H)), DI=DI, BT=BT, QB=QB, TRANS=trans,
            F32=interpreting(), num_warps=4)
    return out
