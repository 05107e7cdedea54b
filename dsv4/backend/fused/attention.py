"""Attention's kernels (dsv4.model.attention holds the torch math they replace, bit for bit where
the bf16 roundings allow; tests/dsv4/kernels/test_attention_kernels.py).

Decode rows: everything between the GEMVs in Triton kernels (dsv4/kernels/decode/attention_prep.py,
attention.py, compressor.py, indexer.py); the projections of x, qr and o read each weight once for
all rows. A chunk's rows: RMSNorm rows, q/kv prep rows, the sparse attention rows with the inverse
RoPE in its epilogue, the grouped wo_a on the prefill GEMM.
Legend: T = decode rows, s = chunk rows, h = heads, d = head_dim, W = window, r = ratio.
"""
from __future__ import annotations

import functools

import torch

from .. import branches
from ..ops import Ops
from . import compressor as fused_compressor
from . import indexer as fused_indexer
from .prefetch import LANE_ATTN, Prefetch


def decode_rows(attn, ops: Ops, x: torch.Tensor, pos: torch.Tensor, st, reduce: bool = True
                ) -> torch.Tensor:
    """The fused decode of T rows at positions pos .. pos+T-1, row t seeing rows < t: x [T, D]
    -> [T, D] (T = 1: one decode step; T > 1: the speculative verify rows, row t with the bits of
    a one-row call after the rows before it). Same math and state updates as
    Attention.decode_rows_reference (bf16 activations). Capture-safe.
    When captured, the compressors and the indexer (state: their own buffers and kv_cache[W:])
    are parallel branches (dsv4.backend.branches) beside wq_a + wkv, q_norm, wq_b and prep (which
    writes the ring kv_cache[:W]): the side projections and both compressors need x only and
    start at once; the indexer's query (its wq_b) needs q_norm's qr only and runs on a second lane
    beside the compressors; the scores and the top-k wait for both. Every row's compressor step
    runs before the first row's scores and attention: those mask the entries of later positions,
    so what later rows emit changes nothing for them. A compressor's steps run row after row in
    one launch (each row's state follows the previous row's); the index query, scores, top-k,
    prep and attention take all rows in one launch each. For T > 1 the ring is written after every row's
    attention (row t + 1's slot holds a position that row t's window reads): until then a row
    reads the slots of rows <= t from their prepped kv (sparse_attention_decode_rows).
    reduce=False: a tensor-parallel rank's partial output (wo_b of its heads), left for the block
    to sum with its mHC post (TensorParallel.reduce_post); needs wo_a on the GEMV."""
    cfg, act, H, T = attn.cfg, x.dtype, attn.n_heads, x.shape[0]     # H: this rank's heads
    W, r, eps = cfg.window_size, attn.ratio, cfg.norm_eps
    ix = attn.indexer
    br = branches.Branch(x, "attn", ops.backend.branches, when=bool(r))
    idx, n, proj = None, (st.kv_cache.shape[0] - W - 1 if r else 0), None  # n: compressed
    with br.side():
        if r:   # each compressor's T steps in one launch, row after row
            proj = side_projections(attn, ops, x)
            if r == 4:
                fused_indexer.compress(ix, ops, x, pos, st, attn.freqs, proj[2:4])
            fused_compressor.decode(attn.compressor, ops, x, pos, st.compressor, st.kv_cache[W:],
                                    attn.freqs, proj[:2])
    qr, kv = q_kv_rows(attn, ops, x)
    qr = ops.rms_norm_row(qr, attn.q_norm, eps)
    bq = None
    if r == 4:
        bq = branches.Branch(qr, "attn", ops.backend.branches, lane=1)
        with bq.side():
            iq = fused_indexer.query(ix, ops, qr, pos, attn.freqs, q=ix.wq_b.rows(qr, act))
        br.wait_branch(bq)
        with br.side():
            idx = fused_indexer.select(ix, ops, iq, pos, st, proj[4])      # [T, k], all rows
            n = idx.shape[-1]
    qb = attn.wq_b.rows(qr, act)
    pf = Prefetch(ops, LANE_ATTN)   # wo_a into L2 while the top-k, prep and attention run
    pf.start("attn", qb, [attn.wo_a.weight, attn.wo_a.scale])
    o = torch.empty(T, H * cfg.head_dim, dtype=act, device=x.device)
    scale = cfg.head_dim ** -0.5
    if T == 1:
        q = ops.attention_prep(qb, kv, attn.kv_norm, st.kv_cache, pos, attn.freqs, eps, H,
                               W)                                      # also kv -> ring slot
    else:   # every row's q and kv; the ring is written after every row's attention
        q, kv = ops.attention_prep_rows(qb, kv, attn.kv_norm, pos, attn.freqs, eps, H,
                                        decode=True)
    if bq is not None:
        bq.join()
    br.join()
    if T == 1:
        ops.sparse_attention_decode(q, st.kv_cache, attn.attn_sink, pos, attn.freqs, scale,
                                    H, W, r, n, idx, out=o)            # inverse RoPE done
    else:
        ops.sparse_attention_decode_rows(q.view(T, -1), kv, st.kv_cache, attn.attn_sink, pos,
                                         attn.freqs, scale, H, W, r, n, idx, out=o)
    y = project_out(attn, ops, o, rows=T > 1, reduce=reduce)
    pf.join()
    return y


