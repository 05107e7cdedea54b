"""The speculative decode step as graphs/ segments: static buffers, verify, accept, rewind, draft.

One step (K = 1 draft, T = K + 1 rows): `embed` (ids = [pending, drafts]) -> `layer{l}` (save the
journal, then the T rows through Block.decode_rows at positions pos.. : each row with the bits of
plain decoding's step, so kept rows are plain decoding's bit for bit; the linears read each weight
once for all rows) -> `lm_head`
(logits of the T rows) -> `accept` (dsv4.speculative.accept: tokens y, rows kept) -> `rewind{l}`
(the journal puts back the rows after keep) -> `mtp` (the MTP block reads the T rows with the
chosen tokens, rewinds its own rows after keep, drafts from its row keep; the pending token and
position advance). Every fn is capture-safe, so the whole step replays from CUDA graphs
(graphs.CUDAGraphDecoder) and runs the same functions eagerly on the CPU.

The host reads `record` ([keep + 1, y...]) after each step: the output of a step is known only
on the device, and the next step's limit (tokens still wanted) depends on it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from graphs import CUDAGraphDecoder, Segment

from . import overlap
from .errors import ConfigError
from .model import Transformer
from .sampling import SamplingParams
from .speculative import Journal, accept, draft, oracle_draft


@dataclass
class SpecBuffers:
    """Static buffers of a speculative step (fill values in allocate: pending 0, pos 1, drafts 0,
    q 0, limit T, eos -1, oracle_a -1 (off), the rest 0)."""
    pending: torch.Tensor            # [1] int64: the token chosen at pos - 1, fed at pos
    pos: torch.Tensor                # [1] int64: its position
    drafts: torch.Tensor             # [K] int64: the drafts of the tokens at pos + 1 ..
    q: torch.Tensor                  # [K, V] f32: their distributions (sampling)
    limit: torch.Tensor              # [1] int64: at most this many output tokens (>= 1)
    eos: torch.Tensor                # [1] int64: the output stops after this token (-1: none)
    ids: torch.Tensor                # [T] int64: the rows' tokens
    logits: torch.Tensor             # [T, V] f32: main logits of the rows
    y: torch.Tensor                  # [T] int64: accept's tokens
    keep: torch.Tensor               # [1] int64: rows kept - 1 (= drafts accepted)
    record: torch.Tensor             # [1 + T] int64: keep + 1, then y (what the host reads)
    hm: torch.Tensor                 # [T, c, D]: the MTP block's rows
    oracle_seq: torch.Tensor         # [capacity + 2] int64: tests / benchmarks, see oracle_draft
    oracle_a: torch.Tensor           # [1] f32: the oracle's probability (< 0: off)
    h: dict = field(default_factory=dict)        # device -> [T, c, D] rows
    ids_on: dict = field(default_factory=dict)   # device -> copy of ids
    pos_on: dict = field(default_factory=dict)   # device -> copy of pos
    keep_on: dict = field(default_factory=dict)  # device -> copy of keep

    @classmethod
    def allocate(cls, model: Transformer, k: int) -> "SpecBuffers":
        cfg, hd, T = model.cfg, model.head_device, k + 1
        i64 = dict(dtype=torch.int64, device=hd)
        V, c, D = cfg.vocab_size, cfg.hc_mult, cfg.dim
        b = cls(pending=torch.zeros(1, **i64), pos=torch.ones(1, **i64),
                drafts=torch.zeros(k, **i64),
                q=torch.zeros(k, V, dtype=torch.float32, device=hd),
                limit=torch.full((1,), T, **i64), eos=torch.full((1,), -1, **i64),
                ids=torch.zeros(T, **i64),
                logits=torch.zeros(T, V, dtype=torch.float32, device=hd),
                y=torch.zeros(T, **i64), keep=torch.zeros(1, **i64),
                record=torch.zeros(1 + T, **i64),
                hm=torch.zeros(T, c, D, dtype=model.act, device=hd),
                oracle_seq=torch.zeros(model.rt.max_seq_len + 2, **i64),
                oracle_a=torch.full((1,), -1.0, dtype=torch.float32, device=hd))
        for dev in [hd] + model.placement:
            if dev not in b.h:
                b.h[dev] = torch.zeros(T, c, D, dtype=model.act, device=dev)
                on_hd = dev == hd
                b.ids_on[dev] = b.ids if on_hd else torch.zeros_like(b.ids, device=dev)
                b.pos_on[dev] = b.pos if on_hd else torch.ones_like(b.pos, device=dev)
                b.keep_on[dev] = b.keep if on_hd else torch.zeros_like(b.keep, device=dev)
        return b

    def reset(self) -> None:
        """A new sequence: the step's carried inputs back to their fill values (in place)."""
        self.pending.zero_()
        self.pos.fill_(1)
        self.drafts.zero_()
        self.q.zero_()


