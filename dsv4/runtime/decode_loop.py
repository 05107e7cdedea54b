"""The plain decode loop of `Session.generate`: the first token from the prompt's logits, then one
decode step per token, each token reaching the host one step late (a pinned copy and an event: the
next step is launched before the host reads it), streamed to `on_token`, stopped at EOS, a limit
or the callback's word; with teacher forcing (forced ids), with log-probabilities (a LogprobStep
after each step, copied with the token), or with a token mask (a Constraint: the host then reads
each token before the next step, whose mask depends on it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .grammar import Constraint
from .logprobs import entry
from .profiling import nvtx_range
from .sampling import sample


@dataclass
class LoopRequest:
    """What one generate() asks of the loop (validated by the Session)."""
    max_new_tokens: int
    force_ids: list | None = None
    eos_id: int | None = None
    on_token: Callable[[int], object] | None = None
    keep_logits: bool = False
    on_logprobs: Callable | None = None        # TokenLogprobs of each token, before on_token
    constraint: Constraint | None = None


@dataclass
class LoopResult:
    out: list = field(default_factory=list)    # the tokens that reached the host
    steps: int = 0                             # decode steps run (the state holds p0 + steps)
    finish: str = "length"                     # "eos" | "length" | "stopped"
    rows: list | None = None                   # logits [V] f32 (CPU) per token, keep_logits
    logprobs: list | None = None               # TokenLogprobs per token, with on_logprobs


class DecodeLoop:
    """One generate()'s plain decode over a session (its decoder, static buffers, sampler, token
    mask and LogprobStep): first() after the prompt, then steps()."""

    def __init__(self, session, req: LoopRequest, p0: int):
        self.s, self.req, self.p0 = session, req, p0     # p0: the position after the prompt
        hd = session.model.head_device
        self.pinned = hd.type == "cuda"
        n = req.max_new_tokens
        self.host = torch.empty(n, dtype=torch.int64, pin_memory=self.pinned)
        self.lp = session.lp if req.on_logprobs is not None else None
        self.lp_host = self.lp.host_slots(n, self.pinned) if self.lp is not None else None
        self.res = LoopResult(rows=[] if req.keep_logits else None,
                              logprobs=[] if self.lp is not None else None)
        self._stopped = False

    # ---- the first token ---------------------------------------------------------------------
    def first(self, logits: torch.Tensor) -> None:
        """Choose token 0 from the prompt's logits [V] f32 (or take the first forced id); the
        next step feeds it at p0."""
        s, b, req, p0 = self.s, self.s.bufs, self.req, self.p0
        mask = s.mask
        if req.constraint is not None:
            mask.load(req.constraint)
        b.pos.fill_(p0 - 1)
        first = sample(logits if mask is None else mask.apply(logits), b.pos, s._sampler)
        b.token.copy_(first if req.force_ids is None else
                      torch.tensor(req.force_ids[:1], dtype=torch.int64, device=b.token.device))
        b.out_ids[p0:p0 + 1].copy_(b.token)
        if self.lp is not None:
            self.lp.of(logits, b.token)
            self.lp.copy_to(self.lp_host, 0, non_blocking=False)
        b.pos.fill_(p0)
        if req.keep_logits:
            self.res.rows.append(logits.to("cpu", copy=True))
        self.host[0:1].copy_(b.out_ids[p0:p0 + 1])

    # ---- the steps ---------------------------------------------------------------------------
    def steps(self) -> LoopResult:
        """Decode until EOS, the limit or on_token's word; -> the result (finish, tokens)."""
        s, b, req, res = self.s, self.s.bufs, self.req, self.res
        force = req.force_ids
        stop = self._take(0)
        pending = None                  # step whose token copy to the host is in flight
        decoder = s.plain_decoder()     # greedy requests of a per-request session: no sampling
        for i in range(1, req.max_new_tokens):
            if stop:
                break
            if req.constraint is not None:      # the mask of token i depends on token i-1
                s.mask.load(req.constraint)
            # step i feeds token i-1 (already in b.token unless forced) and chooses token i
            if s.step_hook is not None:
                s.step_hook(i, True)
            with nvtx_range(f"decode/step{i}"):
                decoder.step(**({"token": [force[i - 1]]} if force is not None else {}))
            if self.lp is not None:
                self.lp.run()
            res.steps += 1
            if s.step_hook is not None:
                s.step_hook(i, False)
            if req.keep_logits:
                res.rows.append(b.logits.to("cpu", copy=True))
            ev = self._copy_out(i)
            if req.constraint is not None:      # read it now: the next mask needs it
                stop = self._take(i, ev)
                continue
            if pending is not None:     # one step late: the next launch is already queued
                stop = self._take(*pending)
            pending = (i, ev)
        if pending is not None and not stop:
            stop = self._take(*pending)
        res.finish = "stopped" if self._stopped else "eos" if stop else "length"
        return res

    def _copy_out(self, i: int):
        """Issue the copies of token i (and its log-probs) to the host -> their event (CUDA)."""
        if self.req.force_ids is not None:   # the output is the forced id, whatever was sampled
            self.host[i] = self.req.force_ids[i]
        else:
            p = self.p0 + i
            self.host[i:i + 1].copy_(self.s.bufs.out_ids[p:p + 1], non_blocking=self.pinned)
        if self.lp is not None:
            self.lp.copy_to(self.lp_host, i, non_blocking=self.pinned)
        if not self.pinned:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def _take(self, i: int, ev=None) -> bool:
        """Token i reached the host: stream it; stop here?"""
        req, res = self.req, self.res
        if ev is not None:
            ev.synchronize()
        tid = int(self.host[i])
        res.out.append(tid)
        if self.lp is not None:
            e = entry(tid, self.lp_host[0][i], self.lp_host[1][i])
            res.logprobs.append(e)
            req.on_logprobs(e)
        if req.constraint is not None:
            req.constraint.accept(tid)
        if req.on_token is not None and req.on_token(tid):
            self._stopped = True
            return True
        return req.force_ids is None and req.eos_id is not None and tid == req.eos_id
