"""Fused sparse attention for decode tokens, after the q/kv prep (attention_prep.py): window +
compressed entries with sink and inverse RoPE (1 launch, or split-K + combine = 2); the verify
rows in one launch for all rows (each row reads the ring as before the step plus the rows' prepped
kv, the ring written after). q [1, h*d] bf16, kv_cache [W + n (+1), d] bf16, pos [1] int64.
References: dsv4.model.attention (sparse_attention, _out), sparse_attention_decode_reference below.
Test: tests/dsv4/kernels/test_attention_kernels.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...numerics.rope import apply_rope, cos_sin
from ...numerics.sparse import sparse_attention
from ..common import (
    NEG_INF,
    dot_bf16,
    from_pairs,
    interpreting,
    launch_args,
    load_pos,
    on_device,
    pdl_wait,
    rope_cos_sin,
    rope_pairs,
    round_bf16,
    to_pairs,
)
from .attention_prep import HATCH

MODE_WINDOW, MODE_RATIO, MODE_INDEXED = 0, 1, 2   # compressed entries: none / implicit / top-k


@dataclass(frozen=True)
class AttnConfig:
    """Sparse-attention launch: hb heads x bn KV rows per tile, ~rows_per_split rows per program,
    at most max_programs programs in the split pass; combine: hc heads x bd dims per program."""
    hb: int = 16
    bn: int = 32
    rows_per_split: int = 32     # one KV tile per program: 16-80 programs for Flash, not 4-20
    max_programs: int = 264
    num_warps: int = 4
    hc: int = 4
    bd: int = 128


# Many compressed entries (a ratio-128 layer's cache past ~256K tokens): 64-row tiles on 8 warps,
# 16 heads a program for up to 32 heads (a tensor-parallel rank's), 32 for more, and at most 66
# splits a head block (132 programs from two blocks on; the combine's reads grow with the
# splits). A ratio-128 layer, one H200 (split pass + combine; the default in brackets):
#   64 heads (Flash):       2,048 entries (10.4 us [11.6]), 8,125 (18.2 [21.2]); <= 512: [6.1] 9.0
#   32 heads (a TP2 rank):  2,048 (8.7 [9.7]), 8,125 (14.4 [23.8, 129 splits])
#   16 heads (a TP4 rank):  2,048 (8.4 [7.8]), 8,125 (13.4; the default's 254 splits make a combine
#                           that did not compile in 7 minutes)
#   128 heads (Pro):        2,048 (15.8 [15.2]), 8,125 (27.1 [33.0])
# so 32 and 64 heads take them from 2,048 entries, other head counts from 4,096 (between 2,048 and
# 8,125 not measured). The splits of any config stop at MAX_SPLITS: the combine unrolls them.
LONG_ATTN_ENTRIES = {32: 2048, 64: 2048}
LONG_ATTN_ENTRIES_OTHER = 4096
LONG_ATTN_CONFIG = AttnConfig(hb=32, bn=64, rows_per_split=64, max_programs=132, num_warps=8)
MAX_SPLITS = 132


def attn_config(n_heads: int, n_comp: int) -> AttnConfig:
    """The launch config a layer's decode attention takes for its heads and compressed entries."""
    if n_comp < LONG_ATTN_ENTRIES.get(n_heads, LONG_ATTN_ENTRIES_OTHER):
        return AttnConfig()
    if n_heads > 32:
        return LONG_ATTN_CONFIG
    return AttnConfig(hb=16, bn=64, rows_per_split=64, max_programs=66 * triton.cdiv(n_heads, 16),
                      num_warps=8)


