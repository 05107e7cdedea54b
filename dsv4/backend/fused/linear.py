"""A weight's kernels: one decode row (or a few: the verify rows) on the GEMV kernels, a prefill
chunk's rows on the stored-format GEMM, each where it fits the call (the weight's format, the
dtypes); anything else takes the weight's torch reference (dsv4.model.linear.Linear)."""
from __future__ import annotations

import torch

from ...weights.formats import FP8_BLOCK
from ..ops import Ops


class KernelLinear:
    """The kernels bound to one Linear: gemv (decode rows on the GEMV kernels), gemm (a chunk's
    rows on the prefill GEMM), both decided once for the weight and its device."""

    def __init__(self, lin, ops: Ops, gemv: bool, gemm: bool):
        self.lin, self.ops, self.gemv, self.gemm = lin, ops, gemv, gemm

    def __call__(self, x: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
        lin = self.lin
        if self.gemv and x.numel() == lin.in_features:
            y = self._gemv(x, act_dtype)
            if y is not None:
                return y.view(*x.shape[:-1], lin.out_features)
        elif (self.gemm and x.numel() > lin.in_features and x.dtype == torch.bfloat16
              and act_dtype in (torch.bfloat16, torch.float32)):
            y = self.ops.prefill_linear(x.reshape(-1, lin.in_features), lin.weight, lin.scale,
                                        lin.fmt, out_dtype=act_dtype)
            return y.view(*x.shape[:-1], lin.out_features)
        return lin.reference(x, act_dtype)

    def rows(self, x: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
        """Decode rows x [T, in]: the GEMV reads the weight once for all rows, row t with the bits
        of a one-row call; where it does not fit, one call per row."""
        if self.gemv:
            y = self._gemv(x, act_dtype)
            if y is not None:
                return y
        return self.lin.reference_rows(x, act_dtype)

    def _gemv(self, x: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor | None:
        """The GEMV of decode rows in bf16 mode, or None (the torch path). float32 mode (x and act
        float32) stays on torch; bf16 weights in bf16 mode may ask for float32 output."""
        lin = self.lin
        if (lin.fmt == "fp8" and act_dtype == torch.bfloat16
                and x.dtype in (torch.bfloat16, torch.float32)
                and lin.out_features % FP8_BLOCK == 0 and lin.in_features % FP8_BLOCK == 0):
            return self.ops.fp8_linear(x, lin.weight, lin.scale)
        if (lin.fmt == "bf16" and x.dtype == torch.bfloat16
                and act_dtype in (torch.bfloat16, torch.float32)):
            return self.ops.bf16_linear(x, lin.weight, out_dtype=act_dtype)
        return None


def bind(lin, ops: Ops) -> None:
    """Bind lin to the kernels its device's backend has for it, else to its torch reference."""
    be = ops.backend
    gemv, gemm = be.kernels, be.gemm_fits(lin.fmt, lin.in_features)
    if gemv or gemm:
        k = KernelLinear(lin, ops, gemv, gemm)
        lin.forward, lin.forward_rows = k, k.rows
    else:
        lin.forward, lin.forward_rows = lin.reference, lin.reference_rows
