"""Compressor: gated pooling of r consecutive tokens' KV into one compressed entry (DSV4_SPEC §3.4).

Ratio 4 runs in overlap mode (c = 2: each entry also pools the first channel half of the previous
block). Legend: s = tokens, r = ratio, dc = entry dim (head_dim, or index_head_dim for the
indexer's rotating compressor), D = model dim. `prefill` and `decode` run the torch reference
unless a backend bound kernels to them (bound by dsv4/backend/binding.py: dsv4/backend/fused/compressor.py).
"""
from __future__ import annotations

import torch

from ..numerics.mhc import rms_norm
from ..numerics.quant import fp4_quant_dequant, fp8_quant_dequant, hadamard
from ..numerics.rope import apply_rope, cos_sin
from ..weights.config import ModelConfig
from .linear import Linear
from .state import CompressorState


class Compressor:
    """Weights of one compressor; prefill (batched) and a capture-safe decode step.

    Bound ops (the torch reference below until the backend binds kernels): `prefill`
    (prefill_reference) and `decode` (decode_reference)."""

    def __init__(self, cfg: ModelConfig, ratio: int, dc: int, rotate: bool, device):
        self.cfg, self.ratio, self.dc, self.rotate = cfg, ratio, dc, rotate
        self.overlap = ratio == 4
        c = 2 if self.overlap else 1
        # stored bf16, applied in float32 (the reference holds them as float32)
        self.wkv = Linear(c * dc, cfg.dim, "bf16", device)
        self.wgate = Linear(c * dc, cfg.dim, "bf16", device)
        self.ape = torch.empty(ratio, c * dc, dtype=torch.float32, device=device)
        self.norm = torch.empty(dc, dtype=torch.float32, device=device)
        self.hadamard = None  # set by the owner when rotate (shared matrix)
        self.prefill = self.prefill_reference
        self.decode = self.decode_reference

    def linears(self) -> list:
        return [self.wkv, self.wgate]

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        d = {**self.wkv.tensors(f"{prefix}.wkv"), **self.wgate.tensors(f"{prefix}.wgate")}
        d[f"{prefix}.ape"] = self.ape
        d[f"{prefix}.norm.weight"] = self.norm
        return d

    def project(self, x: torch.Tensor):
        """x [s, D] act -> (wkv(x), wgate(x)) [s, c*dc] float32 each."""
        return self.wkv(x, torch.float32), self.wgate(x, torch.float32)

    def _finish(self, c: torch.Tensor, first_pos: torch.Tensor, freqs: torch.Tensor,
                act: torch.dtype) -> torch.Tensor:
        """Pooled f32 [n, dc] -> norm, RoPE at the block's first position, fake-quant -> act [n, dc]."""
        cfg = self.cfg
        e = rms_norm(c.to(act), self.norm, cfg.norm_eps)
        e = apply_rope(e, cos_sin(first_pos, freqs))
        if self.rotate:
            return fp4_quant_dequant(hadamard(e, self.hadamard), 32)
        nope = cfg.head_dim - cfg.rope_head_dim
        return torch.cat((fp8_quant_dequant(e[:, :nope], 64), e[:, nope:]), dim=-1)

    def prefill_reference(self, x: torch.Tensor, st: CompressorState, cache: torch.Tensor,
                          freqs: torch.Tensor, start) -> None:
        """Tokens start..start+s-1 (x [s, D] act) after positions < start: the same state and cache
        as s decode steps. Every block that completes in the chunk is pooled (its earlier rows
        come from the state) and its entry written to cache[j]; the state then holds the last
        complete block (overlap mode) and each block row as decode steps leave it.
        start: an int, or a [1] int64 device tensor (read on the host here; the kernels' prefill
        keeps it on the device, capture-safe)."""
        kv, sc = self.project(x)                                      # [s, c*dc] f32
        start = int(start)
        r, dc, s = self.ratio, self.dc, x.shape[0]
        pos = torch.arange(start, start + s, device=x.device)
        sc = sc + self.ape.index_select(0, pos % r)
        b0 = start - start % r                        # first position of start's block
        cur = r if self.overlap else 0                # state row of position b0
        ext_kv = torch.cat((st.kv[cur:cur + start - b0], kv))         # positions b0 .. start+s-1
        ext_sc = torch.cat((st.score[cur:cur + start - b0], sc))
        nb = ext_kv.shape[0] // r                                     # blocks completed here
        j0 = b0 // r
        if nb:
            kvb = ext_kv[:nb * r].unflatten(0, (nb, r))                 # [nb, r, c*dc]
            scb = ext_sc[:nb * r].unflatten(0, (nb, r))
            if self.overlap:        # each block also pools the first half of the one before it
                pkv = torch.cat((st.kv[None, :r], kvb[:-1]))            # block t-1 (t = 0: state)
                psc = torch.cat((st.score[None, :r], scb[:-1]))
                kvp = torch.cat((pkv[..., :dc], kvb[..., dc:]), dim=1)  # [nb, 2r, dc]
                scp = torch.cat((psc[..., :dc], scb[..., dc:]), dim=1)
            else:
                kvp, scp = kvb, scb
            c = (kvp * scp.softmax(dim=1)).sum(dim=1)                   # [nb, dc] f32
            cache[j0:j0 + nb] = self._finish(c, torch.arange(j0, j0 + nb, device=x.device) * r,
                                             freqs, x.dtype)
            if self.overlap:                          # the last complete block -> "previous"
                st.kv[:r] = kvb[-1]
                st.score[:r] = scb[-1]
        # block rows as decode steps leave them: position p in row cur + p % r, the latest
        # position of each row winning (rows past the open block's end keep the block before)
        m = min(ext_kv.shape[0], r)
        rows = cur + torch.arange(start + s - m, start + s, device=x.device) % r
        st.kv[rows] = ext_kv[-m:]
        st.score[rows] = ext_sc[-m:]

    def decode_reference(self, x: torch.Tensor, pos: torch.Tensor, st: CompressorState,
                         cache: torch.Tensor, freqs: torch.Tensor, proj: list | None = None
                         ) -> None:
        """One token at `pos` ([1] int64): update state; when (pos+1) % r == 0 write entry pos//r,
        else write the same computation to the scratch row (cache[-1]). Capture-safe.
        proj: (wkv(x), wgate(x)) float32 when the caller computed them already."""
        r, dc = self.ratio, self.dc
        kv, sc = self.project(x) if proj is None else proj              # [1, c*dc]
        slot = pos % r
        sc = sc + self.ape.index_select(0, slot)
        row = slot + r if self.overlap else slot
        st.kv.index_copy_(0, row, kv)
        st.score.index_copy_(0, row, sc)
        if self.overlap:
            kvc = torch.cat((st.kv[:r, :dc], st.kv[r:, dc:]), dim=0)   # [2r, dc]
            scc = torch.cat((st.score[:r, :dc], st.score[r:, dc:]), dim=0)
        else:
            kvc, scc = st.kv, st.score
        c = (kvc * scc.softmax(dim=0)).sum(dim=0, keepdim=True)       # [1, dc] f32
        emit = (pos + 1) % r == 0                                      # [1] bool
        if self.overlap:                                               # current block -> previous
            st.kv[:r] = torch.where(emit, st.kv[r:], st.kv[:r])
            st.score[:r] = torch.where(emit, st.score[r:], st.score[:r])
        entry = self._finish(c, (pos + 1 - r).clamp_min(0), freqs, x.dtype)
        scratch = cache.shape[0] - 1
        dst = torch.where(emit, pos // r, torch.full_like(pos, scratch))
        cache.index_copy_(0, dst, entry)

