"""CUDA graphs of short prefill chunks: a prompt of a few hundred tokens is host-bound in eager mode
(~100 launches per layer issued from Python), so its chunks replay from graphs instead.

One `graphs.CUDAGraphDecoder` per chunk size S (the powers of two up to `max_rows`), each a
sequence of segments: `embed` (ids [S] -> h) -> `layer{l}` (Block.prefill at a device start, on
the layer's device) -> `lm_head` (the last row's logits). A prompt is fed as max_rows-sized
pieces, then the binary decomposition of the rest, largest piece first, each piece at the
position the previous one reached: chunked prefill at any position is exact, so the state and
logits equal Transformer.prefill's. Every replay costs a fixed part (the prefill GEMMs read all
weights even for a few rows), so a rest of many pieces can be slower than one eager chunk:
building times each size eagerly and replayed, and `plan` replays a piece only where the
measured replays beat the eager chunk. Long chunks gain too: a 4,096-token Flash chunk issues
~7,700 launches, about as long on the host as on the device. Capturing runs every size eagerly
and resets the model: build before the first sequence (Session does, with
RuntimeConfig.prefill_graphs).
"""
from __future__ import annotations

import time

import torch

from graphs import CUDAGraphDecoder, Segment

from .errors import ConfigError

FIX_HINTS = ("lower RuntimeConfig.prefill_graphs (fewer and smaller chunk graphs)",
             "RuntimeConfig.prefill_graphs = 0")


def chunk_sizes(max_rows: int) -> list[int]:
    """The graph chunk sizes for max_rows (a power of two): 1, 2, 4, ..., max_rows."""
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1 \
            or max_rows & (max_rows - 1):
        raise ConfigError(f"prefill_graphs = {max_rows!r}; expected 0 (off) or a power of two")
    return [1 << i for i in range(max_rows.bit_length())]


