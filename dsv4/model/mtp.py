"""The checkpoint's multi-token-prediction block `mtp.0` (DSV4_SPEC §3.8).

At position t it takes the main model's hidden stream h_t (all hc_mult copies, after the last main
layer, before hc_head) and the token at t+1, and its logits predict the token at t+2:
  e = enorm(embed(token_{t+1})),  x = e_proj(e) + h_proj(hnorm(h_t))   (per copy),
then one ordinary Block (layer id n_layers: its compress ratio is the last entry of
compress_ratios, score routing) with its own decode state, and the shared head through the block's
own hc_head_* and norm. Legend: s = rows, c = hc_mult, D = dim.
"""
from __future__ import annotations

import torch

from ..numerics.mhc import rms_norm
from ..weights.config import ModelConfig
from .block import Block
from .linear import Linear
from .sharding import TensorParallel
from .state import LayerState


class MTPBlock:
    """Weights and decode state of one MTP block; eager prefill over rows and a one-row decode."""

    def __init__(self, cfg: ModelConfig, index: int, device, capacity: int, act: torch.dtype,
                 hadamard_matrix: torch.Tensor | None = None, tp: TensorParallel | None = None):
        self.cfg, self.index, self.device, self.act = cfg, index, torch.device(device), act
        layer_id = cfg.n_layers + index
        fmt = "fp8" if cfg.quantized else "bf16"
        D = cfg.dim
        f32 = dict(dtype=torch.float32, device=device)
        self.block = Block(cfg, layer_id, device, hadamard_matrix, tp)   # split as the layers
        self.e_proj = Linear(D, D, fmt, device)
        self.h_proj = Linear(D, D, fmt, device)
        self.enorm, self.hnorm, self.norm = (torch.empty(D, **f32) for _ in range(3))
        self.hc_head = {"hc_head_fn": torch.empty(cfg.hc_mult, cfg.hc_mult * D, **f32),
                        "hc_head_base": torch.empty(cfg.hc_mult, **f32),
                        "hc_head_scale": torch.empty(1, **f32)}
        self.state = LayerState.allocate(cfg, cfg.ratio(layer_id), capacity, act, device)
        self.input_rows = self.input_rows_reference      # bound (dsv4.backend.fused.mtp)

    def tensors(self) -> dict[str, torch.Tensor]:
        p = f"mtp.{self.index}"
        d = {f"{p}.enorm.weight": self.enorm, f"{p}.hnorm.weight": self.hnorm,
             f"{p}.norm.weight": self.norm}
        d.update({f"{p}.{k}": v for k, v in self.hc_head.items()})
        d.update(self.e_proj.tensors(f"{p}.e_proj"))
        d.update(self.h_proj.tensors(f"{p}.h_proj"))
        d.update(self.block.tensors(p))
        return d

    def parts(self) -> dict:
        """Checkpoint name -> the Part of it this rank holds (its block's; {} in one process)."""
        return self.block.parts(f"mtp.{self.index}")

    def weights(self) -> list:
        return [self.e_proj, self.h_proj, *self.block.weights()]

    def head(self) -> tuple[dict, torch.Tensor]:
        """(hc_head_* tensors, final norm) for Transformer.logits."""
        return self.hc_head, self.norm

    def _input(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """h [s, c, D] main hidden stream, emb [s, D] embeddings of the next tokens -> x [s, c, D]."""
        cfg, act = self.cfg, self.act
        s, c, D = h.shape
        e = self.e_proj(rms_norm(emb.to(act), self.enorm, cfg.norm_eps), act)          # [s, D]
        hn = rms_norm(h.to(act), self.hnorm, cfg.norm_eps).reshape(s * c, D)
        return (e.unsqueeze(1) + self.h_proj(hn, act).view(s, c, D)).to(act)

    def prefill(self, h: torch.Tensor, emb: torch.Tensor, ids: torch.Tensor, start: int
                ) -> torch.Tensor:
        """Rows at positions start..start+s-1 (h [s, c, D], emb / ids of the tokens one position
        later) -> the block's output [s, c, D]; the state then holds positions < start + s.
        start == 0 starts over (the state is reset)."""
        if start == 0:
            self.state.reset()
        return self.block.prefill(self._input(h, emb), ids, self.state, start, {})

    def input_rows_reference(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """The block's input of decode rows (h [T, c, D], emb [T, D]) -> [T, c, D], row by row,
        row t with the bits of a one-row call (the bound kernels take all rows in each launch)."""
        return torch.cat([self._input(h[t:t + 1], emb[t:t + 1]) for t in range(h.shape[0])])

    def decode(self, h: torch.Tensor, emb: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor
               ) -> torch.Tensor:
        """One row at device position pos ([1] int64): h [1, c, D] -> [1, c, D]. Capture-safe."""
        return self.block.decode(self.input_rows(h, emb), ids, pos, self.state)

    def decode_rows(self, h: torch.Tensor, emb: torch.Tensor, ids: torch.Tensor,
                    pos: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """T rows at positions pos .. pos+T-1 (the speculative step's rows): each row as decode
        after the rows before it, bit for bit (Block.decode_rows; input_rows)."""
        return self.block.decode_rows(self.input_rows(h, emb), ids, pos, self.state, out=out)

    def reset(self) -> None:
        self.state.reset()
