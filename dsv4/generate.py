"""A decode session: build and load the model, prefill, then the decode loop (eager or CUDA graphs)
with streaming text, stop checks and timings.

The decode loop always goes through `graphs.CUDAGraphDecoder` (eager mode on the CPU), so the
graph and eager paths run the same segment functions. Token ids reach the host one step late
(pinned copies of `out_ids`), off the critical path of the next launch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from graphs import CUDAGraphDecoder, balanced_placement

from .checkpoint import open_checkpoint
from .errors import DeviceError, InputError
from .profiling import nvtx_range
from .model import RuntimeConfig, Transformer
from .sampling import SamplingParams, sample
from .segments import DecodeBuffers, build_segments
from .spec_policy import DEFAULT_MIN_ACCEPTANCE

FIX_HINTS = ("lower RuntimeConfig.max_seq_len (smaller caches and graph memory)", "mode='eager'")


@dataclass
class GenerationResult:
    prompt_ids: list
    output_ids: list
    finish_reason: str                     # "eos" | "length"
    logits: torch.Tensor | None = None     # [n_generated, V] f32 when requested
    timings: dict = field(default_factory=dict)


def resolve_devices(device: str) -> list[str]:
    """--device auto|cpu|cuda|cuda:0,cuda:1 -> device names; never touches CUDA for 'cpu'."""
    if device == "cpu":
        return ["cpu"]
    if device == "auto":
        return ["cuda:0"] if torch.cuda.is_available() else ["cpu"]
    devs = [d.strip() for d in device.split(",") if d.strip()]
    if not devs:
        raise InputError(f"--device {device!r}: expected auto, cpu, cuda or cuda:0,cuda:1,...")
    for d in devs:
        if d.startswith("cuda"):
            if not torch.cuda.is_available():
                raise DeviceError(f"--device {device}: CUDA is not available on this machine; use "
                                  f"--device cpu (or auto)")
            try:
                idx = torch.device(d).index or 0
            except RuntimeError:
                raise InputError(f"--device {d!r}: not a device name") from None
            if idx >= torch.cuda.device_count():
                raise DeviceError(f"--device {d}: only {torch.cuda.device_count()} CUDA device(s)")
        elif d != "cpu":
            raise InputError(f"--device {d!r}: expected cpu or cuda[:i]")
    if "cpu" in devs and len(devs) > 1:
        raise InputError(f"--device {device}: cannot mix cpu with CUDA devices")
    return ["cuda:0" if d == "cuda" else d for d in devs]


def resolve_mode(mode: str, devices: Sequence[str]) -> str:
    """'auto' -> 'graph' on CUDA, 'eager' on the CPU; 'graph' without CUDA is a DeviceError."""
    on_cuda = str(devices[0]).startswith("cuda")
    if mode == "auto":
        return "graph" if on_cuda else "eager"
    if mode == "graph" and not on_cuda:
        raise DeviceError("mode='graph' needs CUDA (no CUDA device in use); use mode='eager' or "
                          "mode='auto'")
    if mode not in ("graph", "eager"):
        raise InputError(f"mode={mode!r}: allowed 'auto', 'graph', 'eager'")
    return mode


def load_model(ckpt_dir, rt: RuntimeConfig, progress: bool | None = None):
    """Open + validate a checkpoint, place layers over rt.devices by weight bytes, load weights."""
    ckpt = open_checkpoint(ckpt_dir)
    cfg = ckpt.config
    devices = list(rt.devices)
    placement = None
    if len(devices) > 1:
        per_layer = [ckpt.nbytes(ckpt.prefix_names(f"layers.{l}.")) for l in range(cfg.n_layers)]
        head = ckpt.nbytes([n for n in ckpt.global_names() if not n.startswith("mtp.")])
        placement = balanced_placement(per_layer, devices, head)
    model = Transformer(cfg, rt, placement)
    model.load(ckpt, progress=progress)
    return model, ckpt


class Session:
    """Prefill + decode of one sequence at a time over a loaded model (eager or graph mode).

    mode: 'eager', 'graph' (captures the decode step at construction) or 'auto' (graph on CUDA,
    eager on the CPU); `session.mode` is the resolved one. A context manager: `with Session(...)
    as s:` closes it (graphs and pools freed) on exit. Errors name API parameters
    (RuntimeConfig.max_seq_len, max_new_tokens); the CLI words them as flags."""

    def __init__(self, model: Transformer, params: SamplingParams, mode: str = "eager",
                 granularity: str = "segment", debug: bool = False, nvtx_domain: str = "dsv4",
                 speculative: int = 0, spec_min_acceptance: float = DEFAULT_MIN_ACCEPTANCE):
        mode = resolve_mode(mode, [model.head_device.type])
        self.model, self.params, self.mode = model, params, mode
        self.spec = None                # the speculative step (dsv4.spec_step), when asked for
        self.bufs = DecodeBuffers.allocate(model)
        segs = build_segments(model, self.bufs, params)
        self.decoder = CUDAGraphDecoder(
            segs, inputs={"token": self.bufs.token, "pos": self.bufs.pos},
            outputs={"logits": self.bufs.logits, "token": self.bufs.token},
            mode=mode, granularity=granularity, reset_fn=self.reset, debug=debug,
            nvtx_domain=nvtx_domain, fix_hints=FIX_HINTS)
        self.decoder.allocate()
        if speculative:
            from .spec_step import SpecStep
            self.spec = SpecStep(model, params, speculative, plain=(self.decoder, self.bufs),
                                 min_acceptance=spec_min_acceptance, mode=mode,
                                 granularity=granularity, reset_fn=self.reset, debug=debug,
                                 nvtx_domain=f"{nvtx_domain}-spec", fix_hints=FIX_HINTS)
        self.length, self.pending = 0, None
        self.capture_s = 0.0
        self.step_hook = None           # profiling: hook(step, before: bool)
        if mode == "graph":
            t = time.perf_counter()
            self.decoder.warmup()
            self.decoder.capture()
            if self.spec is not None:
                self.spec.capture()
            self.capture_s = time.perf_counter() - t
            if model.rt.prefill_graphs and model.prefill_graphs is None and self.spec is None:
                from .prefill_graphs import PrefillGraphs   # short prompts replay chunk graphs
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
        self.length, self.pending = 0, None

    def close(self) -> None:
        """Free the graphs and pools (idempotent); the model and its weights stay."""
        self.decoder.close()
        if self.spec is not None:
            self.spec.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the sequence ------------------------------------------------------------------------
    # `length`: positions the model state holds (tokens fed); `pending`: the last token chosen by
    # generate() and not fed yet (None after a prefill). A continuation feeds pending first.
    def _feed(self, ids: Sequence[int], continue_sequence: bool, n_new: int = 0):
        """Validate ids; -> (tokens to prefill, their first position). Raises before any state
        changes: a bad request loses nothing."""
        cfg = self.model.cfg
        ids = list(ids)
        if not ids:
            raise InputError("empty prompt: give at least one token")
        for tid in ids:
            if not 0 <= tid < cfg.vocab_size:
                raise InputError(f"token id {tid} is out of range: the vocabulary has "
                                 f"{cfg.vocab_size} ids (0..{cfg.vocab_size - 1})")
        if not continue_sequence:
            feed, start = ids, 0
        else:
            feed = ([self.pending] if self.pending is not None else []) + ids
            start = self.length
            m = self.model
            if self.spec is not None and start and not (
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
        if start == 0:
            self.reset()
        logits = self.model.prefill(torch.tensor(feed, dtype=torch.int64,
                                                 device=self.model.head_device), start,
                                    progress=progress, mtp=self.spec is not None)
        self.length, self.pending = start + len(feed), None
        return logits

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                 force_ids: Sequence[int] | None = None, eos_id: int | None = None,
                 on_token: Callable[[int], None] | None = None,
                 keep_logits: bool = False, continue_sequence: bool = False,
                 progress: bool = False) -> GenerationResult:
        """Prefill prompt_ids, then decode up to max_new_tokens (stop at eos_id unless forced).
        continue_sequence: the prompt follows the sequence so far (its tokens stay in the state
        and are not read again; the last generated token is fed first), e.g. a new chat turn.
        progress: a bar on stderr for a prompt of many prefill chunks."""
        model = self.model
        if force_ids is not None:
            force_ids = list(force_ids)
            if not force_ids:
                raise InputError("force_ids is empty; give at least one token id")
            max_new_tokens = len(force_ids)
            for tid in force_ids:
                if not 0 <= tid < model.cfg.vocab_size:
                    raise InputError(f"token id {tid} is out of range: the vocabulary has "
                                     f"{model.cfg.vocab_size} ids (0..{model.cfg.vocab_size - 1})")
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens = {max_new_tokens}: must be >= 1")
        feed, start = self._feed(prompt_ids, continue_sequence, max_new_tokens)
        if self.spec is not None and force_ids is None:
            return self._generate_speculative(feed, start, list(prompt_ids), max_new_tokens,
                                              eos_id, on_token, keep_logits, progress)
        hd, p0 = model.head_device, start + len(feed)          # p0: position after the prompt
        sync = torch.cuda.synchronize if hd.type == "cuda" else (lambda: None)

        if start == 0:
            self.reset()
        sync()
        t0 = time.perf_counter()
        with nvtx_range("prefill"):
            logits = model.prefill(torch.tensor(feed, dtype=torch.int64, device=hd), start,
                                   progress=progress, mtp=self.spec is not None)
        b = self.bufs
        b.pos.fill_(p0 - 1)
        first = sample(logits, b.pos, self.params)
        b.token.copy_(first if force_ids is None else
                      torch.tensor(force_ids[:1], dtype=torch.int64, device=hd))
        b.out_ids[p0:p0 + 1].copy_(b.token)
        b.pos.fill_(p0)
        self.length, self.pending = p0, None
        rows = [logits.to("cpu", copy=True)] if keep_logits else None
        sync()
        t1 = time.perf_counter()

        pinned = hd.type == "cuda"
        host = torch.empty(max_new_tokens, dtype=torch.int64, pin_memory=pinned)
        host[0:1].copy_(b.out_ids[p0:p0 + 1])
        out = []

        def take(i, ev=None) -> bool:   # token i reached the host: stream it; stop at EOS?
            if ev is not None:
                ev.synchronize()
            tid = int(host[i])
            out.append(tid)
            if on_token is not None:
                on_token(tid)
            return force_ids is None and eos_id is not None and tid == eos_id

        stop = take(0)
        pending = None                  # step whose token copy to the host is in flight
        steps = 0
        for i in range(1, max_new_tokens):
            if stop:
                break
            # step i feeds token i-1 (already in b.token unless forced) and chooses token i
            if self.step_hook is not None:
                self.step_hook(i, True)
            with nvtx_range(f"decode/step{i}"):
                self.decoder.step(**({"token": [force_ids[i - 1]]} if force_ids is not None else {}))
            steps += 1
            if self.step_hook is not None:
                self.step_hook(i, False)
            if keep_logits:
                rows.append(b.logits.to("cpu", copy=True))
            ev = None
            if force_ids is not None:   # the output is the forced id, whatever was sampled
                host[i] = force_ids[i]
            else:
                host[i:i + 1].copy_(b.out_ids[p0 + i:p0 + i + 1], non_blocking=pinned)
                if pinned:
                    ev = torch.cuda.Event()
                    ev.record()
            if pending is not None:     # one step late: the next launch is already queued
                stop = take(*pending)
            pending = (i, ev)
        if pending is not None and not stop:
            stop = take(*pending)
        finish = "eos" if stop else "length"
        sync()
        t2 = time.perf_counter()
        # the state now holds tokens 0..steps-1 of `out` (a step one late may have fed the EOS)
        self.length = p0 + steps
        self.pending = out[-1] if len(out) > steps else None
        n_dec = max(len(out) - 1, 0)
        timings = _timings(len(feed), n_dec, t0, t1, t2)
        return GenerationResult(list(prompt_ids), out, finish,
                                torch.stack(rows[:len(out)]) if keep_logits else None, timings)

    @torch.inference_mode()
    def _generate_speculative(self, feed, start, prompt_ids, max_new_tokens, eos_id, on_token,
                              keep_logits, progress) -> GenerationResult:
        """generate() with the MTP block's drafts: prefill (the MTP block following), the first
        token and its draft, then speculative steps (graphs or eager, like the plain loop) of up
        to 1 + k tokens each, or plain steps with the MTP block following where the policy
        says so. The host reads each step's output before the next one: it sets the next step's
        limit, and the state must end exactly at the output's end."""
        model, spec, hd = self.model, self.spec, self.model.head_device
        sync = torch.cuda.synchronize if hd.type == "cuda" else (lambda: None)
        steps0, spec0, prop0, acc0 = spec.steps, spec.spec_steps, spec.proposed, spec.accepted
        if start == 0:
            self.reset()
        sync()
        t0 = time.perf_counter()
        with nvtx_range("prefill"):
            logits = model.prefill(torch.tensor(feed, dtype=torch.int64, device=hd), start,
                                   progress=progress, mtp=True)
        p0 = start + len(feed)
        tok = sample(logits, torch.tensor([p0 - 1], device=hd), self.params)
        spec.start(tok, p0)
        rows = [logits.to("cpu", copy=True)] if keep_logits else None
        out = [int(tok)]
        sync()
        t1 = time.perf_counter()
        if on_token is not None:
            on_token(out[0])
        stop = eos_id is not None and out[0] == eos_id
        pos = p0
        while not stop and len(out) < max_new_tokens:
            i = spec.steps - steps0 + 1                 # this call's step number (profiling)
            if self.step_hook is not None:
                self.step_hook(i, True)
            with nvtx_range(f"decode/spec{i}"):
                ys = spec.step(max_new_tokens - len(out), eos_id)
            if self.step_hook is not None:
                self.step_hook(i, False)
            for tid in ys:
                out.append(tid)
                if on_token is not None:
                    on_token(tid)
            if keep_logits:
                rows += list(spec.logits().to("cpu", copy=True))
            pos += len(ys)
            stop = eos_id is not None and ys[-1] == eos_id
        sync()
        t2 = time.perf_counter()
        model.mtp_commit(pos)             # the MTP block read the rows < pos; none waits
        self.length, self.pending = pos, out[-1]
        n_dec, steps = len(out) - 1, spec.steps - steps0
        proposed, accepted = spec.proposed - prop0, spec.accepted - acc0
        timings = {**_timings(len(feed), n_dec, t0, t1, t2), "speculative": spec.k, "steps": steps,
                   "speculative_steps": spec.spec_steps - spec0,
                   "acceptance_rate": accepted / proposed if proposed else 0.0,
                   "tokens_per_step": n_dec / steps if steps else 0.0}
        return GenerationResult(prompt_ids, out, "eos" if stop else "length",
                                torch.stack(rows) if keep_logits else None, timings)


def _timings(n_feed: int, n_dec: int, t0: float, t1: float, t2: float) -> dict:
    """Prefill over [t0, t1) of n_feed tokens, decode over [t1, t2) of n_dec tokens."""
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1,
            "prefill_tok_per_s": n_feed / max(t1 - t0, 1e-9),
            "decode_tok_per_s": n_dec / (t2 - t1) if n_dec else 0.0,
            "ms_per_token": 1000 * (t2 - t1) / n_dec if n_dec else 0.0}
