"""The speculative decode step as graphs/ segments: static buffers, verify, accept, rewind, draft.

One step (K = 1 draft, T = K + 1 rows): `embed` (ids = [pending, drafts]) -> `layer{l}` (a
device's first layer saves the journal of all its layers; then the T rows through
Block.decode_rows at positions pos.. : each row with the bits of plain decoding's step, so kept
rows are plain decoding's bit for bit; the linears read each weight once for all rows) ->
`lm_head` (logits of the T rows) -> `accept` (dsv4.runtime.speculative.verify.accept: tokens y,
rows kept) -> `rewind{i}` (device i's journal puts back its layers' rows after keep) -> `mtp` (the
MTP block reads the T rows with the chosen tokens, rewinds its own rows after keep, drafts from
its row keep; the pending token and position advance). Every fn is capture-safe, so the whole
step replays from CUDA graphs (graphs.CUDAGraphDecoder) and runs the same functions eagerly on
the CPU.

The host reads `record` ([keep + 1, y...]) of each step: the output of a step is known only on
the device. The next step can be launched before that read (SpecStep.launch / finish) where its
limit (tokens still wanted) holds whatever the step outputs; a step launched past the EOS keeps
its row 0 only (verify.accept).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from graphs import BufferSpec, CUDAGraphDecoder, Segment

from ...errors import ConfigError
from ...model.transformer import Transformer
from ..passes import DecodeBuffers, DeviceBuffers, pass_segments
from ..sampling import SamplingKnobs, SamplingParams, fixed
from .journal import Journal
from .policy import DEFAULT_MIN_ACCEPTANCE, SpecPolicy
from .verify import accept, draft, oracle_draft, oracle_table


@dataclass
class SpecBuffers:
    """Static buffers of a speculative step (fill values in allocate: pending 0, pos 1, drafts 0,
    q 0, limit T, eos -1, the oracle off, the rest 0)."""
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
    oracle: torch.Tensor             # [capacity + 2] int64: tests / benchmarks (oracle_table)
    oracle_on: torch.Tensor          # [1] bool: the drafts are the oracle's
    h: dict = field(default_factory=dict)        # device -> [T, c, D] rows
    ids_on: dict = field(default_factory=dict)   # device -> copy of ids
    pos_on: dict = field(default_factory=dict)   # device -> copy of pos
    keep_on: dict = field(default_factory=dict)  # device -> copy of keep

    @classmethod
    def allocate(cls, model: Transformer, k: int) -> "SpecBuffers":
        cfg, hd, T = model.cfg, model.head_device, k + 1
        i64 = dict(dtype=torch.int64, device=hd)
        V, c, D = cfg.vocab_size, cfg.hc_mult, cfg.dim
        rows = DeviceBuffers.allocate(model, T, [BufferSpec("ids", (T,), torch.int64, hd, 0),
                                                 BufferSpec("pos", (1,), torch.int64, hd, 1),
                                                 BufferSpec("keep", (1,), torch.int64, hd, 0)])
        return cls(pending=torch.zeros(1, **i64), pos=rows.head("pos"),
                   drafts=torch.zeros(k, **i64),
                   q=torch.zeros(k, V, dtype=torch.float32, device=hd),
                   limit=torch.full((1,), T, **i64), eos=torch.full((1,), -1, **i64),
                   ids=rows.head("ids"),
                   logits=torch.zeros(T, V, dtype=torch.float32, device=hd),
                   y=torch.zeros(T, **i64), keep=rows.head("keep"),
                   record=torch.zeros(1 + T, **i64),
                   hm=torch.zeros(T, c, D, dtype=model.act, device=hd),
                   oracle=torch.zeros(model.rt.max_seq_len + 2, **i64),
                   oracle_on=torch.zeros(1, dtype=torch.bool, device=hd),
                   h=rows.h, ids_on=rows.on["ids"], pos_on=rows.on["pos"],
                   keep_on=rows.on["keep"])

    def device_buffers(self) -> DeviceBuffers:
        return DeviceBuffers(self.h, {"ids": self.ids_on, "pos": self.pos_on,
                                      "keep": self.keep_on})

    def reset(self) -> None:
        """A new sequence: the step's carried inputs back to their fill values (in place)."""
        self.pending.zero_()
        self.pos.fill_(1)
        self.drafts.zero_()
        self.q.zero_()


