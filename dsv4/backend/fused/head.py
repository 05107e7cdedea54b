"""The head's kernels: hc_head + the final RMSNorm of the rows in one launch (with the fused mHC),
and the bf16 head as one float32-accumulating GEMV (reading the head once for all rows where the
rows' mHC is fused too; else a GEMV per row, as the torch reference goes row by row)."""
from __future__ import annotations

import functools

import torch

from ..ops import Ops


def head_in_rows(model, ops: Ops, h: torch.Tensor, head: tuple | None = None) -> torch.Tensor:
    """Transformer.head_in_rows_reference in one launch: h [T, c, D] -> [T, D] float32."""
    cfg = model.cfg
    hc_t, norm = head if head is not None else (model.hc_head, model.norm)
    return ops.hc_head_norm(h, hc_t["hc_head_fn"], hc_t["hc_head_scale"], hc_t["hc_head_base"],
                            norm, cfg.norm_eps, cfg.hc_eps).to(torch.float32)


def head_matmul(model, ops: Ops, x: torch.Tensor, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """x [T, D] float32 -> logits [T, Vh] float32 of the head's rows held here (V in one
    process), one GEMV launch for all rows (row t with the bits of a one-row launch)."""
    return ops.bf16_linear(x, model.head, out_dtype=torch.float32, out=out)


def head_matmul_per_row(model, ops: Ops, x: torch.Tensor, out: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """head_matmul one row at a time."""
    if out is None:
        out = torch.empty(x.shape[0], model.head.shape[0], dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        out[t].copy_(head_matmul(model, ops, x[t:t + 1])[0])
    return out


def draft_matmul(model, ops: Ops, x: torch.Tensor) -> torch.Tensor:
    """Transformer.draft_matmul_reference on the FP8 GEMV: x [1, D] float32 -> [1, Vh] float32."""
    w = model.draft_head
    return ops.fp8_linear(x, w.weight, w.scale, out_dtype=torch.float32)


def bind(model, ops: Ops) -> None:
    """head_in_rows on the fused mHC where the head device has it; head_matmul on the GEMV where
    the kernels run there (all rows at once with the fused mHC, else row by row)."""
    be = ops.backend
    model.head_in_rows = (functools.partial(head_in_rows, model, ops) if be.mhc_decode
                          else model.head_in_rows_reference)
    model.head_matmul = (functools.partial(head_matmul, model, ops) if be.mhc_decode
                         else functools.partial(head_matmul_per_row, model, ops) if be.kernels
                         else model.head_matmul_reference)
    model.draft_matmul = (functools.partial(draft_matmul, model, ops) if be.kernels
                          else model.draft_matmul_reference)
