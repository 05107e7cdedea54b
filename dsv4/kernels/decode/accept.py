"""The greedy acceptance of a speculative step in one launch: from the rows' argmax (the main
model's tokens) and the drafts, the tokens the step outputs, how many rows it keeps and the record
the host reads (dsv4.runtime.speculative.verify.accept, greedy, is the reference: ~17 small torch
kernels and 4 copies there). Integer work only: exact.
Test: tests/dsv4/kernels/test_decode_kernels_interp.py (the interpreter against accept).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import on_device


@triton.jit
def _accept_greedy_kernel(am_ptr, drafts_ptr, limit_ptr, eos_ptr, pending_ptr, y_ptr, keep_ptr,
                          rec_ptr, T: tl.constexpr, TP: tl.constexpr):
    # y = the rows' argmax; n = the drafts matched before the first miss (<= T - 1); keep =
    # min(n, limit - 1, the first row whose y is the EOS (eos >= 0)), and 0 where the pending
    # token (row 0's) is the EOS; record = [keep + 1, y]
    i = tl.arange(0, TP)
    row = i < T
    y = tl.load(am_ptr + i, mask=row, other=0)
    d = tl.load(drafts_ptr + i, mask=i < T - 1, other=0)
    miss = (i < T - 1) & (y != d)
    n = tl.minimum(tl.min(tl.where(miss, i, TP), axis=0), T - 1)
    eos = tl.load(eos_ptr)
    first_eos = tl.min(tl.where(row & (y == eos) & (eos >= 0), i, T), axis=0)
    limit = tl.where((tl.load(pending_ptr) == eos) & (eos >= 0), 1, tl.load(limit_ptr))
    keep = tl.minimum(tl.minimum(n.to(tl.int64), limit - 1), first_eos.to(tl.int64))
    tl.store(y_ptr + i, y, mask=row)
    tl.store(keep_ptr, keep)
    tl.store(rec_ptr, keep + 1)
    tl.store(rec_ptr + 1 + i, y, mask=row)


def accept_greedy(am: torch.Tensor, drafts: torch.Tensor, limit: torch.Tensor, eos: torch.Tensor,
                  pending: torch.Tensor, y: torch.Tensor, keep: torch.Tensor,
                  record: torch.Tensor) -> None:
    """am [T] or [T, 1] int64 (the rows' argmax), drafts [T - 1], limit / eos / pending [1] int64
    -> y [T], keep [1], record [1 + T] int64, written in place: verify.accept's (y, keep) for
    greedy sampling and the step's record (keep + 1, then y). One launch, capture-safe."""
    T = y.shape[0]
    with on_device(y):
        _accept_greedy_kernel[(1,)](am.reshape(-1), drafts, limit, eos, pending, y, keep, record,
                                    T=T, TP=triton.next_power_of_2(T), num_warps=1)
