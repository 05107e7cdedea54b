"""Glue between the model and the graphs/ runtime: static decode buffers and one segment per layer.

A decode step is: `embed` (head device) -> `layer{l}` (each on its device, hidden state handed
off at device boundaries) -> `lm_head` (hc_head, norm, logits) -> `sample` (writes the next token
and position back into the static inputs), both on the head device. Every fn is capture-safe.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from graphs import Segment

from . import overlap
from .model import Transformer
from .sampling import SamplingKnobs, SamplingParams, sample


@dataclass
class DecodeBuffers:
    """Static buffers of a decode step (fill values: token 0, pos 1, h 0, logits 0, out_ids -1)."""
    token: torch.Tensor                  # [1] int64, head device: the token fed at `pos`
    pos: torch.Tensor                    # [1] int64, head device: its position
    logits: torch.Tensor                 # [V] f32, head device: logits at `pos`
    out_ids: torch.Tensor                # [capacity + 1] int64: out_ids[p + 1] = token chosen at p
    h: dict = field(default_factory=dict)        # device -> [1, c, D] act hidden state
    token_on: dict = field(default_factory=dict)  # device -> [1] int64 copy of `token`
    pos_on: dict = field(default_factory=dict)    # device -> [1] int64 copy of `pos`

    @classmethod
    def allocate(cls, model: Transformer) -> "DecodeBuffers":
        cfg, hd = model.cfg, model.head_device
        # realistic dummies for warm-up/capture: a valid token id and a position >= 1
        b = cls(token=torch.zeros(1, dtype=torch.int64, device=hd),
                pos=torch.ones(1, dtype=torch.int64, device=hd),
                logits=torch.zeros(cfg.vocab_size, dtype=torch.float32, device=hd),
                out_ids=torch.full((model.rt.max_seq_len + 1,), -1, dtype=torch.int64, device=hd))
        for dev in [hd] + model.placement:
            if dev not in b.h:
                b.h[dev] = torch.zeros(1, cfg.hc_mult, cfg.dim, dtype=model.act, device=dev)
                b.token_on[dev] = b.token if dev == hd else torch.zeros_like(b.token, device=dev)
                b.pos_on[dev] = b.pos if dev == hd else torch.ones_like(b.pos, device=dev)
        return b


def build_segments(model: Transformer, bufs: DecodeBuffers,
                   params: SamplingParams | SamplingKnobs) -> list[Segment]:
    """The per-layer segments of one decode step (plus `embed` and `head` on the head device);
    knobs: the sample segment reads the parameters from their device tensors."""
    hd = model.head_device
    for dev in {hd, *model.placement}:
        overlap.prepare(dev)        # side streams of the captured parallel branches
    segs = [Segment("embed", hd, _embed_fn(model, bufs),
                    reads={"token": bufs.token}, writes={"h": bufs.h[hd]})]
    for l, (blk, st) in enumerate(zip(model.layers, model.states)):
        dev = blk.device
        h, tok, pos = bufs.h[dev], bufs.token_on[dev], bufs.pos_on[dev]
        segs.append(Segment(f"layer{l}", dev, _layer_fn(blk, st, h, tok, pos),
                            reads={"h": h, "token": tok, "pos": pos}, writes={"h": h}))
    segs.append(Segment("lm_head", hd, _lm_head_fn(model, bufs),
                        reads={"h": bufs.h[hd]}, writes={"logits": bufs.logits}))
    segs.append(Segment("sample", hd, _sample_fn(bufs, params),
                        reads={"logits": bufs.logits, "pos": bufs.pos},
                        writes={"token": bufs.token, "pos": bufs.pos, "out_ids": bufs.out_ids}))
    return segs


def _embed_fn(model, bufs):
    h, token = bufs.h[model.head_device], bufs.token

    def fn():
        h.copy_(model.embed_tokens(token))
    return fn


def _layer_fn(blk, st, h, tok, pos):
    def fn():
        blk.decode(h, tok, pos, st, out=h)
    return fn


def _lm_head_fn(model, bufs):
    h = bufs.h[model.head_device]

    def fn():
        bufs.logits.copy_(model.logits(h))
    return fn


def _sample_fn(bufs, params):
    pos, token = bufs.pos, bufs.token

    def fn():
        nxt = sample(bufs.logits, pos, params)
        token.copy_(nxt)
        bufs.out_ids.index_copy_(0, pos + 1, nxt)
        pos.add_(1)
    return fn
