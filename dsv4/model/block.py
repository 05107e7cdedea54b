"""One transformer block: hyper-connection mixing around attention and the MoE (DSV4_SPEC §3.2).

Legend: s = tokens, c = hc_mult copies, D = dim. The residual stream h [s, c, D] is in the
activation dtype. Decode is capture-safe; `prefill` runs a chunk of positions at any offset. The
mixes are the torch math of dsv4.numerics.mhc; a backend may bind the fused mHC kernels to
`decode_rows`, `mix_rows` and `post_rows` (bound by dsv4/backend/binding.py: dsv4/backend/fused/block.py).
"""
from __future__ import annotations

import torch

from ..numerics.mhc import hc_post, hc_pre, rms_norm
from ..weights.config import ModelConfig
from .attention import Attention
from .moe import MoE
from .sharding import TensorParallel, same
from .state import LayerState


class Block:
    """Weights of one block: its attention, its MoE and the mix weights.

    Bound ops (the torch reference below until the backend binds kernels): `decode_rows`
    (decode_rows_reference) and, for a prefill chunk's rows, `mix_rows` (mix) and `post_rows`
    (numerics.mhc.hc_post)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, device, hadamard_matrix=None,
                 tp: TensorParallel | None = None):
        self.cfg, self.layer_id, self.device = cfg, layer_id, torch.device(device)
        self.ratio = cfg.ratio(layer_id)
        fmt = "fp8" if cfg.quantized else "bf16"
        # tp: this rank's heads and expert slices (dsv4.model.sharding); the mix weights and
        # norms are whole on every rank
        self.attn = Attention(cfg, self.ratio, fmt, device, hadamard_matrix, tp)
        self.ffn = MoE(cfg, layer_id, fmt, cfg.expert_format, device, tp)
        D, mix = cfg.dim, cfg.mix_hc
        f32 = dict(dtype=torch.float32, device=device)
        self.attn_norm = torch.empty(D, **f32)
        self.ffn_norm = torch.empty(D, **f32)
        self.hc = {f"hc_{k}_{p}": torch.empty(*shape, **f32)
                   for k in ("attn", "ffn")
                   for p, shape in (("fn", (mix, cfg.hc_mult * D)), ("base", (mix,)), ("scale", (3,)))}
        self.decode_rows = self.decode_rows_reference
        self.mix_rows, self.post_rows = self.mix, hc_post
        # tensor parallel: the rank's place (its sublayers reduce their outputs over the ranks).
        # Where the backend puts the block's mHC post into the launch before it (bound by
        # dsv4/backend/binding.py): post_reduce, each sublayer's all-reduce (tensor parallel);
        # post_in_down, the routed experts' down (one process). None / False: a launch of its own
        self.tp = tp if tp is not None and tp.world > 1 else None
        self.post_reduce: TensorParallel | None = None
        self.post_in_down = False

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        d = {f"{prefix}.attn_norm.weight": self.attn_norm, f"{prefix}.ffn_norm.weight": self.ffn_norm}
        d.update({f"{prefix}.{k}": v for k, v in self.hc.items()})
        d.update(self.attn.tensors(f"{prefix}.attn"))
        d.update(self.ffn.tensors(f"{prefix}.ffn"))
        return d

    def parts(self, prefix: str) -> dict:
        """Checkpoint name -> the Part of it this rank holds ({} in one process)."""
        return {**self.attn.parts(f"{prefix}.attn"), **self.ffn.parts(f"{prefix}.ffn")}

    def weights(self) -> list:
        """Every Linear / ExpertBank of the block (for per-weight settings such as dense caching)."""
        return [*self.attn.linears(), *self.ffn.linears(), self.ffn.experts]

    def mix_weights(self, kind: str) -> tuple:
        """The mix weights of sublayer `kind` ("attn" / "ffn"): (fn, scale, base)."""
        return self.hc[f"hc_{kind}_fn"], self.hc[f"hc_{kind}_scale"], self.hc[f"hc_{kind}_base"]

    def mix(self, h: torch.Tensor, kind: str, norm: torch.Tensor):
        """hc_pre + RMSNorm of h [s, c, D] before sublayer `kind` -> (x [s, D], post, comb)."""
        cfg = self.cfg
        x, post, comb = hc_pre(h, *self.mix_weights(kind), cfg.norm_eps, cfg.hc_eps,
                               cfg.hc_sinkhorn_iters)
        return rms_norm(x, norm, cfg.norm_eps), post, comb

    def prefill(self, h: torch.Tensor, ids: torch.Tensor, st: LayerState, start=0,
                shared: dict | None = None, seq: bool = False) -> torch.Tensor:
        """Positions start..start+s-1: h [s, c, D], ids [s] -> [s, c, D]; updates `st` (which
        holds positions < start) as s decode steps would. start: an int, or a [1] int64 device
        tensor (with the chunk kernels: capture-safe, see Attention.prefill). shared: values the
        layers of one chunk compute once (Attention.prefill). The sublayers' outputs are summed
        over the tensor-parallel ranks here. seq (tensor parallel, s a multiple of the ranks):
        h and the result are this rank's rows split(s) only (sequence parallel: the mHC of a
        rank's rows; the sublayers get every row by an all-gather and sum by a reduce-scatter;
        shared["seq"] tells the attention's indexer to select this rank's rows only)."""
        tp = self.tp
        if seq:
            rows, sums = tp.gather_rows, tp.reduce_scatter
            shared = {} if shared is None else shared
            shared["seq"] = True          # the indexer's queries split by rows too (attended)
        else:
            rows, sums = same, same if tp is None else tp.reduce
        x, post, comb = self.mix_rows(h, "attn", self.attn_norm)
        y = sums(self.attn.prefill(rows(x), st, start, shared)).to(x.dtype)
        h = self.post_rows(y, h, post, comb)
        x, post, comb = self.mix_rows(h, "ffn", self.ffn_norm)
        return self.post_rows(sums(self.ffn.prefill(rows(x), ids)).to(x.dtype), h, post, comb)

    def decode(self, h: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, st: LayerState,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """h [1, c, D], ids [1], pos [1] (device tensors) -> [1, c, D]. Capture-safe. out: where
        the result goes (may be h itself: the layer reads h only before its last kernel, which
        reads the attention sublayer's output instead; a decode step's static buffer then needs
        no copy); default a new tensor."""
        return self.decode_rows(h, ids, pos, st, out=out)

    def decode_rows_reference(self, h: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
                              st: LayerState, out: torch.Tensor | None = None) -> torch.Tensor:
        """T rows at positions pos .. pos+T-1, row t seeing rows < t: h [T, c, D], ids [T] ->
        [T, c, D] (into out, which may be h), one row after another. Capture-safe."""
        out = torch.empty_like(h) if out is None else out
        for t in range(h.shape[0]):
            out[t:t + 1].copy_(self.decode_one(h[t:t + 1], ids[t:t + 1], pos + t, st))
        return out

    def decode_one(self, h: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, st: LayerState
                   ) -> torch.Tensor:
        """The torch math of one row: h [1, c, D] -> [1, c, D]. Capture-safe."""
        x, post, comb = self.mix(h, "attn", self.attn_norm)
        h = hc_post(self.attn.decode(x, pos, st), h, post, comb)
        x, post, comb = self.mix(h, "ffn", self.ffn_norm)
        return hc_post(self.ffn.decode(x, ids), h, post, comb)
