"""The MTP block's input of decode rows on the kernels: enorm and hnorm as one RMSNorm launch each
(a program a row), e_proj and h_proj as one GEMV launch each for every row (T rows, T x c rows),
where the torch reference goes row by row through ~10 torch ops and a prefill GEMM for h_proj's
c rows. Row t has the bits of a one-row call, so the plain steps' MTP follow (one row) and the
speculative step's rows keep the same state. The math: dsv4.model.mtp.MTPBlock._input.
"""
from __future__ import annotations

import functools

import torch

from ..ops import Ops


def input_rows(mtp, ops: Ops, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """MTPBlock.input_rows_reference on the kernels: h [T, c, D], emb [T, D] -> [T, c, D]."""
    T, c, D = h.shape
    act, eps = mtp.act, mtp.cfg.norm_eps
    e = mtp.e_proj.rows(ops.rms_norm_row(emb.to(act).contiguous(), mtp.enorm, eps), act)
    hn = ops.rms_norm_row(h.to(act).reshape(T * c, D).contiguous(), mtp.hnorm, eps)
    return (e.unsqueeze(1) + mtp.h_proj.rows(hn, act).view(T, c, D)).to(act)


def bind(mtp, ops: Ops) -> None:
    """input_rows on the kernels where the backend has the decode kernels and the activations
    are bf16 (the RMSNorm kernel's rows), else the torch reference."""
    fits = ops.backend.kernels and mtp.act == torch.bfloat16
    mtp.input_rows = (functools.partial(input_rows, mtp, ops) if fits
                      else mtp.input_rows_reference)