def build_spec_segments(model: Transformer, bufs: SpecBuffers, params: SamplingParams,
                        journals: list[Journal], mtp_journal: Journal | None) -> list[Segment]:
    """The segments of one step; without mtp_journal, the verify alone (no `mtp` segment: the
    benchmark's verify pass of T rows)."""
    hd = model.head_device
    for dev in {hd, *model.placement}:
        overlap.prepare(dev)
    segs = [Segment("embed", hd, _embed_fn(model, bufs),
                    reads={"pending": bufs.pending, "drafts": bufs.drafts},
                    writes={"ids": bufs.ids, "h": bufs.h[hd]})]
    for l, (blk, st) in enumerate(zip(model.layers, model.states)):
        dev = blk.device
        h, ids, pos = bufs.h[dev], bufs.ids_on[dev], bufs.pos_on[dev]
        segs.append(Segment(f"layer{l}", dev, _layer_fn(blk, st, journals[l], h, ids, pos),
                            reads={"h": h, "ids": ids, "pos": pos}, writes={"h": h}))
    segs.append(Segment("lm_head", hd, _lm_head_fn(model, bufs),
                        reads={"h": bufs.h[hd]}, writes={"logits": bufs.logits}))
    segs.append(Segment("accept", hd, _accept_fn(bufs, params),
                        reads={"logits": bufs.logits, "drafts": bufs.drafts, "q": bufs.q,
                               "pos": bufs.pos, "limit": bufs.limit, "eos": bufs.eos},
                        writes={"y": bufs.y, "keep": bufs.keep, "record": bufs.record}))
    for l, blk in enumerate(model.layers):
        dev = blk.device
        segs.append(Segment(f"rewind{l}", dev,
                            _rewind_fn(journals[l], bufs.pos_on[dev], bufs.keep_on[dev]),
                            reads={"pos": bufs.pos_on[dev], "keep": bufs.keep_on[dev]},
                            writes={}))
    if mtp_journal is None:
        return segs
    segs.append(Segment("mtp", hd, _mtp_fn(model, bufs, params, mtp_journal),
                        reads={"h": bufs.h[hd], "y": bufs.y, "keep": bufs.keep,
                               "pos": bufs.pos},
                        writes={"drafts": bufs.drafts, "q": bufs.q, "pending": bufs.pending,
                                "pos": bufs.pos}))
    return segs


def _embed_fn(model, bufs):
    h = bufs.h[model.head_device]

    def fn():
        bufs.ids[:1].copy_(bufs.pending)
        bufs.ids[1:].copy_(bufs.drafts)
        h.copy_(model.embed_tokens(bufs.ids))
    return fn


def _layer_fn(blk, st, journal, h, ids, pos):
    def fn():
        journal.save(pos)
        blk.decode_rows(h, ids, pos, st, out=h)     # row i sees rows < i in the state: causal
    return fn


def _lm_head_fn(model, bufs):
    h = bufs.h[model.head_device]

    def fn():
        model.logits_rows(h, out=bufs.logits)
    return fn


def _accept_fn(bufs, params):
    def fn():
        y, keep = accept(bufs.logits, bufs.drafts, None if params.greedy else bufs.q, bufs.pos,
                         params, bufs.limit, bufs.eos)
        bufs.y.copy_(y)
        bufs.keep.copy_(keep)
        bufs.record[:1].copy_(keep + 1)
        bufs.record[1:].copy_(y)
    return fn


def _rewind_fn(journal, pos, keep):
    def fn():
        journal.rewind(pos, keep)
    return fn


def _mtp_fn(model, bufs, params, journal):
    mtp, h = model.mtp, bufs.h[model.head_device]

    def fn():
        pos, keep, y = bufs.pos, bufs.keep, bufs.y
        journal.save(pos)
        emb = model.embed.index_select(0, y)                                # [T, D]
        mtp.decode_rows(h, emb, y, pos, out=bufs.hm)
        journal.rewind(pos, keep)
        logits = model.logits(bufs.hm.index_select(0, keep), head=mtp.head())
        next_draft(model, bufs, params, logits, y.index_select(0, keep), pos + keep + 1)
    return fn


def next_draft(model, bufs: SpecBuffers, params: SamplingParams, logits: torch.Tensor,
               pending: torch.Tensor, pos: torch.Tensor) -> None:
    """The pending token [1] at pos ([1] int64) and the MTP logits [V] of the row before it ->
    the buffers' pending, pos, draft (the oracle's, when on) and q. Capture-safe."""
    d, q = draft(logits, pos, params)
    bufs.drafts.copy_(oracle_draft(d, pos + 1, bufs.oracle_seq, bufs.oracle_a,
                                   model.cfg.vocab_size))
    if q is not None:
        bufs.q[0].copy_(q)
    bufs.pending.copy_(pending)
    bufs.pos.copy_(pos)


def layer_journals(model: Transformer, T: int) -> list[Journal]:
    """One journal per main layer for a pass of T rows (on the layer's device)."""
    return [Journal([(st, blk.ratio)], model.cfg.window_size, T)
            for blk, st in zip(model.layers, model.states)]