@triton.jit
def attn_finish(acc, m, l, sink, pos_f, freqs_ptr, pair, ROWS: tl.constexpr, P: tl.constexpr,
                NOPE: tl.constexpr):
    """o = acc / (l + e^(sink - m)) -> bf16 -> inverse RoPE at pos on pairs `pair`: [ROWS, 2P]."""
    o = round_bf16(acc / (l + tl.exp(sink - m))[:, None])
    cos, sin = rope_cos_sin(pos_f, freqs_ptr, pair, NOPE // 2)
    a, b = to_pairs(o, ROWS, P)
    a, b = rope_pairs(a, b, cos, sin, pair >= NOPE // 2, True)
    return from_pairs(a, b, ROWS, P)


@triton.jit
def _attn_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, freqs_ptr, pos_ptr, o_ptr, pm_ptr, pl_ptr,
                 pacc_ptr, new_ptr, scale, H: tl.constexpr, DH: tl.constexpr, W: tl.constexpr,
                 R: tl.constexpr, KC: tl.constexpr, MODE: tl.constexpr, HB: tl.constexpr,
                 BN: tl.constexpr, BPS: tl.constexpr, NSPLIT: tl.constexpr, NOPE: tl.constexpr,
                 ROWS: tl.constexpr, F32: tl.constexpr, PDL: tl.constexpr):
    # program (split, head block): online softmax over BPS tiles of BN entries; entries [0, W) are
    # ring slots (valid iff slot <= pos), entries W + j compressed entry j (valid iff j <
    # (pos+1)//R: row W + j, or row W + idx[j] for the indexer's top-k). Tiles with no valid entry
    # are skipped. NSPLIT == 1: the epilogue runs here; else partial (m, l, acc) go to pm/pl/pacc.
    # ROWS (the speculative verify rows): program_id(2) is the row r, at pos + r, with its own q,
    # idx, partials and output; the ring still holds positions < pos (it is written after all
    # rows), so a ring slot that rows 0..r write comes from their prepped kv at new_ptr instead:
    # the values and their order are those of a one-row launch after the one-row ring writes
    pdl_wait(PDL)
    split = tl.program_id(0)
    hh = tl.program_id(1) * HB + tl.arange(0, HB)
    d = tl.arange(0, DH)
    pos = load_pos(pos_ptr)
    pos0 = pos
    row = 0
    if ROWS:
        row = tl.program_id(2)
        pos = pos0 + row
        q_ptr += row * (H * DH)
        o_ptr += row * (H * DH)
        if MODE == 2:
            idx_ptr += row * KC
        pm_ptr += row * (NSPLIT * H)
        pl_ptr += row * (NSPLIT * H)
        pacc_ptr += row * (NSPLIT * H * DH)
    q = tl.load(q_ptr + hh[:, None] * DH + d[None, :], mask=(hh < H)[:, None], other=0.0)
    nw = tl.minimum(pos + 1, W)                                  # valid ring slots: 0 .. nw-1
    if MODE == 2:   # the indexer's top-k comes unsorted: any of the KC entries may be valid
        vis = (pos + 1) // R
        nc = KC
    elif R > 0:
        vis = (pos + 1) // R                                     # visible compressed entries
        nc = tl.minimum(vis, KC)
    else:
        vis = 0
        nc = 0
    NWB: tl.constexpr = W // BN
    NBLK: tl.constexpr = NWB + (KC + BN - 1) // BN
    m = tl.full([HB], NEG_INF, tl.float32)
    l = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, DH], tl.float32)
    e = tl.arange(0, BN)
    for i in range(BPS):
        blk = split * BPS + i
        win = blk < NWB
        live = (blk < NBLK) & tl.where(win, blk * BN < nw, (blk - NWB) * BN < nc)
        if live:
            j = (blk - NWB) * BN + e
            if MODE == 2:
                # j < 0 iff win (a vector mask: Triton 3.9's interpreter rejects scalar & vector)
                t = tl.load(idx_ptr + j, mask=(j >= 0) & (j < KC), other=-1).to(tl.int32)
                cvalid = (j < KC) & (t >= 0) & (t < vis)
            else:
                t = j
                cvalid = j < nc
            rows = tl.where(win, blk * BN + e, W + t)
            valid = tl.where(win, blk * BN + e < nw, cvalid)
            kp = kv_ptr + rows[:, None] * DH + d[None, :]
            if ROWS:       # ring slots rows 0..row wrote: chunk row jn of new_ptr
                jn = (blk * BN + e - pos0 % W + W) % W
                fresh = (blk * BN + e < W) & (jn <= row)
                kp = tl.where(fresh[:, None], new_ptr + jn[:, None] * DH + d[None, :], kp)
            k = tl.load(kp, mask=valid[:, None], other=0.0)
            s = dot_bf16(q, tl.trans(k), F32) * scale                            # [HB, BN]
            s = tl.where(valid[None, :], s, NEG_INF)
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            # P is rounded to bf16 for P.V, as the official kernel
            acc = acc * alpha[:, None] + dot_bf16(round_bf16(p), k, F32)
            m = m_new
    hm = hh < H
    if NSPLIT == 1:
        sink = tl.load(sink_ptr + hh, mask=hm, other=0.0)
        o = attn_finish(acc, m, l, sink, pos.to(tl.float32), freqs_ptr,
                        tl.arange(0, DH // 2)[None, :], HB, DH // 2, NOPE)
        tl.store(o_ptr + hh[:, None] * DH + d[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=hm[:, None])
    else:
        tl.store(pm_ptr + split * H + hh, m, mask=hm)
        tl.store(pl_ptr + split * H + hh, l, mask=hm)
        tl.store(pacc_ptr + (split * H + hh)[:, None] * DH + d[None, :], acc, mask=hm[:, None])


@triton.jit
def _combine_kernel(pm_ptr, pl_ptr, pacc_ptr, sink_ptr, freqs_ptr, pos_ptr, o_ptr, new_ptr,
                    cache_ptr, H: tl.constexpr, DH: tl.constexpr, HC: tl.constexpr,
                    BD: tl.constexpr, NSPLIT: tl.constexpr, NOPE: tl.constexpr, W: tl.constexpr,
                    ROWS: tl.constexpr, PDL: tl.constexpr):
    # program (head block, dim block): merge the splits in a fixed order, sink, bf16, inverse RoPE.
    # ROWS: program_id(2) is the row r (at pos + r); the head block 0 programs also write row r's
    # prepped kv (new_ptr) into its ring slot: every row's attention has finished reading the ring
    pdl_wait(PDL)
    hh = tl.program_id(0) * HC + tl.arange(0, HC)
    dd = tl.program_id(1) * BD + tl.arange(0, BD)
    hm = hh < H
    pos = load_pos(pos_ptr)
    if ROWS:
        row = tl.program_id(2)
        pos = pos + row
        pm_ptr += row * (NSPLIT * H)
        pl_ptr += row * (NSPLIT * H)
        pacc_ptr += row * (NSPLIT * H * DH)
        o_ptr += row * (H * DH)
        if tl.program_id(0) == 0:
            tl.store(cache_ptr + (pos % W) * DH + dd, tl.load(new_ptr + row * DH + dd))
    # unrolled: every split's loads are independent and go out together (latency, not bytes)
    mx = tl.full([HC], NEG_INF, tl.float32)
    for s in tl.static_range(NSPLIT):
        mx = tl.maximum(mx, tl.load(pm_ptr + s * H + hh, mask=hm, other=NEG_INF))
    l = tl.zeros([HC], tl.float32)
    acc = tl.zeros([HC, BD], tl.float32)
    for s in tl.static_range(NSPLIT):
        w = tl.exp(tl.load(pm_ptr + s * H + hh, mask=hm, other=NEG_INF) - mx)
        l += w * tl.load(pl_ptr + s * H + hh, mask=hm, other=0.0)
        acc += w[:, None] * tl.load(pacc_ptr + (s * H + hh)[:, None] * DH + dd[None, :],
                                    mask=hm[:, None], other=0.0)
    sink = tl.load(sink_ptr + hh, mask=hm, other=0.0)
    pair = tl.program_id(1) * (BD // 2) + tl.arange(0, BD // 2)[None, :]
    o = attn_finish(acc, mx, l, sink, pos.to(tl.float32), freqs_ptr, pair, HC, BD // 2, NOPE)
    tl.store(o_ptr + hh[:, None] * DH + dd[None, :], o.to(o_ptr.dtype.element_ty), mask=hm[:, None])


COMBINE_WIDE_SPLITS = 32    # above this many splits the combine runs one head a program


def plan_attention(n_heads: int, head_dim: int, window: int, n_comp: int,
                   config: AttnConfig | None = None) -> dict:
    """Fixed launch geometry for a layer (host-only, from shapes): tile sizes, splits, grids.
    config None: attn_config's for these heads and entries."""
    c = config or attn_config(n_heads, n_comp)
    hb = max(16, min(c.hb, triton.next_power_of_2(n_heads)))
    bn = max(16, min(c.bn, window))
    while window % bn:
        bn //= 2
    if bn < 16:
        raise ValueError(f"sparse attention: window {window} needs a tile of >= 16 dividing it "
                         f"({HATCH})")
    nblk = window // bn + triton.cdiv(n_comp, bn)
    nhb = triton.cdiv(n_heads, hb)
    nsplit = min(triton.cdiv(nblk * bn, c.rows_per_split), max(1, c.max_programs // nhb), nblk,
                 MAX_SPLITS)
    bps = triton.cdiv(nblk, nsplit)
    nsplit = triton.cdiv(nblk, bps)
    # many splits (long context: a ratio-128 layer at 1M tokens has 66): one head a combine
    # program, so 4x the programs share the partials' reads (each head's merge is unchanged)
    hc = min(c.hc if nsplit <= COMBINE_WIDE_SPLITS else 1, triton.next_power_of_2(n_heads))
    bd = min(c.bd, head_dim)
    return dict(hb=hb, bn=bn, bps=bps, nsplit=nsplit, grid=(nsplit, nhb), num_warps=c.num_warps,
                hc=hc, bd=bd, combine_grid=(triton.cdiv(n_heads, hc), head_dim // bd))


def sparse_attention_decode(q: torch.Tensor, kv_cache: torch.Tensor, sink: torch.Tensor,
                            pos: torch.Tensor, freqs: torch.Tensor, scale: float, n_heads: int,
                            window: int, ratio: int, n_comp: int, idx: torch.Tensor | None = None,
                            config: AttnConfig | None = None, out: torch.Tensor | None = None,
                            pdl: bool = True) -> torch.Tensor:
    """Attention of q [1, h*d] (prepped) over the window ring and the compressed entries of
    kv_cache, with the sink, then inverse RoPE at pos: -> [1, h*d] bf16.

    ratio 0: window only. ratio > 0: n_comp compressed entries, entry j valid iff
    j < (pos+1)//ratio; idx None: entry j is row window + j (get_compress_topk_idxs); idx
    [1, n_comp] int64 (the indexer's raw top-k, in any order): entry j is row window + idx[j]
    (invalid if idx[j] is not visible either). Same math as sparse_attention + apply_rope(inverse).
    Capture-safe, deterministic.
    """
    DH = kv_cache.shape[-1]
    nope = DH - 2 * freqs.numel()
    if q.numel() != n_heads * DH or q.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16:
        raise ValueError(f"sparse_attention_decode: q {tuple(q.shape)} {q.dtype}, kv_cache "
                         f"{tuple(kv_cache.shape)} {kv_cache.dtype}; expected bf16, q [1, h*d] "
                         f"({HATCH})")
    if idx is not None and idx.numel() != n_comp:
        raise ValueError(f"sparse_attention_decode: idx {tuple(idx.shape)}; expected {n_comp} "
                         f"entries")
    pl = plan_attention(n_heads, DH, window, n_comp if ratio else 0, config)
    out = torch.empty_like(q) if out is None else out
    _attention_launches(q, kv_cache, sink, pos, freqs, scale, n_heads, window, ratio, n_comp, idx,
                        pl, out, None, pdl)
    return out


def _attention_launches(q, kv_cache, sink, pos, freqs, scale, n_heads, window, ratio, n_comp,
                        idx, pl, out, new, pdl=True):
    """The split pass (+ combine) of sparse_attention_decode (new None) or of
    sparse_attention_decode_rows (new: the rows' prepped kv; then the ring write at the end)."""
    DH = kv_cache.shape[-1]
    nope = DH - 2 * freqs.numel()
    mode = MODE_WINDOW if not ratio else (MODE_RATIO if idx is None else MODE_INDEXED)
    T = 1 if new is None else new.shape[0]
    ns = pl["nsplit"]
    f32 = dict(dtype=torch.float32, device=q.device)
    pm = torch.empty(T, ns, n_heads, **f32) if ns > 1 else out
    pls = torch.empty(T, ns, n_heads, **f32) if ns > 1 else out
    pacc = torch.empty(T, ns, n_heads, DH, **f32) if ns > 1 else out
    rows = new is not None
    with on_device(q):
        _attn_kernel[pl["grid"] + ((T,) if rows else ())](
            q, kv_cache, idx if idx is not None else pos, sink, freqs, pos, out, pm, pls, pacc,
            new if rows else out, scale, H=n_heads, DH=DH, W=window, R=ratio,
            KC=n_comp if ratio else 0, MODE=mode, HB=pl["hb"], BN=pl["bn"], BPS=pl["bps"],
            NSPLIT=ns, NOPE=nope, ROWS=rows, F32=interpreting(), num_warps=pl["num_warps"],
            **launch_args(out, pdl))
        if ns > 1:
            _combine_kernel[pl["combine_grid"] + ((T,) if rows else ())](
                pm, pls, pacc, sink, freqs, pos, out, new if rows else out,
                kv_cache if rows else out, H=n_heads, DH=DH, HC=pl["hc"], BD=pl["bd"],
                NSPLIT=ns, NOPE=nope, W=window, ROWS=rows, num_warps=4,
                **launch_args(out, pdl))
        elif rows:
            _ring_write_kernel[(T,)](new, kv_cache, pos, W=window, DH=DH, num_warps=4,
                                     **launch_args(out, pdl))


@triton.jit
def _ring_write_kernel(new_ptr, cache_ptr, pos_ptr, W: tl.constexpr, DH: tl.constexpr,
                       PDL: tl.constexpr):
    # program r: row r's prepped kv -> ring slot (pos + r) % W (after every row's attention)
    pdl_wait(PDL)
    r = tl.program_id(0)
    d = tl.arange(0, DH)
    tl.store(cache_ptr + ((load_pos(pos_ptr) + r) % W) * DH + d, tl.load(new_ptr + r * DH + d))


def sparse_attention_decode_rows(q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor,
                                 sink: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor,
                                 scale: float, n_heads: int, window: int, ratio: int, n_comp: int,
                                 idx: torch.Tensor | None = None, config: AttnConfig | None = None,
                                 out: torch.Tensor | None = None, pdl: bool = True
                                 ) -> torch.Tensor:
    """sparse_attention_decode of T decode rows at positions pos .. pos+T-1 (the speculative
    verify rows), row t seeing rows <= t: q [T, h*d] prepped, kv [T, d] their prepped kv
    (attention_prep_rows; the ring is not written yet), idx [T, n_comp] (ratio 4) -> [T, h*d];
    then kv row t goes to ring slot (pos+t) % window. Each output row has the bits of
    attention_prep + sparse_attention_decode run row after row (the same values in the same
    order: a slot rows <= t wrote is read from kv). One split launch (+ combine, which also
    writes the ring; else one ring-write launch). Capture-safe, deterministic."""
    T, DH = kv.shape
    if q.shape != (T, n_heads * DH) or T > window or kv_cache.shape[-1] != DH \
            or q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        raise ValueError(f"sparse_attention_decode_rows: q {tuple(q.shape)} {q.dtype}, kv "
                         f"{tuple(kv.shape)} {kv.dtype}, cache {tuple(kv_cache.shape)}; expected "
                         f"bf16 q [T, h*d], kv [T, d], T <= window ({HATCH})")
    if idx is not None and tuple(idx.shape) != (T, n_comp):
        raise ValueError(f"sparse_attention_decode_rows: idx {tuple(idx.shape)}; expected "
                         f"{(T, n_comp)}")
    pl = plan_attention(n_heads, DH, window, n_comp if ratio else 0, config)
    out = torch.empty_like(q) if out is None else out
    _attention_launches(q, kv_cache, sink, pos, freqs, scale, n_heads, window, ratio, n_comp,
                        None if idx is None else idx.contiguous(), pl, out, kv.contiguous(), pdl)
    return out


# ---- plain-torch references (the code the kernels replace) -----------------------------------

def sparse_attention_decode_reference(q, kv_cache, sink, pos, freqs, scale, n_heads, window, ratio,
                                      n_comp, idx=None):
    """Attention.decode's index construction + sparse_attention + inverse RoPE (torch ops)."""
    dev = q.device
    slots = torch.arange(window, device=dev)
    full = torch.where(slots <= pos, slots, -1).unsqueeze(0)
    if ratio:
        vis = (pos + 1) // ratio                      # as Attention.decode / Indexer.decode
        t = torch.arange(n_comp, device=dev) if idx is None else idx.reshape(-1)
        full = torch.cat((full, torch.where(t < vis, t + window, -1).unsqueeze(0)), -1)
    o = sparse_attention(q.unflatten(-1, (n_heads, -1)), kv_cache, full, sink, scale)
    return apply_rope(o, cos_sin(pos, freqs), inverse=True).flatten(1)
