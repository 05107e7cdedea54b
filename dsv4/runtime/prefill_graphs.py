"""CUDA graphs of short prefill chunks: a prompt of a few hundred tokens is host-bound in eager mode
(~100 launches per layer issued from Python), so its chunks replay from graphs instead.

One `graphs.CUDAGraphDecoder` per chunk size S (the powers of two up to `max_rows`), each a
sequence of segments: `embed` (ids [S] -> h) -> `layer{l}` (Block.prefill at a device start, on
the layer's device) -> `lm_head` (the last row's logits). A prompt is fed as max_rows-sized
pieces, then the binary decomposition of the rest, largest piece first, each piece at the
position the previous one reached: chunked prefill at any position is exact, so the state and
logits equal Transformer.prefill's. Every replay costs a fixed part (the prefill GEMMs read all
weights even for a few rows), so pieces can be slower than the eager chunk they replace:
building times each size replayed and each eager chunk size up to the prefill chunk, and `plan`
replays pieces only where the measured replays beat the eager chunks they stand for (with
--prefill-graphs 512, a 4,096-token prompt replayed eight 512-row graphs in 574 ms where one
eager chunk took 208: issue 33). Long chunks can gain too: a 4,096-token Flash chunk issues
~7,700 launches, about as long on the host as on the device. Capturing runs every size eagerly
and resets the model: build before the first sequence (Session does, with
RuntimeConfig.prefill_graphs).
"""
from __future__ import annotations

import time

import torch

from graphs import BufferSpec, CUDAGraphDecoder

from ..errors import ConfigError
from .config import PREFILL_GRAPHS_EXPECTED, prefill_graphs_ok
from .passes import DeviceBuffers, pass_segments

# the plan weighs an eager chunk's build-time measurement by this much against the replays: an
# eager chunk's time is the host's issue in tensor parallel and moves between measurements (a
# TP2 4,096-row chunk of 8 Flash layers, 2x H200: 49.9 ms at build, 74.3 ms later in the same
# process; 44-61 ms across processes) where a replay's stays within ~2% (42.9 at build, 43.0 and
# 43.3 later). Eager is taken where it measured more than 10% faster.
EAGER_MARGIN = 1.1

FIX_HINTS = ("lower RuntimeConfig.prefill_graphs (fewer and smaller chunk graphs)",
             "RuntimeConfig.prefill_graphs = 0")


def chunk_sizes(max_rows: int) -> list[int]:
    """The graph chunk sizes for max_rows (a power of two): 1, 2, 4, ..., max_rows."""
    if not prefill_graphs_ok(max_rows) or max_rows < 1:
        raise ConfigError(f"prefill_graphs = {max_rows!r}; {PREFILL_GRAPHS_EXPECTED}")
    return [1 << i for i in range(max_rows.bit_length())]


