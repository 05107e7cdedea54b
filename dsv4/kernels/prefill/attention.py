"""Sparse attention of a prefill chunk in one launch: every query attends its own list of KV rows
(the window's rows of the old ring and of the chunk, then compressed entries; -1 = none) with the
attention sink, as the official sparse_attn: float32 logits, online softmax over tiles of rows, the
probabilities rounded to bf16 for P.V, float32 accumulation, then the inverse RoPE at the query's
position (the decode kernel's epilogue). All heads share the KV rows (MQA), so a program takes a
block of heads of one query and reads each of its rows once.

Legend: s = queries, h = heads, d = head_dim, k = attended rows per query.
Reference: dsv4.numerics.sparse.sparse_attention + dsv4.numerics.rope.apply_rope(inverse). Test: tests/dsv4/kernels/test_prefill_kernels.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import NEG_INF, dot_bf16, interpreting, load_pos, on_device, round_bf16
from ..decode.attention import attn_finish

# launch configs (heads per program, KV rows per tile, warps, stages) from the H200 sweep
# (`DSV4_BENCH_ONLY=attn DSV4_BENCH_HEADS=64,32,16 python -m dsv4.bench.prefill_kernels flash
# 4096`, 4,096 Flash queries, ms for ratio 4 / ratio 128): 32 heads a program over 64-row tiles
# in 4 warps (mma.sync, 255 registers), the gathered rows double-buffered, serves 64 heads (one
# GPU) at 1.35 / 0.63 (64 heads on wgmma in 8 warps: 1.39 / 0.70) and 32 (a TP2 rank) at 0.70 /
# 0.32 (16 heads over 32-row tiles, what a rank with fewer than 64 heads ran before: 1.19 /
# 0.45); 16 heads (TP4) over 64-row tiles 0.51 / 0.23 (over 32-row tiles 0.61 / 0.24). Fewer
# heads: NARROW.
WIDE = (32, 64, 4, 2)
MID = (16, 64, 4, 2)
NARROW = (16, 32, 4, 3)
SCAN = 256       # index entries per step of the scan for the first and last valid row


@triton.jit
def _attn_rows_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, freqs_ptr, pos_ptr, o_ptr, scale, KI,
                      H: tl.constexpr, DH: tl.constexpr, HB: tl.constexpr, BN: tl.constexpr,
                      NOPE: tl.constexpr, F32: tl.constexpr,
                      SCAN: tl.constexpr):
    # program (query i, head block): online softmax over the query's KI indices, BN at a time;
    # then the sink, bf16, and the inverse RoPE at the query's position pos + i
    i = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * HB + tl.arange(0, HB)
    hm = hh < H
    d = tl.arange(0, DH)
    q = tl.load(q_ptr + (i * H + hh)[:, None] * DH + d[None, :], mask=hm[:, None], other=0.0)
    m = tl.full([HB], NEG_INF, tl.float32)
    l = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, DH], tl.float32)
    # the tiles from the first valid row to the last: masked tiles outside change nothing (the
    # window's rows before position 0 come first, the compressed entries not yet visible last)
    lo = KI + 0
    hi = 0
    for j0 in range(0, KI, SCAN):
        j = j0 + tl.arange(0, SCAN)
        ok = tl.load(idx_ptr + i * KI + j, mask=j < KI, other=-1) >= 0
        lo = tl.minimum(lo, tl.min(tl.where(ok, j, KI), axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(ok, j + 1, 0), axis=0))
    for j0 in range(lo // BN * BN, hi, BN):
        j = j0 + tl.arange(0, BN)
        t = tl.load(idx_ptr + i * KI + j, mask=j < KI, other=-1)
        valid = t >= 0
        k = tl.load(kv_ptr + t[:, None].to(tl.int64) * DH + d[None, :], mask=valid[:, None],
                    other=0.0)
        s = dot_bf16(q, tl.trans(k), F32) * scale                                # [HB, BN]
        s = tl.where(valid[None, :], s, NEG_INF)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot_bf16(round_bf16(p), k, F32)
        m = m_new
    sink = tl.load(sink_ptr + hh, mask=hm, other=0.0)
    pos = (load_pos(pos_ptr) + i).to(tl.float32)
    o = attn_finish(acc, m, l, sink, pos, freqs_ptr, tl.arange(0, DH // 2)[None, :], HB, DH // 2,
               NOPE)
    tl.store(o_ptr + (i * H + hh)[:, None] * DH + d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=hm[:, None])


def sparse_attention_rows(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor,
                          sink: torch.Tensor, scale: float, freqs: torch.Tensor,
                          pos0: torch.Tensor, *, config: tuple | None = None) -> torch.Tensor:
    """q [s, h, d] bf16 (query i at position pos0 + i, pos0 [1] int64) over rows idx [s, k]
    (int, -1 = masked; every query has a valid one) of kv [n, d] bf16, sink [h] f32 -> o
    [s, h, d] bf16, inverse RoPE (freqs) applied. One launch. config: (heads per program,
    rows per tile, warps, stages), default `launch_config(h)`."""
    S, H, DH = q.shape
    if kv.dtype != torch.bfloat16 or q.dtype != torch.bfloat16 or DH & (DH - 1):
        raise ValueError(f"sparse_attention_rows: bf16 q / kv with a power-of-two head_dim "
                         f"(got {q.dtype}, {kv.dtype}, d = {DH})")
    hb, rows, warps, stages = config or launch_config(H)
    hb = min(hb, triton.next_power_of_2(H))
    o = torch.empty_like(q)
    idx = idx.to(torch.int32).contiguous()
    with on_device(o):
        _attn_rows_kernel[(S, triton.cdiv(H, hb))](q.contiguous(), kv.contiguous(), idx, sink,
                                                   freqs, pos0, o, scale, idx.shape[1], H=H,
                                                   DH=DH, HB=hb, BN=rows,
                                                   NOPE=DH - 2 * freqs.numel(),
                                                   F32=interpreting(), SCAN=SCAN, num_warps=warps,
                                                   num_stages=stages)
    return o


def launch_config(heads: int) -> tuple:
    """(heads per program, rows per tile, warps, stages) for `heads` query heads: WIDE from 32
    heads, MID from 16, else NARROW."""
    return WIDE if heads >= WIDE[0] else MID if heads >= MID[0] else NARROW
