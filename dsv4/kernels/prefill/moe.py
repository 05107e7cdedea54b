"""The routed experts of a prefill chunk, grouped by expert, over the stored weights (prefill_gemm's
GEMMs): `expert_plan` sorts the (token, expert) pairs by expert into row tiles of one expert each,
on the device with no host sync (a fixed grid bound; unused tiles exit); `moe_up` computes w1 and
w3 of every pair with the tokens gathered, the clamped SwiGLU, the route weight and (FP8 / FP4) the
down input's act quant in its epilogue; `moe_down` the down projection per pair; `moe_combine` each
token's expert outputs in ascending expert order, then the shared expert's, in float32, as the
reference's loop does. Only experts that got tokens are read, and no weight is copied dense.

Legend: t = tokens, k = experts per token, p = t*k pairs, e = experts, D = dim, I = inter dim.
Reference: `moe_reference`. Test: tests/dsv4/kernels/test_prefill_kernels.py.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ...numerics.quant import fp8_quant_dequant
from ...weights.formats import FP8_BLOCK
from ..common import on_device, round_bf16
from .gemm import (
    DEFAULT,
    Tile,
    Tuning,
    act_quant,
    act_quant8,
    dequantize,
    gemm8,
    gemm16,
    mma_path,
    pick_bm,
    tile16,
)


@dataclass
class ExpertPlan:
    """(token, expert) pairs sorted by expert (stable: token order within an expert), cut into row
    tiles of at most tile.bm pairs of one expert. Sorted pair i is pair (token[i], its slot) with
    route weight weight[i]; inv[t, j] is the sorted position of token t's j-th expert."""
    token: torch.Tensor     # [p] int32: token of each sorted pair
    weight: torch.Tensor    # [p] f32: its route weight
    inv: torch.Tensor       # [t, k] int32
    tile_e: torch.Tensor    # [tiles] int32: expert of each row tile, -1 = unused
    tile_r: torch.Tensor    # [tiles, 2] int32: sorted pairs [r0, r1) of the tile's expert
    tile: Tile              # the launch config the tiles are cut for
    tuning: Tuning = DEFAULT   # the backend's switches of the GEMMs over the plan

    @property
    def n_tiles(self) -> int:
        return self.tile_e.shape[0]

    def launch(self) -> dict:
        """The GEMM arguments that make a launch run over the plan's tiles."""
        return dict(tiles=(self.tile_e, self.tile_r), grid_m=self.n_tiles)


def group_tile(fmt: str, rows: int, per_group: float, tuning: Tuning = DEFAULT) -> Tile:
    """The launch config of a format's GEMMs over `rows` rows, ~per_group rows per weight
    matrix: tile16 on the bf16 path; on the FP8 path up to 64-row tiles (more spill)."""
    if mma_path(fmt, rows, tuning) == "bf16":
        return tile16(per_group)
    return Tile(pick_bm(per_group), 128, 32, 4)


def expert_plan(idx: torch.Tensor, w: torch.Tensor, n_experts: int, fmt: str = "fp4",
                bm: int | None = None, tuning: Tuning = DEFAULT) -> ExpertPlan:
    """idx [t, k] int64 experts (ascending in each row), w [t, k] f32 -> ExpertPlan, with row
    tiles sized for the average pairs per expert (group_tile; bm overrides the height). Device
    ops only (no host sync): the stable sort, then two launches (the pairs' tokens, weights and
    inverse; the experts' ranges and the tiles); the tile grid has the fixed bound p/bm + min(e,
    p) tiles."""
    T, k = idx.shape
    P, dev = T * k, idx.device
    tile = group_tile(fmt, T, P / n_experts, tuning)
    if bm:
        tile = replace(tile, bm=bm)
    bm = tile.bm
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    se = flat[order]                                  # the pairs' experts, sorted
    token = torch.empty(P, dtype=torch.int32, device=dev)
    weight = torch.empty(P, dtype=torch.float32, device=dev)
    inv = torch.empty(P, dtype=torch.int32, device=dev)
    n_tiles = P // bm + min(n_experts, P)
    tile_e = torch.empty(n_tiles, dtype=torch.int32, device=dev)
    tile_r = torch.empty(n_tiles, 2, dtype=torch.int32, device=dev)
    ep = triton.next_power_of_2(n_experts)
    scratch = torch.empty(4, ep, dtype=torch.int64, device=dev)
    with on_device(idx):
        _plan_pairs_kernel[(triton.cdiv(P, PLAN_BP),)](order, w.reshape(-1).contiguous(), token,
                                                         weight, inv, P, K=k, BP=PLAN_BP)
        _plan_tiles_kernel[(1,)](se, P, P.bit_length(), scratch, tile_e, tile_r, n_tiles,
                                 n_experts.bit_length(), E=n_experts, EP=ep, BM=bm, BT=PLAN_BT)
    return ExpertPlan(token=token, weight=weight, inv=inv.view(T, k), tile_e=tile_e,
                      tile_r=tile_r, tile=tile, tuning=tuning)


