"""The lightning indexer's kernels. Decode in three parts, so that the part that needs only x can
start before wq_a (a parallel branch of the fused attention): `compress` (the index compressor's
step), `query` (wq_b, RoPE, Hadamard, FP4 fake-quant in one launch), `select` (the masked scores
against the index cache, the top-k). A chunk's rows: the query in one launch, the masked scores
[s, t] in one, the top-k in pieces. Same indices as dsv4.model.indexer's torch reference (up to
ties within bf16 rounding of the scores)."""
from __future__ import annotations

import functools

import torch

from ...model.indexer import TOPK_ELEMS
from ...numerics.sparse import visible_bound
from ..ops import Ops
from . import compressor as fused_compressor


def compress(ix, ops: Ops, x, pos, st, freqs, proj: list | None = None) -> None:
    """Part 1 (x only): the index compressor's step (proj: [wkv(x), wgate(x)] float32 when the
    caller computed them); an emitted entry lands in the index cache."""
    fused_compressor.decode(ix.compressor, ops, x, pos, st.index_compressor, st.index_cache, freqs,
                            proj)


def query(ix, ops: Ops, qr, pos, freqs, q: torch.Tensor | None = None) -> torch.Tensor:
    """Part 2 (qr only): the index query [T, h * di] of qr's rows; q: wq_b(qr) when the caller
    computed it (decode rows)."""
    return ops.index_query(ix.wq_b(qr, qr.dtype) if q is None else q, pos, freqs, ix.n_heads)


def select(ix, ops: Ops, q, pos, st, w: torch.Tensor) -> torch.Tensor:
    """Part 3 (after compress and query): scores of the queries q against the index cache with
    head weights w = weights_proj(x), and the top-k entry numbers [T, k] (unsorted; valid iff
    < (pos+1)//4: the fused attention masks the rest)."""
    keys = st.index_cache[:-1]
    sc = ops.index_scores(q, w, keys, pos, ix.weight_scale)
    return ops.index_topk(sc, min(ix.cfg.index_topk, keys.shape[0]))


def decode(ix, ops: Ops, x, qr, cs, pos, st, freqs, offset: int) -> torch.Tensor:
    """Indexer.decode_reference on the kernels (cs unused): [1, k] indices (+offset, -1 where not
    visible). Capture-safe."""
    compress(ix, ops, x, pos, st, freqs)
    idx = select(ix, ops, query(ix, ops, qr, pos, freqs), pos, st, ix.weights_proj(x, x.dtype))
    return torch.where(idx >= (pos + 1) // 4, -1, idx + offset)


def prefill(ix, ops: Ops, x, qr, cs, st, freqs, start, offset: int,
            rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Indexer.prefill_reference on the chunk kernels (cs unused): with a device start ([1] int64)
    every entry of the cache is a candidate, masked by position, and nothing syncs with the
    host (capture-safe). The entries are the decode's top-k of the same scores: the same set
    and, on CUDA, the same order as a decode step of the query selects them. rows (r0, r1):
    those queries' indices only (the compressor takes every row)."""
    s, act = x.shape[0], x.dtype
    r0, r1 = rows or (0, s)
    pos0 = start if isinstance(start, torch.Tensor) else torch.full(
        (1,), start, dtype=torch.int64, device=x.device)
    p0 = pos0 + r0 if r0 else pos0                                      # the first query's
    q = ops.index_query(ix.wq_b(qr[r0:r1], act), p0, freqs, ix.n_heads).view(
        r1 - r0, ix.n_heads, ix.head_dim)
    w = ix.weights_proj(x[r0:r1], act) * ix.weight_scale
    ix.compressor.prefill(x, st.index_compressor, st.index_cache, freqs, pos0)
    t = visible_bound(start, s, 4, st.index_cache.shape[0] - 1)
    k = min(ix.cfg.index_topk, t)
    if k == 0:
        return torch.empty(r1 - r0, 0, dtype=torch.int64, device=x.device)
    keys = st.index_cache[:t]
    visible = (start + 1 + torch.arange(r0, r1, device=x.device)).unsqueeze(1) // 4
    scores = ops.index_scores_rows(q, w, keys, p0)                      # [r1 - r0, t], masked
    # the decode's top-k (a radix select a row in one launch on CUDA; elsewhere topk_lowest, the
    # same tie rule), queries in pieces so that topk_lowest's int64 keys stay bounded
    c = max(1, TOPK_ELEMS // max(1, t))
    parts = [ops.index_topk(scores[i:i + c], k) for i in range(0, r1 - r0, c)]
    idx = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return torch.where(idx >= visible, -1, idx + offset)


def bind(ix, ops: Ops) -> None:
    """decode on the kernels where the backend has the fused decode, prefill where it has the
    chunk's kernels; otherwise the torch reference. (The index compressor is bound with it.)"""
    be = ops.backend
    ix.decode = functools.partial(decode, ix, ops) if be.fused_decode else ix.decode_reference
    ix.prefill = functools.partial(prefill, ix, ops) if be.rows else ix.prefill_reference