def verify_decoder(model: Transformer, k: int, mode: str) -> tuple[CUDAGraphDecoder, SpecBuffers]:
    """Benchmarks: the verify pass of T = k + 1 rows (greedy), accept and rewind included, as a
    decoder of its own (allocated; warm up and capture it for graph mode). Its static inputs are
    those of a step at pos 1 with drafts 0; each step leaves the state as it found it when
    the drafts are rejected."""
    bufs = SpecBuffers.allocate(model, k)
    dec = CUDAGraphDecoder(build_spec_segments(model, bufs, SamplingParams(),
                                               layer_journals(model, k + 1), None),
                           inputs={"pending": bufs.pending, "pos": bufs.pos,
                                   "drafts": bufs.drafts, "q": bufs.q, "limit": bufs.limit,
                                   "eos": bufs.eos},
                           outputs={"record": bufs.record}, mode=mode, reset_fn=model.reset,
                           nvtx_domain="dsv4-verify")
    dec.allocate()
    return dec, bufs


class SpecStep:
    """The speculative step of one model (K = 1) over a graphs.CUDAGraphDecoder: `start` after a
    prefill that the MTP block followed, then `step` until the output is complete."""

    def __init__(self, model: Transformer, params: SamplingParams, k: int = 1, *,
                 mode: str = "eager", granularity: str = "segment", reset_fn=None,
                 debug: bool = False, nvtx_domain: str = "dsv4-spec", fix_hints=()):
        if model.mtp is None:
            raise ConfigError("speculative decoding needs the MTP block: build the model with "
                              "RuntimeConfig(mtp=True) on a checkpoint with "
                              "num_nextn_predict_layers >= 1")
        if k != 1:
            raise ConfigError(f"--speculative {k}: only 1 draft token per step is implemented "
                              f"(0 = off)")
        self.model, self.params, self.k = model, params, k
        T = k + 1
        self.bufs = SpecBuffers.allocate(model, k)
        self.journals = layer_journals(model, T)
        self.mtp_journal = Journal([(model.mtp.state, model.mtp.block.ratio)],
                                   model.cfg.window_size, T)
        b = self.bufs
        segs = build_spec_segments(model, b, params, self.journals, self.mtp_journal)
        self.decoder = CUDAGraphDecoder(
            segs, inputs={"pending": b.pending, "pos": b.pos, "limit": b.limit, "eos": b.eos},
            outputs={"record": b.record, "logits": b.logits}, mode=mode, granularity=granularity,
            reset_fn=reset_fn or model.reset, debug=debug, nvtx_domain=nvtx_domain,
            **({"fix_hints": tuple(fix_hints)} if fix_hints else {}))
        self.decoder.allocate()
        self.steps = self.proposed = self.accepted = 0
        pinned = model.head_device.type == "cuda"
        self._host = torch.zeros(1 + T, dtype=torch.int64, pin_memory=pinned)

    def capture(self) -> None:
        self.decoder.warmup()
        self.decoder.capture()

    def set_oracle(self, seq, a: float) -> None:
        """Tests / benchmarks: draft seq[p] at position p with probability a (a < 0: off)."""
        b = self.bufs
        b.oracle_a.fill_(a)
        if a >= 0:
            s = torch.as_tensor(list(seq)[:b.oracle_seq.shape[0]], dtype=torch.int64)
            b.oracle_seq.zero_()
            b.oracle_seq[:s.shape[0]].copy_(s)

    def reset(self) -> None:
        self.bufs.reset()

    def start(self, token: torch.Tensor, pos: int) -> None:
        """The token [1] chosen at pos - 1 (after a prefill the MTP block followed): the MTP block
        reads its waiting row with it and drafts the next token. Eager (once per generate)."""
        m = self.model
        next_draft(m, self.bufs, self.params, m.mtp_follow_token(token), token,
                   torch.tensor([pos], dtype=torch.int64, device=m.head_device))

    def step(self, limit: int, eos_id: int | None) -> list[int]:
        """One step; -> its output tokens (1 .. min(limit, T); the last one is the new pending
        token, not fed). Waits for the device (the output decides the next step's limit)."""
        b = self.bufs
        b.limit.fill_(limit)
        b.eos.fill_(-1 if eos_id is None else eos_id)
        self.decoder.step()
        self._host.copy_(b.record, non_blocking=self._host.is_pinned())
        if self._host.is_pinned():
            torch.cuda.current_stream(b.record.device).synchronize()
        rec = self._host.tolist()
        n = rec[0]
        self.steps += 1
        self.proposed += min(self.k, limit - 1)
        self.accepted += n - 1
        return rec[1:1 + n]

    def stats(self) -> dict:
        return {"speculative": self.k, "steps": self.steps, "proposed": self.proposed,
                "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0}

    def close(self) -> None:
        self.decoder.close()
