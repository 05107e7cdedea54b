"""Self-speculative decoding with the checkpoint's MTP block: the device-side decisions of a step.

A step starts with the pending token x_P (chosen, not fed yet) at position P and K drafts of the
tokens after it. The main model reads the T = K + 1 rows [x_P, d_1..d_K] at positions P..P+K (row
by row through each layer, exactly as decode steps would: dsv4.runtime.speculative.step), which gives the logits
of the tokens at P+1..P+T. `accept` decides how many drafts stand (greedy: the longest matching
prefix; sampling: the standard rejection rule, so every output token follows plain sampling) and
which tokens the step outputs; `Journal` puts back every state slot a row after the last kept one
wrote; the MTP block reads the kept rows and `draft` guesses the next token.

Every function here is capture-safe: positions, counts and decisions stay device tensors, and
Python branches only on fixed shapes and on the sampling parameters. Noise: the counter-based
draws of dsv4.runtime.sampling keyed by (seed, position), a separate stream each for the draft, the
acceptance test, the residual draw and the benchmark oracle. Legend: T = rows, V = vocab.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ...errors import ConfigError
from ..sampling import (SamplingKnobs, SamplingParams, filtered_probs, fixed, race, sample,
                       uniform_noise)
from ...model.state import LayerState

STREAM = {"draft": 1, "accept": 2, "residual": 3, "oracle": 4}


def stream_seed(seed: int, stream: str) -> int:
    """A seed of its own per noise stream (bits 40+ reach the hash through seed >> 31)."""
    return seed + (STREAM[stream] << 40)


def draft(logits: torch.Tensor, pos: torch.Tensor, params: SamplingParams | SamplingKnobs):
    """MTP logits [V] f32 of the row at `pos` ([1] int64: the position of the pending token) ->
    (the draft of the token at pos + 1 [1] int64, its distribution q [V] f32, or None when
    greedy; with knobs always q, unused where greedy). Capture-safe."""
    params = fixed(params)
    if isinstance(params, SamplingKnobs):
        q = filtered_probs(logits, params)
        d = race(q, stream_seed(params.seed, "draft"), pos)
        return torch.where(params.greedy, logits.argmax(dim=-1, keepdim=True), d), q
    if params.greedy:
        return logits.argmax(dim=-1, keepdim=True), None
    q = filtered_probs(logits, params)
    return race(q, stream_seed(params.seed, "draft"), pos), q


def oracle_draft(d: torch.Tensor, pos: torch.Tensor, seq: torch.Tensor, a: torch.Tensor,
                 vocab: int) -> torch.Tensor:
    """Tests and benchmarks: the MTP block of a random checkpoint never guesses right, so a draft
    override makes the draft of the token at `pos` ([1]) equal seq[pos] with probability a (else
    seq[pos] + 1, a wrong one); a < 0 leaves the draft d [1] alone. seq [n] int64 (the output of a
    plain run, whose tokens speculation must reproduce), a [1] float32. Capture-safe."""
    n = seq.shape[0]
    t = torch.where(pos < n, seq.index_select(0, pos.clamp(max=n - 1)), 0)
    u = uniform_noise(stream_seed(0, "oracle"), pos, 1)
    forced = torch.where(u < a, t, (t + 1) % vocab)
    return torch.where(a < 0, d, forced)


def accept(logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, pos: torch.Tensor,
           params: SamplingParams | SamplingKnobs, limit: torch.Tensor, eos: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify: logits [T, V] f32 of the rows at pos ([1] int64) .. pos+T-1 (row i follows draft
    i), drafts [T-1] int64, q [T-1, V] their distributions (None: greedy; with knobs always
    given, unused where greedy) -> (y [T] int64, keep [1] int64): the step outputs y[:keep+1], the first `keep` drafts and then the main model's own
    choice (a correction after a rejection, a bonus token after full acceptance); its state keeps
    rows 0..keep. keep is also capped so that the output holds at most limit[0] (>= 1) tokens and
    ends at the first eos (eos[0] < 0: none). Each output token follows plain sampling given the
    tokens before it. Capture-safe."""
    T, dev = logits.shape[0], logits.device
    rows = torch.arange(T, device=dev)
    params = fixed(params)
    knobs = isinstance(params, SamplingKnobs)
    if knobs or params.greedy:
        y_greedy = logits.argmax(dim=-1)                                            # [T]
        ok_greedy = y_greedy[:-1] == drafts
    if knobs or not params.greedy:
        p = torch.stack([filtered_probs(logits[i], params) for i in range(T - 1)])  # [T-1, V]
        u = torch.cat([uniform_noise(stream_seed(params.seed, "accept"), pos + i, 1)
                       for i in range(T - 1)])
        dd = drafts[:, None]
        ok = u * q.gather(1, dd)[:, 0] < p.gather(1, dd)[:, 0]      # accept w.p. min(1, p/q)
        resid = (p - q).clamp_min(0)                                   # rejected: draw (p - q)+
        resid = torch.where(resid.sum(dim=-1, keepdim=True) > 0, resid, p)   # p == q: never used
        corr = torch.cat([race(resid[i], stream_seed(params.seed, "residual"), pos + i)
                          for i in range(T - 1)])
        bonus = sample(logits[T - 1], pos + T - 1, params)
        y = torch.cat((torch.where(ok, drafts, corr), bonus))
    if knobs:
        y, ok = torch.where(params.greedy, y_greedy, y), torch.where(params.greedy, ok_greedy, ok)
    elif params.greedy:
        y, ok = y_greedy, ok_greedy
    n = ok.to(torch.int64).cumprod(dim=0).sum().reshape(1)            # leading accepted drafts
    first_eos = torch.where((y == eos) & (eos >= 0), rows, T).min().reshape(1)
    keep = torch.minimum(torch.minimum(n, limit - 1), first_eos)
    return y, keep


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
        self.fast = None        # one launch where the states' device has the kernels
        if self.entries and ops is not None and ops.backend.kernels:
            self.fast = ops.journal(self.entries)

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
