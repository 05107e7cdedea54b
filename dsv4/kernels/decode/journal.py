"""The speculative step's journal in one launch: save (before the verify pass) or put back (after
acceptance) every state slot of a layer's entries (dsv4.runtime.speculative.verify.Journal, whose torch loop is the
reference), instead of ~3 small torch kernels per slot. Entries are rows of state tensors at
addresses fixed for the decoder's lifetime, so a table of raw addresses is built once; the slots'
rows depend on the device position and are computed in the kernel. Copies of 32-bit words: exact.
Test: `python -m pytest tests/dsv4/test_spec_step.py -m cuda`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import on_device

COLS = 10        # table columns, see JournalKernel
BLOCK = 1024     # 32-bit words per program step (the widest row: 1,024 float32 compressor values)


@triton.jit
def _journal_kernel(tab_ptr, pos_ptr, keep_ptr, REWIND: tl.constexpr, BLOCK: tl.constexpr):
    # one program per entry: rows o + ((q // a) % b) + [0, n) of the tensor at src, q = pos + i;
    # save: -> buf; rewind: buf -> them where the row i was dropped (keep < i) and, if r > 0,
    # the row completed a compressor block ((q + 1) % r == 0)
    t = tab_ptr + tl.program_id(0) * 10
    src = tl.load(t).to(tl.pointer_type(tl.int32))
    stride = tl.load(t + 1)
    nw = tl.load(t + 2)
    n = tl.load(t + 3)
    o = tl.load(t + 4)
    a = tl.load(t + 5)
    b = tl.load(t + 6)
    r = tl.load(t + 7)
    i = tl.load(t + 8)
    buf = tl.load(t + 9).to(tl.pointer_type(tl.int32))
    q = tl.load(pos_ptr) + i
    base = o + (q // a) % b
    w = tl.arange(0, BLOCK)
    if REWIND:
        undo = tl.load(keep_ptr) < i
        undo = undo & ((r == 0) | ((q + 1) % tl.maximum(r, 1) == 0))
        for j in range(0, n):
            for w0 in range(0, nw, BLOCK):
                m = (w0 + w < nw) & undo
                v = tl.load(buf + j * nw + w0 + w, mask=m)
                tl.store(src + (base + j) * stride + w0 + w, v, mask=m)
    else:
        for j in range(0, n):
            for w0 in range(0, nw, BLOCK):
                m = w0 + w < nw
                v = tl.load(src + (base + j) * stride + w0 + w, mask=m)
                tl.store(buf + j * nw + w0 + w, v, mask=m)


class JournalKernel:
    """The journal entries (i, tensor, n, o, a, b, r, buf) of dsv4.runtime.speculative.verify.Journal as a device
    table: [address, words per row, words copied per row, n, o, a, b, r, i, buffer address]."""

    def __init__(self, entries):
        rows = []
        for i, t, n, o, a, b, r, buf in entries:
            row_bytes = t.stride(0) * t.element_size()
            copy_bytes = t[0].numel() * t.element_size()
            if row_bytes % 4 or copy_bytes % 4 or t.data_ptr() % 4 or buf.data_ptr() % 4 \
                    or not t[0].is_contiguous() or not buf.is_contiguous():
                raise ValueError(f"journal entry {tuple(t.shape)} {t.dtype}: rows must be "
                                 f"contiguous whole 32-bit words")
            rows.append([t.data_ptr(), row_bytes // 4, copy_bytes // 4, n, o, a, b, r, i,
                         buf.data_ptr()])
        dev = entries[0][1].device
        self.table = torch.tensor(rows, dtype=torch.int64, device=dev)
        self._keep_dummy = torch.zeros(1, dtype=torch.int64, device=dev)
        self.tensors = [e[1] for e in entries] + [e[7] for e in entries]   # keep them alive

    def run(self, pos: torch.Tensor, keep: torch.Tensor | None) -> None:
        """keep None: save; else put back the entries of rows after keep. Capture-safe."""
        with on_device(self.table):
            _journal_kernel[(self.table.shape[0],)](
                self.table, pos, self._keep_dummy if keep is None else keep,
                REWIND=keep is not None, BLOCK=BLOCK, num_warps=4)
