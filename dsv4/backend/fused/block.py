"""The block's fused mHC kernels (dsv4/kernels/decode/mhc.py, prefill/mhc.py): hc_pre + Sinkhorn
+ RMSNorm of the rows in one launch, hc_post in one; in a captured decode step each Sinkhorn runs
beside its sublayer (a parallel branch on lane 2), and the L2 prefetch of each half's first
weights beside its mHC (lane 3: dsv4.backend.fused.prefetch)."""
from __future__ import annotations

import functools

import torch

from ...numerics.mhc import hc_post
from .. import branches
from ..ops import Ops
from .prefetch import LANE_BLOCK, Prefetch, ffn_weights, layer_weights


def decode_rows(blk, ops: Ops, h: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, st,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Block.decode_rows_reference with every launch of the mHC and the linears taking all T rows
    (one binary per row: the same bits; the linears read each weight once), attention and the
    MoE as bound. Each Sinkhorn runs beside its sublayer (hc_pre_norm's branch forks after its
    mix); each half's first weights are prefetched into L2 during its mHC. Capture-safe."""
    cfg = blk.cfg
    pf = Prefetch(ops, LANE_BLOCK)
    pf.start("layer", h, layer_weights(blk.attn))
    sk = branches.Branch(h, "mhc", ops.backend.branches, lane=2, fork=False)
    x, post, comb = ops.hc_pre_norm(h, *blk.mix_weights("attn"), blk.attn_norm, cfg, sk)
    a = blk.attn.decode_rows(x, pos, st)
    sk.join()
    h = ops.hc_post(a, h, post, comb)
    pf.start("ffn", h, ffn_weights(blk.ffn))
    sk = branches.Branch(h, "mhc", ops.backend.branches, lane=2, fork=False)
    x, post, comb = ops.hc_pre_norm(h, *blk.mix_weights("ffn"), blk.ffn_norm, cfg, sk)
    f = blk.ffn.decode_rows(x, ids)
    sk.join()
    pf.join()
    return ops.hc_post(f, h, post, comb, out=out)


def mix_rows(blk, ops: Ops, h: torch.Tensor, kind: str, norm: torch.Tensor):
    """Block.mix of a chunk's rows in one launch."""
    return ops.hc_pre_norm_rows(h, *blk.mix_weights(kind), norm, blk.cfg)


def bind(blk, ops: Ops) -> None:
    """decode_rows on the fused mHC where the backend has it for decode rows; mix_rows and
    post_rows where it has the chunk's mHC kernels; otherwise the torch reference."""
    be = ops.backend
    blk.decode_rows = (functools.partial(decode_rows, blk, ops) if be.mhc_decode
                       else blk.decode_rows_reference)
    if be.mhc_prefill:
        blk.mix_rows, blk.post_rows = functools.partial(mix_rows, blk, ops), ops.hc_post_rows
    else:
        blk.mix_rows, blk.post_rows = blk.mix, hc_post