def pieces(n: int, max_rows: int) -> list[int]:
    """n tokens as graph chunks: max_rows-sized ones, then the binary decomposition of the rest
    (largest first)."""
    out = [max_rows] * (n // max_rows)
    rest = n % max_rows
    out += [1 << i for i in range(rest.bit_length() - 1, -1, -1) if rest >> i & 1]
    return out


def eager_time(n: int, eager_ms: dict) -> float:
    """The measured time of one eager chunk of n rows: that of the smallest measured size >= n
    (an eager chunk costs no less with more rows), or past the largest, scaled from it."""
    above = [S for S in eager_ms if S >= n]
    if above:
        return eager_ms[min(above)]
    top = max(eager_ms)
    return eager_ms[top] * n / top


def eager_sizes(max_rows: int, limit: int) -> list[int]:
    """The eager chunk sizes a build times: the captured ones, then powers of two past them up
    to `limit` (the prefill chunk, at most the cache capacity: a prompt's eager alternative is
    chunks of it), and `limit` itself."""
    out = chunk_sizes(max_rows)
    while out[-1] * 2 < limit:
        out.append(out[-1] * 2)
    return out + [limit] if limit > out[-1] else out


def agreed_ms(times: dict[int, float], tp) -> dict[int, float]:
    """The build-time measurements {rows: ms} every rank plans by. A tensor-parallel rank times
    its own replays and eager chunks, but its pieces decide the shapes and the number of its
    all-reduces, so the ranks must plan the same pieces: each size gets the slowest rank's time
    (the ranks run every piece together, as fast as the slowest). One process (tp None): as
    measured. Collective (host-side, at build): every rank calls it with the same sizes."""
    if tp is None or tp.comm is None:
        return dict(times)
    every = tp.comm.group.all_gather_object(dict(times))
    sizes = set(times)
    if any(set(t) != sizes for t in every):
        raise ConfigError(f"prefill graphs: the ranks measured different chunk sizes "
                          f"({[sorted(t) for t in every]}); every rank needs the same "
                          f"prefill_graphs, prefill chunk and cache capacity")
    return {S: max(t[S] for t in every) for S in sorted(sizes)}


def capture_blocker(model) -> str | None:
    """Why a prefill chunk of this model cannot be captured (None: it can). A chunk keeps its
    start on the device only on the prefill kernels; the routed experts' torch reference
    (MoE.prefill_experts_reference, where the backend has no grouped-GEMM kernel for the
    shapes: `prefill.moe` off) reads on the host which experts got rows, and a host read inside
    a capture ends it ("operation failed due to a previous error during capture")."""
    why = {}
    for dev, be in model.binding.backends().items():
        if be.moe_prefill:
            continue
        if be.act != torch.bfloat16:
            act = str(be.act).replace("torch.", "")
            why[dev] = f"activations in {act} (the prefill kernels are bfloat16)"
        elif not be.rows:
            why[dev] = "the prefill kernels off on this device (no Triton, or switched off)"
        else:
            ranks = f" / {model.rt.tp} ranks" if model.rt.tp > 1 else ""
            why[dev] = (f"no grouped expert GEMM for moe_inter_dim {model.cfg.moe_inter_dim}"
                        f"{ranks}")
    if not why:
        return None
    reasons = "; ".join(f"{dev}: {w}" for dev, w in why.items())
    return (f"the prefill's routed experts run on their torch reference ({reasons}), which "
            f"reads the routing on the host: a chunk cannot be captured")


def _meet(model):
    """The ranks' meeting before a timed piece (None in one process): a tensor-parallel rank's
    chunk waits in its all-reduces for the slowest rank to arrive, which its own clock would
    count as the chunk's time."""
    tp = model.tp
    return None if tp is None or tp.comm is None else tp.comm.group.barrier


def _timed(fn, devices, meet=None) -> float:
    """Host wall time of fn() in ms, the devices synchronized before and after, and the ranks
    met (`meet`) before it starts (build time only)."""
    for d in devices:
        torch.cuda.synchronize(d)
    if meet is not None:
        meet()
        for d in devices:
            torch.cuda.synchronize(d)
    t = time.perf_counter()
    fn()
    for d in devices:
        torch.cuda.synchronize(d)
    return 1e3 * (time.perf_counter() - t)


class _ChunkGraphs:
    """The captured prefill of one chunk size S: static ids [S] and start [1] on the head device,
    hidden rows [S, c, D] per layer device, logits [V] of the last row. A tensor-parallel rank
    with model.seq_rows(S) keeps only its rows split(S) of the hidden rows up to date (the
    blocks' sequence-parallel prefill) and gathers the last row for the head."""

    def __init__(self, model, S: int, nvtx_domain: str):
        cfg, hd = model.cfg, model.head_device
        self.S = S
        bufs = DeviceBuffers.allocate(model, S, [BufferSpec("ids", (S,), torch.int64, hd, 0),
                                                 BufferSpec("start", (1,), torch.int64, hd, 0)])
        self.ids, self.start = bufs.head("ids"), bufs.head("start")
        self.logits = BufferSpec("logits", (cfg.vocab_size,), torch.float32, hd).allocate()
        h = bufs.h[hd]
        seq = model.seq_rows(S)
        r0, r1 = model.tp.split(S) if seq else (0, S)

        def embed():
            h[r0:r1].copy_(model.embed_tokens(self.ids[r0:r1]))

        def layer(l, blk, st, h, ids, start):
            mine = h[r0:r1]

            def fn():
                mine.copy_(blk.prefill(mine, ids, st, start, seq=seq))
            return fn

        def lm_head():      # the last row (the last rank's, gathered where the rows are split)
            last = model.tp.gather_rows(h[r1 - 1:r1])[-1:] if seq else h[-1:]
            self.logits.copy_(model.logits(last))

        segs = pass_segments(model, bufs, embed, ({"ids": self.ids}, {}), layer, ("ids", "start"),
                             lm_head, {"logits": self.logits})
        self.decoder = CUDAGraphDecoder(segs, inputs={"ids": self.ids, "start": self.start},
                                        outputs={"logits": self.logits}, mode="graph",
                                        warmup_iters=1, reset_fn=model.reset,
                                        nvtx_domain=nvtx_domain, fix_hints=FIX_HINTS)
        self.decoder.allocate()
        # time on random tokens: identical ones would route every row to the same few experts
        gen = torch.Generator(device=hd).manual_seed(S)
        torch.randint(0, cfg.vocab_size, (S,), generator=gen, device=hd, out=self.ids)
        self.decoder.warmup()                 # compiles the kernels of this size
        # one eager chunk of the same tokens, warm (its start a host int: cache entries past the
        # chunk are not scanned), then the replay
        self.eager_ms = _eager_chunk_ms(model, S)
        self.decoder.capture()
        # the first replay uploads the graph (milliseconds, once): timed is the second, as a
        # prefill replays it
        self.decoder.step()
        model.reset()
        self.replay_ms = _timed(self.decoder.step, list(dict.fromkeys([hd] + model.placement)),
                                _meet(model))
        model.reset()


def _eager_chunk_ms(model, S: int) -> float:
    """One eager chunk of S random tokens at position 0 (Transformer.prefill's), warm, in ms
    (the tokens _ChunkGraphs times its replay on: the same seed)."""
    hd = model.head_device
    gen = torch.Generator(device=hd).manual_seed(S)
    ids = torch.randint(0, model.cfg.vocab_size, (S,), generator=gen, device=hd)

    def eager():
        model.logits(model.prefill_chunk(ids, 0)[-1:].to(hd))
    model.reset()
    eager()                                   # compiles the kernels of this size
    model.reset()
    ms = _timed(eager, list(dict.fromkeys([hd] + model.placement)), _meet(model))
    model.reset()
    return ms


class PrefillGraphs:
    """Captured prefill chunks of 1, 2, 4, ..., max_rows tokens for one model (CUDA only; in
    tensor parallel, one per rank, built by every rank together and planned alike: agreed_ms).

    Attach with `model.prefill_graphs = PrefillGraphs(model, n)`: Transformer.prefill then feeds
    prompts through them where `plan` says the replays beat the eager chunks (prefills that the
    MTP block follows, and prompts longer than `max_prompt` when given, stay eager)."""

    # "replay": every prompt within max_prompt as graph pieces, whatever the build measured
    # (the bench's "chunk graphs only" beside the plan's); None: the plan weighs the times
    prefer: str | None = None

    def __init__(self, model, max_rows: int, max_prompt: int | None = None,
                 nvtx_domain: str = "dsv4-prefill"):
        if model.head_device.type != "cuda":
            raise ConfigError("prefill graphs need CUDA devices (the model is on "
                              f"{model.head_device}); use prefill_graphs = 0")
        why = capture_blocker(model)
        if why is not None:
            raise ConfigError(f"prefill graphs: {why}; use prefill_graphs = 0")
        chunk_sizes(max_rows)             # validates it
        cap = model.rt.max_seq_len        # no chunk longer than the cache (state past it)
        self.max_rows = min(max_rows, 1 << (cap.bit_length() - 1))
        self.max_prompt = max_prompt
        self.prefill_chunk = model.rt.prefill_chunk
        t = time.perf_counter()
        with torch.inference_mode():
            self.chunks = {S: _ChunkGraphs(model, S, nvtx_domain)
                           for S in chunk_sizes(self.max_rows)}
            self.replay_ms = {S: c.replay_ms for S, c in self.chunks.items()}
            self.eager_ms = {S: c.eager_ms for S, c in self.chunks.items()}
            for S in eager_sizes(self.max_rows, min(self.prefill_chunk, cap))[len(self.chunks):]:
                self.eager_ms[S] = _eager_chunk_ms(model, S)   # the eager alternative's chunks
            self.replay_ms = agreed_ms(self.replay_ms, model.tp)
            self.eager_ms = agreed_ms(self.eager_ms, model.tp)
        self.capture_s = time.perf_counter() - t

    def plan(self, n: int, chunk: int | None = None) -> list[tuple[int, bool]]:
        """n tokens as pieces [(rows, replayed)] in order, by the times measured when built. The
        eager alternative is chunks of `chunk` rows (default: the model's prefill chunk), so
        each such segment takes the fastest of: one eager chunk; its graph pieces (pieces of
        `cap` rows, the largest captured size <= chunk, then the binary pieces of the rest); its
        cap-sized pieces replayed and the rest as one eager chunk; an eager chunk's measured
        time weighed by EAGER_MARGIN (the host's time moves, a replay's does not). Beyond
        max_prompt: all eager. With prefer = "replay", each segment its graph pieces.
        Neighbouring eager pieces merge (Transformer.prefill cuts them into chunks)."""
        chunk = self.prefill_chunk if chunk is None else chunk
        cap = min(self.max_rows, 1 << (chunk.bit_length() - 1))
        if self.max_prompt is not None and n > self.max_prompt:
            return [(n, False)]
        out: list[tuple[int, bool]] = []
        for pos in range(0, n, chunk):
            seg = min(chunk, n - pos)
            full, rest = divmod(seg, cap)
            options = [(EAGER_MARGIN * eager_time(seg, self.eager_ms), [(seg, False)]),
                       (sum(self.replay_ms[S] for S in pieces(seg, cap)),
                        [(S, True) for S in pieces(seg, cap)])]
            if full and rest:
                options.append((full * self.replay_ms[cap]
                                + EAGER_MARGIN * eager_time(rest, self.eager_ms),
                                [(cap, True)] * full + [(rest, False)]))
            out += (options[1] if self.prefer == "replay" else min(options, key=lambda o: o[0]))[1]
        merged: list[tuple[int, bool]] = []
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

