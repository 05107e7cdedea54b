"""Fused lightning-indexer kernels for one decode token: query prep (RoPE + Hadamard + FP4
fake-quant, 1 launch) and scores over the fixed-capacity cache (1 launch; torch.topk after).
q [1, h*di] bf16, w [1, h] bf16, index_cache [n, di] bf16. Test: tests/dsv4/kernels/test_attention_kernels.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...numerics import sparse
from ...numerics.quant import fp4_quant_dequant, hadamard, hadamard_matrix
from ...numerics.rope import apply_rope, cos_sin
from ..common import (
    INDEX_SCORES_TRANS,
    NEG_INF,
    dot_bf16,
    fp4_fake_quant_rows,
    from_pairs,
    index_tile_scores,
    interpreting,
    launch_args,
    load_pos,
    on_device,
    pdl_wait,
    rope_cos_sin,
    rope_pairs,
    round_bf16,
    sylvester,
    to_pairs,
)
from ..common import pdl as pdl_on
from ..cuda import lib as cuda_cpp

BT = 64     # cache entries per tile of the score kernel
SCORES_SUB = 4             # tiles a program takes on long caches (scores_tiles)
SCORES_MIN_PROGRAMS = 528  # ... while that leaves this many programs (4 an SM of an H100 / H200)
SCORES_STAGES = 2   # the key tiles in flight (at most the tiles a program takes)
SCORES_WARPS = 4    # a program's warps
HATCH = "DSV4_KERNELS=0 runs the torch path"


@triton.jit
def _query_kernel(q_ptr, qo_ptr, freqs_ptr, pos_ptr, H: tl.constexpr, DI: tl.constexpr,
                  HQ: tl.constexpr, NOPE: tl.constexpr, F32: tl.constexpr, PDL: tl.constexpr):
    # HQ heads per program: RoPE (bf16) -> normalized Sylvester Hadamard (bf16) -> FP4 fake-quant;
    # program_id(1): the row (prefill: a chunk's rows at positions pos + row; decode: one row)
    pdl_wait(PDL)
    row = tl.program_id(1)
    q_ptr += row.to(tl.int64) * (H * DI)
    qo_ptr += row.to(tl.int64) * (H * DI)
    hh = tl.program_id(0) * HQ + tl.arange(0, HQ)
    hm = (hh < H)[:, None]
    d = tl.arange(0, DI)
    off = hh[:, None] * DI + d[None, :]
    q = tl.load(q_ptr + off, mask=hm, other=0.0).to(tl.float32)
    P: tl.constexpr = DI // 2
    pair = tl.arange(0, P)[None, :]
    cos, sin = rope_cos_sin((load_pos(pos_ptr) + row).to(tl.float32), freqs_ptr, pair,
                            NOPE // 2)
    a, b = to_pairs(q, HQ, P)
    a, b = rope_pairs(a, b, cos, sin, pair >= NOPE // 2, False)
    h = sylvester(d[:, None], d[None, :])                              # [DI, DI] +-1, symmetric
    y = round_bf16(dot_bf16(from_pairs(a, b, HQ, P), h, F32) * (DI ** -0.5))
    tl.store(qo_ptr + off, fp4_fake_quant_rows(y, HQ, DI).to(qo_ptr.dtype.element_ty), mask=hm)


@triton.jit
def _scores_kernel(q_ptr, w_ptr, k_ptr, pos_ptr, out_ptr, wscale, N, H: tl.constexpr,
                   HP: tl.constexpr, DI: tl.constexpr, BT: tl.constexpr, SUB: tl.constexpr,
                   STAGES: tl.constexpr, TRANS: tl.constexpr, F32: tl.constexpr,
                   PDL: tl.constexpr):
    # entries [t0, t0 + SUB*BT) in SUB tiles of BT: sum_h relu(q_h . k_t) * w_h with bf16 rounding
    # after each torch op; -inf for t >= (pos+1)//4 (their keys are not loaded: masked). q and w
    # are loaded once for the SUB tiles, whose keys are requested STAGES tiles ahead (a software
    # pipeline); each tile's math is the SUB = 1 program's, so an entry's bits depend on neither.
    # program_id(1): the row (the speculative verify rows: row r at pos + r, its q, w and scores
    # at row r)
    pdl_wait(PDL)
    row = tl.program_id(1)
    q_ptr += row.to(tl.int64) * (H * DI)
    w_ptr += row * H
    out_ptr += row.to(tl.int64) * N
    t0 = tl.program_id(0) * (SUB * BT)
    vis = (load_pos(pos_ptr) + row + 1) // 4
    hh = tl.arange(0, HP)
    d = tl.arange(0, DI)
    if t0 < vis:
        q = tl.load(q_ptr + hh[:, None] * DI + d[None, :], mask=(hh < H)[:, None], other=0.0)
        w = round_bf16(tl.load(w_ptr + hh, mask=hh < H, other=0.0).to(tl.float32) * wscale)
        for j in tl.range(0, SUB, num_stages=STAGES):
            t = t0 + j * BT + tl.arange(0, BT)
            k = tl.load(k_ptr + t[:, None] * DI + d[None, :], mask=(t < vis)[:, None], other=0.0)
            s = tl.where(t < vis, index_tile_scores(q, k, w, TRANS, F32), NEG_INF)
            tl.store(out_ptr + t, s.to(out_ptr.dtype.element_ty), mask=t < N)
    else:
        for j in tl.static_range(SUB):
            t = t0 + j * BT + tl.arange(0, BT)
            tl.store(out_ptr + t, tl.full([BT], NEG_INF, tl.float32).to(out_ptr.dtype.element_ty),
                     mask=t < N)


def scores_tiles(n: int) -> int:
    """BT-entry tiles a score program takes for a cache of n entries: SCORES_SUB where that
    still leaves SCORES_MIN_PROGRAMS programs (long contexts: the 16 KB query loaded once for
    them), else 1."""
    return SCORES_SUB if triton.cdiv(n, BT * SCORES_SUB) >= SCORES_MIN_PROGRAMS else 1


def index_query(q: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor, n_heads: int,
                out: torch.Tensor | None = None, pdl: bool = True) -> torch.Tensor:
    """q [s, h*di] bf16 (indexer.wq_b output; decode: one row) -> RoPE at pos + row, Hadamard,
    FP4 fake-quant: [s, h*di] bf16 (Indexer._query's q). One launch. Capture-safe,
    deterministic."""
    DI = q.shape[-1] // n_heads
    nope = DI - 2 * freqs.numel()
    S = q.numel() // (n_heads * DI)
    if q.shape[-1] != n_heads * DI or DI & (DI - 1) or DI < 32 or q.dtype != torch.bfloat16:
        raise ValueError(f"index_query: q {tuple(q.shape)} {q.dtype}, {n_heads} heads; expected "
                         f"bf16 [1, h*di] with di a power of two >= 32 ({HATCH})")
    hq = 16
    out = torch.empty_like(q) if out is None else out
    with on_device(q):
        _query_kernel[(triton.cdiv(n_heads, hq), S)](q, out, freqs, pos, H=n_heads, DI=DI,
                                                     HQ=hq, NOPE=nope, F32=interpreting(),
                                                     num_warps=4, **launch_args(out, pdl))
    return out


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, pos: torch.Tensor,
                 wscale: float, out: torch.Tensor | None = None, pdl: bool = True,
                 tiles: int | None = None, stages: int | None = None,
                 warps: int = SCORES_WARPS, trans: bool = INDEX_SCORES_TRANS) -> torch.Tensor:
    """Index scores [T, n] bf16 of the prepped q [T, h*di] against keys [n, di] (the index cache
    without its scratch row) with head weights w [T, h] * wscale; -inf for entries not yet visible
    (t >= (pos+r+1)//4 for row r: one decode row, or the speculative verify rows at pos + r). As
    dsv4.numerics.sparse.index_scores + the decode mask; each row has the bits of its one-row launch.
    tiles: BT-entry tiles a program (default scores_tiles(n)); stages: the tiles whose keys are in
    flight (the software pipeline's depth; default SCORES_STAGES, at most the tiles); warps: a
    program's; the bits depend on none of them.
    trans: the orientation (INDEX_SCORES_TRANS; the chunk kernel's bits agree with the default's).
    Capture-safe, deterministic."""
    n, DI = keys.shape
    T = w.shape[0] if w.dim() == 2 else 1
    H = w.numel() // T
    if q.numel() != T * H * DI or keys.dtype != torch.bfloat16:
        raise ValueError(f"index_scores: q {tuple(q.shape)}, w {tuple(w.shape)}, keys "
                         f"{tuple(keys.shape)} {keys.dtype}; expected q [T, h*di], bf16 keys "
                         f"({HATCH})")
    if out is None:
        out = torch.empty(T, n, dtype=torch.bfloat16, device=q.device)
    sub = scores_tiles(n) if tiles is None else tiles
    stages = min(SCORES_STAGES, sub) if stages is None else stages
    with on_device(q):
        _scores_kernel[(triton.cdiv(n, BT * sub), T)](q, w, keys, pos, out, wscale, n, H=H,
                                                    HP=max(16, triton.next_power_of_2(H)), DI=DI,
                                                    BT=BT, SUB=sub, STAGES=stages, TRANS=trans,
                                                    F32=interpreting(), num_warps=warps,
                                                    **launch_args(out, pdl))
    return out


def index_topk(scores: torch.Tensor, k: int, out: torch.Tensor | None = None,
               impl: str = "cuda", pdl: bool = True) -> torch.Tensor:
    """The k best entries of each row of index scores [T, n] bf16 -> [T, k] int64, unsorted (the
    set matters; among equal scores at the threshold the lowest entries). One CUDA launch (a radix
    select per row in csrc/topk.cu) where the CUDA kernels serve the device (impl "cuda", the
    backend's decision), else dsv4.numerics.sparse.topk_lowest (the same tie rule). Capture-safe,
    deterministic."""
    n = scores.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"index_topk: k = {k} for {n} scores")
    if impl == "cuda" and scores.dtype == torch.bfloat16 and scores.dim() == 2 \
            and scores.is_contiguous() and cuda_cpp.usable(scores):
        out = torch.empty(scores.shape[0], k, dtype=torch.int64, device=scores.device) \
            if out is None else out
        with on_device(out):
            cuda_cpp.topk_bf16(cuda_cpp.lib_for(out.device), scores, k, out, pdl_on(out, pdl))
        return out
    return sparse.topk_lowest(scores, k)


# ---- plain-torch references (the code the kernels replace) -----------------------------------

def index_query_reference(q, pos, freqs, n_heads):
    """Indexer._query's q after the GEMV (torch ops)."""
    q = apply_rope(q.unflatten(-1, (n_heads, -1)), cos_sin(pos, freqs))
    h = hadamard_matrix(q.shape[-1], q.device)
    return fp4_quant_dequant(hadamard(q, h), 32).flatten(1)


def index_scores_reference(q, w, keys, pos, wscale):
    """Indexer.decode's scores: index_scores + the visibility mask (torch ops)."""
    H = w.numel()
    sc = sparse.index_scores(q.unflatten(-1, (H, -1)), w * wscale, keys)
    cols = torch.arange(keys.shape[0], device=q.device)
    return sc.masked_fill(cols >= (pos + 1) // 4, float("-inf"))
