"""A decode session: load the model, prefill, then the decode loop (eager or CUDA graphs) with
streaming tokens, stop checks and timings; plain or speculative steps, snapshots of a point.

The decode loop always goes through `graphs.CUDAGraphDecoder` (eager mode on the CPU), so the
graph and eager paths run the same segment functions. Token ids reach the host one step late
(pinned copies of `out_ids`), off the critical path of the next launch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from graphs import CUDAGraphDecoder

from ..errors import InputError
from ..model.transformer import Transformer
from .build import load_model
from .config import resolve_mode
from .decode_loop import DecodeLoop, LoopRequest
from .grammar import Constraint, TokenMask
from .logprobs import LogprobStep, TokenLogprobs, prompt_logprobs
from .passes import DecodeBuffers, build_segments
from .prefill import prefill
from .profiling import nvtx_range
from .sampling import SamplingKnobs, SamplingParams, sample
from .snapshot import StateSnapshot
from .speculative.policy import DEFAULT_MIN_ACCEPTANCE

__all__ = ["FIX_HINTS", "GenerationResult", "Session", "check_token_ids", "load_model"]

FIX_HINTS = ("lower RuntimeConfig.max_seq_len (smaller caches and graph memory)", "mode='eager'")


@dataclass
class GenerationResult:
    prompt_ids: list
    output_ids: list
    finish_reason: str                     # "eos" | "length" | "stopped" (on_token said so)
    logits: torch.Tensor | None = None     # [n_generated, V] f32 when requested
    timings: dict = field(default_factory=dict)
    logprobs: list | None = None           # TokenLogprobs per output token, with on_logprobs
    prompt_logprobs: list | None = None    # [None, TokenLogprobs...] per prompt id (scored)


def check_token_ids(ids: Sequence[int], vocab_size: int) -> None:
    """InputError naming the first id outside 0..vocab_size-1."""
    for tid in ids:
        if not 0 <= tid < vocab_size:
            raise InputError(f"token id {tid} is out of range: the vocabulary has {vocab_size} ids "
                             f"(0..{vocab_size - 1})")


class Session:
    """Prefill + decode of one sequence at a time over a loaded model (eager or graph mode).

    mode: 'eager', 'graph' (captures the decode step at construction) or 'auto' (graph on CUDA,
    eager on the CPU); `session.mode` is the resolved one. A context manager: `with Session(...)
    as s:` closes it (graphs and pools freed) on exit. Errors name API parameters
    (RuntimeConfig.max_seq_len, max_new_tokens); the CLI words them as flags.

    per_request_sampling: each generate() may pass its own parameters (`sampling=`), the same
    tokens as a session built with them. Captured steps read them from device tensors
    (dsv4.runtime.sampling.SamplingKnobs) and pay for the sampling ops on every step; a greedy
    request replays a twin of the step captured with an argmax instead (`greedy`: the same
    layer graphs' work, a second capture), so it pays none of them. Eager steps branch on the
    host as fixed parameters do. Off, the parameters are fixed when the steps are captured."""

    def __init__(self, model: Transformer, params: SamplingParams, mode: str = "eager",
                 granularity: str = "segment", debug: bool = False, nvtx_domain: str = "dsv4",
                 speculative: int = 0, spec_min_acceptance: float = DEFAULT_MIN_ACCEPTANCE,
                 per_request_sampling: bool = False):
        mode = resolve_mode(mode, [model.head_device.type])
        self.model, self.params, self.mode = model, params, mode
        self.spec = None                # the speculative step (dsv4.runtime.speculative.step), when asked for
        # eager steps branch on the host copy of the knobs: no cost; captured ones read tensors
        self.knobs = (SamplingKnobs(model.head_device, params, on_host=mode != "graph")
                      if per_request_sampling else None)
        sampler = self.knobs if self.knobs is not None else params
        self._sampler = sampler
        self.bufs = DecodeBuffers.allocate(model)
        # per-request sessions (the server) also serve token masks and log-probabilities: the
        # mask's bias is added in the sample segment (0 when off), the log-probs are a pass of
        # their own run only for the requests that ask
        self.mask = (TokenMask(model.head_device, model.cfg.vocab_size, graph=mode == "graph")
                     if per_request_sampling else None)
        kw = dict(inputs={"token": self.bufs.token, "pos": self.bufs.pos},
                  outputs={"logits": self.bufs.logits, "token": self.bufs.token}, mode=mode,
                  granularity=granularity, reset_fn=self.reset, debug=debug,
                  nvtx_domain=nvtx_domain, fix_hints=FIX_HINTS)
        self.decoder = CUDAGraphDecoder(build_segments(model, self.bufs, sampler, self.mask), **kw)
        self.decoder.allocate()
        # per-request sampling in graph mode: the twin a greedy request replays (an argmax over
        # the same logits and mask: the knobs' greedy token, bit for bit)
        self.greedy = None
        if self.knobs is not None and mode == "graph":
            self.greedy = CUDAGraphDecoder(
                build_segments(model, self.bufs, SamplingParams(), self.mask), **kw)
            self.greedy.allocate()
        self.lp = (LogprobStep(self.bufs.logits, self.bufs.token, mode)
                   if per_request_sampling else None)
        if speculative:
            from .speculative.step import SpecStep
            self.spec = SpecStep(model, sampler, speculative, plain=(self.decoder, self.bufs),
                                 min_acceptance=spec_min_acceptance, mode=mode,
                                 granularity=granularity, reset_fn=self.reset, debug=debug,
                                 nvtx_domain=f"{nvtx_domain}-spec", fix_hints=FIX_HINTS)
        self.length, self.pending = 0, None
        self._logits = None             # logits [V] of the last fed token, while none was chosen
        self.capture_s = 0.0
        self.step_hook = None           # profiling: hook(step, before: bool)
        if mode == "graph":
            t = time.perf_counter()
            for dec in (self.decoder, self.greedy):
                if dec is not None:
                    dec.warmup()
                    dec.capture()
            if self.spec is not None:
                self.spec.capture()
            self.capture_s = time.perf_counter() - t
            if model.rt.prefill_graphs and model.prefill_graphs is None and self.spec is None:
                from .prefill_graphs import (
                    PrefillGraphs,  # short prompts replay chunk graphs
                )
                model.prefill_graphs = PrefillGraphs(model, model.rt.prefill_graphs)
                self.capture_s += model.prefill_graphs.capture_s

    def reset(self) -> None:
        """Forget the sequence: model state and decode buffers back to their fill values."""
        self.model.reset()
        self.bufs.token.zero_()
        self.bufs.pos.fill_(1)
        self.bufs.out_ids.fill_(-1)
        if self.spec is not None:
            self.spec.reset()
        self.length, self.pending, self._logits = 0, None, None

    @property
    def holds_logits(self) -> bool:
        """Right after a prefill() or a restore() of a point saved after one: the last fed
        token's logits are held, and generate([], ..., continue_sequence=True) samples from them."""
        return self._logits is not None

    def new_snapshot(self) -> StateSnapshot:
        """An empty snapshot of this session's state (buffers allocated now), for save()."""
        return StateSnapshot(self.model)

    def save(self, snap: StateSnapshot) -> None:
        """Save the sequence's current point into `snap` (allocated once with
        StateSnapshot(session.model)): the state that later positions overwrite, the length, the
        pending token and, right after a prefill() or a restore(), the logits of the last token.
        About a window ring and the compressors' open rows per layer; no host sync."""
        snap.save(self.model, self.length, self.pending, self._logits)

    def restore(self, snap: StateSnapshot) -> None:
        """Back to a saved point: the next generate(..., continue_sequence=True) or prefill(...,
        continue_sequence=True) goes on from it (an empty continuation samples from the saved
        logits, when there are some), with the same tokens and logits as a fresh run that fed
        the same tokens in the same pieces. Valid while nothing was fed at a position below
        snap.length since the save (the compressed entries, append-only, are not saved:
        dsv4.runtime.snapshot; dsv4.runtime.prefix_cache keeps that account). The speculative step starts
        over, as after a fresh prefill."""
        if snap.empty:
            raise InputError("restore of an empty snapshot: save() into it first")
        self._logits = snap.restore(self.model)
        self.length, self.pending = snap.length, snap.pending
        if self.spec is not None:
            self.spec.reset()

    def close(self) -> None:
        """Free the graphs and pools (idempotent); the model and its weights stay. In tensor
        parallel the model's prefill chunk graphs go too: they captured NCCL all-reduces, and
        NCCL's teardown (TPGroup.close) waits until every such graph is destroyed."""
        if self.model.tp is not None:
            self.model.prefill_graphs = None
        self.decoder.close()
        if self.greedy is not None:
            self.greedy.close()
        if self.lp is not None:
            self.lp.close()
        if self.spec is not None:
            self.spec.close()

    def plain_decoder(self) -> CUDAGraphDecoder:
        """The decoder of this request's plain steps: the greedy twin for a greedy request (a
        per-request session in graph mode), else the one that samples as the parameters say."""
        if self.greedy is not None and self.knobs.params.greedy:
            return self.greedy
        return self.decoder

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the sequence ------------------------------------------------------------------------
    # `length`: positions the model state holds (tokens fed); `pending`: the last token chosen by
    # generate() and not fed yet (None after a prefill). A continuation feeds pending first.
    def _feed(self, ids: Sequence[int], continue_sequence: bool, n_new: int = 0,
              speculate: bool = True):
        """Validate ids; -> (tokens to prefill, their first position). Raises before any state
        changes: a bad request loses nothing. An empty result: go on from the held logits.
        speculate: what follows decodes speculatively (the MTP block must have followed)."""
        cfg = self.model.cfg
        ids = list(ids)
        if not ids and not (continue_sequence and self.pending is None and
                            self._logits is not None):
            raise InputError("empty prompt: give at least one token")
        check_token_ids(ids, cfg.vocab_size)
        if not continue_sequence:
            feed, start = ids, 0
        else:
            feed = ([self.pending] if self.pending is not None else []) + ids
            start = self.length
            m = self.model
            # a speculative session's prefill runs the MTP block, which must have followed
            if speculate and self.spec is not None and start and not (
                    m.mtp_len == start or (m.mtp_len == start - 1 and m.h_last is not None)):
                raise InputError("this sequence cannot be continued with speculative decoding: "
                                 "its last tokens were not decoded with it (forced ids); start a "
                                 "new sequence")
        self.model.check_capacity(start + len(feed), n_new)
        return feed, start

    def prefill(self, ids: Sequence[int], continue_sequence: bool = False,
                progress: bool = False) -> torch.Tensor:
        """Feed ids without generating: a new sequence, or (continue_sequence) after the tokens
        already fed and the last generated one. Returns the logits [V] f32 after the last id
        (a copy). The next generate(..., continue_sequence=True) goes on from there."""
        feed, start = self._feed(ids, continue_sequence)
        if not feed:                    # continue_sequence=True with nothing new: held logits
            return self._logits.clone()
        if start == 0:
            self.reset()
        logits = prefill(self.model, torch.tensor(feed, dtype=torch.int64,
                                                  device=self.model.head_device), start,
                         progress=progress, mtp=self.spec is not None)
        self.length, self.pending, self._logits = start + len(feed), None, logits
        return logits.clone()

    def score(self, ids: Sequence[int]) -> list:
        """Feed ids as a new sequence (the state then holds them, as after prefill(ids)) and
        return each one's TokenLogprobs given the ids before it: [None, entry(ids[1]), ...]
        (dsv4.runtime.logprobs.prompt_logprobs: every row's logits of the prompt's pass). The
        next generate([], ..., continue_sequence=True, speculative=False) goes on from there."""
        feed, _ = self._feed(ids, False, speculate=False)
        self.reset()
        entries, logits = prompt_logprobs(self.model, feed, self.model.rt.prefill_chunk)
        self.length, self.pending, self._logits = len(feed), None, logits
        return entries

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                 force_ids: Sequence[int] | None = None, eos_id: int | None = None,
                 on_token: Callable[[int], object] | None = None,
                 keep_logits: bool = False, continue_sequence: bool = False,
                 progress: bool = False, sampling: SamplingParams | None = None,
                 speculative: bool | None = None,
                 on_logprobs: Callable[[TokenLogprobs], object] | None = None,
                 constraint: Constraint | None = None) -> GenerationResult:
        """Prefill prompt_ids, then decode up to max_new_tokens (stop at eos_id unless forced).
        continue_sequence: the prompt follows the sequence so far (its tokens stay in the state
        and are not read again; the last generated token is fed first), e.g. a new chat turn;
        empty, it goes on from a prefill(), score() or restore() without feeding anything again.
        on_token(tid): each token as it reaches the host; a truthy return ends the generation
        there (finish_reason "stopped"; the state may hold one more token, or, in a speculative
        step, the step's later ones, which output_ids then ends with: length / pending say).
        sampling: this call's parameters (per_request_sampling sessions; default the session's).
        speculative=False: plain steps in a speculative session (the MTP block follows the
        prompt, not the steps: a later continuation of this sequence cannot speculate).
        on_logprobs(entry): each token's TokenLogprobs (dsv4.runtime.logprobs), just before
        on_token; constraint: a grammar's mask on every token (dsv4.runtime.grammar). Both need
        a per_request_sampling session and take plain steps.
        progress: a bar on stderr for a prompt of many prefill chunks."""
        self._set_sampling(sampling)
        force_ids, max_new_tokens = self._check_request(force_ids, max_new_tokens, speculative,
                                                        on_logprobs, constraint)
        speculate = (self.spec is not None and force_ids is None and speculative is not False
                     and on_logprobs is None and constraint is None)
        feed, start = self._feed(prompt_ids, continue_sequence, max_new_tokens, speculate)
        if speculate:
            return self._generate_speculative(feed, start, list(prompt_ids), max_new_tokens,
                                              eos_id, on_token, keep_logits, progress)
        hd, p0 = self.model.head_device, start + len(feed)     # p0: position after the prompt
        sync = torch.cuda.synchronize if hd.type == "cuda" else (lambda: None)
        if start == 0:
            self.reset()
        loop = DecodeLoop(self, LoopRequest(max_new_tokens, force_ids, eos_id, on_token,
                                            keep_logits, on_logprobs, constraint), p0)
        try:
            sync()
            t0 = time.perf_counter()
            loop.first(self._prefill_or_held(feed, start, progress))
            self.length, self.pending = p0, None
            sync()
            t1 = time.perf_counter()
            res = loop.steps()
            sync()
            t2 = time.perf_counter()
        finally:
            if self.mask is not None:
                self.mask.clear()
        # the state now holds tokens 0..steps-1 of `out` (a step one late may have fed the EOS)
        out = res.out
        self.length = p0 + res.steps
        self.pending = out[-1] if len(out) > res.steps else None
        timings = _timings(len(feed), max(len(out) - 1, 0), t0, t1, t2)
        return GenerationResult(list(prompt_ids), out, res.finish,
                                torch.stack(res.rows[:len(out)]) if keep_logits else None,
                                timings, res.logprobs)

    def _check_request(self, force_ids, max_new_tokens: int, speculative, on_logprobs,
                       constraint) -> tuple[list | None, int]:
        """generate()'s arguments checked before any state changes -> (force_ids as a list or
        None, the number of tokens to produce)."""
        if speculative and self.spec is None:
            raise InputError("speculative decoding was asked for a session built without it; "
                             "build the Session with speculative=1 (a checkpoint with an MTP "
                             "block, RuntimeConfig(mtp=True))")
        if (on_logprobs is not None or constraint is not None) and self.knobs is None:
            raise InputError("log-probabilities and token masks need a Session built with "
                             "per_request_sampling=True")
        if force_ids is not None:
            force_ids = list(force_ids)
            if not force_ids:
                raise InputError("force_ids is empty; give at least one token id")
            if on_logprobs is not None or constraint is not None:
                raise InputError("force_ids decides every token: leave out log-probabilities "
                                 "and the token mask (score forced ids with score())")
            max_new_tokens = len(force_ids)
            check_token_ids(force_ids, self.model.cfg.vocab_size)
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens = {max_new_tokens}: must be >= 1")
        return force_ids, max_new_tokens

    @torch.inference_mode()
    def _generate_speculative(self, feed, start, prompt_ids, max_new_tokens, eos_id, on_token,
                              keep_logits, progress) -> GenerationResult:
        """generate() with the MTP block's drafts: prefill (the MTP block following), the first
        token and its draft, then speculative steps (graphs or eager, like the plain loop) of up
        to 1 + k tokens each, or plain steps with the MTP block following where the policy
        says so. The next step is launched before the host reads a step's output wherever that
        step cannot reach the limit (SpecStep.launch): a step launched past an EOS feeds it and
        keeps nothing more (the state then holds the EOS, pending none, as plain decoding's
        one-late step leaves it); one launched past on_token's stop outputs its tokens too
        (output_ids ends with them, as with a step's later tokens)."""
        model, spec, hd = self.model, self.spec, self.model.head_device
        sync = torch.cuda.synchronize if hd.type == "cuda" else (lambda: None)
        steps0, spec0, prop0, acc0 = spec.steps, spec.spec_steps, spec.proposed, spec.accepted
        if start == 0:
            self.reset()
        sync()
        t0 = time.perf_counter()
        logits = self._prefill_or_held(feed, start, progress)
        p0 = start + len(feed)
        tok = sample(logits, torch.tensor([p0 - 1], device=hd), self._sampler)
        spec.start(tok, p0)
        rows = [logits.to("cpu", copy=True)] if keep_logits else None
        out = [int(tok)]
        sync()
        t1 = time.perf_counter()
        stopped = on_token is not None and bool(on_token(out[0]))
        stop = stopped or (eos_id is not None and out[0] == eos_id)
        pos, fed = p0, 0                # fed: a step past the end fed the EOS (pending none)
        left = max_new_tokens - len(out)

        def launch(j: int, limit: int):  # step j of this call (profiling hooks, NVTX)
            if self.step_hook is not None:
                self.step_hook(j, True)
            with nvtx_range(f"decode/spec{j}"):
                return spec.launch(limit, eos_id)

        def done(j: int) -> None:
            if self.step_hook is not None:
                self.step_hook(j, False)

        run = launch(1, left) if not stop and left > 0 else None
        i = 1
        while run is not None:
            nxt = None
            # the next step goes in before this one is read (the host's turn-around hidden behind
            # the device) where this one cannot end the output at the limit; logits are read
            # from the step's buffers, so keep_logits reads each step first
            if left >= 2 * (spec.k + 1) and not keep_logits:
                nxt = launch(i + 1, left - spec.k - 1)
            ys = spec.finish(run)
            done(i)
            for tid in ys:              # all of them are in the state (the last one pending)
                out.append(tid)
                if on_token is not None and not stopped and on_token(tid):
                    stopped = True
            if keep_logits:
                rows += list(spec.logits().to("cpu", copy=True))
            pos += len(ys)
            left -= len(ys)
            eos_end = eos_id is not None and ys[-1] == eos_id
            stop = stopped or eos_end
            if stop and nxt is not None:
                if eos_end:             # it fed the EOS and kept nothing more (verify.accept)
                    spec.abandon(nxt)
                    fed = 1
                else:                   # stopped by on_token: its tokens are in the state too
                    ys = spec.finish(nxt)
                    out += ys
                    pos += len(ys)
                done(i + 1)
                nxt = None
            if stop or left <= 0:
                break
            run = nxt if nxt is not None else launch(i + 1, left)
            i += 1
        spec.settle()
        sync()
        t2 = time.perf_counter()
        model.mtp_commit(pos + fed)       # the MTP block read the rows < pos (+ the EOS fed)
        self.length, self.pending = pos + fed, None if fed else out[-1]
        n_dec, steps = len(out) - 1, spec.steps - steps0
        proposed, accepted = spec.proposed - prop0, spec.accepted - acc0
        timings = {**_timings(len(feed), n_dec, t0, t1, t2), "speculative": spec.k, "steps": steps,
                   "speculative_steps": spec.spec_steps - spec0,
                   "acceptance_rate": accepted / proposed if proposed else 0.0,
                   "tokens_per_step": n_dec / steps if steps else 0.0}
        finish = "stopped" if stopped else "eos" if stop else "length"
        return GenerationResult(prompt_ids, out, finish,
                                torch.stack(rows) if keep_logits else None, timings)

    def _set_sampling(self, sampling: SamplingParams | None) -> None:
        if self.knobs is not None:
            self.knobs.set(sampling if sampling is not None else self.params)
        elif sampling is not None and sampling != self.params:
            raise InputError(f"this Session samples with the parameters it was built with "
                             f"({self.params}); build it with Session(..., "
                             f"per_request_sampling=True) to pass sampling= per call")

    def _prefill_or_held(self, feed: list, start: int, progress: bool) -> torch.Tensor:
        """The prompt's logits [V] f32: a prefill of feed at start, or, feed empty, the logits
        a prefill() / restore() left. Either way they are used up (a token is chosen next)."""
        held, self._logits = self._logits, None
        if not feed:
            return held
        with nvtx_range("prefill"):
            return prefill(self.model, torch.tensor(feed, dtype=torch.int64,
                                                    device=self.model.head_device), start,
                           progress=progress, mtp=self.spec is not None)


def _timings(n_feed: int, n_dec: int, t0: float, t1: float, t2: float) -> dict:
    """Prefill over [t0, t1) of n_feed tokens, decode over [t1, t2) of n_dec tokens."""
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1,
            "prefill_tok_per_s": n_feed / max(t1 - t0, 1e-9),
            "decode_tok_per_s": n_dec / (t2 - t1) if n_dec else 0.0,
            "ms_per_token": 1000 * (t2 - t1) / n_dec if n_dec else 0.0}
