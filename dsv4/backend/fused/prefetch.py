"""The L2 prefetch of weights in a captured decode step: while the main branch runs latency-bound
kernels that leave the memory idle (a layer's first mHC, the indexer's top-k and attention, the
FFN's mHC and routing), a side branch brings the weights that come next into L2
(csrc/prefetch.cu: the copy engine's bulk prefetch, a kernel that ends as soon as it has issued
them), and their GEMV then reads them from L2. Points (Backend.prefetch, DSV4_PREFETCH): "layer"
(wq_a, wkv and the side projections, during the attention's mHC), "attn" (wo_a, during the
index top-k, prep and attention), "ffn" (the gate and the shared expert, during the FFN's mHC and
routing). Only where a graph is captured and the CUDA C++ library serves the device: an eager step
launches nothing (a hint changes no result, so eager and graph keep the same bits).

Off unless asked (DSV4_PREFETCH=1): measured on an H100 it makes a step no faster (BENCHMARKS.md,
"An L2 prefetch beside the latency-bound kernels"): the GEMVs read their weights from L2 hardly
faster than from memory; what limits them is their own shape (a wave of CTAs that each load, then
compute), not the memory.
"""
from __future__ import annotations

import torch

from .. import branches
from ..ops import Ops

LANE_BLOCK, LANE_ATTN = 3, 4      # the block's points ("layer", "ffn"); attention's ("attn")


class Prefetch:
    """One prefetch point: `start(point, tensors)` forks a side branch on `lane` that prefetches
    the tensors (when the point is on and the step is being captured); `join()` before the graph's
    capture ends (or before the lane's next start). The launch is short, so joining it costs the
    main branch nothing."""

    def __init__(self, ops: Ops, lane: int):
        self.ops, self.lane, self.branch = ops, lane, None

    def start(self, point: str, like: torch.Tensor, tensors) -> None:
        self.join()
        ts = [t for t in tensors if t is not None and t.is_cuda and t.device == like.device
              and t.is_contiguous()]
        br = branches.Branch(like, point, self.ops.backend.prefetch, when=bool(ts),
                             lane=self.lane)
        if br.on:
            with br.side():
                self.ops.l2_prefetch(ts)
            self.branch = br

    def join(self) -> None:
        if self.branch is not None:
            self.branch.join()
            self.branch = None


def layer_weights(attn) -> list:
    """What a layer reads first (after its first mHC): wq_a, wkv, the side projections."""
    ws = [attn.wq_a.weight, attn.wq_a.scale, attn.wkv.weight, attn.wkv.scale]
    if attn.ratio:
        c = attn.compressor
        ws += [c.wkv.weight, c.wgate.weight]
        if attn.indexer is not None:
            ic = attn.indexer.compressor
            ws += [ic.wkv.weight, ic.wgate.weight, attn.indexer.weights_proj.weight]
    return ws


def ffn_weights(moe) -> list:
    """What the FFN reads before its routed experts: the gate and the shared expert."""
    sh = moe.shared
    return [moe.gate.weight] + [t for n in ("w1", "w3", "w2") for t in (sh[n].weight, sh[n].scale)]
