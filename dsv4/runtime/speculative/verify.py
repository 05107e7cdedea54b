"""Self-speculative decoding with the checkpoint's MTP block: the device-side decisions of a step.

A step starts with the pending token x_P (chosen, not fed yet) at position P and K drafts of the
tokens after it. The main model reads the T = K + 1 rows [x_P, d_1..d_K] at positions P..P+K (row
by row through each layer, exactly as decode steps would: dsv4.runtime.speculative.step), which gives the logits
of the tokens at P+1..P+T. `accept` decides how many drafts stand (greedy: the longest matching
prefix; sampling: the standard rejection rule, so every output token follows plain sampling) and
which tokens the step outputs; the journal (journal.py) puts back every state slot a row after the last kept one
wrote; the MTP block reads the kept rows and `draft` guesses the next token.

Every function here is capture-safe: positions, counts and decisions stay device tensors, and
Python branches only on fixed shapes and on the sampling parameters. Noise: the counter-based
draws of dsv4.runtime.sampling keyed by (seed, position), a separate stream each for the draft, the
acceptance test, the residual draw and the benchmark oracle. Legend: T = rows, V = vocab.
"""
from __future__ import annotations

import torch

from ..sampling import (
    SamplingKnobs,
    SamplingParams,
    filtered_probs,
    first_argmax,
    fixed,
    race,
    sample,
    uniform_noise,
)

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
        return torch.where(params.greedy, first_argmax(logits), d), q
    if params.greedy:
        return first_argmax(logits), None
    q = filtered_probs(logits, params)
    return race(q, stream_seed(params.seed, "draft"), pos), q


def oracle_table(seq: torch.Tensor, a: float, vocab: int) -> torch.Tensor:
    """Tests and benchmarks: the MTP block of a random checkpoint never guesses right, so an
    oracle overrides the draft: the draft of the token at position p is seq[p] with probability a
    (else seq[p] + 1, a wrong one), the noise keyed by p. seq [n] int64 (the output of a plain
    run, whose tokens speculation must reproduce, zero past it) -> the oracle's draft of every
    position [n] int64, made once when the oracle is set, so that a step only looks its draft
    up (oracle_draft: a few launches, where drawing it there took ~60 small ones)."""
    p = torch.arange(seq.shape[0], device=seq.device, dtype=torch.int64)
    u = uniform_noise(stream_seed(0, "oracle"), p, 1)
    return torch.where(u < a, seq, (seq + 1) % vocab)


def oracle_draft(d: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, on: torch.Tensor
                 ) -> torch.Tensor:
    """The draft d [1] of the token at `pos` ([1] int64), or the oracle's (oracle_table) where
    on ([1] bool) is set. Capture-safe."""
    return torch.where(on, table.index_select(0, pos.clamp(max=table.shape[0] - 1)), d)


def accept(logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, pos: torch.Tensor,
           params: SamplingParams | SamplingKnobs, limit: torch.Tensor, eos: torch.Tensor,
           pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify: logits [T, V] f32 of the rows at pos ([1] int64) .. pos+T-1 (row i follows draft
    i), drafts [T-1] int64, q [T-1, V] their distributions (None: greedy; with knobs always
    given, unused where greedy) -> (y [T] int64, keep [1] int64): the step outputs y[:keep+1], the first `keep` drafts and then the main model's own
    choice (a correction after a rejection, a bonus token after full acceptance); its state keeps
    rows 0..keep. keep is also capped so that the output holds at most limit[0] (>= 1) tokens and
    ends at the first eos (eos[0] < 0: none). pending ([1] int64, row 0's token): where it is
    the eos, the output had ended before this step (a step launched before the host read the
    last one's output: Session's pipelined loop), and the step keeps row 0 only (keep 0). Each
    output token follows plain sampling given the tokens before it. Capture-safe."""
    T, dev = logits.shape[0], logits.device
    rows = torch.arange(T, device=dev)
    params = fixed(params)
    knobs = isinstance(params, SamplingKnobs)
    if knobs or params.greedy:
        y_greedy = first_argmax(logits)[:, 0]                                       # [T]
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
    if pending is not None:
        limit = torch.where((pending == eos) & (eos >= 0), 1, limit)
    keep = torch.minimum(torch.minimum(n, limit - 1), first_eos)
    return y, keep
