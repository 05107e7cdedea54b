"""Lightning indexer of ratio-4 layers: scores compressed positions and picks the top-k (DSV4_SPEC §3.5).

Legend: s = queries, h = index heads, di = index_head_dim, t = compressed entries, k = top-k.
Selected entries come back as indices into the attention KV (offset added), -1 for none.
"""
from __future__ import annotations

import torch

from .compressor import Compressor
from ..weights.config import ModelConfig
from .linear import Linear
from ..backend.ops import Ops
from ..numerics.quant import fp4_quant_dequant, hadamard
from ..numerics.rope import apply_rope
from ..numerics.sparse import index_scores, topk_lowest, visible_bound
from .state import LayerState

SCORE_ELEMS = 1 << 26  # prefill: bound on the [queries, heads, entries] index-score tensor
TOPK_ELEMS = 1 << 24   # prefill kernels: bound on the [queries, entries] int64 keys of one top-k


class Indexer:
    def __init__(self, cfg: ModelConfig, fmt: str, device, hadamard_matrix: torch.Tensor,
                 ops: Ops | None = None):
        self.cfg = cfg
        self.ops = ops = ops or Ops.for_device(device, cfg=cfg)
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Linear(self.n_heads * self.head_dim, cfg.q_lora_rank, fmt, device, ops)
        self.weights_proj = Linear(self.n_heads, cfg.dim, "bf16", device, ops)
        self.compressor = Compressor(cfg, 4, self.head_dim, rotate=True, device=device, ops=ops)
        self.compressor.hadamard = hadamard_matrix
        self.hadamard = hadamard_matrix

    def set_ops(self, ops: Ops) -> None:
        self.ops = self.wq_b.ops = self.weights_proj.ops = ops
        self.compressor.set_ops(ops)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {**self.wq_b.tensors(f"{prefix}.wq_b"),
                **self.weights_proj.tensors(f"{prefix}.weights_proj"),
                **self.compressor.tensors(f"{prefix}.compressor")}

    def _query(self, x, qr, cs, act):
        """q [s, h, di] (RoPE, Hadamard, FP4 fake-quant) and head weights [s, h]."""
        q = self.wq_b(qr, act).unflatten(-1, (self.n_heads, self.head_dim))
        q = apply_rope(q, cs)
        q = fp4_quant_dequant(hadamard(q, self.hadamard), 32)
        w = self.weights_proj(x, act) * (self.head_dim ** -0.5 * self.n_heads ** -0.5)
        return q, w

    def prefill(self, x, qr, cs, st: LayerState, freqs, start, offset: int) -> torch.Tensor:
        """Queries at positions start..start+s-1 -> compressed indices [s, min(k, t)] over the
        t = (start+s)//4 entries the chunk leaves in the index cache (+offset, -1 where not yet
        visible to the query); the chunk's entries are compressed into the cache first.
        start: an int, or a [1] int64 device tensor (kernel path: t is then the whole cache,
        masked by position, and nothing syncs with the host)."""
        s, act = x.shape[0], x.dtype
        rows = self.ops.backend.rows
        if rows:                           # RoPE, Hadamard, FP4 fake-quant in one launch
            pos0 = start if isinstance(start, torch.Tensor) else torch.full(
                (1,), start, dtype=torch.int64, device=x.device)
            q = self.ops.index_query(self.wq_b(qr, act), pos0, freqs, self.n_heads).view(
                s, self.n_heads, self.head_dim)
            w = self.weights_proj(x, act) * (self.head_dim ** -0.5 * self.n_heads ** -0.5)
        else:
            start = int(start)             # the torch path: host shapes (never captured)
            q, w = self._query(x, qr, cs, act)
        self.compressor.prefill(x, st.index_compressor, st.index_cache, freqs,
                                pos0 if rows else start)
        t = visible_bound(start, s, 4, st.index_cache.shape[0] - 1)
        k = min(self.cfg.index_topk, t)
        if k == 0:
            return torch.empty(s, 0, dtype=torch.int64, device=x.device)
        keys = st.index_cache[:t]
        visible = (start + 1 + torch.arange(s, device=x.device)).unsqueeze(1) // 4
        if rows:                           # one launch, the masked scores [s, t]
            scores = self.ops.index_scores_rows(q, w, keys, pos0)
        else:
            cols = torch.arange(t, device=x.device)
        # chunk the queries so the [c, h, t] score tensor (torch) and top-k's int64 keys stay
        # bounded for long prompts
        c = max(1, (TOPK_ELEMS if rows else SCORE_ELEMS // self.n_heads) // max(1, t))
        out = []
        for i in range(0, s, c):
            if rows:
                sc = scores[i:i + c]
            else:
                sc = index_scores(q[i:i + c], w[i:i + c], keys)               # [c, t]
                sc = sc.masked_fill(cols >= visible[i:i + c], float("-inf"))
            idx = topk_lowest(sc, k)
            out.append(torch.where(idx >= visible[i:i + c], -1, idx + offset))
        return torch.cat(out, dim=0)

    def decode(self, x, qr, cs, pos, st: LayerState, freqs, offset: int, fused: bool | None = None,
               raw: bool = False, proj: list | None = None) -> torch.Tensor:
        """One query at `pos` -> [1, min(k, n)] indices over the whole fixed-size cache. Capture-safe.
        fused (default: one token where the backend has the fused decode): the fused parts below
        (decode_compress, decode_query, decode_select; cs unused). raw: the top-k entry numbers
        themselves (unsorted; valid iff < (pos+1)//4), without the offset and the -1 mask (the
        fused attention takes those).
        proj (fused): [compressor wkv(x), wgate(x), weights_proj(x)] computed by the caller."""
        act = x.dtype
        if fused is None:
            fused = self.ops.backend.fused_decode and x.shape[0] == 1
        keys = st.index_cache[:-1]                                    # [n, di], scratch row excluded
        visible = (pos + 1) // 4                                      # [1]
        if fused:
            self.decode_compress(x, pos, st, freqs, None if proj is None else proj[:2])
            idx = self.decode_select(self.decode_query(qr, pos, freqs), pos, st,
                                     self.weights_proj(x, act) if proj is None else proj[2])
        else:
            q, w = self._query(x, qr, cs, act)
            self.compressor.decode(x, pos, st.index_compressor, st.index_cache, freqs, fused=False)
            sc = index_scores(q, w, keys)                                 # [1, n]
            cols = torch.arange(keys.shape[0], device=x.device)
            sc = sc.masked_fill(cols >= visible, float("-inf"))
            k = min(self.cfg.index_topk, keys.shape[0])
            idx = topk_lowest(sc, k)
        if raw:
            return idx
        return torch.where(idx >= visible, -1, idx + offset)

    # the fused decode in two parts, so that the part that needs only x can run before wq_a
    def decode_compress(self, x, pos, st: LayerState, freqs, proj: list | None = None) -> None:
        """Fused decode, part 1 (x only): the index compressor's step (proj: [wkv(x), wgate(x)]
        float32 when the caller computed them); an emitted entry lands in the index cache."""
        self.compressor.decode(x, pos, st.index_compressor, st.index_cache, freqs, fused=True,
                               proj=proj)

    def decode_query(self, qr, pos, freqs, q: torch.Tensor | None = None) -> torch.Tensor:
        """Fused decode, part 2 (qr only): the index query [1, h, di] from qr (wq_b, RoPE,
        Hadamard, FP4 fake-quant); q: wq_b(qr) when the caller computed it (decode rows)."""
        return self.ops.index_query(self.wq_b(qr, qr.dtype) if q is None else q, pos, freqs,
                                    self.n_heads)

    def decode_select(self, q, pos, st: LayerState, w: torch.Tensor) -> torch.Tensor:
        """Fused decode, part 3 (after decode_compress and decode_query): scores of the query q
        against the index cache with head weights w = weights_proj(x), and the top-k entry
        numbers [1, k] (unsorted; valid iff < (pos+1)//4)."""
        keys = st.index_cache[:-1]
        sc = self.ops.index_scores(q, w, keys, pos, self.head_dim ** -0.5 * self.n_heads ** -0.5)
        return self.ops.index_topk(sc, min(self.cfg.index_topk, keys.shape[0]))
