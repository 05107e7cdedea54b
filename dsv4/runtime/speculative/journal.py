"""The journal of a speculative pass: the state rows that rows 1..T-1 of a verify pass may write,
saved before the pass and put back for the rows after the last kept one, so that the state is that
of the kept rows alone. One launch where the device has the kernels
(dsv4/kernels/decode/journal.py), else the torch loop below (the reference)."""
from __future__ import annotations

from typing import Sequence

import torch

from ...errors import ConfigError
from ...model.state import LayerState


class Journal:
    """The state slots that rows 1..T-1 of a pass at positions pos..pos+T-1 may write, saved before
    the pass (`save`) and put back for the rows after `keep` (`rewind`): the state is then that of
    rows 0..keep alone. Fixed buffers and device positions: capture-safe. Needs T <= window and T
    <= every compress ratio > 0: then no two rows write one slot and at most one row completes a
    compressor block, so the slots are disjoint and their order does not matter.

    Entry (row i, tensor, rows n, offset o, divisor a, modulus b, cond r): the rows
    o + ((q // a) % b) + [0, n) of the tensor for q = pos + i, written only when (q + 1) % r == 0
    if r > 0 (a compressor block completes: its entry, and in overlap mode the block becoming the
    "previous" one). Where the states' backend (ops: dsv4.backend.ops.Ops of their device) has the
    kernels, one launch saves / rewinds them all (dsv4.kernels.decode.journal); else the torch
    loop below (the reference)."""

    def __init__(self, states: Sequence[tuple[LayerState, int]], window: int, T: int,
                 ops=None):
        if T > window:
            raise ConfigError(f"a verify pass of {T} rows needs window_size >= {T}")
        self.T = T
        self.entries: list[tuple] = []
        for st, r in states:
            if r and T > r:
                raise ConfigError(f"a verify pass of {T} rows needs compress ratios >= {T} "
                                  f"(layer ratio {r})")
        for i in range(1, T):
            for st, r in states:
                self._add(i, st.kv_cache, 1, 0, 1, window, 0)               # window ring row
                for comp, cache, off in ((st.compressor, st.kv_cache, window),
                                         (st.index_compressor, st.index_cache, 0)):
                    if comp is None:
                        continue
                    cur = r if r == 4 else 0                 # overlap mode: current block rows
                    for t in (comp.kv, comp.score):
                        self._add(i, t, 1, cur, 1, r, 0)
                    self._add(i, cache, 1, off, r, 1 << 62, r)              # emitted entry
                    if r == 4:
                        for t in (comp.kv, comp.score):
                            self._add(i, t, r, 0, 1, 1, r)                  # -> "previous"
        # one launch where the states' device has the kernels (Ops.journal: None elsewhere)
        self.fast = ops.journal(self.entries) if self.entries and ops is not None else None

    def _add(self, i, t, n, o, a, b, r):
        self.entries.append((i, t, n, o, a, b, r, torch.empty(n, *t.shape[1:], dtype=t.dtype,
                                                                   device=t.device)))

    @staticmethod
    def _rows(pos, i, n, o, a, b):
        q = pos + i
        return o + (q // a) % b + torch.arange(n, device=pos.device)

    def save(self, pos: torch.Tensor) -> None:
        """Before the pass at pos ([1] int64 on the states' device). Capture-safe."""
        if self.fast is not None:
            return self.fast.run(pos, None)
        for i, t, n, o, a, b, r, buf in self.entries:
            buf.copy_(t.index_select(0, self._rows(pos, i, n, o, a, b)))

    def rewind(self, pos: torch.Tensor, keep: torch.Tensor) -> None:
        """After the pass: undo the rows after keep ([1] int64; 0 <= keep < T). Capture-safe."""
        if self.fast is not None:
            return self.fast.run(pos, keep)
        for i, t, n, o, a, b, r, buf in self.entries:
            idx = self._rows(pos, i, n, o, a, b)
            undo = keep < i
            if r:
                undo = undo & ((pos + i + 1) % r == 0)
            t.index_copy_(0, idx, torch.where(undo.view(1, *[1] * (buf.dim() - 1)), buf,
                                              t.index_select(0, idx)))
