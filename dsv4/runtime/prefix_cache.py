"""Prefix reuse over one Session: how much of a new prompt the session already holds (its live
sequence, or a snapshot saved at the end of an earlier prompt), getting there, and the account of
which snapshots are still exact.

A prompt is served from the longest reusable prefix: the live sequence (every id the state holds:
the last prompt and the tokens generated since, the pending last one fed first if the prompt goes
on with it) when the prompt starts with it, else a snapshot whose ids the prompt starts with
(dsv4.runtime.snapshot: restored bit for bit), else position 0. Each served prompt leaves a snapshot at its
end (state + the last prompt token's logits: a repeat of the prompt, or one that continues it after
a different reply, prefills nothing or only what differs) and, when asked, one before its last
token (a thinking-mode follow-up re-encodes the previous turn with "</think>" where the prompt
ended with "<think>"). Feeding from position k rewrites every position >= k, so the snapshots
saved beyond k are dropped; those at or before k stay exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import InputError
from .session import GenerationResult, Session, check_token_ids
from .snapshot import StateSnapshot


@dataclass
class _Slot:
    snap: StateSnapshot
    ids: tuple = ()           # the ids the saved state holds (positions 0..len-1)
    used: int = 0             # last use (LRU clock)


@dataclass(frozen=True)
class Plan:
    """How a prompt is reached: `cached` prompt ids reused from `source` ("live", "snapshot" or
    "none"), the slot to restore, and whether the held pending token is the prompt's next id."""
    cached: int
    source: str
    slot: _Slot | None = None
    feeds_pending: bool = False


