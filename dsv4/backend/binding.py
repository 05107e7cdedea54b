"""Binding: each sublayer of a model bound, once, to the implementation its device's Backend
chose (dsv4.backend.fused, or the sublayer's own torch reference). `bind` runs when the runtime
builds a model (dsv4.runtime.build.build_model) and again when a test or benchmark asks for other
switches; captured steps keep the implementations they were captured with.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .decision import Backend, resolve
from .fused import attention as fused_attention
from .fused import block as fused_block
from .fused import compressor as fused_compressor
from .fused import head as fused_head
from .fused import indexer as fused_indexer
from .fused import linear as fused_linear
from .fused import moe as fused_moe
from .fused import mtp as fused_mtp
from .ops import Ops
from .options import Options


@dataclass(frozen=True)
class Binding:
    """What bind decided for one model: the switches it read and each device's Ops (and Backend)."""
    options: Options
    ops_on: dict                          # torch.device -> Ops

    def ops(self, device) -> Ops:
        return self.ops_on[torch.device(device)]

    def backends(self) -> dict[str, Backend]:
        """device name -> its Backend."""
        return {str(dev): ops.backend for dev, ops in self.ops_on.items()}

    def table(self) -> dict:
        """op -> implementation, for the head device (the table of each device where they
        differ: {device: table}); the CLI's --json `backend`."""
        tables = {dev: be.table() for dev, be in self.backends().items()}
        first = next(iter(tables.values()))
        return first if all(t == first for t in tables.values()) else tables


def bind(model, options: Options | None = None) -> Binding:
    """Resolve the Backend of the model's head device and every layer device (options: default
    the model's RuntimeConfig.options, else the DSV4_* environment, read here once) and bind every
    sublayer to its implementation. -> the Binding, also kept as model.binding."""
    if options is None:
        options = model.rt.options if model.rt.options is not None else Options.from_env()
    # a tensor-parallel rank's kernels see its shard's shapes (its heads, its inter slice)
    cfg = model.cfg if model.tp is None else model.tp.shapes(model.cfg)
    ops_on = {dev: Ops(resolve(dev, model.act, cfg, options)) for dev in model.devices}
    head = ops_on[model.head_device]
    fused_head.bind(model, head)
    model.seq_parallel = options.seq_parallel       # a TP prefill chunk's mHC split by rows
    for blk in model.layers:
        bind_block(blk, ops_on[blk.device])
    if model.mtp is not None:
        bind_block(model.mtp.block, head)
        for lin in (model.mtp.e_proj, model.mtp.h_proj):
            fused_linear.bind(lin, head)
        fused_mtp.bind(model.mtp, head)
    model.binding = Binding(options, ops_on)
    return model.binding


def bind_block(blk, ops: Ops) -> None:
    """Bind one block and everything in it to the implementations of ops' Backend."""
    fused_block.bind(blk, ops)
    bind_attention(blk.attn, ops)
    bind_moe(blk.ffn, ops)
    fused_block.bind_fused_post(blk, ops)


def bind_moe(moe, ops: Ops) -> None:
    """Bind one layer's MoE and its weights."""
    fused_moe.bind(moe, ops)
    for lin in moe.linears():
        fused_linear.bind(lin, ops)


def bind_attention(attn, ops: Ops) -> None:
    """Bind one layer's attention, its compressors, its indexer and their weights."""
    fused_attention.bind(attn, ops)
    if attn.compressor is not None:
        fused_compressor.bind(attn.compressor, ops)
    if attn.indexer is not None:
        fused_indexer.bind(attn.indexer, ops)
        fused_compressor.bind(attn.indexer.compressor, ops)
    for lin in attn.linears():
        fused_linear.bind(lin, ops)
