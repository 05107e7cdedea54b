"""When a speculative session drafts: a host rule on the drafts' acceptance so far.

A speculative step (the pending token and one draft through every layer, the MTP block's rows and
its draft) costs S; a plain step with the MTP block reading its row costs P. With acceptance rate a
a speculative step yields 1 + a tokens, so it pays when a > S / P - 1 (0.65 for Flash 30 layers on
one H200: BENCHMARKS.md). The rule: speculate while the acceptance stays >= min_acceptance, judged
over the first `probe` speculative steps of a run, then over each next `window` of them (windows
that do not overlap: a sliding window near the bar would stop good drafts by chance); when it
falls below, take `backoff` plain steps (the MTP block still reads every row, so its state and a
later draft are those of constant speculation), then probe again, doubling the plain run after
each failed probe up to `max_backoff` and starting over once a whole window passes. It depends on
accepted counts only, so a seed gives the same tokens in eager and graph mode; min_acceptance 0
always speculates.
"""
from __future__ import annotations

from ...errors import InputError

DEFAULT_MIN_ACCEPTANCE = 0.65


def check_min_acceptance(a: float) -> None:
    """The --speculative-min-acceptance value (CLI, before anything loads) or SpecPolicy's."""
    if not 0.0 <= a <= 1.0:
        raise InputError(f"spec_min_acceptance = {a}: must be in [0, 1] (the share of "
                         f"accepted drafts below which steps go plain; 0 = always draft)")


class SpecPolicy:
    """Host-side; no tensors. speculate() before a step, then spec_step() or plain_step()."""

    def __init__(self, min_acceptance: float = DEFAULT_MIN_ACCEPTANCE, probe: int = 4,
                 window: int = 32, backoff: int = 16, max_backoff: int = 256):
        check_min_acceptance(min_acceptance)
        if not 1 <= probe <= window or not 1 <= backoff <= max_backoff:
            raise ValueError(f"SpecPolicy: need 1 <= probe ({probe}) <= window ({window}) and "
                             f"1 <= backoff ({backoff}) <= max_backoff ({max_backoff})")
        self.min_acceptance, self.probe, self.window = min_acceptance, probe, window
        self.min_backoff, self.max_backoff = backoff, max_backoff
        self.reset()

    def reset(self) -> None:
        """A new sequence: speculate first, with the shortest back-off."""
        self.backoff, self.plain_left = self.min_backoff, 0
        self._new_run()

    def _new_run(self) -> None:
        self.accepted = self.proposed = self.steps = 0    # since the last judgement
        self.judged = False                                # the probe of this run passed

    def speculate(self) -> bool:
        return self.plain_left == 0

    def spec_step(self, accepted: int, proposed: int) -> None:
        """After a speculative step that proposed `proposed` (>= 1) drafts."""
        self.accepted += accepted
        self.proposed += proposed
        self.steps += 1
        if self.min_acceptance <= 0 or self.steps < (self.window if self.judged else self.probe):
            return
        if self.accepted < self.min_acceptance * self.proposed:
            self.plain_left, self.backoff = self.backoff, min(2 * self.backoff, self.max_backoff)
            self._new_run()
            return
        if self.judged:       # a whole window passed: the next failure backs off from the start
            self.backoff = self.min_backoff
        self.accepted = self.proposed = self.steps = 0
        self.judged = True

    def plain_step(self) -> None:
        self.plain_left = max(self.plain_left - 1, 0)
