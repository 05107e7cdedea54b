"""The greedy pick: each row's argmax in one program (one launch for every row). torch runs an
arg-reduction to one output on a single 512-thread block, whose loop takes 27.6 us for Flash's
129,280 logits on an H100 (profiled, fourteenth session: `reduce_kernel<512, 1, ArgMaxOps>`,
grid [1, 1, 1]), 1.3% of a 12-layer step; a two-pass split over 256 blocks cost the same in its
four launches. Here one program of 32 warps reads the row (just written by the head: from L2)
in blocks of 8,192 values, two blocks' loads in flight at once, each lane (a thread's values)
keeping its own best across the blocks: one block-wide reduction at the end, none in the loop.

The result is torch.argmax's: the index of the first largest value; a NaN counts above every
number (the first NaN's index wins); -0.0 equals 0.0. Reference: `argmax_reference`
(`x.argmax(-1, keepdim=True)`). Test: tests/dsv4/kernels/test_argmax_kernel.py (the interpreter
on the CPU, the GPU against torch's argmax).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import on_device

BLOCK = 8192
NUM_WARPS = 32
_NONE = tl.constexpr(2147483647)      # int32 max: "no such index yet"


def argmax_reference(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] -> [..., 1] int64: what argmax_rows computes."""
    return x.argmax(dim=-1, keepdim=True)


@triton.jit
def _lane_step(v, offs, V, lane_v, lane_i, lane_nan):
    """Each lane's state after one more value v at index offs (blocks come in index order)."""
    live = offs < V
    isnan = v != v
    lane_nan = tl.minimum(lane_nan, tl.where(isnan & live, offs, _NONE))
    num = tl.where(isnan, float("-inf"), v)
    take = live & ((num > lane_v) | (lane_i == _NONE))
    return tl.where(take, num, lane_v), tl.where(take, offs, lane_i), lane_nan


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, V, stride, BLOCK: tl.constexpr):
    # program r: row r of x, read in blocks of BLOCK (two at a time); lane j of a block keeps
    # the largest number it has seen with its first index (a strictly larger one replaces it:
    # its later indices lose ties) and its first NaN, with no barrier inside the loop; one
    # reduction at the end: the first NaN of all, else the first lane index of the largest
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    k = tl.arange(0, BLOCK)
    lane_v = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_i = tl.full([BLOCK], _NONE, tl.int32)
    lane_nan = tl.full([BLOCK], _NONE, tl.int32)
    for start in range(0, V, 2 * BLOCK):
        # two blocks' loads in flight before either is looked at (half the round trips)
        offs_a = start + k
        offs_b = offs_a + BLOCK
        va = tl.load(base + offs_a, mask=offs_a < V, other=float("-inf")).to(tl.float32)
        vb = tl.load(base + offs_b, mask=offs_b < V, other=float("-inf")).to(tl.float32)
        lane_v, lane_i, lane_nan = _lane_step(va, offs_a, V, lane_v, lane_i, lane_nan)
        lane_v, lane_i, lane_nan = _lane_step(vb, offs_b, V, lane_v, lane_i, lane_nan)
    nan_i = tl.min(lane_nan, axis=0)
    best = tl.max(lane_v, axis=0)
    best_i = tl.min(tl.where(lane_v == best, lane_i, _NONE), axis=0)
    tl.store(out_ptr + row, tl.where(nan_i < _NONE, nan_i, best_i).to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] (float32 / bf16 / fp16, the last dim contiguous) -> [..., 1] int64: each row's
    argmax (argmax_reference's index). One launch, no host sync: capture-safe."""
    V = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.reshape(-1, V)
    out = torch.empty(rows.shape[0], dtype=torch.int64, device=x.device)
    if rows.shape[0] == 0:
        return out.view(*x.shape[:-1], 1)
    block = min(BLOCK, triton.next_power_of_2(V))
    with on_device(x):
        _argmax_kernel[(rows.shape[0],)](rows, out, V, rows.stride(0), BLOCK=block,
                                         num_warps=NUM_WARPS if block >= 2048 else 4)
    return out.view(*x.shape[:-1], 1)