class PrefixCache:
    """Serves prompts over `session` with prefix reuse; `slots` snapshots (0: the live sequence
    only), allocated here once. Every generation of the session must go through this object (it
    keeps the account of the ids the state holds)."""

    def __init__(self, session: Session, slots: int = 4):
        if slots < 0:
            raise InputError(f"--prefix-snapshots {slots}: must be >= 0 (0 = reuse the live "
                             f"sequence only)")
        self.session = session
        self.slots = [_Slot(session.new_snapshot()) for _ in range(slots)]
        self.ids: list[int] = []          # ids the state holds (session.length of them)
        self._clock = 0

    def nbytes(self) -> int:
        return sum(s.snap.nbytes() for s in self.slots)

    # ---- planning ----------------------------------------------------------------------------
    def plan(self, prompt: Sequence[int], use_cache: bool = True) -> Plan:
        """The longest reusable prefix of prompt (no state changes)."""
        prompt = list(prompt)
        best = Plan(0, "none")
        if not use_cache:
            return best
        s = self.session
        live = self._reach(prompt, self.ids, s.pending, s.holds_logits,
                           self._mtp_ok(s.model.mtp_len, s.model.h_last is not None, len(self.ids)))
        if live is not None:
            best = Plan(len(self.ids), "live", feeds_pending=live)
        for slot in self.slots:
            if slot.snap.empty or len(slot.ids) <= best.cached:
                continue
            sn = slot.snap
            hit = self._reach(prompt, slot.ids, sn.pending, sn.has_logits,
                              self._mtp_ok(sn.mtp_len, sn.has_h_last, sn.length))
            if hit is not None:
                best = Plan(len(slot.ids), "snapshot", slot, hit)
        return best

    def _reach(self, prompt, held, pending, has_logits, mtp_ok) -> bool | None:
        """Can the prompt go on from a state holding `held`? -> None (no), else whether the held
        pending token is the prompt's next id (then fed as such)."""
        n = len(held)
        if not mtp_ok or n == 0 or len(prompt) < n or prompt[:n] != list(held):
            return None
        if len(prompt) == n:                      # nothing new: only the held logits serve
            return False if pending is None and has_logits else None
        return pending is not None and prompt[n] == pending

    def _mtp_ok(self, mtp_len: int, has_h_last: bool, length: int) -> bool:
        """In a speculative session every prefill runs the MTP block, which must have followed
        the held sequence to its end (a plain generate leaves it behind)."""
        if self.session.spec is None:
            return True
        return mtp_len == length or (mtp_len == length - 1 and has_h_last)

    # ---- serving -----------------------------------------------------------------------------
    def generate(self, prompt: Sequence[int], max_new_tokens: int, *, use_cache: bool = True,
                 save_before_last: bool = False, score: bool = False,
                 on_scored: Callable[[list], object] | None = None,
                 **kw) -> tuple[GenerationResult, int]:
        """Generate after `prompt` (a whole sequence from position 0, as the request gives it)
        -> (the session's GenerationResult, the number of prompt ids reused). kw: Session.generate's
        (eos_id, on_token, sampling, speculative, force_ids...). save_before_last: also keep a
        snapshot before the prompt's last token (costs that token's own prefill pass).
        score: the result's prompt_logprobs hold each prompt id's log-probs (Session.score: the
        whole prompt is read again, nothing reused), also given to on_scored before the first
        token; max_new_tokens may then be 0."""
        prompt = list(prompt)
        s, n = self.session, len(prompt)
        if not prompt:
            raise InputError("empty prompt: give at least one token")
        forced = kw.get("force_ids")
        check_token_ids(prompt + list(forced or []), s.model.cfg.vocab_size)  # before any change
        s.model.check_capacity(n, len(forced) if forced else max_new_tokens)
        if score:
            try:
                return self._score(prompt, max_new_tokens, on_scored, kw), 0
            except BaseException:
                self.forget()
                raise
        plan = self.plan(prompt, use_cache)
        try:
            return self._serve(prompt, plan, max_new_tokens, save_before_last, kw), plan.cached
        except BaseException:
            self.forget()                 # the state is unknown: start the next prompt afresh
            raise

    def _serve(self, prompt, plan: Plan, max_new_tokens, save_before_last, kw):
        s, n = self.session, len(prompt)
        if plan.slot is not None:
            s.restore(plan.slot.snap)
            self.ids = list(plan.slot.ids)
            self._touch(plan.slot)
        at = plan.cached                          # the state holds prompt[:at]
        # the held pending token is fed (as prompt[at]) only if the prompt goes on with it: feed
        # prompt[at:] itself either way
        s.pending = None
        self._drop_beyond(at)
        if at == 0:
            s.reset()
        if save_before_last and n - 1 > at:
            self._prefill(prompt, at, n - 1)
            at = n - 1
            self._save(prompt[:at])
        if at < n:
            self._prefill(prompt, at, n)
            self._save(prompt)
        res = s.generate([], max_new_tokens, continue_sequence=True, **kw)
        self.ids = prompt + res.output_ids[:s.length - n]
        return res

    def _score(self, prompt, max_new_tokens, on_scored, kw) -> GenerationResult:
        s = self.session
        s.pending = None
        self._drop_beyond(0)
        entries = s.score(prompt)
        self.ids = list(prompt)
        self._save(prompt)
        if on_scored is not None:
            on_scored(entries)
        if max_new_tokens == 0:
            res = GenerationResult(list(prompt), [], "length")
        else:       # the MTP block did not follow the prompt's pass: plain steps
            res = s.generate([], max_new_tokens, continue_sequence=True,
                             **{**kw, "speculative": False})
            self.ids = prompt + res.output_ids[:s.length - len(prompt)]
        res.prompt_logprobs = entries
        return res

    def _prefill(self, prompt, at: int, end: int) -> None:
        self.session.prefill(prompt[at:end], continue_sequence=at > 0)
        self.ids = prompt[:end]

    def _save(self, ids: list) -> None:
        if not self.slots:
            return
        key = tuple(ids)
        slot = next((x for x in self.slots if x.ids == key), None) or min(
            self.slots, key=lambda x: (not x.snap.empty, x.used))
        self.session.save(slot.snap)
        slot.ids = key
        self._touch(slot)

    def _touch(self, slot: _Slot) -> None:
        self._clock += 1
        slot.used = self._clock

    def _drop_beyond(self, k: int) -> None:
        """Positions >= k are about to be fed: snapshots saved past k are no longer exact."""
        for slot in self.slots:
            if len(slot.ids) > k:
                slot.snap.clear()
                slot.ids = ()

    def forget(self) -> None:
        """Start afresh: the session reset, no live sequence, no snapshot."""
        self.session.reset()
        self.ids = []
        self._drop_beyond(0)
