"""Launch configs of the CUDA C++ routed-expert kernels (csrc/fp4_up.cu, fp4_up_wg.cu,
fp4_down.cu, used by dsv4/kernels/fp4_experts.py): `ExpertCudaConfig`, the configs measured best
on an H200, the instantiated variants, the heuristics for other shapes, and the down kernel's
workspace.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class ExpertCudaConfig:
    """CUDA C++ expert kernel config: spw steps of 128 K-elements per warp (the CTA has
    K / (128 * spw) warps and 16 rows of one expert); dec, the e2m1 decode (0: to e4m3 bytes and
    the hardware cvt to f16, 1: f16 bit patterns with integer ops); depth, steps of weights in
    flight per warp (0: all spw; fewer registers, more resident warps); all_experts (down only):
    one CTA per 16 rows takes every expert (its warps stream the k * spw steps of their K slice,
    depth of them in flight), summing in slot order without the workspace and semaphores; ctas
    (up; 0: one CTA per expert and 16 rows): that many CTAs, each streaming tiles with the next
    tile's weights in flight (spw 1 or 2, decode 0, at most 64 pairs of at most 4 activation
    rows); ctas with all_experts (down): the ring kernel on that many CTAs (one an SM), depth its
    ring slots (>= 2) of one expert's 16-row tile each, bulk-copied, with the all-experts kernel's
    bits (spw 2, decode 0, k 6 a row, the rows in turn; sm_90). wgmma (up): the warpgroup-MMA kernel
    (csrc/fp4_up_wg.cu, an sm_90 GPU) on ctas CTAs instead, a persistent ring fed by tensor copies
    of the checkpoint's bytes (spw, dec and depth unused; up_wg_fits says where it serves, else the
    streaming kernel of spw on ctas CTAs): new bits (the FP8 MMA's sums), the same for every ctas
    and row count."""
    spw: int
    dec: int = 0
    depth: int = 0
    all_experts: bool = False
    ctas: int = 0
    wgmma: bool = False


# measured best on an H200 (bench_kernels --sweep --backend cuda), keyed (k, I, D)
# up: the wgmma kernel on 100 CTAs (18.1 us alone on 132, against the streaming kernel's 25.0 on
# 100 and 20.2 on 132); 100 leave SMs for the shared expert's branch beside it (12 Flash layers,
# graph/device, one H200: 1.722 / 1.722 ms on 100, 1.741 / 1.739 on 132, the streaming kernel
# 1.741 / 1.747), and the verify rows gain most (T = 2: 1.59x -> 1.53x the plain step)
UP_STREAM_MAX_K, UP_STREAM_ROWS = 64, 4   # the streaming up kernel's pairs and activation rows
# a tensor-parallel rank's inter slice (I / world): bench_kernels --sweep --tp N, alone on one
# H200 (2026-11-29; the streaming kernel on 100 CTAs in brackets); not yet timed in a TP layer
TUNED_CUDA_UP: dict[tuple, ExpertCudaConfig] = {
    (6, 2048, 4096): ExpertCudaConfig(2, ctas=100, wgmma=True),
    (6, 1024, 4096): ExpertCudaConfig(2, ctas=100, wgmma=True),    # TP2 (14.5) 12.7 us
    (6, 512, 4096): ExpertCudaConfig(2, ctas=100, wgmma=True),     # TP4 (9.3) 9.0 us
    # Pro (one H200, alone: the per-tile default 82.0 us, wgmma 47.2 on 100 CTAs, 43.7 on 132;
    # 100 as Flash's layer chose; spw 4: rows past the wgmma's two take the per-tile kernel)
    (6, 3072, 7168): ExpertCudaConfig(4, ctas=100, wgmma=True)}
TUNED_CUDA_DOWN: dict[tuple, ExpertCudaConfig] = {
    # the ring, 4 slots (one H200: 11.8 us against the all-experts kernel's 15.4; 12 Flash layers,
    # graph: 1.770 / 1.771 -> 1.741 / 1.736 ms)
    (6, 2048, 4096): ExpertCudaConfig(2, 0, 4, True, 132),
    (6, 1024, 4096): ExpertCudaConfig(2, 0, 6, True),  # TP2 (9.7) 9.5 us
    (6, 512, 4096): ExpertCudaConfig(1, 0, 1),         # TP4 (7.3) 6.8 us, one expert per CTA
    (6, 3072, 7168): ExpertCudaConfig(2, 0, 6, True, 132)}  # Pro: the ring (45.3) 27.3 us
# the instantiated (spw, dec, depth) of csrc (depth 0 = spw)
CUDA_UP_VARIANTS = ((1, 0, 1), (2, 0, 2), (2, 0, 1), (4, 0, 4), (4, 0, 3), (4, 0, 2), (4, 1, 4),
                    (4, 1, 2))
CUDA_DOWN_VARIANTS = ((1, 0, 1), (2, 0, 2), (2, 0, 1), (4, 0, 4), (4, 0, 2), (2, 1, 2))
# the instantiated (k, spw, depth) of the all-experts down kernel (e2m1 decode 0; k = 6, the
# released models' experts per token: other k take one expert per CTA)
CUDA_DOWN_ALL_VARIANTS = ((6, 2, 2), (6, 2, 4), (6, 2, 6), (6, 4, 4))
# the streaming up kernel's (spw, ctas) sweep (an H100 / H200 has 132 SMs: one CTA per SM fits)
CUDA_UP_STREAM_VARIANTS = ((2, 132), (2, 120), (2, 100), (2, 66))
# the down ring kernel's (slots, ctas) sweep (k 6, spw 2); its shared memory (csrc/fp4_down.cu,
# down_ring_smem): the all-experts layout of 2 groups, then the slots; at most 227 KB an SM
CUDA_DOWN_RING_VARIANTS = ((8, 132), (6, 132), (4, 132))
RING_SMEM_LIMIT = 227 * 1024


# the wgmma up kernel (csrc/fp4_up_wg.cu): 4 consumer warpgroups of 2 slots of 64 rows x 512 K, 32
# inter rows a tile, at most 4 activation rows (two share a B operand of 1 KB per 128-block)
UP_WG_WGS, UP_WG_SLOTS, UP_WG_KC, UP_WG_TILE, UP_WG_ROWS = 4, 2, 512, 32, 4
CUDA_UP_WG_VARIANTS = (132, 100)   # its ctas in the sweep


def up_wg_smem(rows: int, dim: int) -> int:
    """Bytes of shared memory of the wgmma up kernel (csrc/fp4_up_wg.cu: UpWgSmem)."""
    kb = dim // 128
    slots = (rows + 1) // 2 * kb * 1024
    ef = slots + UP_WG_WGS * UP_WG_SLOTS * 64 * (UP_WG_KC // 2 + UP_WG_KC // 32)
    red = ef + -(-rows * kb * 4 // 16) * 16
    return red + 2 * UP_WG_WGS * 64 * 4 + 2 * UP_WG_WGS * UP_WG_SLOTS * 8


def up_wg_fits(rows: int, inter: int, dim: int, capability: tuple) -> bool:
    """Whether the wgmma up kernel serves rows activation rows of I = inter, D = dim on a GPU of
    this capability (sm_90 only: wgmma)."""
    return (tuple(capability) == (9, 0) and 1 <= rows <= UP_WG_ROWS and inter % UP_WG_TILE == 0
            and inter > 0 and dim % UP_WG_KC == 0 and dim > 0
            and up_wg_smem(rows, dim) <= RING_SMEM_LIMIT)


def up_wg_variants(inter: int, dim: int) -> list[ExpertCudaConfig]:
    """The wgmma up configs of the sweep for one row of I = inter, D = dim (on an sm_90 GPU)."""
    if not up_wg_fits(1, inter, dim, (9, 0)):
        return []
    spw = next(s for s in (2, 4, 1) if cuda_spw_fits(dim, s))   # the fallback's warps (below)
    return [ExpertCudaConfig(spw, ctas=c, wgmma=True) for c in CUDA_UP_WG_VARIANTS]


def up_wg_fallback(cfg: ExpertCudaConfig) -> ExpertCudaConfig:
    """The kernel for the rows a wgmma config cannot serve (more than its rows, or not sm_90):
    the streaming kernel where (spw, ctas) is one of its instantiations, else the per-tile kernel
    with cfg's steps per warp (the two give the same bits; not the wgmma kernel's)."""
    return replace(cfg, wgmma=False,
                   ctas=cfg.ctas if (cfg.spw, cfg.ctas) in CUDA_UP_STREAM_VARIANTS else 0)


def down_ring_smem(inter: int, slots: int) -> int:
    """Bytes of shared memory of the down ring kernel (csrc/fp4_down.cu: down_ring_smem) at k 6,
    spw 2 and I = inter, with its two (one, past 12 warps a group) consumer groups."""
    wg = inter // 256
    groups = 2 if 2 * wg + 1 <= 25 else 1
    head = 128 + wg * (256 * 12 + 4 * 12) + wg * 2 * groups * 6 * 16 * 4
    return -(-head // 128) * 128 + slots * 16 * (inter // 2 + inter // 32) + slots * 16


def down_ring_variants(k: int, inter: int) -> list[ExpertCudaConfig]:
    """The down ring configs that serve k experts of I = inter (k 6, spw 2, within the shared
    memory)."""
    if k != 6 or not cuda_spw_fits(inter, 2):
        return []
    return [ExpertCudaConfig(2, 0, slots, True, ctas) for slots, ctas in CUDA_DOWN_RING_VARIANTS
            if down_ring_smem(inter, slots) <= RING_SMEM_LIMIT]


def up_stream_variants(dim: int) -> list[ExpertCudaConfig]:
    """The streaming up configs whose warps split K = dim."""
    return [ExpertCudaConfig(spw, ctas=c) for spw, c in CUDA_UP_STREAM_VARIANTS
            if cuda_spw_fits(dim, spw)]


def down_all_variants(k: int, inter: int) -> list[ExpertCudaConfig]:
    """The all-experts down configs instantiated for k experts of I = inter."""
    return [ExpertCudaConfig(spw, 0, depth, True) for kk, spw, depth in CUDA_DOWN_ALL_VARIANTS
            if kk == k and cuda_spw_fits(inter, spw)]


def cuda_spw_fits(k_dim: int, spw: int) -> bool:
    """The CUDA expert kernels split K = k_dim into warps of spw 128-wide steps, at most 16 warps."""
    return k_dim % (128 * spw) == 0 and k_dim // (128 * spw) <= 16


def cuda_expert_config(k_dim: int, table: dict, key: tuple) -> ExpertCudaConfig | None:
    """K = k_dim: 4 steps per warp when that gives at most 16 warps, else 2, else 1."""
    if key in table:
        return table[key]
    return next((ExpertCudaConfig(spw) for spw in (4, 2, 1) if cuda_spw_fits(k_dim, spw)), None)


def cuda_down_config(k: int, inter: int, dim: int) -> ExpertCudaConfig | None:
    """down's CUDA config: the tuned one, else the all-experts kernel when instantiated for k (2
    steps per warp, 4 in flight, if it fits), else one expert per CTA (cuda_expert_config)."""
    if (k, inter, dim) in TUNED_CUDA_DOWN:
        return TUNED_CUDA_DOWN[(k, inter, dim)]
    return down_all_config(k, inter)


def down_all_config(k: int, inter: int) -> ExpertCudaConfig | None:
    """down's config without the ring: the all-experts kernel when instantiated for k (2 steps
    per warp, 4 in flight, if it fits), else one expert per CTA (cuda_expert_config)."""
    alls = down_all_variants(k, inter)
    return (next((c for c in alls if (c.spw, c.depth) == (2, 4)), alls[0]) if alls
            else cuda_expert_config(inter, {}, ()))


_workspaces: dict = {}


def down_workspace(k: int, dim: int, device, shared: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ws [k, D] float32, cnt [D / 16] int32 zeros): the CUDA down kernel's per-expert partials and
    per-row-tile semaphores (left zero after each launch). shared: one per (device, k, D) for
    launches that never run concurrently (one stream); otherwise a new one. Allocate it before a
    CUDA-graph capture (the decoder's warm-up does) so the zeros are not a captured memset."""
    key = (torch.device(device), k, dim)
    if not shared or key not in _workspaces:
        ws = (torch.empty(k, dim, dtype=torch.float32, device=device),
              torch.zeros(dim // 16, dtype=torch.int32, device=device))
        if not shared:
            return ws
        _workspaces[key] = ws
    return _workspaces[key]


def down_needs_workspace(k: int, inter: int, dim: int) -> bool:
    """Whether fp4_experts_down's default CUDA config for this shape uses a workspace."""
    c = cuda_down_config(k, inter, dim)
    return c is not None and not c.all_experts
