"""The decode worker: one thread owns the Session (through a PrefixCache) and serves jobs from a
bounded FIFO queue, one at a time, streaming each token's text to the job's asyncio queue.

The event loop never waits on the model: `submit` only enqueues, the worker posts events with
loop.call_soon_threadsafe. A job whose client went away (`cancel`) stops at its next token; on
shutdown the running job stops at its next token and the waiting ones are refused. Detokenizing
and parsing the reply happen in the worker, between launches of the next step (in graph mode the
step is already queued on the device), so a stop string ends the generation at the token that
completes it.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..errors import UserInputError
from ..runtime.prefix_cache import PrefixCache
from ..runtime.sampling import SamplingParams
from ..text.tokenizer import IncrementalDetokenizer
from .metrics import Metrics
from .reply import Delta, ReplyParser
from .schemas import ApiError

RETRY_AFTER_S = 1          # the Retry-After of a 503 for a full queue


@dataclass
class Job:
    """One request for the worker. Events on `events` (an asyncio.Queue of `loop`): ("deltas",
    [Delta]) as text arrives, then ("done", self) or ("error", ApiError)."""
    prompt: list
    max_tokens: int
    sampling: SamplingParams
    parser: ReplyParser
    loop: asyncio.AbstractEventLoop
    use_cache: bool = True
    speculative: bool | None = None
    save_before_last: bool = False
    force_ids: list | None = None
    skip_special: bool = True
    ignore_eos: bool = False
    top: int | None = None          # log-probs of the generated tokens, with top alternatives
    score: bool = False             # log-probs of the prompt's tokens (completions' echo)
    constraint: object = None       # a token mask's Constraint (structured output)
    echo: str | None = None         # completions' echo: the prompt's text the reply starts with
    texts: object = None            # the tokenizer's TokenTexts (log-probs' token strings)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    # filled by the worker
    output_ids: list = field(default_factory=list)   # the tokens delivered (EOS included)
    cached: int = 0
    logprobs: list = field(default_factory=list)     # TokenLogprobs per delivered token
    prompt_logprobs: list | None = None              # [None, TokenLogprobs...] when scored
    finish: str = ""                                 # eos | length | stop | cancelled
    t_submit: float = 0.0
    t_start: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0

    def post(self, kind: str, payload) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:        # the loop is closed: nobody listens any more
            pass


class Engine:
    """Owns the session, the prefix cache and the worker thread (started by `start`)."""

    def __init__(self, session, tokenizer, *, max_queue: int = 16, prefix_snapshots: int = 4,
                 metrics: Metrics | None = None):
        if max_queue < 0:
            raise UserInputError(f"--max-queue {max_queue}: must be >= 0 (requests that may "
                                 f"wait while one decodes)")
        self.session, self.tok = session, tokenizer
        self.cache = PrefixCache(session, prefix_snapshots)
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self.special = tokenizer.special_ids()
        self._pending: deque[Job] = deque()          # FIFO; cancelled ones wait to be skipped
        self._cv = threading.Condition()
        self._running: Job | None = None
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._work, name="dsv4-decode", daemon=True)
        self.healthy, self.problem = True, ""
        self.metrics.queue = lambda: (self.waiting, int(self.busy))
        spec = session.spec
        if spec is not None:
            self.metrics.spec = lambda: (spec.proposed, spec.accepted)

    # ---- the event loop's side ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Enqueue (FIFO); ApiError 503 with Retry-After when --max-queue jobs already wait or
        the server is shutting down."""
        with self._cv:
            if self._closing.is_set():
                raise ApiError(503, "the server is shutting down; retry on another instance",
                               kind="server_error", code="shutting_down")
            waiting = self._count_waiting()
            if waiting >= self.max_queue and self._running is not None:
                raise ApiError(503, f"the request queue is full ({waiting} waiting, "
                                    f"--max-queue {self.max_queue}); retry after "
                                    f"{RETRY_AFTER_S} s", kind="server_error", code="queue_full",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            job.t_submit = time.perf_counter()
            self._pending.append(job)
            self._cv.notify()

    def _count_waiting(self) -> int:
        return sum(not j.cancel.is_set() for j in self._pending)

    @property
    def waiting(self) -> int:
        """Requests waiting (those whose client went away are not counted)."""
        with self._cv:
            return self._count_waiting()

    @property
    def busy(self) -> bool:
        return self._running is not None

    def shutdown(self) -> None:
        """Stop taking jobs: the running one ends at its next token, the waiting ones get a 503.
        Idempotent; returns at once (close() waits)."""
        with self._cv:
            self._closing.set()
            if self._running is not None:
                self._running.cancel.set()
            self._cv.notify()

    def close(self) -> None:
        """shutdown(), wait for the worker (the running job ends at its next token, or when its
        prefill ends), close the session (graphs and memory released)."""
        self.shutdown()
        if self._thread.is_alive():
            self._thread.join()
        self.session.close()

    # ---- the worker --------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closing.is_set():
                    self._cv.wait()
                if self._closing.is_set():
                    break
                job = self._running = self._pending.popleft()
            try:
                if job.cancel.is_set():               # its client went away while it waited
                    job.finish = "cancelled"
                    job.post("done", job)
                else:
                    self._run(job)
            except Exception as e:                    # outside the decode: still answer, go on
                job.post("error", ApiError(500, f"internal error: {type(e).__name__}: {e}",
                                           kind="server_error"))
            finally:
                with self._cv:
                    self._running = None
        with self._cv:                                # refuse whatever still waits
            left, self._pending = list(self._pending), deque()
        for job in left:
            job.post("error", ApiError(503, "the server is shutting down", kind="server_error",
                                       code="shutting_down"))

    def _run(self, job: Job) -> None:
        job.t_start = time.perf_counter()
        self.metrics.queue_wait.observe(job.t_start - job.t_submit)
        detok = IncrementalDetokenizer(self.tok)
        eos = self.tok.eos_id
        unsent = []                 # log-probs of tokens whose text was not delivered yet

        def on_token(tid: int) -> bool:
            if not job.output_ids:
                job.t_first = time.perf_counter()
            job.output_ids.append(tid)
            if tid != eos and not (job.skip_special and tid in self.special):
                piece = detok.push(tid)
                if piece:
                    self._deliver(job, job.parser.push(piece), unsent)
            return job.cancel.is_set() or job.parser.done

        def on_logprobs(e) -> None:
            job.logprobs.append(e)
            unsent.append(e)

        if job.max_tokens == 0 and not job.score:        # nothing to compute
            res = None
        else:
            try:
                res, job.cached = self.cache.generate(
                    job.prompt, job.max_tokens, use_cache=job.use_cache,
                    save_before_last=job.save_before_last, score=job.score,
                    on_scored=self._scored(job),
                    eos_id=None if job.ignore_eos else eos, on_token=on_token,
                    sampling=job.sampling, speculative=job.speculative, force_ids=job.force_ids,
                    on_logprobs=on_logprobs if job.top is not None else None,
                    constraint=job.constraint)
            except UserInputError as e:
                job.post("error", ApiError(400, str(e)))
                return
            except Exception as e:                # a bug or a device fault: say so, self-check
                job.post("error", ApiError(500, f"decode failed: {type(e).__name__}: {e}",
                                           kind="server_error"))
                self._self_check(e)
                return
        tail = detok.flush()
        self._deliver(job, (job.parser.push(tail) if tail else []) + job.parser.finish(), unsent,
                      last=True)
        job.t_end = time.perf_counter()
        job.finish = ("cancelled" if job.cancel.is_set() and not job.parser.done else
                      "stop" if job.parser.done else
                      "eos" if res is not None and (res.finish_reason == "eos" or (
                          job.force_ids and job.output_ids[-1:] == [eos]))
                      else "length")
        self.metrics.record_job(job)
        if job.finish == "cancelled" and self._closing.is_set():
            job.post("error", ApiError(503, "the server is shutting down: the reply was cut at "
                                            f"{len(job.output_ids)} tokens", kind="server_error",
                                       code="shutting_down"))
            return
        job.post("done", job)

    def _scored(self, job: Job):
        def on_scored(entries: list) -> None:     # before any token: a stream's echo needs them
            job.prompt_logprobs = entries
        return on_scored

    def _deliver(self, job: Job, deltas: list[Delta], unsent: list, last: bool = False) -> None:
        """Post text pieces; the log-probs of the tokens since the last post ride on the first
        piece (at the end, on an empty content piece if no text is left)."""
        if unsent and (deltas or last):
            if not deltas:
                deltas = [Delta("content", "")]
            deltas[0].logprobs = list(unsent)
            unsent.clear()
        if deltas:
            job.post("deltas", deltas)

    def _self_check(self, cause: Exception) -> None:
        """After an unexpected failure: can the session still decode? If not, /health says so."""
        try:
            self.session.reset()
            self.cache.forget()
            self.session.generate([self.tok.bos_id], 1)
            self.session.reset()
        except Exception as e:
            self.healthy = False
            self.problem = (f"the decode session failed ({type(cause).__name__}: {cause}) and "
                            f"cannot decode since ({type(e).__name__}: {e}); restart the server")