def build_spec_segments(model: Transformer, bufs: SpecBuffers,
                        params: SamplingParams | SamplingKnobs,
                        journals: dict, mtp_journal: Journal | None) -> list[Segment]:
    """The segments of one step (journals: device_journals); without mtp_journal, the verify
    alone (no `mtp` segment: the benchmark's verify pass of T rows)."""
    hd = model.head_device
    h = bufs.h[hd]

    def embed():
        bufs.ids[:1].copy_(bufs.pending)
        bufs.ids[1:].copy_(bufs.drafts)
        h.copy_(model.embed_tokens(bufs.ids))

    first = {}                                          # device -> its first layer
    for l, blk in enumerate(model.layers):
        first.setdefault(blk.device, l)

    def layer(l, blk, st, h, ids, pos):
        # the device's first layer saves the slots of all its layers (none written yet)
        journal = journals[blk.device] if first[blk.device] == l else None

        def fn():
            if journal is not None:
                journal.save(pos)
            blk.decode_rows(h, ids, pos, st, out=h)     # row i sees rows < i in the state: causal
        return fn

    def lm_head():
        model.logits_rows(h, out=bufs.logits)

    segs = pass_segments(model, bufs.device_buffers(), embed,
                         ({"pending": bufs.pending, "drafts": bufs.drafts}, {"ids": bufs.ids}),
                         layer, ("ids", "pos"), lm_head, {"logits": bufs.logits}, branches=True)
    segs.append(Segment("accept", hd, _accept_fn(bufs, params, model.binding.ops(hd)),
                        reads={"logits": bufs.logits, "drafts": bufs.drafts, "q": bufs.q,
                               "pos": bufs.pos, "limit": bufs.limit, "eos": bufs.eos,
                               "pending": bufs.pending},
                        writes={"y": bufs.y, "keep": bufs.keep, "record": bufs.record}))
    for i, (dev, journal) in enumerate(journals.items()):
        segs.append(Segment(f"rewind{i}", dev,
                            _rewind_fn(journal, bufs.pos_on[dev], bufs.keep_on[dev]),
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


def _accept_fn(bufs, params, ops):
    def fn():
        p = fixed(params)
        if (not isinstance(p, SamplingKnobs) and p.greedy and ops.accept_greedy(
                bufs.logits, bufs.drafts, bufs.limit, bufs.eos, bufs.pending,
                bufs.y, bufs.keep, bufs.record)):
            return              # greedy: one launch after the argmax (kernels.decode.accept)
        q = bufs.q if isinstance(p, SamplingKnobs) or not p.greedy else None
        y, keep = accept(bufs.logits, bufs.drafts, q, bufs.pos,
                         params, bufs.limit, bufs.eos, bufs.pending)
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
        logits = model.draft_logits(bufs.hm.index_select(0, keep))
        next_draft(model, bufs, params, logits, y.index_select(0, keep), pos + keep + 1)
    return fn


def next_draft(model, bufs: SpecBuffers, params: SamplingParams, logits: torch.Tensor,
               pending: torch.Tensor, pos: torch.Tensor) -> None:
    """The pending token [1] at pos ([1] int64) and the MTP logits [V] of the row before it ->
    the buffers' pending, pos, draft (the oracle's, when on) and q. Capture-safe."""
    set_draft(model, bufs, params, logits, pos)
    bufs.pending.copy_(pending)
    bufs.pos.copy_(pos)


def set_draft(model, bufs: SpecBuffers, params: SamplingParams, logits: torch.Tensor,
              pos: torch.Tensor) -> None:
    """The MTP logits [V] of the row before the pending token's position pos ([1] int64) -> the
    buffers' draft (the oracle's, when on) and q. Capture-safe."""
    d, q = draft(logits, pos, params)
    bufs.drafts.copy_(oracle_draft(d, pos + 1, bufs.oracle, bufs.oracle_on))
    if q is not None:
        bufs.q[0].copy_(q)


def plain_segments(model: Transformer, bufs: SpecBuffers, plain: DecodeBuffers, params
                   ) -> tuple[Segment, Segment]:
    """The segments that keep the MTP block along a plain decode step (dsv4.runtime.passes): `follow`
    (after the step: the MTP block reads the step's row at pos - 1, its hidden stream and the
    token it chose, exactly as row 0 of a speculative step does; the pending token and position
    move to `bufs`) and `mtp_draft` (when speculation resumes: the MTP logits of that row -> the
    draft of the token after the pending one). Capture-safe."""
    mtp, hd = model.mtp, model.head_device
    h = plain.h[hd]

    def follow():
        pos = plain.pos - 1
        mtp.decode_rows(h, model.embed.index_select(0, plain.token), plain.token, pos,
                        out=bufs.hm[:1])
        bufs.pending.copy_(plain.token)
        bufs.pos.copy_(plain.pos)

    def redraft():
        set_draft(model, bufs, params, model.draft_logits(bufs.hm[:1]), bufs.pos)

    return (Segment("mtp_follow", hd, follow,
                    reads={"h": h, "token": plain.token, "ppos": plain.pos},
                    writes={"hm": bufs.hm, "pending": bufs.pending, "pos": bufs.pos}),
            Segment("mtp_draft", hd, redraft, reads={"hm": bufs.hm, "pos": bufs.pos},
                    writes={"drafts": bufs.drafts, "q": bufs.q}))


def device_journals(model: Transformer, T: int) -> dict:
    """{device: the journal of its layers} for a pass of T rows: one save and one rewind launch a
    device (the save in the device's first layer, before any of its layers writes)."""
    states: dict = {}
    for blk, st in zip(model.layers, model.states):
        states.setdefault(blk.device, []).append((st, blk.ratio))
    return {dev: Journal(sts, model.cfg.window_size, T, model.binding.ops(dev))
            for dev, sts in states.items()}


def verify_decoder(model: Transformer, k: int, mode: str, granularity: str = "segment"
                   ) -> tuple[CUDAGraphDecoder, SpecBuffers]:
    """Benchmarks: the verify pass of T = k + 1 rows (greedy), accept and rewind included, as a
    decoder of its own (allocated; warm up and capture it for graph mode). Its static inputs are
    those of a step at pos 1 with drafts 0; each step leaves the state as it found it when
    the drafts are rejected."""
    bufs = SpecBuffers.allocate(model, k)
    dec = CUDAGraphDecoder(build_spec_segments(model, bufs, SamplingParams(),
                                               device_journals(model, k + 1), None),
                           inputs={"pending": bufs.pending, "pos": bufs.pos,
                                   "drafts": bufs.drafts, "q": bufs.q, "limit": bufs.limit,
                                   "eos": bufs.eos},
                           outputs={"record": bufs.record}, mode=mode, granularity=granularity,
                           reset_fn=model.reset, nvtx_domain="dsv4-verify")
    dec.allocate()
    return dec, bufs


class SpecStep:
    """The speculative step of one model (K = 1) over a graphs.CUDAGraphDecoder: `start` after a
    prefill that the MTP block followed, then `step` until the output is complete. With `plain`
    (the session's plain decoder and its buffers), a SpecPolicy picks each step: speculative, or
    plain with the MTP block following (two one-segment decoders of plain_segments), so drafts
    that are seldom accepted cost little; without it every step speculates."""

    def __init__(self, model: Transformer, params: SamplingParams | SamplingKnobs, k: int = 1, *,
                 plain: tuple[CUDAGraphDecoder, DecodeBuffers] | None = None,
                 min_acceptance: float = DEFAULT_MIN_ACCEPTANCE,
                 mode: str = "eager", granularity: str = "segment", reset_fn=None,
                 debug: bool = False, nvtx_domain: str = "dsv4-spec", fix_hints=()):
        if model.mtp is None:
            raise ConfigError("speculative decoding needs the MTP block: build the model with "
                              "RuntimeConfig(mtp=True) on a checkpoint with "
                              "num_nextn_predict_layers >= 1")
        if k != 1:
            raise ConfigError(f"speculative = {k}: only 1 draft token per step is implemented "
                              f"(0 = off)")
        self.model, self.params, self.k = model, params, k
        model.ensure_draft_head()       # before any step is captured (its address is fixed)
        self.policy = SpecPolicy(min_acceptance if plain is not None else 0.0)
        T = k + 1
        self.bufs = SpecBuffers.allocate(model, k)
        self.journals = device_journals(model, T)
        self.mtp_journal = Journal([(model.mtp.state, model.mtp.block.ratio)],
                                   model.cfg.window_size, T, model.binding.ops(model.head_device))
        b = self.bufs
        segs = build_spec_segments(model, b, params, self.journals, self.mtp_journal)
        kw = dict(mode=mode, granularity=granularity, reset_fn=reset_fn or model.reset,
                  debug=debug, nvtx_domain=nvtx_domain,
                  **({"fix_hints": tuple(fix_hints)} if fix_hints else {}))
        self.decoder = CUDAGraphDecoder(
            segs, inputs={"pending": b.pending, "pos": b.pos, "limit": b.limit, "eos": b.eos},
            outputs={"record": b.record, "logits": b.logits}, **kw)
        self.plain, self.follow, self.redraft = plain, None, None
        if plain is not None:
            pb = plain[1]
            follow, redraft = plain_segments(model, b, pb, params)
            self.follow = CUDAGraphDecoder(
                [follow], inputs={"h": pb.h[model.head_device], "token": pb.token,
                                  "ppos": pb.pos},
                outputs={"pending": b.pending}, **kw)
            self.redraft = CUDAGraphDecoder([redraft], inputs={"hm": b.hm, "pos": b.pos},
                                            outputs={"drafts": b.drafts}, **kw)
        for d in self.decoders():
            d.allocate()
        self.steps = self.spec_steps = self.proposed = self.accepted = 0
        # bufs.drafts hold the pending token's draft; else the last step was plain and the plain
        # buffers hold the pending token and its position
        self._drafted = False
        self._last = 0                  # rows of the last step's logits (spec > 0, plain 0)
        self._stop = (None, None)       # (limit, eos) as last written to bufs (set_stop)
        # two host slots: a step's output copy lands in its own while the next step runs
        self._slots = [_HostSlot(1 + T, model.head_device) for _ in range(2)]
        self._launched = 0              # steps launched (their index)
        self._done: list = []           # (index, accepted, proposed) not yet given to the policy

    def decoders(self) -> list[CUDAGraphDecoder]:
        return [d for d in (self.decoder, self.follow, self.redraft) if d is not None]

    def capture(self) -> None:
        for d in self.decoders():
            d.warmup()
            d.capture()

    def set_oracle(self, seq, a: float) -> None:
        """Tests / benchmarks: draft seq[p] at position p with probability a (a < 0: off)."""
        b = self.bufs
        b.oracle_on.fill_(a >= 0)
        if a >= 0:
            s = torch.zeros_like(b.oracle)
            got = torch.as_tensor(list(seq)[:s.shape[0]], dtype=torch.int64)
            s[:got.shape[0]].copy_(got)
            b.oracle.copy_(oracle_table(s, a, self.model.cfg.vocab_size))

    def reset(self) -> None:
        self.bufs.reset()
        self.policy.reset()
        self._done.clear()
        self._drafted = False
        self._stop = (None, None)

    def set_stop(self, limit: int, eos_id: int | None) -> None:
        """The next steps' output cap (limit >= 1 tokens) and EOS (None: none) in bufs, each
        written only when it changes: accept reads limit only as limit - 1 against at most K
        accepted drafts, so every limit >= T is T, and a request's EOS stays. Most steps then
        launch no fill between the host's read and the step's first graph."""
        limit, eos = min(limit, self.k + 1), -1 if eos_id is None else eos_id
        if limit != self._stop[0]:
            self.bufs.limit.fill_(limit)
        if eos != self._stop[1]:
            self.bufs.eos.fill_(eos)
        self._stop = (limit, eos)

    def start(self, token: torch.Tensor, pos: int) -> None:
        """The token [1] chosen at pos - 1 (after a prefill that the MTP block followed): the MTP
        block reads its waiting row with it and drafts the next token. Eager (once per
        generate)."""
        m = self.model
        next_draft(m, self.bufs, self.params, m.mtp_follow_token(token, draft=True), token,
                   torch.tensor([pos], dtype=torch.int64, device=m.head_device))
        self._drafted = True

    def step(self, limit: int, eos_id: int | None) -> list[int]:
        """One step, speculative or plain as the policy says (plain, when there is a plain
        decoder, where only one more token is wanted); -> its output tokens (1 .. min(limit, T);
        the last one is the new pending token, not fed). Waits for the device (the output
        decides the next step's limit)."""
        return self.finish(self.launch(limit, eos_id))

    def launch(self, limit: int, eos_id: int | None) -> "Launched":
        """Launch one step (as step) without waiting for it; its output's copy to the host is
        queued behind it. Another step may be launched before finish() reads this one: it feeds
        this one's last output token (the device's pending), and its limit must hold whatever
        this one outputs. If this one ends the output at eos_id, that step keeps its row 0 only
        (verify.accept): the state then holds the EOS fed, as after plain decoding's one-late
        step. The policy's choice of each step's kind sees the steps finished two launches
        before (the same choices however the host interleaves launches and reads)."""
        self._launched += 1
        while self._done and self._done[0][0] <= self._launched - 2:
            _, accepted, proposed = self._done.pop(0)
            self.policy.spec_step(accepted, proposed)
        self.steps += 1
        slot = self._slots[self._launched % len(self._slots)]
        if self.plain is None or (limit > 1 and self.policy.speculate()):
            return self._speculative_launch(limit, eos_id, slot)
        return self._plain_launch(slot)

    def finish(self, run: "Launched") -> list[int]:
        """Wait for a launched step -> its output tokens (as step's); counts its drafts."""
        rec = run.read()
        if not run.speculative:
            self._last = 0
            return rec[:1]
        n = rec[0]
        self.spec_steps += 1
        self.proposed += run.proposed
        self.accepted += n - 1
        self._done.append((run.index, n - 1, run.proposed))
        self._last = n
        return rec[1:1 + n]

    def abandon(self, run: "Launched") -> None:
        """A launched step that followed the end of the output (its pending token the EOS: it fed
        that token and kept nothing else): wait for it; neither its tokens nor its drafts
        count."""
        run.read()
        self.steps -= 1

    def settle(self) -> None:
        """The end of a generate(): the policy takes every finished step's drafts."""
        for _, accepted, proposed in self._done:
            self.policy.spec_step(accepted, proposed)
        self._done.clear()

    def logits(self) -> torch.Tensor:
        """The main logits [n, V] of the last step's output tokens (views of static buffers)."""
        if self._last == 0:
            return self.plain[1].logits[None]
        return self.bufs.logits[:self._last]

    def _speculative_launch(self, limit: int, eos_id: int | None, slot) -> "Launched":
        b = self.bufs
        if not self._drafted:           # after plain steps: draft from the MTP block's last row
            self.redraft.step()
        self.set_stop(limit, eos_id)
        self.decoder.step()
        self._drafted = True
        return Launched(self._launched, True, min(self.k, limit - 1), *slot.queue(b.record))

    def _plain_launch(self, slot) -> "Launched":
        if self.plain is None:
            raise ConfigError("a plain step needs the session's plain decoder (SpecStep(plain=))")
        dec, pb = self.plain
        b = self.bufs
        if self._drafted:               # after a speculative step (or start): the plain step
            pb.token.copy_(b.pending)   # feeds the pending token at its position (after a plain
            pb.pos.copy_(b.pos)         # step its sample segment left them there)
        dec.step()
        self.follow.step()              # the MTP block reads the row; pending and pos move on
        self._drafted = False
        self.policy.plain_step()
        return Launched(self._launched, False, 0, *slot.queue(b.pending))

    def close(self) -> None:
        for d in self.decoders():
            d.close()


class _HostSlot:
    """A pinned host buffer (CUDA) a step's output is copied into, with the event that says the
    copy is done."""

    def __init__(self, n: int, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=self.cuda)

    def queue(self, t: torch.Tensor) -> tuple:
        """Queue the copy of t [n] int64 (on the stream the steps run on) -> (host view, event or
        None)."""
        host = self.host[:t.shape[0]]
        if not self.cuda:
            host.copy_(t)
            return host, None
        with torch.cuda.device(self.device):
            host.copy_(t, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
        return host, ev


@dataclass
class Launched:
    """A launched step (SpecStep.launch): its index, kind, drafts proposed, and its output's host
    copy with the event that says it landed."""
    index: int
    speculative: bool
    proposed: int
    host: torch.Tensor
    event: object = None

    def read(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