def q_kv_rows(attn, ops: Ops, x: torch.Tensor):
    """wq_a(x), wkv(x) of bf16 decode rows: one FP8 launch when both are FP8 and the device has
    the kernels, else two."""
    if attn.wq_a.fmt == "fp8" and attn.wkv.fmt == "fp8" and ops.backend.kernels:
        return ops.fp8_linear2(x, attn.wq_a.weight, attn.wq_a.scale, attn.wkv.weight,
                               attn.wkv.scale)
    return attn.wq_a.rows(x, x.dtype), attn.wkv.rows(x, x.dtype)


def side_projections(attn, ops: Ops, x: torch.Tensor) -> list:
    """The bf16 projections of x besides attention's own, in one launch: compressor wkv, wgate
    (float32), then for ratio 4 the indexer compressor's wkv, wgate (float32) and the indexer
    weights_proj (activation dtype)."""
    c = attn.compressor
    lins, dts = [c.wkv, c.wgate], [torch.float32, torch.float32]
    if attn.indexer is not None:
        ic = attn.indexer.compressor
        lins += [ic.wkv, ic.wgate, attn.indexer.weights_proj]
        dts += [torch.float32, torch.float32, x.dtype]
    if not ops.backend.kernels:   # the interpreter tests of the fused path: torch
        return [lin.rows(x, dt) for lin, dt in zip(lins, dts)]
    return ops.bf16_linear_multi(x, [lin.weight for lin in lins], dts)


def project_out(attn, ops: Ops, o: torch.Tensor, rows: bool = False, reduce: bool = True
                ) -> torch.Tensor:
    """Attention.project_out on the kernels where the backend has them: the grouped wo_a of
    decode rows (rows: each row with the bits of a one-row call) in one FP8 GEMV launch, of a
    chunk's rows on the prefill GEMM; then wo_b, summed over the tensor-parallel ranks
    (reduce=False: this rank's partial, left for the block to sum)."""
    be, act, G = ops.backend, o.dtype, attn.n_groups
    o = o.reshape(o.shape[0], -1)                                           # [s, h*d]
    if rows and not be.wo_a_gemv:   # each row as decode's one-row path (not the prefill GEMM)
        return torch.cat([attn.project_out(o[t:t + 1], reduce) for t in range(o.shape[0])])
    if be.wo_a_gemv and (o.shape[0] == 1 or rows):
        z = ops.fp8_linear(o, attn.wo_a.weight, attn.wo_a.scale, quant_act=False,
                           group_k=o.shape[-1] // G)
    elif o.shape[0] > 1 and be.wo_a_prefill:
        z = ops.prefill_linear(o, attn.wo_a.weight, attn.wo_a.scale, attn.wo_a.fmt,
                               out_dtype=act, quant_act=False, group_k=o.shape[-1] // G)
    else:
        return attn.project_out(o, reduce)
    y = attn.wo_b.rows(z, act) if rows else attn.wo_b(z, act)
    return attn.reduce(y) if reduce else y


def prefill(attn, ops: Ops, x: torch.Tensor, st, start=0, shared: dict | None = None
            ) -> torch.Tensor:
    """Attention.prefill_reference on the chunk kernels (in tensor parallel: this rank's partial
    sum): with a device start ([1] int64) the chunk has fixed shapes (every compressed entry of
    the cache is a candidate, masked by position) and no host sync, so it can be captured."""
    cfg, shared = attn.cfg, {} if shared is None else shared
    pos = attn.chunk_positions(x, start, shared)
    pos0 = pos[:1]
    qr = ops.rms_norm_rows(attn.wq_a(x, x.dtype), attn.q_norm, cfg.norm_eps)
    q, kv = ops.attention_prep_rows(attn.wq_b(qr, x.dtype), attn.wkv(x, x.dtype), attn.kv_norm,
                                    pos0, attn.freqs, cfg.norm_eps, attn.n_heads)
    idx, kv_all = attn.attended(x, qr, None, kv, st, start, pos, shared, pos0)
    o = ops.sparse_attention_rows(q, kv_all, idx, attn.attn_sink, cfg.head_dim ** -0.5,
                                  attn.freqs, pos0)                    # inverse RoPE done
    return project_out(attn, ops, o, reduce=False)


def bind(attn, ops: Ops) -> None:
    """decode_rows on the fused kernels where the backend has the fused decode, prefill where it
    has the chunk's kernels; otherwise the torch reference."""
    be = ops.backend
    attn.decode_rows = (functools.partial(decode_rows, attn, ops) if be.fused_decode
                        else attn.decode_rows_reference)
    attn.prefill = functools.partial(prefill, attn, ops) if be.rows else attn.prefill_reference
