"""The MoE's kernels. Decode rows: the gate GEMV and the routing kernel, the routed FP4 experts
up + down (the shared expert's output added in down's epilogue), the FP8 shared expert beside
them as a parallel branch when captured. A chunk's rows: the grouped expert GEMMs
(dsv4/kernels/prefill/moe.py). Same math as dsv4.model.moe's loop: bf16(routed sum in f32 + bf16
shared), experts added in ascending id order.
"""
from __future__ import annotations

import functools

import torch

from .. import branches
from ..ops import Ops


class DecodeKernels:
    """MoE.decode_rows on the kernels for one layer (it owns the layer's down workspace: no two
    layers share one; the launches of one layer run in order on one stream, so its rows share
    it)."""

    def __init__(self, moe, ops: Ops):
        self.moe, self.ops = moe, ops
        self.down_ws = None           # the CUDA down kernel's workspace, lazily; (): none needed

    def route(self, x: torch.Tensor, ids: torch.Tensor):
        """The routing of rows x [T, D] as two launches (gate GEMV, the routing kernel) ->
        (weights [T * k] f32, experts [T * k] int64, ascending per row), as MoE.route + sort."""
        moe, cfg = self.moe, self.moe.cfg
        return self.ops.route_decode(moe.gate.rows(x, torch.float32), cfg.n_activated_experts,
                                     cfg.score_func, cfg.route_scale, bias=moe.bias,
                                     tid2eid=moe.tid2eid, ids=ids if moe.hash else None)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, reduce: bool = True,
                 post=None) -> torch.Tensor:
        """decode rows x [T, D], ids [T] -> [T, D], each launch taking every row; the FP8 shared
        expert (fused w1/w3 SwiGLU, w2) a parallel branch when captured, forked after the routing
        (so the routing's small kernels find free SMs; the shared expert then streams beside up).
        Row t has the bits of a one-row call. Capture-safe. reduce=False: a tensor-parallel
        rank's partial output, left for the block to sum with its mHC post
        (TensorParallel.reduce_post). post (one process; fused/block.take_post, bound): the
        block's mHC post of the output in down's own launch (fp4_experts_down's post) -> the
        streams [T, c, D]; called just before down, it joins the block's Sinkhorn (which
        computes post and comb beside the MoE)."""
        moe, ops = self.moe, self.ops
        bank, lim, sh = moe.experts, moe.cfg.swiglu_limit, moe.shared
        T, fp8 = x.shape[0], sh["w1"].fmt == "fp8"
        w, idx = self.route(x, ids)                       # [T * k]: row t's experts, sorted
        br = branches.Branch(x, "moe", ops.backend.branches, when=fp8)
        with br.side():
            if fp8:
                a_sh = ops.fp8_swiglu(x, sh["w1"].weight, sh["w1"].scale, sh["w3"].weight,
                                      sh["w3"].scale, lim)
                y_sh = ops.fp8_linear(a_sh, sh["w2"].weight, sh["w2"].scale, out_dtype=x.dtype)
            else:
                y_sh = torch.cat([moe.shared_expert(x[t:t + 1]) for t in range(T)])  # [T, D]
        a = ops.fp4_experts_up(x, idx, w, bank.w1, bank.w1_scale, bank.w3, bank.w3_scale, lim)
        br.join()
        if self.down_ws is None:
            self.down_ws = ops.down_workspace(idx.numel() // T, a.shape[-1], x)
        # a tensor-parallel rank's part (its inter slice of every expert) summed over the ranks;
        # idx came from the routing, before up: down requests its weights before its PDL wait
        kw = dict(add=y_sh, out_dtype=x.dtype, workspace=self.down_ws or None, rows=T,
                  idx_early=True)
        if post is not None:
            return ops.fp4_experts_down(a, idx, bank.w2, bank.w2_scale, post=post(), **kw)
        y = ops.fp4_experts_down(a, idx, bank.w2, bank.w2_scale, **kw)
        return moe.reduce(y) if reduce else y


def prefill_experts(moe, ops: Ops, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor
                    ) -> torch.Tensor:
    """MoE.prefill_experts_reference on the grouped GEMMs: the (token, expert) pairs grouped by
    expert through the stored formats (no host sync, no dense weight copy); in tensor parallel
    this rank's partial sum."""
    bank, sh = moe.experts, moe.shared
    return ops.prefill_moe(x, w, idx, (bank.w1, bank.w1_scale, bank.w3, bank.w3_scale,
                                       bank.w2, bank.w2_scale), bank.fmt,
                           (sh["w1"].weight, sh["w1"].scale, sh["w3"].weight,
                            sh["w3"].scale, sh["w2"].weight, sh["w2"].scale),
                           sh["w1"].fmt, moe.cfg.swiglu_limit)


def route_rows(moe, ops: Ops, x: torch.Tensor, ids: torch.Tensor):
    """MoE.route of a chunk's rows x [t, D] after the gate in one launch (the decode rows'
    routing kernel: a CTA or program a row) in place of ~10 torch ops -> weights [t, k] f32,
    experts [t, k] int64, each row's in ascending id order (the order the reference adds them);
    the same experts as MoE.route, weights within float32 rounding (the kernel sums them in
    that order). Capture-safe."""
    cfg, k = moe.cfg, moe.cfg.n_activated_experts
    w, idx = ops.route_decode(moe.gate(x, torch.float32), k, cfg.score_func, cfg.route_scale,
                              bias=moe.bias, tid2eid=moe.tid2eid, ids=ids if moe.hash else None)
    return w.view(-1, k), idx.view(-1, k)


def bind(moe, ops: Ops) -> None:
    """decode_rows on the kernels where the backend has the MoE decode kernels, a chunk's
    routing where it has the chunk's kernels, prefill_experts on the grouped GEMMs where it has
    them; otherwise the torch reference."""
    be = ops.backend
    moe.decode_rows = DecodeKernels(moe, ops) if be.moe_decode else moe.decode_rows_reference
    moe.route_rows = functools.partial(route_rows, moe, ops) if be.rows else moe.route
    moe.prefill_experts = (functools.partial(prefill_experts, moe, ops) if be.moe_prefill
                           else moe.prefill_experts_reference)
