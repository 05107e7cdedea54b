"""Lightning indexer of ratio-4 layers: scores compressed positions and picks the top-k (DSV4_SPEC §3.5).

Legend: s = queries, h = index heads, di = index_head_dim, t = compressed entries, k = top-k.
Selected entries come back as indices into the attention KV (offset added), -1 for none. `prefill`
and `decode` run the torch reference unless a backend bound kernels to them
(bound by dsv4/backend/binding.py: dsv4/backend/fused/indexer.py).
"""
from __future__ import annotations

import torch

from ..numerics.quant import fp4_quant_dequant, hadamard
from ..numerics.rope import apply_rope
from ..numerics.sparse import index_scores, topk_lowest, visible_bound
from ..weights.config import ModelConfig
from .compressor import Compressor
from .linear import Linear
from .state import LayerState

SCORE_ELEMS = 1 << 26  # prefill: bound on the [queries, heads, entries] index-score tensor
TOPK_ELEMS = 1 << 24   # prefill kernels: bound on the [queries, entries] int64 keys of one top-k


class Indexer:
    """Weights of one lightning indexer and its own compressor (rotating, FP4 entries).

    Bound ops (the torch reference below until the backend binds kernels): `prefill`
    (prefill_reference) and `decode` (decode_reference)."""

    def __init__(self, cfg: ModelConfig, fmt: str, device, hadamard_matrix: torch.Tensor):
        self.cfg = cfg
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Linear(self.n_heads * self.head_dim, cfg.q_lora_rank, fmt, device)
        self.weights_proj = Linear(self.n_heads, cfg.dim, "bf16", device)
        self.compressor = Compressor(cfg, 4, self.head_dim, rotate=True, device=device)
        self.compressor.hadamard = hadamard_matrix
        self.hadamard = hadamard_matrix
        self.prefill = self.prefill_reference
        self.decode = self.decode_reference

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {**self.wq_b.tensors(f"{prefix}.wq_b"),
                **self.weights_proj.tensors(f"{prefix}.weights_proj"),
                **self.compressor.tensors(f"{prefix}.compressor")}

    @property
    def weight_scale(self) -> float:
        """The head weights' scale: head_dim^-1/2 * n_heads^-1/2."""
        return self.head_dim ** -0.5 * self.n_heads ** -0.5

    def _query(self, x, qr, cs, act):
        """q [s, h, di] (RoPE, Hadamard, FP4 fake-quant) and head weights [s, h]."""
        q = self.wq_b(qr, act).unflatten(-1, (self.n_heads, self.head_dim))
        q = apply_rope(q, cs)
        q = fp4_quant_dequant(hadamard(q, self.hadamard), 32)
        w = self.weights_proj(x, act) * self.weight_scale
        return q, w

    def prefill_reference(self, x, qr, cs, st: LayerState, freqs, start, offset: int,
                          rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Queries at positions start..start+s-1 -> compressed indices [s, min(k, t)] over the
        t = (start+s)//4 entries the chunk leaves in the index cache (+offset, -1 where not yet
        visible to the query); the chunk's entries are compressed into the cache first.
        start: an int, or a [1] int64 device tensor (read on the host here). rows (r0, r1): the
        indices of those queries only, [r1 - r0, min(k, t)] (the compressor takes every row)."""
        s, act = x.shape[0], x.dtype
        start = int(start)
        r0, r1 = rows or (0, s)
        q, w = self._query(x[r0:r1], qr[r0:r1], tuple(c[r0:r1] for c in cs), act)
        self.compressor.prefill(x, st.index_compressor, st.index_cache, freqs, start)
        t = visible_bound(start, s, 4, st.index_cache.shape[0] - 1)
        k = min(self.cfg.index_topk, t)
        if k == 0:
            return torch.empty(r1 - r0, 0, dtype=torch.int64, device=x.device)
        keys = st.index_cache[:t]
        visible = (start + 1 + torch.arange(r0, r1, device=x.device)).unsqueeze(1) // 4
        cols = torch.arange(t, device=x.device)
        # chunk the queries so the [c, h, t] score tensor stays bounded for long prompts
        c = max(1, SCORE_ELEMS // self.n_heads // max(1, t))
        out = []
        for i in range(0, r1 - r0, c):
            sc = index_scores(q[i:i + c], w[i:i + c], keys)                   # [c, t]
            sc = sc.masked_fill(cols >= visible[i:i + c], float("-inf"))
            out.append(self.select(sc, k, visible[i:i + c], offset))
        return torch.cat(out, dim=0)

    @staticmethod
    def select(scores: torch.Tensor, k: int, visible: torch.Tensor, offset: int) -> torch.Tensor:
        """The top-k of masked scores [s, t] -> entry + offset, -1 where not visible."""
        idx = topk_lowest(scores, k)
        return torch.where(idx >= visible, -1, idx + offset)

    def decode_reference(self, x, qr, cs, pos, st: LayerState, freqs, offset: int
                         ) -> torch.Tensor:
        """One query at `pos` -> [1, min(k, n)] indices over the whole fixed-size cache
        (+offset, -1 where not visible). Capture-safe."""
        act = x.dtype
        keys = st.index_cache[:-1]                                    # [n, di], scratch row excluded
        visible = (pos + 1) // 4                                      # [1]
        q, w = self._query(x, qr, cs, act)
        self.compressor.decode(x, pos, st.index_compressor, st.index_cache, freqs)
        sc = index_scores(q, w, keys)                                 # [1, n]
        cols = torch.arange(keys.shape[0], device=x.device)
        sc = sc.masked_fill(cols >= visible, float("-inf"))
        return self.select(sc, min(self.cfg.index_topk, keys.shape[0]), visible, offset)
