"""Self-speculative decoding with the checkpoint's MTP block (eager).

A step starts with the pending token x_P (chosen, not fed yet) and the MTP block's draft d of the
token after it. The main model reads [x_P, d] at positions P, P+1 in one two-row pass (the chunked
prefill path: causal within the rows), which gives the logits of P+1 and P+2; acceptance is
decided from them (greedy: the longest matching prefix; sampling: the standard rejection rule, so
the tokens follow the plain sampling distribution); the MTP block then reads the main hidden
stream of both rows with the chosen tokens, and its row at the last accepted position drafts the
next token. Every state slot the rejected row wrote (window ring row, compressor row, an emitted
compressed / index entry, the previous-block half of an overlap compressor) is put back from a
journal taken before the pass (`Journal`), so the state equals plain decoding's over the accepted
tokens.

Noise: the counter-based draws of dsv4.sampling, keyed by (seed, position) with separate streams
for the draft, the acceptance test and the residual draw, so a seed gives the same tokens on every
run and device.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .errors import ConfigError
from .sampling import SamplingParams, filtered_probs, race, sample, uniform_noise
from .state import LayerState

STREAM = {"draft": 1, "accept": 2, "residual": 3}


def _seed(params: SamplingParams, stream: str) -> int:
    """A seed of its own per noise stream (bits 40+ reach the hash through seed >> 31)."""
    return params.seed + (STREAM[stream] << 40)


def draft(logits: torch.Tensor, pos: torch.Tensor, params: SamplingParams):
    """MTP logits [V] of the row at `pos` -> (draft token [1], its distribution q [V] or None when
    greedy)."""
    if params.greedy:
        return logits.argmax(dim=-1, keepdim=True), None
    q = filtered_probs(logits, params)
    return race(q, _seed(params, "draft"), pos), q


def accept(logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, pos0: int,
           params: SamplingParams) -> tuple[torch.Tensor, int]:
    """Verify: logits [T, V] f32 of rows at positions pos0.. (row i follows draft i-1), drafts
    [T-1] int64, q [T-1, V] their distributions (None: greedy) -> (tokens [T] int64, n) with
    tokens[:n+1] the output of the step: n accepted drafts, then the main model's own choice (a
    correction after a rejection, a bonus token after full acceptance). Distribution: each output
    token follows plain sampling given the tokens before it."""
    T, dev = logits.shape[0], logits.device
    pos = torch.arange(pos0, pos0 + T, device=dev)
    out = torch.zeros(T, dtype=torch.int64, device=dev)     # rows after a rejection: any valid id
    for i in range(T):
        p_i = pos[i:i + 1]
        if i == T - 1:                                      # every draft accepted: bonus token
            out[i:] = sample(logits[i], p_i, params)
            return out, i
        d = drafts[i:i + 1]
        if params.greedy:
            y = logits[i].argmax(dim=-1, keepdim=True)
            out[i:i + 1] = y
            if int(y) != int(d):
                return out, i
            continue
        p = filtered_probs(logits[i], params)
        u = uniform_noise(_seed(params, "accept"), p_i, 1)
        if bool(u * q[i, d] < p[d]):                          # accept with min(1, p(d) / q(d))
            out[i:i + 1] = d
            continue
        resid = (p - q[i]).clamp_min(0)                      # rejected: draw from (p - q)+
        if not bool(resid.sum() > 0):                        # p == q: cannot be rejected
            resid = p
        out[i:i + 1] = race(resid, _seed(params, "residual"), p_i)
        return out, i
    raise AssertionError("unreachable")


class Journal:
    """The state slots a pass over positions pos0..pos0+T-1 may overwrite for rows 1..T-1, saved
    before the pass; `rewind(keep)` puts back those of rows >= keep (rejected), so the state is
    that of the first `keep` rows only. Needs T <= every compress ratio > 0 (each ratio-r block
    completes at most once in the pass, and rows of a block own distinct slots) and T <= window."""

    def __init__(self, states: Sequence[tuple[LayerState, int]], window: int, pos0: int, T: int):
        self.rows = []                   # per row i >= 1: [(tensor, index, saved value), ...]
        for i in range(1, T):
            q, saved = pos0 + i, []
            for st, r in states:
                if r and T > r:
                    raise ConfigError(f"a verify pass of {T} rows needs compress ratios >= {T} "
                                      f"(layer ratio {r})")
                saved.append((st.kv_cache, q % window))
                for comp, cache, off in ((st.compressor, st.kv_cache, window),
                                         (st.index_compressor, st.index_cache, 0)):
                    if comp is None:
                        continue
                    cur = r if r == 4 else 0               # overlap mode: current block rows
                    saved += [(comp.kv, cur + q % r), (comp.score, cur + q % r)]
                    if (q + 1) % r == 0:                   # the row completes a block
                        saved.append((cache, off + q // r))
                        if r == 4:                         # ... which becomes "previous"
                            saved += [(comp.kv, slice(0, r)), (comp.score, slice(0, r))]
            self.rows.append([(t, ix, t[ix].clone()) for t, ix in saved])

    def rewind(self, keep: int) -> None:
        """Undo rows keep..T-1 (keep >= 1), latest first: each slot ends with its value before
        the pass (no kept row shares a slot with a rejected one)."""
        for saved in reversed(self.rows[keep - 1:]):
            for t, ix, v in reversed(saved):
                t[ix] = v


class Speculator:
    """The speculative decode loop of one model with an MTP block (eager; K = 1 draft per step).

    Sequence bookkeeping lives in the model (Transformer.mtp_len / h_last): after a prefill the
    MTP block has read every row whose next token is known; `first_draft` reads the last one once
    the first new token is chosen; each `step` leaves the same shape of state behind."""

    def __init__(self, model, params: SamplingParams, k: int = 1):
        if model.mtp is None:
            raise ConfigError("speculative decoding needs the MTP block: build the model with "
                              "RuntimeConfig(mtp=True) on a checkpoint with num_nextn_predict_layers "
                              ">= 1")
        if k != 1:
            raise ConfigError(f"--speculative {k}: only 1 draft token per step is implemented "
                              f"(0 = off)")
        self.model, self.params, self.k = model, params, k
        self.steps = self.proposed = self.accepted = 0
        # tests / benchmarks: hook(position of the drafted token, draft [1]) -> draft [1]
        self.draft_hook = None
        # benchmarks only (random weights never draft right): hook(n accepted, T) -> n' to treat
        # the first n' drafts as right (the output is then the drafts, not the model's choice)
        self.accept_hook = None

    def _states(self):
        m = self.model
        return [(st, blk.ratio) for blk, st in zip(m.layers, m.states)]

    def first_draft(self, token: torch.Tensor, pos: int):
        """The pending token [1] at `pos` was just chosen: the MTP block reads its row pos-1 ->
        (draft [1], q)."""
        logits = self.model.mtp_follow_token(token)
        return self._draft(logits, pos)

    def _draft(self, logits: torch.Tensor, pos: int):
        """MTP logits of the row before `pos` -> (draft of the token at pos + 1, q)."""
        d, q = draft(logits, torch.tensor([pos], device=logits.device), self.params)
        if self.draft_hook is not None:
            d = self.draft_hook(pos + 1, d)
        return d, q

    def step(self, pending: torch.Tensor, d: torch.Tensor, q, pos: int, limit: int,
             eos_id: int | None = None):
        """Feed pending [1] at `pos` and verify the draft d [1] -> (tokens [n+1] int64 on the
        head device, logits [n+1, V], next draft, its q). limit: at most this many tokens out
        (>= 1); with 1 (or no room in the cache) the step feeds the pending token alone. The
        output stops at eos_id (the rows after it are rewound like rejected ones)."""
        m = self.model
        T = 1 + self.k if limit > self.k and pos + self.k < m.rt.max_seq_len else 1
        ids = torch.cat((pending, d))[:T]
        jm = Journal(self._states(), m.cfg.window_size, pos, T)
        h = m.hidden(ids, pos)                                           # [T, c, D]
        hd = h.to(m.head_device)
        logits = torch.stack([m.logits(hd[i:i + 1]) for i in range(T)])  # [T, V]
        y, n = accept(logits, d[:T - 1], None if q is None else q[None], pos, self.params)
        if self.accept_hook is not None:
            n2 = self.accept_hook(n, T)
            if n2 > n:
                y[:n2] = d[:n2]
                y[n2:n2 + 1] = sample(logits[n2], torch.tensor([pos + n2], device=y.device),
                                      self.params)
            n = n2
        if eos_id is not None and n:
            ys = y[:n + 1].tolist()
            n = ys.index(eos_id) if eos_id in ys else n
        jt = Journal([(m.mtp.state, m.mtp.block.ratio)], m.cfg.window_size, pos, T)
        hm = m.mtp_rows(hd, y, pos)                                       # [T, c, D]
        jm.rewind(n + 1)
        jt.rewind(n + 1)
        m.mtp_commit(pos + n + 1)
        self.steps += 1
        self.proposed += T - 1
        self.accepted += n
        nxt, nq = self._draft(m.logits(hm[n:n + 1], head=m.mtp.head()), pos + n + 1)
        return y[:n + 1], logits[:n + 1], nxt, nq

    def stats(self) -> dict:
        return {"speculative": self.k, "steps": self.steps, "proposed": self.proposed,
                "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0}
