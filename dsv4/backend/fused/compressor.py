"""A compressor's kernels: the decode step as one Triton launch after the projections
(dsv4/kernels/decode/compressor.py; it leaves the scratch row alone) and a chunk's entries and
state rows from a device start (dsv4/kernels/prefill/compressor.py: fixed shapes, no host sync,
capture-safe). Same state and cache as the torch reference (dsv4.model.compressor)."""
from __future__ import annotations

import functools

import torch

from ..ops import Ops


def decode(comp, ops: Ops, x: torch.Tensor, pos: torch.Tensor, st, cache: torch.Tensor,
           freqs: torch.Tensor, proj: list | None = None) -> None:
    """Compressor.decode_reference's steps for the T rows of x at pos .. pos + T - 1 (pos [1]
    int64; T > 1: the speculative verify rows, in turn), the pooling, norm, RoPE and fake-quant in
    one launch. proj: (wkv(x), wgate(x)) float32 [T, c*dc] when computed already."""
    kv, sc = comp.project(x) if proj is None else proj               # [T, c*dc] f32
    ops.compressor_decode(kv, sc, comp.ape, st.kv, st.score, comp.norm, freqs, pos, cache,
                          comp.cfg.norm_eps, comp.ratio, comp.rotate,
                          comp.dc - comp.cfg.rope_head_dim)


def prefill(comp, ops: Ops, x: torch.Tensor, st, cache: torch.Tensor, freqs: torch.Tensor,
            start) -> None:
    """Compressor.prefill_reference of the chunk x [s, D] at positions start.. (an int or a [1]
    int64 device tensor), on the kernels: every block completed in the chunk pooled into cache,
    the state as s decode steps leave it. Capture-safe with a device start."""
    kv, sc = comp.project(x)                                         # [s, c*dc] f32
    pos0 = start if isinstance(start, torch.Tensor) else torch.full(
        (1,), start, dtype=torch.int64, device=x.device)
    r = comp.ratio
    cur = r if comp.overlap else 0
    # ext: the open block's state rows rolled so that row r - o + i is block row i (o = pos0 %
    # r), then the chunk with the scores' positional bias (rows r - o - 1 and before are stale
    # rows no completed block reads); then the blocks the chunk completes, then the state
    ext_kv, ext_sc = ops.compress_ext(kv, sc, comp.ape, st.kv, st.score, pos0, r, cur)
    ops.compress_rows(ext_kv, ext_sc, st.kv, st.score, pos0, comp.norm, freqs, cache,
                      comp.cfg.norm_eps, r, comp.rotate, comp.dc - comp.cfg.rope_head_dim)
    ops.compress_state(ext_kv, ext_sc, st.kv, st.score, pos0, r, cur)


def bind(comp, ops: Ops) -> None:
    """decode on its kernel where the backend has the fused decode, prefill where it has the
    chunk's kernels; otherwise the torch reference."""
    be = ops.backend
    comp.decode = (functools.partial(decode, comp, ops) if be.fused_decode
                   else comp.decode_reference)
    comp.prefill = functools.partial(prefill, comp, ops) if be.rows else comp.prefill_reference
