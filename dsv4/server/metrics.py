"""Prometheus metrics of the server, in the text exposition format (no client library needed).

Counters: requests by endpoint and outcome, requests refused before any route by reason, prompt /
cached prompt / generated tokens, speculative drafts proposed and accepted. Histograms: time to
first token (from arrival, queue included), time per output token (after the first), queue wait.
Gauges: requests waiting, requests running.
Updated from the worker and the event loop under one lock; memory does not grow with requests.
"""
from __future__ import annotations

import bisect
import threading

PREFIX = "dsv4"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0)
OUTCOMES = ("ok", "cancelled", "bad_request", "rejected", "error")
# requests refused before any route sees them (auth.py, limits.py, connection.py)
REFUSALS = ("api_key", "too_large", "timeout", "header", "connections")


class Histogram:
    """Cumulative buckets (upper bounds, +Inf added), sum and count."""

    def __init__(self, buckets, lock: threading.Lock):
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum, self.n, self._lock = 0.0, 0, lock

    def observe(self, v: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.bounds, v)] += 1
            self.sum += v
            self.n += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        out, acc = [], 0
        sep = "," if labels else ""
        for bound, c in zip(self.bounds + (float("inf"),), self.counts):
            acc += c
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {acc}')
        lab = f"{{{labels}}}" if labels else ""
        out += [f"{name}_sum{lab} {self.sum!r}", f"{name}_count{lab} {self.n}"]
        return out


class Metrics:
    """The server's metrics; `spec` (a callable -> (proposed, accepted) or None) and `queue`
    (-> (waiting, running)) are read at each scrape."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}
        self.refused = dict.fromkeys(REFUSALS, 0)
        self.prompt_tokens = self.cached_tokens = self.generated_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS, self._lock)
        self.tpot = Histogram(TPOT_BUCKETS, self._lock)
        self.queue_wait = Histogram(TTFT_BUCKETS, self._lock)
        self.spec = lambda: None
        self.queue = lambda: (0, 0)

    def request(self, endpoint: str, outcome: str) -> None:
        assert outcome in OUTCOMES, f"unknown outcome {outcome!r}; expected one of {OUTCOMES}"
        with self._lock:
            key = (endpoint, outcome)
            self.requests[key] = self.requests.get(key, 0) + 1

    def refuse(self, reason: str) -> None:
        """A request (or connection) refused before any route: a reason of REFUSALS."""
        assert reason in REFUSALS, f"unknown refusal {reason!r}; expected one of {REFUSALS}"
        with self._lock:
            self.refused[reason] += 1

    def record_job(self, job) -> None:
        """A finished generation: its token counts and latencies."""
        n = len(job.output_ids)
        with self._lock:
            self.prompt_tokens += len(job.prompt)
            self.cached_tokens += job.cached
            self.generated_tokens += n
        if n:
            self.ttft.observe(job.t_first - job.t_submit)
        if n > 1:
            self.tpot.observe((job.t_end - job.t_first) / (n - 1))

    def render(self) -> str:
        p = PREFIX
        waiting, running = self.queue()
        spec = self.spec()
        with self._lock:
            lines = [f"# HELP {p}_requests_total Requests by endpoint and outcome.",
                     f"# TYPE {p}_requests_total counter"]
            for (ep, outcome), v in sorted(self.requests.items()):
                lines.append(f'{p}_requests_total{{endpoint="{ep}",outcome="{outcome}"}} {v}')
            lines += [f"# HELP {p}_refused_total Requests refused before any route, by reason.",
                      f"# TYPE {p}_refused_total counter"]
            for reason, v in self.refused.items():
                lines.append(f'{p}_refused_total{{reason="{reason}"}} {v}')
            for name, v, what in (("prompt_tokens", self.prompt_tokens, "Prompt tokens"),
                                  ("cached_prompt_tokens", self.cached_tokens,
                                   "Prompt tokens reused from the session's state"),
                                  ("generated_tokens", self.generated_tokens,
                                   "Tokens generated")):
                lines += [f"# HELP {p}_{name}_total {what}.", f"# TYPE {p}_{name}_total counter",
                          f"{p}_{name}_total {v}"]
            for name, h, what in (("time_to_first_token_seconds", self.ttft,
                                   "From arrival to the first token (queue wait included)"),
                                  ("time_per_output_token_seconds", self.tpot,
                                   "Per token after the first, per request"),
                                  ("queue_wait_seconds", self.queue_wait,
                                   "From arrival to the start of decoding")):
                lines += [f"# HELP {p}_{name} {what}.", f"# TYPE {p}_{name} histogram"]
                lines += h.lines(f"{p}_{name}")
        lines += [f"# HELP {p}_queue_depth Requests waiting for the decoder.",
                  f"# TYPE {p}_queue_depth gauge", f"{p}_queue_depth {waiting}",
                  f"# HELP {p}_requests_running Requests decoding (0 or 1).",
                  f"# TYPE {p}_requests_running gauge", f"{p}_requests_running {running}"]
        if spec is not None:
            proposed, accepted = spec
            rate = accepted / proposed if proposed else 0.0
            lines += [f"# HELP {p}_speculative_drafts_total Drafted tokens verified.",
                      f"# TYPE {p}_speculative_drafts_total counter",
                      f"{p}_speculative_drafts_total {proposed}",
                      f"# HELP {p}_speculative_accepted_total Drafted tokens accepted.",
                      f"# TYPE {p}_speculative_accepted_total counter",
                      f"{p}_speculative_accepted_total {accepted}",
                      f"# HELP {p}_speculative_acceptance_rate Accepted / drafted, since start.",
                      f"# TYPE {p}_speculative_acceptance_rate gauge",
                      f"{p}_speculative_acceptance_rate {rate!r}"]
        return "\n".join(lines) + "\n"
