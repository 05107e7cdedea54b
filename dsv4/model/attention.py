"""Attention of one layer: low-rank q, shared-KV MQA over a sliding window + compressed entries,
attention sink, inverse RoPE and the grouped low-rank output projection (DSV4_SPEC §3.3).

Legend: s = queries, h = heads, d = head_dim, k = attended entries, g = output groups,
W = window, r = compress ratio. Prefill works on fresh tensors; decode is capture-safe. This is
the torch math; a backend may bind the fused kernels to `decode_rows` and `prefill`
(bound by dsv4/backend/binding.py: dsv4/backend/fused/attention.py), and to the compressor, indexer and linears.
"""
from __future__ import annotations

import torch

from ..numerics.mhc import rms_norm
from ..numerics.quant import fp8_quant_dequant
from ..numerics.rope import apply_rope, cos_sin, rope_frequencies
from ..numerics.sparse import sparse_attention, visible_bound
from ..weights.config import ModelConfig
from ..weights.parts import Part
from .compressor import Compressor
from .indexer import Indexer
from .linear import Linear
from .sharding import TensorParallel, same
from .state import LayerState

QUERY_BLOCK = 64  # prefill queries per torch sparse-attention call (bounds the gathered KV)


class Attention:
    """Weights of one layer's attention (its compressor and indexer by ratio).

    Bound ops (the torch reference below until the backend binds kernels): `decode_rows`
    (decode_rows_reference) and `prefill` (prefill_reference); `reduce`, the sum of wo_b's
    output over the tensor-parallel ranks (none in one process). Decode sums over the ranks
    itself; prefill returns this rank's partial, which the block sums (Block.prefill).
    tp: this rank's place (dsv4.model.sharding): it holds n_heads / world heads (wq_b rows,
    attn_sink) and o_groups / world output groups (wo_a rows, wo_b columns); None: all."""

    def __init__(self, cfg: ModelConfig, ratio: int, fmt: str, device,
                 hadamard_matrix: torch.Tensor | None = None, tp: TensorParallel | None = None):
        self.cfg, self.ratio = cfg, ratio
        H, Dh, G, R = cfg.n_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
        h0, h1 = tp.split(H) if tp else (0, H)                 # this rank's heads
        g0, g1 = tp.split(G) if tp else (0, G)                 # and output groups
        self.n_heads, self.n_groups = h1 - h0, g1 - g0
        cut = tp is not None and tp.world > 1
        self.heads = (h0, h1) if cut else None
        self.attn_sink = torch.empty(self.n_heads, dtype=torch.float32, device=device)
        self.wq_a = Linear(cfg.q_lora_rank, cfg.dim, fmt, device)
        self.q_norm = torch.empty(cfg.q_lora_rank, dtype=torch.float32, device=device)
        self.wq_b = Linear(self.n_heads * Dh, cfg.q_lora_rank, fmt, device,
                           split=(0, h0 * Dh, h1 * Dh) if cut else None)
        self.wkv = Linear(Dh, cfg.dim, fmt, device)
        self.kv_norm = torch.empty(Dh, dtype=torch.float32, device=device)
        self.wo_a = Linear(self.n_groups * R, H * Dh // G, fmt, device,
                           split=(0, g0 * R, g1 * R) if cut else None)
        self.wo_b = Linear(cfg.dim, self.n_groups * R, fmt, device,
                           split=(1, g0 * R, g1 * R) if cut else None)
        self.reduce = tp.reduce if cut else same
        self.tp = tp if cut else None
        self.compressor = (Compressor(cfg, ratio, Dh, rotate=False, device=device)
                           if ratio else None)
        self.indexer = Indexer(cfg, fmt, device, hadamard_matrix) if ratio == 4 else None
        self.freqs = rope_frequencies(cfg, ratio, device)
        self.decode_rows = self.decode_rows_reference
        self.prefill = self.prefill_reference

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        d = {f"{prefix}.attn_sink": self.attn_sink, f"{prefix}.q_norm.weight": self.q_norm,
             f"{prefix}.kv_norm.weight": self.kv_norm}
        for n in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b"):
            d.update(getattr(self, n).tensors(f"{prefix}.{n}"))
        if self.compressor is not None:
            d.update(self.compressor.tensors(f"{prefix}.compressor"))
        if self.indexer is not None:
            d.update(self.indexer.tensors(f"{prefix}.indexer"))
        return d

    def parts(self, prefix: str) -> dict[str, Part]:
        """Checkpoint name -> the Part of it this rank holds (heads, output groups); {} whole."""
        if self.heads is None:
            return {}
        d = {f"{prefix}.attn_sink": Part(0, *self.heads)}
        for n in ("wq_b", "wo_a", "wo_b"):
            d.update(getattr(self, n).parts(f"{prefix}.{n}"))
        return d

    def linears(self) -> list:
        """Every Linear of the attention (its compressors' and the indexer's included)."""
        out = [self.wq_a, self.wq_b, self.wkv, self.wo_a, self.wo_b]
        for c in (self.compressor, self.indexer and self.indexer.compressor):
            if c:
                out += c.linears()
        if self.indexer:
            out += [self.indexer.wq_b, self.indexer.weights_proj]
        return out

    # ---- shared pieces -----------------------------------------------------------------------
    def _q_kv(self, x: torch.Tensor, cs):
        """x [s, D] act -> qr [s, Rq], q [s, h, d] (RMS + RoPE), kv [s, d] (norm, RoPE, FP8 fake-quant)."""
        cfg, act = self.cfg, x.dtype
        qr = rms_norm(self.wq_a(x, act), self.q_norm, cfg.norm_eps)
        q = self.wq_b(qr, act).unflatten(-1, (self.n_heads, cfg.head_dim))
        q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + cfg.norm_eps)   # in act dtype
        q = apply_rope(q, cs)
        kv = rms_norm(self.wkv(x, act), self.kv_norm, cfg.norm_eps)
        kv = apply_rope(kv, cs)
        nope = cfg.head_dim - cfg.rope_head_dim
        kv = torch.cat((fp8_quant_dequant(kv[:, :nope], 64), kv[:, nope:]), dim=-1)
        return qr, q, kv

    def _out(self, o: torch.Tensor, cs, reduce: bool = True) -> torch.Tensor:
        """o [s, h, d] -> inverse RoPE -> grouped wo_a (no act quant) -> wo_b -> [s, D]."""
        return self.project_out(apply_rope(o, cs, inverse=True), reduce)

    def project_out(self, o: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """Grouped low-rank output projection of the de-rotated o ([s, h, d] or [s, h*d]): wo_a
        per group on the unquantized activation, then wo_b -> [s, D], summed over the ranks
        (each holds its heads' groups; reduce=False: this rank's partial)."""
        cfg, act, G = self.cfg, o.dtype, self.n_groups
        o = o.reshape(o.shape[0], -1)                                           # [s, h*d]
        wo_a = self.wo_a.dense(act).view(G, cfg.o_lora_rank, -1)               # [g, R, h/g*d]
        z = torch.einsum("sgd,grd->sgr", o.view(o.shape[0], G, -1), wo_a).flatten(1)
        y = self.wo_b(z, act)
        return self.reduce(y) if reduce else y

    # ---- prefill -----------------------------------------------------------------------------
    def prefill_reference(self, x: torch.Tensor, st: LayerState, start=0,
                          shared: dict | None = None) -> torch.Tensor:
        """Positions start..start+s-1 after positions < start: x [s, D] -> [s, D] (in tensor
        parallel this rank's partial sum: Block.prefill sums it); updates the layer state as s
        decode steps would (ring, compressor and indexer state, caches).
        start: an int, or a [1] int64 device tensor (read on the host here: the chunk kernels
        keep it on the device, so that a chunk can be captured). shared: a dict the layers of one
        chunk share (its positions and window rows)."""
        start, shared = int(start), {} if shared is None else shared
        pos = self.chunk_positions(x, start, shared)
        cs = cos_sin(pos, self.freqs)
        qr, q, kv = self._q_kv(x, cs)
        idx, kv_all = self.attended(x, qr, cs, kv, st, start, pos, shared, start)
        o = torch.cat([sparse_attention(q[i:i + QUERY_BLOCK], kv_all, idx[i:i + QUERY_BLOCK],
                                        self.attn_sink, self.cfg.head_dim ** -0.5)
                       for i in range(0, x.shape[0], QUERY_BLOCK)], dim=0)
        return self._out(o, cs, reduce=False)

    def chunk_positions(self, x: torch.Tensor, start, shared: dict) -> torch.Tensor:
        """The chunk's positions [s] (start an int or a [1] device tensor), and its window rows
        (window_indices), computed once per chunk and device in `shared`."""
        s, dev = x.shape[0], x.device
        if ("pos", dev) not in shared:
            shared["pos", dev] = start + torch.arange(s, device=dev)
            shared["win", dev] = window_indices(start, s, self.cfg.window_size, dev)  # [s, W]
        return shared["pos", dev]

    def attended(self, x, qr, cs, kv, st: LayerState, start, pos, shared: dict,
                 comp_start) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows a chunk attends: idx [s, W + k] into kv_all = [0, W) the ring as it was
        (positions < start), [W, W+s) this chunk's kv, [W+s, ...) the compressed entries visible
        at the chunk's end (its own written first; with a device start: every entry of the cache,
        the invisible ones masked). The compressors take their chunk (at comp_start), then the
        ring keeps the chunk's last W rows. -> (idx, kv_all). With shared["seq"] (a chunk split
        by rows over the tensor-parallel ranks: Block.prefill) the indexer scores and selects
        this rank's rows only and an all-gather gives every rank every row's entries."""
        s, dev, W, r = x.shape[0], x.device, self.cfg.window_size, self.ratio
        idx = shared["win", dev]                                               # [s, W]
        n_vis = visible_bound(start, s, r, st.kv_cache.shape[0] - W - 1) if r else 0
        if r == 4:
            rows = self.tp.split(s) if self.tp is not None and shared.get("seq") else None
            ix = self.indexer.prefill(x, qr, cs, st, self.freqs, start, offset=W + s, rows=rows)
            if rows is not None:      # k is the same on every rank: all gather, or none does
                ix = self.tp.gather_rows(ix) if ix.shape[1] else ix.new_empty(s, 0)
            idx = torch.cat((idx, ix), -1)
        elif r:
            comp = torch.arange(n_vis, device=dev).expand(s, n_vis)
            idx = torch.cat((idx, torch.where(comp < (pos[:, None] + 1) // r, comp + W + s, -1)),
                            -1)
        if r:
            self.compressor.prefill(x, st.compressor, st.kv_cache[W:], self.freqs, comp_start)
        kv_all = torch.cat((st.kv_cache[:W], kv, st.kv_cache[W:W + n_vis]))
        keep = min(s, W)                                 # ring write (the old ring is copied)
        st.kv_cache[pos[s - keep:] % W] = kv[s - keep:]
        return idx, kv_all

    # ---- decode ------------------------------------------------------------------------------
    def decode(self, x: torch.Tensor, pos: torch.Tensor, st: LayerState) -> torch.Tensor:
        """One token at device position `pos` ([1] int64): x [1, D] -> [1, D]. Capture-safe."""
        return self.decode_rows(x, pos, st)

    def decode_rows_reference(self, x: torch.Tensor, pos: torch.Tensor, st: LayerState
                              ) -> torch.Tensor:
        """T rows at positions pos .. pos+T-1, row t after the rows before it: x [T, D] -> [T, D],
        one decode_one per row. Capture-safe."""
        return torch.cat([self.decode_one(x[t:t + 1], pos + t, st) for t in range(x.shape[0])])

    def decode_one(self, x: torch.Tensor, pos: torch.Tensor, st: LayerState) -> torch.Tensor:
        """The torch math of one token at `pos` ([1] int64): x [1, D] -> [1, D]. Capture-safe."""
        cfg, dev = self.cfg, x.device
        W, r = cfg.window_size, self.ratio
        cs = cos_sin(pos, self.freqs)
        qr, q, kv = self._q_kv(x, cs)
        slots = torch.arange(W, device=dev)
        idx = torch.where(slots <= pos, slots, -1).unsqueeze(0)               # [1, W] ring slots
        if r == 4:
            idx = torch.cat((idx, self.indexer.decode(x, qr, cs, pos, st, self.freqs, W)), -1)
        elif r:
            n = st.kv_cache.shape[0] - W - 1
            comp = torch.arange(n, device=dev)
            idx = torch.cat((idx, torch.where(comp < (pos + 1) // r, comp + W, -1).unsqueeze(0)), -1)
        st.kv_cache.index_copy_(0, pos % W, kv)
        if r:
            self.compressor.decode(x, pos, st.compressor, st.kv_cache[W:], self.freqs)
        o = sparse_attention(q, st.kv_cache, idx, self.attn_sink, cfg.head_dim ** -0.5)
        return self._out(o, cs)


def window_indices(start, s: int, window: int, device) -> torch.Tensor:
    """Window rows of queries at positions start..start+s-1 in [ring (window rows) | chunk (s
    rows)]: [s, window] int64, entry e = position p - window + 1 + e (oldest first), -1 before
    position 0. Positions >= start are chunk rows window + (q - start); older ones ring slots
    q % window (the ring holds positions start - window .. start - 1). start: an int or a [1]
    int64 tensor on `device` (no host sync)."""
    p = (start + torch.arange(s, device=device)).unsqueeze(1)
    q = p - window + 1 + torch.arange(window, device=device)
    return torch.where(q < 0, -1, torch.where(q >= start, q - start + window, q % window))
