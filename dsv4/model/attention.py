"""Attention of one layer: low-rank q, shared-KV MQA over a sliding window + compressed entries,
attention sink, inverse RoPE and the grouped low-rank output projection (DSV4_SPEC §3.3).

Legend: s = queries, h = heads, d = head_dim, k = attended entries, g = output groups,
W = window, r = compress ratio. Prefill works on fresh tensors; `decode` is capture-safe. The fused
kernels (q/kv prep, sparse attention, the compressor and indexer steps, the GEMVs) serve where the
device's backend says so (self.ops); the torch math is the reference and the escape hatch.
"""
from __future__ import annotations

import torch

from ..backend import branches
from .compressor import Compressor
from ..weights.config import ModelConfig
from .indexer import Indexer
from .linear import Linear
from ..numerics.mhc import rms_norm
from ..backend.ops import Ops
from ..numerics.quant import fp8_quant_dequant
from ..numerics.rope import apply_rope, cos_sin, rope_frequencies
from ..numerics.sparse import sparse_attention, visible_bound
from .state import LayerState

QUERY_BLOCK = 64  # prefill queries per torch sparse-attention call (bounds the gathered KV)


class Attention:
    def __init__(self, cfg: ModelConfig, ratio: int, fmt: str, device,
                 hadamard_matrix: torch.Tensor | None = None, ops: Ops | None = None):
        self.cfg, self.ratio = cfg, ratio
        self.ops = ops = ops or Ops.for_device(device, cfg=cfg)
        H, Dh, G = cfg.n_heads, cfg.head_dim, cfg.o_groups
        self.attn_sink = torch.empty(H, dtype=torch.float32, device=device)
        self.wq_a = Linear(cfg.q_lora_rank, cfg.dim, fmt, device, ops)
        self.q_norm = torch.empty(cfg.q_lora_rank, dtype=torch.float32, device=device)
        self.wq_b = Linear(H * Dh, cfg.q_lora_rank, fmt, device, ops)
        self.wkv = Linear(Dh, cfg.dim, fmt, device, ops)
        self.kv_norm = torch.empty(Dh, dtype=torch.float32, device=device)
        self.wo_a = Linear(G * cfg.o_lora_rank, H * Dh // G, fmt, device, ops)
        self.wo_b = Linear(cfg.dim, G * cfg.o_lora_rank, fmt, device, ops)
        self.compressor = (Compressor(cfg, ratio, Dh, rotate=False, device=device, ops=ops)
                           if ratio else None)
        self.indexer = Indexer(cfg, fmt, device, hadamard_matrix, ops) if ratio == 4 else None
        self.freqs = rope_frequencies(cfg, ratio, device)

    def set_ops(self, ops: Ops) -> None:
        self.ops = ops
        for lin in (self.wq_a, self.wq_b, self.wkv, self.wo_a, self.wo_b):
            lin.ops = ops
        for part in (self.compressor, self.indexer):
            if part is not None:
                part.set_ops(ops)

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

    # ---- shared pieces -----------------------------------------------------------------------
    def _q_kv(self, x: torch.Tensor, cs):
        """x [s, D] act -> qr [s, Rq], q [s, h, d] (RMS + RoPE), kv [s, d] (norm, RoPE, FP8 fake-quant)."""
        cfg, act = self.cfg, x.dtype
        qr = rms_norm(self.wq_a(x, act), self.q_norm, cfg.norm_eps)
        q = self.wq_b(qr, act).unflatten(-1, (cfg.n_heads, cfg.head_dim))
        q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + cfg.norm_eps)   # in act dtype
        q = apply_rope(q, cs)
        kv = rms_norm(self.wkv(x, act), self.kv_norm, cfg.norm_eps)
        kv = apply_rope(kv, cs)
        nope = cfg.head_dim - cfg.rope_head_dim
        kv = torch.cat((fp8_quant_dequant(kv[:, :nope], 64), kv[:, nope:]), dim=-1)
        return qr, q, kv

    def _out(self, o: torch.Tensor, cs) -> torch.Tensor:
        """o [s, h, d] -> inverse RoPE -> grouped wo_a (no act quant) -> wo_b -> [s, D]."""
        return self._project_out(apply_rope(o, cs, inverse=True))

    def _project_out(self, o: torch.Tensor, rows: bool = False) -> torch.Tensor:
        """Grouped low-rank output projection of the de-rotated o ([s, h, d] or [s, h*d]): wo_a per
        group on the unquantized activation (one GEMV launch for a bf16 token, the prefill GEMM for
        a chunk's rows, where the backend has them), then wo_b.
        rows: o holds decode rows (decode_rows): the GEMV kernels, each row as a one-row call."""
        cfg, act, G, be = self.cfg, o.dtype, self.cfg.o_groups, self.ops.backend
        o = o.reshape(o.shape[0], -1)                                           # [s, h*d]
        if rows and not be.wo_a_gemv:   # each row as decode's one-row path (not the prefill GEMM)
            return torch.cat([self._project_out(o[t:t + 1]) for t in range(o.shape[0])])
        if be.wo_a_gemv and (o.shape[0] == 1 or rows):
            z = self.ops.fp8_linear(o, self.wo_a.weight, self.wo_a.scale, quant_act=False,
                                    group_k=o.shape[-1] // G)
        elif o.shape[0] > 1 and be.wo_a_prefill:
            z = self.ops.prefill_linear(o, self.wo_a.weight, self.wo_a.scale, self.wo_a.fmt,
                                        out_dtype=act, quant_act=False, group_k=o.shape[-1] // G)
        else:
            wo_a = self.wo_a.dense(act).view(G, cfg.o_lora_rank, -1)           # [g, R, h/g*d]
            z = torch.einsum("sgd,grd->sgr", o.view(o.shape[0], G, -1), wo_a).flatten(1)
        return self.wo_b.rows(z, act) if rows else self.wo_b(z, act)

    # ---- prefill -----------------------------------------------------------------------------
    def prefill(self, x: torch.Tensor, st: LayerState, start=0,
                shared: dict | None = None) -> torch.Tensor:
        """Positions start..start+s-1 after positions < start: x [s, D] -> [s, D]; updates the
        layer state as s decode steps would (ring, compressor and indexer state, caches).
        start: an int, or a [1] int64 device tensor: with the kernels (bf16 rows on a GPU) the
        chunk then has fixed shapes (every compressed entry of the cache is a candidate, masked
        by position) and no host sync, so it can be captured; the torch path reads it on the
        host. shared: a dict the layers of one chunk share (its positions and window rows)."""
        cfg, s, dev = self.cfg, x.shape[0], x.device
        W, r = cfg.window_size, self.ratio
        shared = {} if shared is None else shared
        ops = self.ops
        rows = ops.backend.rows              # the chunk's kernels (bf16 rows on the GPU)
        if not rows and isinstance(start, torch.Tensor):
            start = int(start)                # the torch path: host shapes (never captured)
        if ("pos", dev) not in shared:
            shared["pos", dev] = start + torch.arange(s, device=dev)
            shared["win", dev] = window_indices(start, s, W, dev)               # [s, W]
        pos = shared["pos", dev]
        cs = None if rows else cos_sin(pos, self.freqs)
        pos0 = pos[:1]
        if rows:
            qr = ops.rms_norm_rows(self.wq_a(x, x.dtype), self.q_norm, cfg.norm_eps)
            q, kv = ops.attention_prep_rows(self.wq_b(qr, x.dtype), self.wkv(x, x.dtype),
                                            self.kv_norm, pos0, self.freqs, cfg.norm_eps,
                                            cfg.n_heads)
        else:
            qr, q, kv = self._q_kv(x, cs)
        # attended rows: [0, W) the ring as it was (positions < start), [W, W+s) this chunk's kv,
        # [W+s, ...) the compressed entries visible at the chunk's end (its own written first;
        # with a device start: every entry of the cache, the invisible ones masked)
        idx = shared["win", dev]                                               # [s, W]
        n_vis = visible_bound(start, s, r, st.kv_cache.shape[0] - W - 1) if r else 0
        if r == 4:
            idx = torch.cat((idx, self.indexer.prefill(x, qr, cs, st, self.freqs, start,
                                                       offset=W + s)), -1)
        elif r:
            comp = torch.arange(n_vis, device=dev).expand(s, n_vis)
            idx = torch.cat((idx, torch.where(comp < (pos[:, None] + 1) // r, comp + W + s, -1)),
                            -1)
        if r:
            self.compressor.prefill(x, st.compressor, st.kv_cache[W:], self.freqs,
                                    pos0 if rows else start)
        kv_all = torch.cat((st.kv_cache[:W], kv, st.kv_cache[W:W + n_vis]))
        keep = min(s, W)                                 # ring write (the old ring is copied)
        st.kv_cache[pos[s - keep:] % W] = kv[s - keep:]
        scale = cfg.head_dim ** -0.5
        if rows:                                      # inverse RoPE in the kernel's epilogue
            return self._project_out(ops.sparse_attention_rows(q, kv_all, idx, self.attn_sink,
                                                               scale, self.freqs, pos0))
        o = torch.cat([sparse_attention(q[i:i + QUERY_BLOCK], kv_all, idx[i:i + QUERY_BLOCK],
                                        self.attn_sink, scale)
                       for i in range(0, s, QUERY_BLOCK)], dim=0)
        return self._out(o, cs)

    # ---- decode ------------------------------------------------------------------------------
    def decode(self, x: torch.Tensor, pos: torch.Tensor, st: LayerState, fused: bool | None = None
               ) -> torch.Tensor:
        """One token at device position `pos` ([1] int64): x [1, D] -> [1, D]. Capture-safe.
        fused (default: one token where the backend has the fused decode): decode_rows
        (everything between the GEMVs in Triton kernels)."""
        cfg, dev = self.cfg, x.device
        W, r = cfg.window_size, self.ratio
        if fused is None:
            fused = self.ops.backend.fused_decode and x.shape[0] == 1
        if fused:
            return self.decode_rows(x, pos, st)
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

    def decode_rows(self, x: torch.Tensor, pos: torch.Tensor, st: LayerState) -> torch.Tensor:
        """The fused decode of T rows at positions pos .. pos+T-1, row t seeing rows < t: x [T, D]
        -> [T, D] (T = 1: decode's fused path; T > 1: the speculative verify rows, row t with the
        bits of decode(x[t:t+1], pos + t) after the rows before it). Same math and state updates
        as the torch path (bf16 activations), everything between the GEMVs in Triton kernels
        (dsv4/kernels/decode/attention_prep.py, attention.py, compressor.py,
        indexer.py); the projections of x, qr and o read each weight once for all rows.
        Capture-safe.
        When captured, the compressors and the indexer (state: their own buffers and
        kv_cache[W:]) are parallel branches (dsv4.backend.branches) beside wq_a + wkv, q_norm, wq_b and
        prep (which writes the ring kv_cache[:W]): the side projections and both compressors need
        x only and start at once; the indexer's query (its wq_b) needs q_norm's qr only and runs
        on a second lane beside the compressors; the scores and the top-k wait for both. Every
        row's compressor step runs before the first row's scores and attention: those mask the
        entries of later positions, so what later rows emit changes nothing for them. The
        compressor steps run row after row (each row's state follows the previous row's); the
        index query, scores, top-k, prep and attention take all rows in one launch each. For T > 1
        the ring is written after every row's attention (row t + 1's slot holds a position that
        row t's window reads): until then a row reads the slots of rows <= t from their prepped
        kv (attention_decode.sparse_attention_decode_rows)."""
        ops = self.ops
        cfg, act, H, T = self.cfg, x.dtype, self.cfg.n_heads, x.shape[0]
        W, r, eps = cfg.window_size, self.ratio, cfg.norm_eps
        ps = pos if T == 1 else pos + torch.arange(T, device=x.device)   # the rows' positions
        rows = [slice(t, t + 1) for t in range(T)]
        br = branches.Branch(x, "attn", ops.backend.branches, when=bool(r))
        idx, n, proj = None, (st.kv_cache.shape[0] - W - 1 if r else 0), None  # n: compressed
        with br.side():
            if r:
                proj = self._side_projections(x)
                for row in rows:
                    if r == 4:
                        self.indexer.decode_compress(x[row], ps[row], st, self.freqs,
                                                     [proj[2][row], proj[3][row]])
                    self.compressor.decode(x[row], ps[row], st.compressor, st.kv_cache[W:],
                                           self.freqs, fused=True, proj=[proj[0][row], proj[1][row]])
        qr, kv = self._q_kv_rows(x)
        qr = ops.rms_norm_row(qr, self.q_norm, eps)
        bq = None
        if r == 4:
            bq = branches.Branch(qr, "attn", ops.backend.branches, lane=1)
            with bq.side():
                iq = self.indexer.decode_query(qr, pos, self.freqs,
                                               q=self.indexer.wq_b.rows(qr, act))   # all rows
            br.wait_branch(bq)
            with br.side():
                idx = self.indexer.decode_select(iq, pos, st, proj[4])      # [T, k], all rows
                n = idx.shape[-1]
        qb = self.wq_b.rows(qr, act)
        o = torch.empty(T, H * cfg.head_dim, dtype=act, device=x.device)
        scale = cfg.head_dim ** -0.5
        if T == 1:
            q = ops.attention_prep(qb, kv, self.kv_norm, st.kv_cache, pos, self.freqs, eps, H,
                                   W)                                  # also kv -> ring slot
        else:   # every row's q and kv; the ring is written after every row's attention
            q, kv = ops.attention_prep_rows(qb, kv, self.kv_norm, pos, self.freqs, eps, H,
                                            decode=True)
        if bq is not None:
            bq.join()
        br.join()
        if T == 1:
            ops.sparse_attention_decode(q, st.kv_cache, self.attn_sink, pos, self.freqs, scale,
                                        H, W, r, n, idx, out=o)        # inverse RoPE done
        else:
            ops.sparse_attention_decode_rows(q.view(T, -1), kv, st.kv_cache, self.attn_sink, pos,
                                             self.freqs, scale, H, W, r, n, idx, out=o)
        return self._project_out(o, rows=T > 1)

    def _q_kv_rows(self, x: torch.Tensor):
        """wq_a(x), wkv(x) of bf16 decode rows: one FP8 launch when both are FP8 and the device
        has the kernels, else two."""
        if self.wq_a.fmt == "fp8" and self.wkv.fmt == "fp8" and self.ops.backend.kernels:
            return self.ops.fp8_linear2(x, self.wq_a.weight, self.wq_a.scale, self.wkv.weight,
                                        self.wkv.scale)
        return self.wq_a.rows(x, x.dtype), self.wkv.rows(x, x.dtype)

    def _side_projections(self, x: torch.Tensor) -> list:
        """The bf16 projections of x besides attention's own, in one launch: compressor wkv, wgate
        (float32), then for ratio 4 the indexer compressor's wkv, wgate (float32) and the indexer
        weights_proj (activation dtype)."""
        c = self.compressor
        lins, dts = [c.wkv, c.wgate], [torch.float32, torch.float32]
        if self.indexer is not None:
            ic = self.indexer.compressor
            lins += [ic.wkv, ic.wgate, self.indexer.weights_proj]
            dts += [torch.float32, torch.float32, x.dtype]
        if not self.ops.backend.kernels:   # the interpreter tests of the fused path: torch
            return [lin.rows(x, dt) for lin, dt in zip(lins, dts)]
        return self.ops.bf16_linear_multi(x, [lin.weight for lin in lins], dts)


def window_indices(start, s: int, window: int, device) -> torch.Tensor:
    """Window rows of queries at positions start..start+s-1 in [ring (window rows) | chunk (s
    rows)]: [s, window] int64, entry e = position p - window + 1 + e (oldest first), -1 before
    position 0. Positions >= start are chunk rows window + (q - start); older ones ring slots
    q % window (the ring holds positions start - window .. start - 1). start: an int or a [1]
    int64 tensor on `device` (no host sync)."""
    p = (start + torch.arange(s, device=device)).unsqueeze(1)
    q = p - window + 1 + torch.arange(window, device=device)
    return torch.where(q < 0, -1, torch.where(q >= start, q - start + window, q % window))
