"""Saving a sequence's decode state at a length and putting it back later, for prefix reuse.

While the state holds positions < L, what positions >= L overwrite is small: each layer's window
ring (slot p % W), its compressors' open-block rows (in overlap mode also the previous block's)
and the MTP block's own ring and compressor rows, plus the MTP block's place along the sequence.
The compressed KV and index entries are append-only and masked by position: an entry that a later
position wrote is invisible to every query before that position and is written again before any
query at or after it reads it, and no position >= L writes an entry of a block that closed before
L. So copying the first set at L and back restores the state of the sequence at L bit for bit,
whatever ran in between, as long as nothing was fed at a position < L since the save (a new
sequence from position 0, a continuation from an earlier point: those rewrite entries the saved
point reads; dsv4.runtime.prefix_cache keeps that account). The buffers are allocated once and reused:
serving many prompts allocates nothing.
"""
from __future__ import annotations

import torch

from ..model.transformer import Transformer


def overwritten_state(model: Transformer) -> list[torch.Tensor]:
    """Views of every state buffer that positions after the current length overwrite: per main
    layer and for the MTP block, the window ring kv_cache[:W] and both compressors' kv / score
    rows (the compressed and index entries are append-only and not included)."""
    W = model.cfg.window_size
    states = list(model.states) + ([model.mtp.state] if model.mtp is not None else [])
    out = []
    for st in states:
        out.append(st.kv_cache[:W])
        for comp in (st.compressor, st.index_compressor):
            if comp is not None:
                out += [comp.kv, comp.score]
    return out


class StateSnapshot:
    """Preallocated copies of `overwritten_state(model)`, the MTP block's place (mtp_len and the
    waiting main row h_last), and the session-level facts of the saved point: its length, the
    pending token, the logits of the last fed token when the session held them. `length` < 0:
    empty."""

    def __init__(self, model: Transformer):
        self.tensors = [torch.empty_like(t) for t in overwritten_state(model)]
        cfg, hd = model.cfg, model.head_device
        self.h_last = torch.empty(1, cfg.hc_mult, cfg.dim, dtype=model.act, device=hd)
        self.logits = torch.empty(cfg.vocab_size, dtype=torch.float32, device=hd)
        self.length, self.pending = -1, None
        self.mtp_len, self.has_h_last, self.has_logits = 0, False, False

    @property
    def empty(self) -> bool:
        return self.length < 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.tensors, self.h_last, self.logits])

    def save(self, model: Transformer, length: int, pending: int | None,
             logits: torch.Tensor | None) -> None:
        """Copy the model's state (which holds positions < length) in; logits [V] f32 of the last
        fed token, if known. Ordered on each device's current stream (no host sync)."""
        _copy(self.tensors, overwritten_state(model))
        self.mtp_len, self.has_h_last = model.mtp_len, model.h_last is not None
        if self.has_h_last:
            self.h_last.copy_(model.h_last)
        self.has_logits = logits is not None
        if self.has_logits:
            self.logits.copy_(logits)
        self.length, self.pending = length, pending

    def restore(self, model: Transformer) -> torch.Tensor | None:
        """Copy the saved state back into the model (in place: captured graphs keep their
        pointers) -> the saved logits (a copy) or None. The compressed entries of positions >=
        length stay as they are: masked by position until rewritten."""
        assert not self.empty, "restore of an empty snapshot"
        _copy(overwritten_state(model), self.tensors)
        model.mtp_len = self.mtp_len
        model.h_last = self.h_last.clone() if self.has_h_last else None
        return self.logits.clone() if self.has_logits else None

    def clear(self) -> None:
        self.length, self.pending, self.has_logits, self.has_h_last = -1, None, False, False


def _copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """dst.copy_(src) for each pair, a few multi-tensor launches per device instead of one copy
    each (a Flash snapshot is ~170 tensors: one launch apiece would cost ~1 ms of host time)."""
    by_device: dict = {}
    for d, s in zip(dsts, srcs):
        by_device.setdefault(d.device, ([], []))
        by_device[d.device][0].append(d)
        by_device[d.device][1].append(s)
    for d, s in by_device.values():
        torch._foreach_copy_(d, s)
