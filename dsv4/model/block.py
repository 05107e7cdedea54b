"""One transformer block: hyper-connection mixing around attention and the MoE (DSV4_SPEC §3.2).

Legend: s = tokens, c = hc_mult copies, D = dim. The residual stream h [s, c, D] is in the
activation dtype. `decode` is capture-safe; `prefill` runs a chunk of positions at any offset.
The mixes run as the fused mHC kernels where the device's backend says so (self.ops), else the
torch math of dsv4.numerics.mhc.
"""
from __future__ import annotations

import torch

from ..backend import branches
from .attention import Attention
from ..weights.config import ModelConfig
from ..numerics.mhc import hc_post, hc_pre, rms_norm
from .moe import MoE
from ..backend.ops import Ops
from .state import LayerState


class Block:
    def __init__(self, cfg: ModelConfig, layer_id: int, device, hadamard_matrix=None,
                 ops: Ops | None = None):
        self.cfg, self.layer_id, self.device = cfg, layer_id, torch.device(device)
        self.ratio = cfg.ratio(layer_id)
        self.ops = ops or Ops.for_device(device, cfg=cfg)     # the model passes its device's
        fmt = "fp8" if cfg.quantized else "bf16"
        self.attn = Attention(cfg, self.ratio, fmt, device, hadamard_matrix, ops=self.ops)
        self.ffn = MoE(cfg, layer_id, fmt, cfg.expert_format, device, ops=self.ops)
        D, mix = cfg.dim, cfg.mix_hc
        f32 = dict(dtype=torch.float32, device=device)
        self.attn_norm = torch.empty(D, **f32)
        self.ffn_norm = torch.empty(D, **f32)
        self.hc = {f"hc_{k}_{p}": torch.empty(*shape, **f32)
                   for k in ("attn", "ffn")
                   for p, shape in (("fn", (mix, cfg.hc_mult * D)), ("base", (mix,)), ("scale", (3,)))}

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        d = {f"{prefix}.attn_norm.weight": self.attn_norm, f"{prefix}.ffn_norm.weight": self.ffn_norm}
        d.update({f"{prefix}.{k}": v for k, v in self.hc.items()})
        d.update(self.attn.tensors(f"{prefix}.attn"))
        d.update(self.ffn.tensors(f"{prefix}.ffn"))
        return d

    def set_ops(self, ops: Ops) -> None:
        """Another backend for the block and everything in it (Transformer.use_options)."""
        self.ops = ops
        self.attn.set_ops(ops)
        self.ffn.set_ops(ops)

    def weights(self) -> list:
        """Every Linear / ExpertBank of the block (for per-weight settings such as dense caching)."""
        a = self.attn
        out = [a.wq_a, a.wq_b, a.wkv, a.wo_a, a.wo_b, self.ffn.gate, self.ffn.experts,
               *self.ffn.shared.values()]
        for c in (a.compressor, a.indexer and a.indexer.compressor):
            if c:
                out += [c.wkv, c.wgate]
        if a.indexer:
            out += [a.indexer.wq_b, a.indexer.weights_proj]
        return out

    def _hc(self, kind: str) -> tuple:
        """The mix weights of sublayer `kind` ("attn" / "ffn"): (fn, scale, base)."""
        return self.hc[f"hc_{kind}_fn"], self.hc[f"hc_{kind}_scale"], self.hc[f"hc_{kind}_base"]

    def _mix(self, h: torch.Tensor, kind: str, norm: torch.Tensor):
        cfg = self.cfg
        x, post, comb = hc_pre(h, *self._hc(kind), cfg.norm_eps, cfg.hc_eps,
                               cfg.hc_sinkhorn_iters)
        return rms_norm(x, norm, cfg.norm_eps), post, comb

    def prefill(self, h: torch.Tensor, ids: torch.Tensor, st: LayerState, start=0,
                shared: dict | None = None) -> torch.Tensor:
        """Positions start..start+s-1: h [s, c, D], ids [s] -> [s, c, D]; updates `st` (which
        holds positions < start) as s decode steps would. start: an int, or a [1] int64 device
        tensor (with the kernels: capture-safe, see Attention.prefill). shared: values the
        layers of one chunk compute once (Attention.prefill)."""
        mix, post_fn = self._mix, hc_post
        if self.ops.backend.mhc_prefill:       # the chunk's rows on the mHC rows kernels
            mix, post_fn = self._mix_rows, self.ops.hc_post_rows
        x, post, comb = mix(h, "attn", self.attn_norm)
        h = post_fn(self.attn.prefill(x, st, start, shared), h, post, comb)
        x, post, comb = mix(h, "ffn", self.ffn_norm)
        return post_fn(self.ffn.prefill(x, ids), h, post, comb)

    def _mix_rows(self, h: torch.Tensor, kind: str, norm: torch.Tensor):
        return self.ops.hc_pre_norm_rows(h, *self._hc(kind), norm, self.cfg)

    def _mix_decode(self, h: torch.Tensor, kind: str, norm: torch.Tensor, branch=None):
        """The fused hc_pre + RMSNorm of decode rows h [T, c, D] (Ops.hc_pre_norm)."""
        return self.ops.hc_pre_norm(h, *self._hc(kind), norm, self.cfg, branch)

    def decode(self, h: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, st: LayerState,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """h [1, c, D], ids [1], pos [1] (device tensors) -> [1, c, D]. Capture-safe. out: where
        the result goes (may be h itself: the layer reads h only before its last kernel, which
        reads the attention sublayer's output instead; a decode step's static buffer then needs
        no copy); default a new tensor. With the fused mHC kernels: decode_rows of one row."""
        if self.ops.backend.mhc_decode and h.shape[0] == 1:
            return self.decode_rows(h, ids, pos, st, out=out)
        x, post, comb = self._mix(h, "attn", self.attn_norm)
        h = hc_post(self.attn.decode(x, pos, st), h, post, comb)
        x, post, comb = self._mix(h, "ffn", self.ffn_norm)
        y = hc_post(self.ffn.decode(x, ids), h, post, comb)
        return y if out is None else out.copy_(y)

    def decode_rows(self, h: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, st: LayerState,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """T rows at positions pos .. pos+T-1, row t seeing rows < t: h [T, c, D], ids [T] ->
        [T, c, D] (into out, which may be h). T = 1: decode's fused path; T > 1 (the speculative
        verify rows): row t with the bits of decode(h[t:t+1], ids[t:t+1], pos + t) after the rows
        before it. With the fused kernels every launch of the mHC and the linears takes all rows
        (one binary per row: the same bits; the linears read each weight once), Attention /
        MoE.decode_rows; each Sinkhorn runs beside its sublayer (hc_pre_norm's branch forks after
        its mix). Otherwise T decode calls. Capture-safe."""
        ops = self.ops
        if not ops.backend.mhc_decode:
            out = torch.empty_like(h) if out is None else out
            for t in range(h.shape[0]):
                self.decode(h[t:t + 1], ids[t:t + 1], pos + t, st, out=out[t:t + 1])
            return out
        sk = branches.Branch(h, "mhc", ops.backend.branches, lane=2, fork=False)
        x, post, comb = self._mix_decode(h, "attn", self.attn_norm, sk)
        a = self.attn.decode_rows(x, pos, st)
        sk.join()
        h = ops.hc_post(a, h, post, comb)
        sk = branches.Branch(h, "mhc", ops.backend.branches, lane=2, fork=False)
        x, post, comb = self._mix_decode(h, "ffn", self.ffn_norm, sk)
        f = self.ffn.decode_rows(x, ids)
        sk.join()
        return ops.hc_post(f, h, post, comb, out=out)

