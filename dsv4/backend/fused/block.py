"""The block's fused mHC kernels (dsv4/kernels/decode/mhc.py, prefill/mhc.py): hc_pre's mixes in
one launch, x + RMSNorm and the Sinkhorn in another, hc_post in one (or in the launch before it:
bind_fused_post; in one process the attention's post also makes the FFN's mixes: hc_post_mix);
in a captured decode step each Sinkhorn runs beside its sublayer (a parallel branch on lane 2),
and the L2 prefetch of each half's first weights beside its mHC (lane 3:
dsv4.backend.fused.prefetch)."""
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
    cfg, tp = blk.cfg, blk.post_reduce
    part = {"reduce": False} if tp is not None else {}   # the sublayers' partial outputs

    def post_of(y, h, post, comb, out=None):   # (the sum over the ranks of) y into the streams
        if tp is None:
            return ops.hc_post(y, h, post, comb, out=out)
        return tp.reduce_post(y, h, post, comb, ops.hc_post, out=out)

    pf = Prefetch(ops, LANE_BLOCK)
    pf.start("layer", h, layer_weights(blk.attn))
    sk = branches.Branch(h, "mhc", ops.backend.branches, lane=2, fork=False)
    x, post, comb = ops.hc_pre_norm(h, *blk.mix_weights("attn"), blk.attn_norm, cfg, sk)
    a = blk.attn.decode_rows(x, pos, st, **part)
    sk.join()
    mix = blk.mix_weights("ffn")
    # where the attention's post is a launch of its own (one process, or no all-reduce that takes
    # it), it also makes the FFN's partial mixes (Options.fuse_mix)
    both = (ops.hc_post_mix(a, h, post, comb, mix[0])
            if tp is None and ops.backend.options.fuse_mix else None)
    h, mixed = both if both is not None else (post_of(a, h, post, comb), None)
    pf.start("ffn", h, ffn_weights(blk.ffn))
    sk = branches.Branch(h, "mhc", ops.backend.branches, lane=2, fork=False)
    x, post, comb = ops.hc_pre_norm(h, *mix, blk.ffn_norm, cfg, sk, mixed=mixed)
    if blk.post_in_down:    # down's launch takes the post (and joins the Sinkhorn before it)
        f = blk.ffn.decode_rows(x, ids, post=functools.partial(take_post, sk, h, post, comb, out))
        pf.join()
        return f
    f = blk.ffn.decode_rows(x, ids, **part)
    sk.join()
    pf.join()
    return post_of(f, h, post, comb, out=out)


def take_post(sk, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
              out: torch.Tensor | None) -> tuple:
    """What decode_rows above gives a sublayer as `post` (bound to these arguments), called
    just before the launch that writes the block's mHC post: the Sinkhorn branch sk (which
    computes post and comb) joined -> (res, post, comb, streams), streams = out or a new tensor
    like res."""
    sk.join()
    return res, post, comb, torch.empty_like(res) if out is None else out


def mix_rows(blk, ops: Ops, h: torch.Tensor, kind: str, norm: torch.Tensor):
    """Block.mix of a chunk's rows in one launch."""
    return ops.hc_pre_norm_rows(h, *blk.mix_weights(kind), norm, blk.cfg)


def bind_fused_post(blk, ops: Ops) -> None:
    """Where the block's mHC post joins the launch before it (Options.fuse_post, on unless
    DSV4_FUSE_POST=0; only where decode_rows above runs): in tensor parallel blk.post_reduce = the
    block's TensorParallel where both sublayers' decode rows are the kernel paths that can leave
    their output unreduced (the fused attention with wo_a on the GEMV, the MoE's DecodeKernels):
    each sublayer's all-reduce takes the post (TensorParallel.reduce_post); in one process
    blk.post_in_down where the MoE runs DecodeKernels: the routed experts' down takes the FFN's
    post (the attention's stays a launch of its own). Call after the sublayers are bound."""
    from . import attention as fused_attention
    from .moe import DecodeKernels
    attn, be = blk.attn.decode_rows, ops.backend
    on = be.options.fuse_post and be.mhc_decode and isinstance(blk.ffn.decode_rows, DecodeKernels)
    tp_ok = (on and blk.tp is not None and be.wo_a_gemv
             and getattr(attn, "func", None) is fused_attention.decode_rows)
    blk.post_reduce = blk.tp if tp_ok else None
    blk.post_in_down = bool(on and blk.tp is None)


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
