"""Fixed-shape decode state of one layer, allocated once at the cache capacity and reset per sequence.

Legend: W = window, r = compress ratio, n = capacity // r, d = head_dim, di = index_head_dim,
c = 2 for r == 4 (overlap mode) else 1. Every buffer keeps its address for the decoder's lifetime
(CUDA graphs replay against these pointers); `reset()` refills them in place.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..weights.config import ModelConfig


@dataclass
class CompressorState:
    """Gated-pooling state of one compressor (DSV4_SPEC §6.1)."""
    kv: torch.Tensor      # [c*r, c*dc] f32, fill 0: raw wkv projections of the current (+previous) block
    score: torch.Tensor   # [c*r, c*dc] f32, fill -inf: wgate projections + ape
    FILLS = {"kv": 0.0, "score": float("-inf")}

    @classmethod
    def allocate(cls, ratio: int, dc: int, device) -> "CompressorState":
        c = 2 if ratio == 4 else 1
        st = cls(kv=torch.empty(c * ratio, c * dc, dtype=torch.float32, device=device),
                 score=torch.empty(c * ratio, c * dc, dtype=torch.float32, device=device))
        st.reset()
        return st

    def reset(self) -> None:
        self.kv.fill_(self.FILLS["kv"])
        self.score.fill_(self.FILLS["score"])


@dataclass
class LayerState:
    """All persistent decode state of one attention layer."""
    kv_cache: torch.Tensor               # [W + n + (1 if r else 0), d] act dtype; rows [0, W) window
    # ring (token p at slot p % W), rows [W, W+n) compressed entries, last row = scratch for
    # masked (non-emitting) compressor writes. Fill 0.
    compressor: CompressorState | None = None
    index_cache: torch.Tensor | None = None   # [n + 1, di] act dtype (r == 4), last row scratch. Fill 0.
    index_compressor: CompressorState | None = None

    @classmethod
    def allocate(cls, cfg: ModelConfig, ratio: int, capacity: int, act_dtype: torch.dtype,
                 device) -> "LayerState":
        W = cfg.window_size
        n = capacity // ratio if ratio else 0
        st = cls(kv_cache=torch.empty(W + n + (1 if ratio else 0), cfg.head_dim, dtype=act_dtype,
                                      device=device))
        if ratio:
            st.compressor = CompressorState.allocate(ratio, cfg.head_dim, device)
        if ratio == 4:
            st.index_cache = torch.empty(n + 1, cfg.index_head_dim, dtype=act_dtype, device=device)
            st.index_compressor = CompressorState.allocate(ratio, cfg.index_head_dim, device)
        st.reset()
        return st

    def reset(self) -> None:
        """Start a new sequence: zero caches, compressor states to (0, -inf). In place."""
        self.kv_cache.zero_()
        if self.index_cache is not None:
            self.index_cache.zero_()
        for c in (self.compressor, self.index_compressor):
            if c is not None:
                c.reset()

    def buffers(self) -> dict[str, torch.Tensor]:
        out = {"kv_cache": self.kv_cache}
        if self.index_cache is not None:
            out["index_cache"] = self.index_cache
        for name in ("compressor", "index_compressor"):
            c = getattr(self, name)
            if c is not None:
                out[f"{name}.kv"], out[f"{name}.score"] = c.kv, c.score
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers().values())
