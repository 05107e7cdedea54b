"""Glue between the model and the graphs/ runtime: the static buffers of a pass through the
layers on each device and its segments, built once for the three passes that replay from graphs
(the plain decode step below, the speculative step in dsv4.runtime.speculative.step, the prefill chunks in
dsv4.runtime.prefill_graphs).

A pass is: `embed` (head device) -> `layer{l}` (each on its device, the hidden rows handed off at
device boundaries) -> `lm_head` (head device), plus what the caller adds. The plain decode step
appends `sample` (writes the next token and position back into the static inputs). Every fn is
capture-safe.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch

from graphs import BufferSpec, Segment

from ..backend import branches as side_streams   # not `branches`: pass_segments' flag
from ..model.transformer import Transformer
from .sampling import SamplingKnobs, SamplingParams, sample


def pass_devices(model: Transformer) -> list[torch.device]:
    """The devices of a pass: the head device first, then each other layer device in order."""
    return list(dict.fromkeys([model.head_device, *model.placement]))


@dataclass
class DeviceBuffers:
    """The per-device static buffers of a pass of `rows` rows: the hidden rows h[dev]
    [rows, c, D] (activation dtype, fill 0) on every device of the pass, and each named input of
    the layers on every device: on the head device the input itself, elsewhere a copy of its
    spec there (same fill), which the graphs/ plan keeps in step by a hand-off copy."""
    h: dict = field(default_factory=dict)        # device -> [rows, c, D]
    on: dict = field(default_factory=dict)       # input name -> {device -> tensor}

    @classmethod
    def allocate(cls, model: Transformer, rows: int, inputs: Sequence[BufferSpec]
                 ) -> "DeviceBuffers":
        """inputs: specs of the layers' inputs on the head device (allocated here)."""
        cfg, b = model.cfg, cls()
        for dev in pass_devices(model):
            b.h[dev] = BufferSpec("h", (rows, cfg.hc_mult, cfg.dim), model.act, dev).allocate()
            for spec in inputs:
                b.on.setdefault(spec.name, {})[dev] = replace(spec, device=dev).allocate()
        return b

    def head(self, name: str) -> torch.Tensor:
        """Input `name` on the head device (the pass's first device)."""
        return next(iter(self.on[name].values()))


def pass_segments(model: Transformer, bufs: DeviceBuffers, embed: Callable, embed_io: tuple,
                  layer: Callable, layer_inputs: Sequence[str], head: Callable, head_writes: dict,
                  branches: bool = False) -> list[Segment]:
    """embed -> layer{l} -> lm_head over `bufs`: embed() writes bufs.h on the head device
    (embed_io: its (reads, writes) besides that); layer(l, blk, st, h, **inputs) -> the callable
    of layer l, reading h and the named layer_inputs on its device and writing h; head() reads
    the head device's h and writes head_writes. branches: prepare the side streams of the
    captured parallel branches (dsv4.backend.branches) on every device first (decode passes)."""
    hd = model.head_device
    if branches:
        for dev in pass_devices(model):
            side_streams.prepare(dev)
    reads, writes = embed_io
    segs = [Segment("embed", hd, embed, reads=reads, writes={**writes, "h": bufs.h[hd]})]
    for l, (blk, st) in enumerate(zip(model.layers, model.states)):
        dev = blk.device
        h, inputs = bufs.h[dev], {n: bufs.on[n][dev] for n in layer_inputs}
        segs.append(Segment(f"layer{l}", dev, layer(l, blk, st, h, **inputs),
                            reads={"h": h, **inputs}, writes={"h": h}))
    segs.append(Segment("lm_head", hd, head, reads={"h": bufs.h[hd]}, writes=head_writes))
    return segs


# ---- the plain decode step ---------------------------------------------------------------------

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
        rows = DeviceBuffers.allocate(model, 1, [BufferSpec("token", (1,), torch.int64, hd, 0),
                                                 BufferSpec("pos", (1,), torch.int64, hd, 1)])
        return cls(token=rows.head("token"), pos=rows.head("pos"),
                   logits=BufferSpec("logits", (cfg.vocab_size,), torch.float32, hd).allocate(),
                   out_ids=BufferSpec("out_ids", (model.rt.max_seq_len + 1,), torch.int64, hd,
                                      -1).allocate(),
                   h=rows.h, token_on=rows.on["token"], pos_on=rows.on["pos"])

    def device_buffers(self) -> DeviceBuffers:
        return DeviceBuffers(self.h, {"token": self.token_on, "pos": self.pos_on})


def build_segments(model: Transformer, bufs: DecodeBuffers,
                   params: SamplingParams | SamplingKnobs) -> list[Segment]:
    """The per-layer segments of one decode step (plus `embed` and `head` on the head device);
    knobs: the sample segment reads the parameters from their device tensors."""
    hd = model.head_device
    h = bufs.h[hd]

    def embed():
        h.copy_(model.embed_tokens(bufs.token))

    def layer(l, blk, st, h, token, pos):
        def fn():
            blk.decode(h, token, pos, st, out=h)
        return fn

    def lm_head():
        bufs.logits.copy_(model.logits(h))

    segs = pass_segments(model, bufs.device_buffers(), embed, ({"token": bufs.token}, {}),
                         layer, ("token", "pos"), lm_head, {"logits": bufs.logits},
                         branches=True)
    segs.append(Segment("sample", hd, _sample_fn(bufs, params),
                        reads={"logits": bufs.logits, "pos": bufs.pos},
                        writes={"token": bufs.token, "pos": bufs.pos, "out_ids": bufs.out_ids}))
    return segs


def _sample_fn(bufs, params):
    pos, token = bufs.pos, bufs.token

    def fn():
        nxt = sample(bufs.logits, pos, params)
        token.copy_(nxt)
        bufs.out_ids.index_copy_(0, pos + 1, nxt)
        pos.add_(1)
    return fn