PLAN_BP, PLAN_BT = 1024, 256     # pairs a program, tiles a step of the tiles' one program


@triton.jit
def _plan_pairs_kernel(order_ptr, w_ptr, token_ptr, weight_ptr, inv_ptr, P, K: tl.constexpr,
                       BP: tl.constexpr):
    # sorted pair p is pair order[p]: its token order[p] // K, its route weight; inv its inverse
    p = tl.program_id(0) * BP + tl.arange(0, BP)
    m = p < P
    o = tl.load(order_ptr + p, mask=m, other=0)
    tl.store(token_ptr + p, (o // K).to(tl.int32), mask=m)
    tl.store(weight_ptr + p, tl.load(w_ptr + o, mask=m).to(tl.float32), mask=m)
    tl.store(inv_ptr + o, p.to(tl.int32), mask=m)


@triton.jit
def _bisect(ptr, n, x, steps, RIGHT: tl.constexpr):
    # per lane: the number of ptr[0:n] (ascending) below x (RIGHT: at most x), by bisection
    lo = tl.zeros(x.shape, tl.int64)
    hi = tl.zeros(x.shape, tl.int64) + n
    for _ in range(steps):
        act = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(ptr + mid, mask=act, other=0)
        if RIGHT:
            right = act & (v <= x)
        else:
            right = act & (v < x)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(act & (right == 0), mid, hi)
    return lo


@triton.jit
def _plan_tiles_kernel(se_ptr, P, psteps, scratch_ptr, tile_e_ptr, tile_r_ptr, NT, esteps,
                       E: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr, BT: tl.constexpr):
    # one program: expert e's sorted pairs [start, end) (bisections of se), its tiles of at most
    # BM pairs and their running count tcum; then tile t's expert (the first with tcum > t; E:
    # unused) and its pairs [r0, end)
    e = tl.arange(0, EP)
    em = e < E
    start = _bisect(se_ptr, P, e.to(tl.int64), psteps, False)
    end = _bisect(se_ptr, P, e.to(tl.int64), psteps, True)
    ntile = tl.where(em, (end - start + BM - 1) // BM, 0)
    tcum = tl.cumsum(ntile, axis=0)
    tl.store(scratch_ptr + e, start)
    tl.store(scratch_ptr + EP + e, end)
    tl.store(scratch_ptr + 2 * EP + e, ntile)
    tl.store(scratch_ptr + 3 * EP + e, tcum)
    tl.debug_barrier()
    for t0 in range(0, NT, BT):
        t = t0 + tl.arange(0, BT)
        tm = t < NT
        te = _bisect(scratch_ptr + 3 * EP, E, t.to(tl.int64), esteps, True)
        tec = tl.minimum(te, E - 1)
        s0 = tl.load(scratch_ptr + tec, mask=tm, other=0)
        e1 = tl.load(scratch_ptr + EP + tec, mask=tm, other=0)
        nt = tl.load(scratch_ptr + 2 * EP + tec, mask=tm, other=0)
        tc = tl.load(scratch_ptr + 3 * EP + tec, mask=tm, other=0)
        r0 = s0 + (t - tc + nt) * BM
        tl.store(tile_e_ptr + t, tl.where(te < E, te, -1).to(tl.int32), mask=tm)
        tl.store(tile_r_ptr + 2 * t, r0.to(tl.int32), mask=tm)
        tl.store(tile_r_ptr + 2 * t + 1, e1.to(tl.int32), mask=tm)


@dataclass
class Rows:
    """A chunk's rows as the A operand of a format's GEMMs: e4m3 bytes + scales (x8, xs) on the
    FP8 path, else bf16 x (act-quantized, exact values, for quantized weights)."""
    x: torch.Tensor | None = None
    x8: torch.Tensor | None = None
    xs: torch.Tensor | None = None

    @staticmethod
    def kind(fmt: str, rows: int, tuning: Tuning = DEFAULT) -> str:
        """Which A operand a weight format's GEMMs over `rows` rows take: "bf16" (unquantized),
        "fp8" (e4m3 bytes + scales) or "bf16q" (act-quantized, exact bf16 values)."""
        return "bf16" if fmt == "bf16" else "fp8" if mma_path(fmt, rows, tuning) == "fp8" else \
            "bf16q"

    @classmethod
    def of(cls, x: torch.Tensor, fmt: str, tuning: Tuning = DEFAULT) -> "Rows":
        k = cls.kind(fmt, x.shape[0], tuning)
        return cls(x) if k == "bf16" else cls(None, *act_quant8(x)) if k == "fp8" else \
            cls(act_quant(x))

    @property
    def n(self) -> int:
        return (self.x if self.x is not None else self.x8).shape[0]

    @property
    def device(self) -> torch.device:
        return (self.x if self.x is not None else self.x8).device


def _up(r: Rows, w1, s1, w3, s3, fmt, limit, n_rows, tile: Tile, tuning: Tuning, **kw) -> Rows:
    """bf16(route_w * SwiGLU(w1 x, w3 x)) of n_rows rows, act-quantized for a quantized down: in
    the epilogue (128-feature tiles) or in a launch after it."""
    I = w1.shape[-2]
    if r.x8 is None:
        out = torch.empty(n_rows, I, dtype=torch.bfloat16, device=r.device)
        q = fmt != "bf16"
        gemm16(r.x, w1, s1, fmt, out, w3=w3, s3=s3, limit=limit, quant=q and tile.bn == 128,
               bm=tile.bm, bn=tile.bn, bk=tile.bk, warps=tile.warps,
               split_programs=tuning.split_programs, **kw)
        return Rows(act_quant(out) if q and tile.bn != 128 else out)
    a8 = torch.empty(n_rows, I, dtype=torch.uint8, device=r.device)
    a_s = torch.empty(n_rows, I // 128, dtype=torch.float32, device=r.device)
    # 64-row tiles of the two matrices: 8 warps (the Flash shared expert's up over 4,096 rows on
    # an H200: 0.50 -> 0.32 ms; its down stays faster on 4)
    gemm8(r.x8, r.xs, w1, s1, fmt, a8, w3=w3, s3=s3, limit=limit, out_scale=a_s, bm=tile.bm,
          warps=8 if tile.bm == 64 else tile.warps, cublas=tuning.cublas, **kw)
    return Rows(None, a8, a_s)


def _down(a: Rows, w2, s2, fmt, tile: Tile, tuning: Tuning, **kw) -> torch.Tensor:
    out = torch.empty(a.n, w2.shape[-2], dtype=torch.bfloat16, device=a.device)
    if a.x8 is None:
        return gemm16(a.x, w2, s2, fmt, out, bm=tile.bm, bn=tile.bn, bk=tile.bk,
                      warps=tile.warps, split_programs=tuning.split_programs, **kw)
    return gemm8(a.x8, a.xs, w2, s2, fmt, out, bm=tile.bm, warps=tile.warps,
                 cublas=tuning.cublas, **kw)


def moe_up(x: Rows, plan: ExpertPlan, w1, s1, w3, s3, fmt: str, limit: float) -> Rows:
    """Routed up of every sorted pair: bf16(route_w * SwiGLU(w1 x, w3 x)) [p, I], act-quantized
    for down when the weights are (x: the chunk's rows, Rows.of(x, fmt))."""
    return _up(x, w1, s1, w3, s3, fmt, limit, plan.token.shape[0], plan.tile, plan.tuning,
               rows=plan.token, rw=plan.weight, **plan.launch())


def moe_down(a: Rows, plan: ExpertPlan, w2, s2, fmt: str) -> torch.Tensor:
    """Routed down of every sorted pair: its up output a [p, I] -> [p, D] bf16."""
    return _down(a, w2, s2, fmt, plan.tile, plan.tuning, **plan.launch())


def shared_expert(x: Rows, w1, s1, w3, s3, w2, s2, fmt: str, limit: float,
                  tuning: Tuning = DEFAULT) -> torch.Tensor:
    """The shared expert of the rows x (Rows.of(x, fmt, tuning)): w2(bf16(SwiGLU(w1 x, w3 x)))
    -> [t, D] bf16."""
    tile = group_tile(fmt, x.n, x.n, tuning)
    return _down(_up(x, w1, s1, w3, s3, fmt, limit, x.n, tile, tuning), w2, s2, fmt, tile,
                 tuning)


@triton.jit
def _combine_kernel(o_ptr, inv_ptr, sh_ptr, y_ptr, D: tl.constexpr, KE: tl.constexpr,
                    BD: tl.constexpr, SHARED: tl.constexpr):
    # y[t] = bf16(sum_j o[inv[t, j]] (+ shared[t])) in float32, j in ascending expert order
    t = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    acc = tl.zeros([BD], tl.float32)
    for j in tl.static_range(KE):
        p = tl.load(inv_ptr + t * KE + j).to(tl.int64)
        acc += tl.load(o_ptr + p * D + d).to(tl.float32)
    if SHARED:
        acc += tl.load(sh_ptr + t.to(tl.int64) * D + d).to(tl.float32)
    tl.store(y_ptr + t.to(tl.int64) * D + d, round_bf16(acc).to(y_ptr.dtype.element_ty))


def moe_combine(o: torch.Tensor, plan: ExpertPlan, shared: torch.Tensor | None) -> torch.Tensor:
    """Each token's routed outputs o [p, D] in ascending expert order, then shared [t, D], summed
    in float32 -> [t, D] bf16."""
    T, k = plan.inv.shape
    D = o.shape[1]
    bd = 1024 if D % 1024 == 0 else D
    if D % bd or bd & (bd - 1):
        raise ValueError(f"moe_combine: D = {D} must be a power of two or a multiple of 1024")
    y = torch.empty(T, D, dtype=torch.bfloat16, device=o.device)
    with on_device(y):
        _combine_kernel[(T, D // bd)](o, plan.inv, shared if shared is not None else o, y, D=D,
                                      KE=k, BD=bd, SHARED=shared is not None, num_warps=4)
    return y


def grouped_moe(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, bank: tuple, fmt: str,
                shared: tuple, shared_fmt: str, limit: float,
                tuning: Tuning = DEFAULT) -> torch.Tensor:
    """A prefill chunk's MoE: rows x [t, D] bf16 routed to idx [t, k] with weights w [t, k]; bank
    (w1, s1, w3, s3, w2, s2) the routed experts in `fmt`, shared the shared expert's in
    `shared_fmt`. x is act-quantized once where routed and shared use one tensor-core path; the
    (token, expert) pairs grouped by expert through routed up (w1, w3, SwiGLU, route weight,
    act quant) and down per expert tile, the shared expert, then each token's sum in ascending
    expert order plus the shared output, as the reference's loop -> [t, D] bf16. No host sync."""
    w1, s1, w3, s3, w2, s2 = bank
    idx, order = idx.sort(dim=1)              # the reference adds experts in ascending id
    plan = expert_plan(idx, w.gather(1, order), w1.shape[0], fmt, tuning=tuning)
    xr = Rows.of(x, fmt, tuning)
    n = x.shape[0]
    same = Rows.kind(shared_fmt, n, tuning) == Rows.kind(fmt, n, tuning)
    xs = xr if same else Rows.of(x, shared_fmt, tuning)
    o = moe_down(moe_up(xr, plan, w1, s1, w3, s3, fmt, limit), plan, w2, s2, fmt)
    y_sh = shared_expert(xs, *shared, shared_fmt, limit, tuning=tuning)
    return moe_combine(o, plan, y_sh)


# ---- plain-torch reference (the code the kernels replace) --------------------------------------

def moe_reference(x, idx, w, bank, fmt, limit, shared=None):
    """The routed experts of rows x [t, D] bf16 (idx, w [t, k]) as the official loop: per expert in
    ascending id order, bf16 up outputs, clamped SwiGLU, route weight, bf16, act quant, down ->
    bf16, summed in float32 (+ shared [t, D]) -> bf16. bank: (w1, s1, w3, s3, w2, s2)."""
    w1, s1, w3, s3, w2, s2 = bank
    q = fmt != "bf16"
    xq = fp8_quant_dequant(x, FP8_BLOCK) if q else x
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(idx).tolist():
        rows, slot = torch.where(idx == e)
        xe = xq[rows].float()
        g = (xe @ dequantize(fmt, w1[e], s1[e] if q else None).t()).bfloat16().float()
        u = (xe @ dequantize(fmt, w3[e], s3[e] if q else None).t()).bfloat16().float()
        if limit > 0:
            u, g = u.clamp(-limit, limit), g.clamp(max=limit)
        a = (w[rows, slot].unsqueeze(-1) * F.silu(g) * u).bfloat16()
        a = fp8_quant_dequant(a, FP8_BLOCK) if q else a
        y[rows] += (a.float() @ dequantize(fmt, w2[e], s2[e] if q else None).t()).bfloat16().float()
    if shared is not None:
        y += shared.float()
    return y.bfloat16()
