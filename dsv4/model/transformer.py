"""The DSV4 transformer for batch-1 decoding: embedding -> blocks -> hc_head/norm/head logits.

Weights stay in their stored formats on the device that owns their layer; all decode state is
preallocated at the cache capacity. `prefill` feeds a prompt (or the next tokens of a sequence) in
eager chunks at any position; a decode step is a pass of the runtime (dsv4.runtime.passes) over
each block's capture-safe `decode`, and `logits` / `logits_rows` its head. The torch math runs
until the backend binds each sublayer's implementation (the runtime's build_model does).
Legend: s = tokens, c = hc_mult, D = dim, V = vocab.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Sequence

import torch

from ..errors import CapacityError, ConfigError
from ..numerics.mhc import hc_head, rms_norm
from ..numerics.quant import hadamard_matrix
from ..weights.config import ModelConfig
from ..weights.formats import FP8_BLOCK, quantize_fp8_weight
from ..weights.parts import Part
from .block import Block
from .linear import Linear
from .sharding import rank_place
from .state import LayerState

HEAD_CHUNK = 16384  # vocab rows per float32 head matmul (bounds the transient of the fp32 copy)
PROGRESS_CHUNKS = 4   # a prefill of at least this many chunks shows a progress bar (if asked)


class Transformer:
    """Weights + state of the whole model. Build (dsv4.runtime.build_model: this and the backend's
    binding), then `load(source)`, then prefill / decode passes.

    rt: the runtime knobs (dsv4.runtime.RuntimeConfig: max_seq_len, dtype, devices, mtp,
    cache_dense, prefill_chunk, tp). Bound ops (the torch reference below until the backend binds
    kernels): `head_in_rows` (head_in_rows_reference) and `head_matmul` (head_matmul_reference).
    `binding`: what the backend decided (dsv4/backend/binding.py; None before).
    comm: with rt.tp > 1, this rank's communicator (dsv4.parallel.Communicator): the model is
    then the rank's shard (dsv4.model.sharding; `tp` its place, None in one process), its head
    this rank's vocabulary rows, and `parts()` says which slice of each tensor it holds."""

    def __init__(self, cfg: ModelConfig, rt, placement: Sequence | None = None, comm=None):
        self.cfg, self.rt = cfg, rt
        self.act = rt.dtype
        self.head_device = rt.devices[0]
        self.placement = [torch.device(d) for d in (placement or [rt.devices[0]] * cfg.n_layers)]
        if len(self.placement) != cfg.n_layers:
            raise ConfigError(f"placement has {len(self.placement)} entries; expected n_layers = "
                              f"{cfg.n_layers}")
        self.tp = rank_place(cfg, rt.tp, comm, self.devices)
        # tensor parallel: a prefill chunk's mHC split by rows over the ranks where they split
        # evenly (seq_rows; the backend's switch, DSV4_SEQ_PARALLEL, may turn it off at binding)
        self.seq_parallel = True
        self.binding = None
        self.head_in_rows = self.head_in_rows_reference
        self.head_matmul = self.head_matmul_reference
        # the head's e4m3 copy the MTP block drafts from (ensure_draft_head), and its matmul
        self.draft_head: Linear | None = None
        self.draft_matmul = self.draft_matmul_reference
        hdev = self.head_device
        D, V = cfg.dim, cfg.vocab_size
        v0, v1 = self.tp.vocab_rows(V) if self.tp else (0, V)   # the head's rows held here
        self.embed = torch.empty(V, D, dtype=torch.bfloat16, device=hdev)
        self.head = torch.empty(v1 - v0, D, dtype=torch.bfloat16, device=hdev)
        self.norm = torch.empty(D, dtype=torch.float32, device=hdev)
        self.hc_head = {"hc_head_fn": torch.empty(cfg.hc_mult, cfg.hc_mult * D, dtype=torch.float32,
                                                  device=hdev),
                        "hc_head_base": torch.empty(cfg.hc_mult, dtype=torch.float32, device=hdev),
                        "hc_head_scale": torch.empty(1, dtype=torch.float32, device=hdev)}
        had = {}
        self.layers: list[Block] = []
        self.states: list[LayerState] = []
        for l, dev in enumerate(self.placement):
            if dev not in had:
                had[dev] = hadamard_matrix(cfg.index_head_dim, dev)
            self.layers.append(Block(cfg, l, dev, had[dev], self.tp))
            self.states.append(LayerState.allocate(cfg, cfg.ratio(l), rt.max_seq_len, self.act, dev))
        self.mtp = None                    # the MTP block on the head device (rt.mtp)
        if rt.mtp:
            if cfg.dspark is not None:
                raise ConfigError("RuntimeConfig(mtp=True) on a DSpark checkpoint: its draft "
                                  "module is not an MTP block, and DSpark drafting is not "
                                  "supported yet; use mtp=False (plain decoding)")
            if cfg.n_mtp_layers < 1:
                raise ConfigError("RuntimeConfig(mtp=True) but the checkpoint has no MTP block "
                                  "(num_nextn_predict_layers = 0); use mtp=False")
            from .mtp import MTPBlock
            had.setdefault(hdev, hadamard_matrix(cfg.index_head_dim, hdev))
            self.mtp = MTPBlock(cfg, 0, hdev, rt.max_seq_len, self.act, had[hdev], self.tp)
        # the MTP block's rows follow the main model's by one (row t needs token t+1): it has read
        # positions < mtp_len; h_last = the main hidden stream of position mtp_len when pending
        self.mtp_len, self.h_last = 0, None
        # the runtime's captured prefill chunks of this model (dsv4.runtime.prefill_graphs), kept
        # here so that every session on it replays them; the model never reads it
        self.prefill_graphs = None

    @property
    def devices(self) -> list[torch.device]:
        """The head device first, then each other layer device in order."""
        return list(dict.fromkeys([self.head_device, *self.placement]))

    # ---- weights -----------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """Checkpoint name -> destination tensor for every weight the runtime holds (the MTP
        block's only with rt.mtp)."""
        d = {"embed.weight": self.embed, "head.weight": self.head, "norm.weight": self.norm}
        d.update(self.hc_head)
        for l, blk in enumerate(self.layers):
            d.update(blk.tensors(f"layers.{l}"))
        if self.mtp is not None:
            d.update(self.mtp.tensors())
        return d

    def parts(self) -> dict[str, Part]:
        """Checkpoint name -> the Part of it (dsv4.weights.parts) its destination in tensors()
        holds, for each one that holds a slice: a tensor-parallel rank's shard ({} in one
        process; the names absent here are held whole)."""
        if self.tp is None:
            return {}
        d = {"head.weight": Part(0, *self.tp.vocab_rows(self.cfg.vocab_size))}
        for l, blk in enumerate(self.layers):
            d.update(blk.parts(f"layers.{l}"))
        if self.mtp is not None:
            d.update(self.mtp.parts())
        return d

    def load(self, source, progress: bool | None = None) -> None:
        """Fill every weight from `source` (a Checkpoint, or anything with get/load_into); a
        tensor-parallel rank reads only its parts of the sliced tensors (load_into's part=); only
        rank 0 shows the progress bar unless asked (one bar, not one a rank interleaved)."""
        items, parts = list(self.tensors().items()), self.parts()
        if progress is None and self.tp is not None and self.tp.rank != 0:
            progress = False
        if hasattr(source, "load_many"):
            source.load_many(items, desc="load", progress=progress,
                             **({"parts": parts} if parts else {}))
        else:
            for name, dst in items:
                source.load_into(name, dst, **({"part": parts[name]} if name in parts else {}))
        self._reset_dense_caches()
        if self.draft_head is not None:          # in place: captured steps keep its address
            self._fill_draft_head()

    def _reset_dense_caches(self) -> None:
        """On the CPU, keep dequantized weights (op overhead, not bytes, bounds small models there);
        on GPUs weights stay in their stored formats and are dequantized on use."""
        on = self._dense_on()
        for blk in self.layers:
            for w in blk.weights():
                w.dense_cache = {} if on else None
        if self.mtp is not None:
            for w in self.mtp.weights():
                w.dense_cache = {} if on else None

    def _dense_on(self) -> bool:
        return self.rt.cache_dense if self.rt.cache_dense is not None else all(
            d.type == "cpu" for d in self.rt.devices)

    def weight_bytes(self, layer: int | None = None) -> int:
        tensors = self.layers[layer].tensors("") if layer is not None else self.tensors()
        return sum(t.numel() * t.element_size() for t in tensors.values())

    # ---- pieces shared by prefill and decode -------------------------------------------------
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [s] int64 -> h [s, c, D] (the embedding repeated hc_mult times), act dtype."""
        h = self.embed.index_select(0, ids).to(self.act)
        return h.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()

    def head_in_rows_reference(self, h: torch.Tensor, head: tuple | None = None) -> torch.Tensor:
        """h [T, c, D] -> the head's input [T, D] float32 (hc_head, final norm), row by row.
        head: (hc_head_* tensors, norm) other than the model's (the MTP block's)."""
        cfg = self.cfg
        hc_t, norm = head if head is not None else (self.hc_head, self.norm)
        hc = (hc_t["hc_head_fn"], hc_t["hc_head_scale"], hc_t["hc_head_base"])
        return torch.cat([rms_norm(hc_head(h[t:t + 1], *hc, cfg.norm_eps, cfg.hc_eps), norm,
                                   cfg.norm_eps).to(torch.float32) for t in range(h.shape[0])])

    def head_matmul_reference(self, x: torch.Tensor, out: torch.Tensor | None = None
                              ) -> torch.Tensor:
        """x [T, D] float32 -> logits [T, Vh] float32 of the head's Vh rows held here (all V in
        one process): the bf16 head in float32, row by row, in pieces of HEAD_CHUNK vocabulary
        rows (bounds the transient of the float32 copy)."""
        rows = self.head.shape[0]
        if out is None:
            out = torch.empty(x.shape[0], rows, dtype=torch.float32, device=x.device)
        for t in range(x.shape[0]):
            out[t].copy_(torch.cat([self.head[i:i + HEAD_CHUNK].to(torch.float32) @ x[t]
                                    for i in range(0, rows, HEAD_CHUNK)]))
        return out

    def vocab_logits(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The head's input x [T, D] float32 -> logits [T, V] float32 (into out if given): the
        head's rows; a tensor-parallel rank computes its vocabulary rows and all-gathers the
        others', so every rank holds every logit (the same bits everywhere)."""
        if self.tp is None:
            return self.head_matmul(x, out)
        return self.tp.gather(self.head_matmul(x), self.cfg.vocab_size, out)

    def logits(self, h: torch.Tensor, head: tuple | None = None) -> torch.Tensor:
        """h [1, c, D] (last position) -> logits [V] f32 (hc_head, final norm, head in fp32).
        head: (hc_head_* tensors, norm) other than the model's (the MTP block's)."""
        return self.vocab_logits(self.head_in_rows(h, head))[0]

    def ensure_draft_head(self) -> None:
        """Before a speculative step is built: the e4m3 copy of the head (128x128 ue8m0 scales,
        the checkpoint's FP8 format) that the MTP block drafts from, half the bf16 head's bytes,
        where the backend's switch has it (Options.draft_fp8, DSV4_DRAFT_FP8) and the head's
        rows here split into 128x128 blocks. Made once; load() refills it in place. Drafts are
        proposals: the verify pass keeps the output exact whichever head drafts."""
        opts = self.binding.options if self.binding is not None else None
        if self.draft_head is not None or self.mtp is None or opts is None or not opts.draft_fp8:
            return
        rows, D = self.head.shape
        if rows % FP8_BLOCK or D % FP8_BLOCK:
            return
        self.draft_head = Linear(rows, D, "fp8", self.head_device)
        self._fill_draft_head()

    def _fill_draft_head(self) -> None:
        w, step = self.draft_head, 64 * FP8_BLOCK         # rows a piece (bounds the float32 copy)
        for i in range(0, w.out_features, step):
            q, s = quantize_fp8_weight(self.head[i:i + step])
            w.weight[i:i + step].copy_(q)
            w.scale[i // FP8_BLOCK:(i + step) // FP8_BLOCK].copy_(s)
        w.dense_cache = {} if self._dense_on() else None  # the CPU keeps it dequantized

    def draft_matmul_reference(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, D] float32 -> [1, Vh] float32 through the e4m3 head: W8A8 (x to e4m3 per 128,
        as the FP8 linears), float32 accumulation."""
        return self.draft_head.reference(x, torch.float32)

    def draft_logits(self, hm: torch.Tensor) -> torch.Tensor:
        """The MTP block's row hm [1, c, D] -> its logits [V] float32 as drafting takes them:
        through the head's e4m3 copy where there is one (ensure_draft_head), else the MTP head's
        logits (logits(hm, head=mtp.head())). Capture-safe."""
        if self.draft_head is None:
            return self.logits(hm, head=self.mtp.head())
        y = self.draft_matmul(self.head_in_rows(hm, self.mtp.head()))
        return (y if self.tp is None else self.tp.gather(y, self.cfg.vocab_size))[0]

    def logits_rows(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """h [T, c, D] (decode rows) -> logits [T, V] float32, row t with the bits of
        logits(h[t:t+1]) (bound kernels read the head once for all rows)."""
        return self.vocab_logits(self.head_in_rows(h), out)

    def reset(self) -> None:
        """Start a new sequence (all layer state back to its fill values, in place)."""
        for st in self.states:
            st.reset()
        if self.mtp is not None:
            self.mtp.reset()
        self.mtp_len, self.h_last = 0, None

    def check_capacity(self, n_prompt: int, n_new: int) -> None:
        cap = self.rt.max_seq_len
        if n_prompt + n_new > cap:
            raise CapacityError(f"prompt ({n_prompt} tokens) + max_new_tokens ({n_new}) = "
                                f"{n_prompt + n_new} exceeds the cache capacity {cap}; raise "
                                f"RuntimeConfig.max_seq_len to at least {n_prompt + n_new} or "
                                f"lower max_new_tokens")

    # ---- prefill -----------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, start: int = 0, chunk: int | None = None,
                progress: bool = False, mtp: bool = False) -> torch.Tensor:
        """Feed ids [s] int64 at positions start..start+s-1 -> logits [V] f32 of the last one.

        start == 0 begins a new sequence (the state is reset); start > 0 continues the sequence
        whose positions 0..start-1 the state holds (a new chat turn, appended tokens): the state
        ends exactly as s decode steps would leave it. The tokens go through every layer `chunk`
        (default rt.prefill_chunk) at a time, so activation memory is bounded by the chunk, not
        the prompt; `progress` shows a bar on stderr when that takes PROGRESS_CHUNKS or more.
        mtp: the MTP block follows (reads every row whose next token is known: all but the
        last, which waits for the next token, see mtp_follow_token). May sync with the host.
        (A session replays captured chunks where they pay: dsv4.runtime.prefill.)"""
        chunk = self.check_prefill(ids.shape[0], start, chunk)
        if start == 0:
            self.reset()
        ids = ids.to(self.head_device)
        with progress_bar(ids.shape[0], chunk, progress) as bar:
            h = self.feed(ids, start, chunk, mtp, bar)
        return self.logits(h[-1:].to(self.head_device))

    def check_prefill(self, s: int, start: int, chunk: int | None) -> int:
        """The chunk of a prefill of s tokens at `start` (default rt.prefill_chunk), or the error
        naming the capacity or the chunk."""
        cap = self.rt.max_seq_len
        chunk = self.rt.prefill_chunk if chunk is None else chunk
        if s < 1 or start < 0 or start + s > cap:
            raise CapacityError(f"prefill of {s} tokens at position {start}: positions must stay in "
                                f"0..{cap - 1} (raise RuntimeConfig.max_seq_len to at least {start + s})")
        if chunk < 1:
            raise ConfigError(f"prefill chunk = {chunk}; expected a positive integer")
        return chunk

    def feed(self, ids: torch.Tensor, start: int, chunk: int, mtp: bool = False, bar=None
             ) -> torch.Tensor:
        """ids [s] (head device) at positions start.. in chunks of `chunk` rows through every layer
        (the MTP block following, with mtp) -> the last chunk's h [n, c, D] (its last layer's
        device). bar: a progress bar to advance (or None)."""
        h = None
        for c0 in range(start, start + ids.shape[0], chunk):
            piece = ids[c0 - start:c0 - start + chunk]
            h = self.prefill_chunk(piece, c0)
            if mtp:
                self._mtp_follow(h, piece, c0, ids[c0 - start + 1:c0 - start + chunk + 1])
            if bar is not None:
                bar.update(h.shape[0])
        return h

    def prefill_chunk(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """One chunk through every layer -> the last layer's h [s, c, D] (on its device). In
        tensor parallel with seq_rows(s) each rank runs its rows' mHC (Block.prefill's seq) and
        an all-gather gives every rank every row at the end."""
        shared: dict = {}                  # positions, window rows: computed once per chunk
        seq = self.seq_rows(ids.shape[0])
        r0, r1 = self.tp.split(ids.shape[0]) if seq else (0, ids.shape[0])
        h = self.run_layers(self.embed_tokens(ids[r0:r1]), (ids,),
                            lambda blk, st, h, ids: blk.prefill(h, ids, st, start, shared, seq))
        return self.tp.gather_rows(h) if seq else h

    def seq_rows(self, s: int) -> bool:
        """Whether a prefill chunk of s rows splits its mHC by rows over the tensor-parallel
        ranks (sequence parallel, Block.prefill's seq): tensor parallel, seq_parallel on, s a
        multiple of the ranks."""
        return self.tp is not None and self.seq_parallel and s % self.tp.world == 0

    def run_layers(self, h: torch.Tensor, inputs: tuple, layer) -> torch.Tensor:
        """The eager pass: h [rows, c, D] through every layer on its device, h and the `inputs`
        (tensors on one device) handed over where the device changes; layer(blk, st, h,
        *inputs) -> h. (The captured passes are one segment per layer: dsv4.runtime.passes.)"""
        on = {inputs[0].device: inputs}
        for blk, st in zip(self.layers, self.states):
            dev = blk.device
            if dev not in on:
                on[dev] = tuple(t.to(dev) for t in inputs)
            h = layer(blk, st, h.to(dev), *on[dev])
        return h

    # ---- one eager decode step (the reference of the runtime's captured step) ---------------
    @torch.inference_mode()
    def decode_hidden(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """decode_step without the head: -> the last layer's hidden stream [1, c, D]."""
        return self.run_layers(self.embed_tokens(token), (token, pos),
                               lambda blk, st, h, token, pos: blk.decode(h, token, pos, st))

    @torch.inference_mode()
    def decode_step(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One token: token, pos [1] int64 on the head device -> logits [V] f32. No host sync."""
        return self.logits(self.decode_hidden(token, pos).to(self.head_device))

    @torch.inference_mode()
    def hidden(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """ids [s] at positions start.. in one pass (causal within the rows) -> the last layer's
        hidden stream [s, c, D] (before hc_head), on the last layer's device; the state then
        holds positions < start + s (start == 0 resets it first)."""
        if start == 0:
            self.reset()
        return self.prefill_chunk(ids.to(self.head_device), start)

    # ---- the MTP block along the sequence ----------------------------------------------------
    def _mtp_follow(self, h: torch.Tensor, ids: torch.Tensor, pos0: int, nxt: torch.Tensor) -> None:
        """Main rows h [n, c, D] of ids at pos0.. were computed; nxt: the tokens after them that
        are known ([n] or [n-1]). The MTP block reads its rows up to the last known pair (first
        the row before pos0 if it waited for ids[0]); an unpaired last row waits in h_last."""
        hd = h.to(self.head_device)
        rows, toks, first = hd[:nxt.shape[0]], nxt, pos0
        if self.h_last is not None and self.mtp_len == pos0 - 1:
            rows, toks, first = torch.cat((self.h_last, rows)), torch.cat((ids[:1], nxt)), pos0 - 1
        elif self.mtp_len != pos0:
            raise ConfigError(f"the MTP block has read {self.mtp_len} positions of a sequence "
                              f"continued at {pos0}: it did not follow the tokens in between "
                              f"(start a new sequence)")
        if toks.shape[0]:
            self.mtp.prefill(rows, self.embed.index_select(0, toks), toks, first)
        self.mtp_len = first + toks.shape[0]
        self.h_last = hd[-1:] if self.mtp_len < pos0 + hd.shape[0] else None

    def mtp_follow_token(self, token: torch.Tensor, draft: bool = False) -> torch.Tensor:
        """The token after the waiting row (h_last) was chosen: token [1] -> the MTP logits [V]
        f32 of that row (the prediction of the token after `token`; draft: as drafting takes
        them, draft_logits)."""
        if self.h_last is None:
            raise ConfigError("no main row waits for the MTP block (prefill with mtp=True first)")
        hm = self.mtp.prefill(self.h_last, self.embed.index_select(0, token), token, self.mtp_len)
        self.mtp_len, self.h_last = self.mtp_len + 1, None
        return self.draft_logits(hm) if draft else self.logits(hm, head=self.mtp.head())

    def mtp_commit(self, length: int) -> None:
        """The MTP block has read positions < length (no row waits)."""
        self.mtp_len, self.h_last = length, None


@contextlib.contextmanager
def progress_bar(s: int, chunk: int, on: bool):
    """A progress bar on stderr for a prefill of s tokens in chunks of `chunk`, when asked (on) and
    it takes PROGRESS_CHUNKS or more; else None."""
    bar = None
    if on and -(-s // chunk) >= PROGRESS_CHUNKS:
        from tqdm import tqdm
        bar = tqdm(total=s, desc="prefill", unit="tok", file=sys.stderr, leave=False)
    try:
        yield bar
    finally:
        if bar is not None:
            bar.close()