def pieces(n: int, max_rows: int) -> list[int]:
    """n tokens as graph chunks: max_rows-sized ones, then the binary decomposition of the rest
    (largest first)."""
    out = [max_rows] * (n // max_rows)
    rest = n % max_rows
    out += [1 << i for i in range(rest.bit_length() - 1, -1, -1) if rest >> i & 1]
    return out


def graphs_pay(n: int, max_rows: int, replay_ms: dict, eager_ms: dict) -> bool:
    """Whether n tokens replay faster as graph pieces than as one eager chunk, by the measured
    times per chunk size (eager: that of the smallest size >= n; longer prompts: the largest)."""
    eager = eager_ms[min([S for S in eager_ms if S >= n], default=max_rows)]
    return sum(replay_ms[S] for S in pieces(n, max_rows)) < eager


def _timed(fn, devices) -> float:
    """Host wall time of fn() in ms, the devices synchronized before and after (build time only)."""
    for d in devices:
        torch.cuda.synchronize(d)
    t = time.perf_counter()
    fn()
    for d in devices:
        torch.cuda.synchronize(d)
    return 1e3 * (time.perf_counter() - t)


class _ChunkGraphs:
    """The captured prefill of one chunk size S: static ids [S] and start [1] on the head device,
    hidden rows [S, c, D] per layer device, logits [V] of the last row."""

    def __init__(self, model, S: int, nvtx_domain: str):
        cfg, hd = model.cfg, model.head_device
        self.S = S
        self.ids = torch.zeros(S, dtype=torch.int64, device=hd)
        self.start = torch.zeros(1, dtype=torch.int64, device=hd)
        self.logits = torch.zeros(cfg.vocab_size, dtype=torch.float32, device=hd)
        h, ids_on, start_on = {}, {}, {}
        for dev in [hd] + model.placement:
            if dev not in h:
                h[dev] = torch.zeros(S, cfg.hc_mult, cfg.dim, dtype=model.act, device=dev)
                ids_on[dev] = self.ids if dev == hd else torch.zeros_like(self.ids, device=dev)
                start_on[dev] = self.start if dev == hd else torch.zeros_like(self.start,
                                                                              device=dev)
        segs = [Segment("embed", hd, _embed_fn(model, self.ids, h[hd]),
                        reads={"ids": self.ids}, writes={"h": h[hd]})]
        for l, (blk, st) in enumerate(zip(model.layers, model.states)):
            dev = blk.device
            segs.append(Segment(f"layer{l}", dev,
                                _layer_fn(blk, st, h[dev], ids_on[dev], start_on[dev]),
                                reads={"h": h[dev], "ids": ids_on[dev], "start": start_on[dev]},
                                writes={"h": h[dev]}))
        segs.append(Segment("lm_head", hd, _head_fn(model, h[hd], self.logits),
                            reads={"h": h[hd]}, writes={"logits": self.logits}))
        self.decoder = CUDAGraphDecoder(segs, inputs={"ids": self.ids, "start": self.start},
                                        outputs={"logits": self.logits}, mode="graph",
                                        warmup_iters=1, reset_fn=model.reset,
                                        nvtx_domain=nvtx_domain, fix_hints=FIX_HINTS)
        self.decoder.allocate()
        # time on random tokens: identical ones would route every row to the same few experts
        gen = torch.Generator(device=hd).manual_seed(S)
        torch.randint(0, cfg.vocab_size, (S,), generator=gen, device=hd, out=self.ids)
        self.decoder.warmup()                 # compiles the kernels of this size
        devs = list(dict.fromkeys([hd] + model.placement))

        def eager():                          # Transformer.prefill's eager chunk at position 0
            model.logits(model._prefill_chunk(self.ids, 0)[-1:].to(hd))
        model.reset()
        eager()                               # its host-shaped kernels compiled too
        model.reset()
        self.eager_ms = _timed(eager, devs)   # one eager chunk, warm (its start a host int:
        self.decoder.capture()                # cache entries past the chunk are not scanned)
        self.replay_ms = _timed(self.decoder.step, devs)
        model.reset()


class PrefillGraphs:
    """Captured prefill chunks of 1, 2, 4, ..., max_rows tokens for one model (CUDA only).

    Attach with `model.prefill_graphs = PrefillGraphs(model, n)`: Transformer.prefill then feeds
    prompts through them where `plan` says the replays beat the eager chunks (prefills that the
    MTP block follows, and prompts longer than `max_prompt` when given, stay eager)."""

    def __init__(self, model, max_rows: int, max_prompt: int | None = None,
                 nvtx_domain: str = "dsv4-prefill"):
        if model.head_device.type != "cuda":
            raise ConfigError("prefill graphs need CUDA devices (the model is on "
                              f"{model.head_device}); use prefill_graphs = 0")
        self.max_rows = max_rows
        self.max_prompt = max_prompt
        t = time.perf_counter()
        with torch.inference_mode():
            self.chunks = {S: _ChunkGraphs(model, S, nvtx_domain) for S in chunk_sizes(max_rows)}
        self.capture_s = time.perf_counter() - t
        self.replay_ms = {S: c.replay_ms for S, c in self.chunks.items()}
        self.eager_ms = {S: c.eager_ms for S, c in self.chunks.items()}

    def plan(self, n: int, chunk: int | None = None) -> list[tuple[int, bool]]:
        """n tokens as pieces [(rows, replayed)] in order, by the times measured when built:
        pieces of `cap` rows (the largest captured size <= chunk, default max_rows) replay where
        their replay beat the eager chunk; the rest (< cap) replays as its binary pieces where
        together they beat one eager chunk of it, else stays one eager piece. Beyond
        max_prompt: all eager."""
        cap = self.max_rows if chunk is None else min(self.max_rows, 1 << (chunk.bit_length() - 1))
        if self.max_prompt is not None and n > self.max_prompt:
            return [(n, False)]
        full, rest = divmod(n, cap)
        out = [(cap, self.replay_ms[cap] < self.eager_ms[cap])] * full
        if rest:
            if graphs_pay(rest, cap, self.replay_ms, self.eager_ms):
                out += [(S, True) for S in pieces(rest, cap)]
            else:
                out.append((rest, False))
        merged: list[tuple[int, bool]] = []       # neighbouring eager pieces: one
        for rows, graphed in out:
            if merged and not graphed and not merged[-1][1]:
                merged[-1] = (merged[-1][0] + rows, False)
            else:
                merged.append((rows, graphed))
        return merged

    def covers(self, n: int, chunk: int | None = None) -> bool:
        """Whether any of n tokens replays chunk graphs (plan)."""
        return any(graphed for _, graphed in self.plan(n, chunk))

    def graph_bytes(self) -> int:
        return sum(sum(c.decoder.graph_bytes.values()) for c in self.chunks.values())

    def replay(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Feed ids [S] (S a captured size, head device) at positions start.. -> the last
        position's logits [V] f32 (the graph's output buffer: the next replay overwrites it).
        No host sync."""
        return self.chunks[ids.shape[0]].decoder.step(ids=ids, start=start)["logits"]

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Feed ids [n] (head device) at positions start.. through the chunk graphs (pieces,
        whatever plan says) -> the last position's logits [V] f32 (a new tensor). No host sync."""
        pos, out = start, None
        for S in pieces(ids.shape[0], self.max_rows):
            out = self.replay(ids[pos - start:pos - start + S], pos)
            pos += S
        return out.clone()


def _embed_fn(model, ids, h):
    def fn():
        h.copy_(model.embed_tokens(ids))
    return fn


def _layer_fn(blk, st, h, ids, start):
    def fn():
        h.copy_(blk.prefill(h, ids, st, start))
    return fn


def _head_fn(model, h, logits):
    def fn():
        logits.copy_(model.logits(h[-1:]))
    return fn
