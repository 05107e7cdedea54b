"""Routed FP4 experts of one decode token in two launches: `fp4_experts_up` (w1, w3, clamped SwiGLU,
route weight) -> a [k, I] bf16, and `fp4_experts_down` (w2, per-expert bf16, fp32 sum in order) ->
y [1, D] float32. Weights [E, out, in/2] int8 (e2m1 pairs) + [E, out, in/32] ue8m0.
Two implementations: the CUDA C++ kernels on tensor cores (csrc/fp4_up.cu, fp4_down.cu via
dsv4.kernels.cuda.lib; the default where available: e2m1 decoded to f16 in registers, f16 MMAs
with float32 accumulation per 32-group, the group scale applied in float32; on an sm_90 GPU the
tuned up is csrc/fp4_up_wg.cu's, e2m1 decoded to e4m3 for Hopper's FP8 warpgroup MMA, whose
accumulation of a group's 32 products is not IEEE float32: new bits within ~1e-4 of the sums) and
the Triton kernels below (the fallback, and the interpreter tests). `impl=` (the backend's
decision: "cuda" or "triton") / the config type pick one.
The CUDA kernels' launch configs: dsv4/kernels/cuda/experts.py.
Test: `python -m pytest tests/dsv4/kernels/test_decode_kernels.py`; bench: `python scripts/bench_kernels.py`.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ...numerics.quant import fp8_quant_dequant
from ...weights.formats import FP4_BLOCK, dequantize_fp4_weight
from ..common import (
    Config,
    block_exponent,
    device_capability,
    device_sms,
    e2m1_word_to_f32,
    e8m0_to_f32,
    interpreting,
    launch_args,
    on_device,
    pdl_wait,
    pick_config,
    quant_dequant,
    round_bf16,
)
from ..common import pdl as pdl_on
from ..cuda import lib as cuda_cpp
from ..cuda.experts import (
    TUNED_CUDA_UP,
    UP_STREAM_MAX_K,
    UP_STREAM_ROWS,
    ExpertCudaConfig,
    cuda_down_config,
    cuda_expert_config,
    down_all_config,
    down_workspace,
    up_wg_fallback,
    up_wg_fits,
)
from .mhc import hc_post, post_streams

# The e2m1 decode (e2m1_word_to_f32): 4 nibbles become e4m3 bytes in three 32-bit ops (inline PTX),
# then hardware e4m3x2 -> f16x2 -> f32 casts, then one FMA per weight.
UP_TILE_BYTES = 4096     # packed bytes per program, step and matrix (w1 and w3: twice that)
DOWN_TILE_BYTES = 8192
BN_MAX = 16              # rows per program: more rows amortize the act quant, fewer keep programs many
DOWN_TARGET = 256        # the down kernel keeps BN = 16 (x work per row) over more programs
X_SCALE = tl.constexpr(64.0)          # e2m1_word_to_f32 returns value * 2^-6: folded into x
X_SCALE_BITS = tl.constexpr(16384.0)  # ... or value * 2^-14 without NATIVE (interpreter)


@triton.jit
def _eighths(t):
    """[..., 2, 2, 2] -> its 8 slices [...] at the last three indices (r2, r1, r0), r = 4 r2 + 2 r1
    + r0 in order (in-thread splits: a word's 8 elements live in one thread)."""
    e, o = tl.split(t)
    e0, e1 = tl.split(e)
    o0, o1 = tl.split(o)
    e00, e01 = tl.split(e0)
    e10, e11 = tl.split(e1)
    o00, o01 = tl.split(o0)
    o10, o11 = tl.split(o1)
    return e00, o00, e10, o10, e01, o01, e11, o11


@triton.jit
def _x_quant(x_ptr, k0, K: tl.constexpr, NB: tl.constexpr, EVEN_K: tl.constexpr,
             NATIVE: tl.constexpr):
    """act_quant of the chunk [k0, k0 + NB*128) (each value quantized once), times the decode's
    scale, as 8 tensors [G, 4] (G = NB*4 groups of 32): x8[r][g, a] = x[32g + 8a + r], the element
    that nibble r of word a of group g multiplies."""
    G: tl.constexpr = NB * 4
    xoff = k0 + tl.arange(0, NB)[:, None] * 128 + tl.arange(0, 128)[None, :]
    if EVEN_K:
        xb = tl.load(x_ptr + xoff).to(tl.float32)
    else:
        xb = tl.load(x_ptr + xoff, mask=xoff < K, other=0).to(tl.float32)
    xq = quant_dequant(xb, block_exponent(xb)[:, None]) * (X_SCALE if NATIVE else X_SCALE_BITS)
    return _eighths(tl.reshape(xq, [G, 4, 2, 2, 2]))


@triton.jit
def _w_load(w_ptr, s_ptr, wrow, srow, k0, K: tl.constexpr, NB: tl.constexpr,
            EVEN_K: tl.constexpr):
    """Words [BN, G, 4] (int32, 8 e2m1 each) and scales [BN, G] (float32) of the K-chunk at k0;
    wrow / srow: row offsets in words / scales."""
    G: tl.constexpr = NB * 4
    gg = tl.arange(0, G)
    wo = (k0 // 8 + gg[:, None] * 4 + tl.arange(0, 4)[None, :])[None, :, :]   # [1, G, 4]
    so = (k0 // 32 + gg)[None, :]
    if EVEN_K:
        w = tl.load(w_ptr + wrow[:, None, None] + wo)
        s = tl.load(s_ptr + srow[:, None] + so)
    else:
        w = tl.load(w_ptr + wrow[:, None, None] + wo, mask=wo < K // 8, other=0)
        s = tl.load(s_ptr + srow[:, None] + so, mask=so < K // 32, other=0)
    return w, e8m0_to_f32(s)


@triton.jit
def _group_dots(w, x8, NATIVE: tl.constexpr):
    """[BN, G] partial dots of every 32-group: words w [BN, G, 4] against x8 (see _x_quant)."""
    v = e2m1_word_to_f32(w, NATIVE)
    t = v[0] * x8[0][None, :, :]
    for r in tl.static_range(1, 8):
        t += v[r] * x8[r][None, :, :]
    return tl.sum(t, axis=2)


@triton.jit
def _fp4_up_kernel(x_ptr, idx_ptr, rw_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, a_ptr, limit,
                   I: tl.constexpr, D: tl.constexpr, HAS_LIMIT: tl.constexpr, BN: tl.constexpr,
                   NB: tl.constexpr, EVEN_K: tl.constexpr, NATIVE: tl.constexpr,
                   PDL: tl.constexpr):
    # x [D] bf16; idx [k] int64; rw [k] f32; w1, w3 [E, I, D/8] int32; s1, s3 [E, I, D/32] u8;
    # a [k, I] bf16. Program (i, j): rows [i*BN, (i+1)*BN) of expert idx[j].
    pdl_wait(PDL)
    j = tl.program_id(1)
    e = tl.load(idx_ptr + j).to(tl.int64)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    wrow = e * I * (D // 8) + rows * (D // 8)
    srow = e * I * (D // 32) + rows * (D // 32)
    G: tl.constexpr = NB * 4
    BK: tl.constexpr = NB * 128
    STEPS: tl.constexpr = (D + BK - 1) // BK
    acc1 = tl.zeros([BN, G], tl.float32)
    acc3 = tl.zeros([BN, G], tl.float32)
    w1n, s1n = _w_load(w1_ptr, s1_ptr, wrow, srow, 0, D, NB, EVEN_K)
    w3n, s3n = _w_load(w3_ptr, s3_ptr, wrow, srow, 0, D, NB, EVEN_K)
    for st in range(STEPS):
        k0 = st * BK
        w1, sc1, w3, sc3 = w1n, s1n, w3n, s3n
        if st + 1 < STEPS:   # prefetch: the next chunk's loads overlap this chunk's math
            w1n, s1n = _w_load(w1_ptr, s1_ptr, wrow, srow, k0 + BK, D, NB, EVEN_K)
            w3n, s3n = _w_load(w3_ptr, s3_ptr, wrow, srow, k0 + BK, D, NB, EVEN_K)
        x8 = _x_quant(x_ptr, k0, D, NB, EVEN_K, NATIVE)
        acc1 += _group_dots(w1, x8, NATIVE) * sc1   # per-32 weight scale on each group's dot
        acc3 += _group_dots(w3, x8, NATIVE) * sc3
    g = round_bf16(tl.sum(acc1, axis=1))      # fp4_gemm outputs bf16
    u = round_bf16(tl.sum(acc3, axis=1))
    if HAS_LIMIT:
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
    a = g / (1.0 + tl.exp(-g)) * u * tl.load(rw_ptr + j)
    tl.store(a_ptr + j * I + rows, round_bf16(a).to(tl.bfloat16))


@triton.jit
def _down_load(idx_ptr, w2_ptr, s2_ptr, rows, t, D: tl.constexpr, I: tl.constexpr,
               NB: tl.constexpr, STEPS: tl.constexpr, EVEN_K: tl.constexpr):
    """Words and scales of flattened step t = (expert slot t // STEPS, K-chunk t % STEPS)."""
    e = tl.load(idx_ptr + t // STEPS).to(tl.int64)
    wrow = e * D * (I // 8) + rows * (I // 8)
    srow = e * D * (I // 32) + rows * (I // 32)
    return _w_load(w2_ptr, s2_ptr, wrow, srow, (t % STEPS) * (NB * 128), I, NB, EVEN_K)


@triton.jit
def _fp4_down_kernel(a_ptr, idx_ptr, w2_ptr, s2_ptr, add_ptr, y_ptr, D: tl.constexpr,
                     I: tl.constexpr, TOPK: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                     EVEN_K: tl.constexpr, HAS_ADD: tl.constexpr, NATIVE: tl.constexpr,
                     PDL: tl.constexpr):
    # a [k, I] bf16; idx [k] int64; w2 [E, D, I/8] int32; s2 [E, D, I/32] u8; y [D] f32 or bf16;
    # HAS_ADD: y = y_type(sum + add[D]) (the shared expert's output).
    # One program: BN output rows, all k experts in slot order (fixed fp32 summation order);
    # the (expert, K-chunk) steps run as one loop so the next step's weights load during this one.
    pdl_wait(PDL)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    G: tl.constexpr = NB * 4
    STEPS: tl.constexpr = (I + NB * 128 - 1) // (NB * 128)
    y = tl.zeros([BN], tl.float32)
    acc = tl.zeros([BN, G], tl.float32)
    wn, sn = _down_load(idx_ptr, w2_ptr, s2_ptr, rows, 0, D, I, NB, STEPS, EVEN_K)
    for t in range(TOPK * STEPS):
        w, sc = wn, sn
        if t + 1 < TOPK * STEPS:
            wn, sn = _down_load(idx_ptr, w2_ptr, s2_ptr, rows, t + 1, D, I, NB, STEPS, EVEN_K)
        x8 = _x_quant(a_ptr + (t // STEPS) * I, (t % STEPS) * (NB * 128), I, NB, EVEN_K, NATIVE)
        acc += _group_dots(w, x8, NATIVE) * sc
        if t % STEPS == STEPS - 1:             # expert done: its output is bf16, summed in fp32
            y += round_bf16(tl.sum(acc, axis=1))
            acc = tl.zeros([BN, G], tl.float32)
    if HAS_ADD:
        y += tl.load(add_ptr + rows).to(tl.float32)
    if y_ptr.dtype.element_ty == tl.bfloat16:
        y = round_bf16(y)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))


# measured best on an H200 by `bench_kernels.py --sweep` (2026-11-22, e4m3-path decode, PDL) for
# Flash (k, I, D); the heuristic's configs: up 40.3 us, down 28.3 us
TUNED_UP = {(6, 2048, 4096): Config(32, 2, 8)}      # 31.2 us
TUNED_DOWN = {(6, 2048, 4096): Config(32, 16, 8)}   # 21.3 us


def up_config(k: int, inter: int, dim: int) -> Config:
    if (k, inter, dim) in TUNED_UP:
        return TUNED_UP[(k, inter, dim)]
    return pick_config(inter, dim, UP_TILE_BYTES, 0.5, programs_per_row=k, bn_max=BN_MAX)


def down_config(k: int, inter: int, dim: int) -> Config:
    if (k, inter, dim) in TUNED_DOWN:
        return TUNED_DOWN[(k, inter, dim)]
    return pick_config(dim, inter, DOWN_TILE_BYTES, 0.5, bn_max=BN_MAX, target=DOWN_TARGET)


def _native(t: torch.Tensor) -> bool:
    """Inline PTX and the hardware e4m3 cast: CUDA, not the interpreter."""
    return t.is_cuda and not interpreting()


def _check(w, s, what):
    E, n, kh = w.shape
    if w.dtype != torch.int8 or tuple(s.shape) != (E, n, kh * 2 // FP4_BLOCK) or (kh * 2) % 128:
        raise ValueError(f"{what}: weight {tuple(w.shape)} {w.dtype}, scale {tuple(s.shape)}; "
                         f"expected int8 [E, out, in/2] and [E, out, in/32] with in % 128 == 0")
    return E, n, kh * 2


def fp4_experts_up(x: torch.Tensor, idx: torch.Tensor, route_w: torch.Tensor, w1: torch.Tensor,
                   s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor, limit: float, *,
                   out: torch.Tensor | None = None,
                   config: Config | ExpertCudaConfig | None = None,
                   impl: str = "cuda", strict: bool = False, pdl: bool = True) -> torch.Tensor:
    """x [1, D] bf16, idx [k] int64 (device), route_w [k] f32 -> a [k, I] bf16 with
    a[j] = bf16(silu(g) * u * route_w[j]), g/u = bf16(W8A8 w1/w3 of expert idx[j] at x), u clamped
    to +-limit and g from above (limit 0: none). Capture-safe (experts read on device).
    x [T, D] (the speculative verify rows): the k pairs split into T runs of k / T, run t on row t,
    one launch on CUDA, each pair with the bits of a one-row launch."""
    E, I, D = _check(w1, s1, "fp4_experts_up w1")
    T = x.numel() // D if x.numel() % D == 0 else 0
    k = idx.numel()
    if _check(w3, s3, "fp4_experts_up w3") != (E, I, D) or T < 1 or k % T:
        raise ValueError(f"fp4_experts_up: w3 {tuple(w3.shape)} or x {tuple(x.shape)} does not "
                         f"match w1 {tuple(w1.shape)} and {k} pairs")
    if out is None:
        out = torch.empty(k, I, dtype=torch.bfloat16, device=x.device)
    xc, rw = x.contiguous(), route_w.to(torch.float32).contiguous()
    if (cuda_cpp.pick("fp4 experts", impl, xc, w1, s1, w3, s3, out,
                      declined=isinstance(config, Config),
                      strict=strict or isinstance(config, ExpertCudaConfig))
            and I % 16 == 0 and idx.dtype == torch.int64):
        ccfg = config if isinstance(config, ExpertCudaConfig) else cuda_expert_config(
            D, TUNED_CUDA_UP, (k // T, I, D))
        if ccfg is not None and ccfg.wgmma:
            if up_wg_fits(T, I, D, device_capability(out.device)):
                with on_device(out):
                    cuda_cpp.fp4_up_wg(cuda_cpp.lib_for(out.device), xc, idx.contiguous(), rw,
                                       w1, s1.view(torch.uint8), w3, s3.view(torch.uint8), out,
                                       float(limit), E, I, D, k, k // T,
                                       min(ccfg.ctas, device_sms(out.device)),
                                       pdl_on(out, pdl))
                return out
            ccfg = up_wg_fallback(ccfg)                       # the CUDA-core kernels instead
        if ccfg is not None and ccfg.ctas:
            if k > UP_STREAM_MAX_K or T > UP_STREAM_ROWS:     # the streaming kernel's limits
                ccfg = replace(ccfg, ctas=0)
            else:                                             # one CTA per SM at most resides
                ccfg = replace(ccfg, ctas=min(ccfg.ctas, device_sms(out.device)))
        if ccfg is not None:
            with on_device(out):
                cuda_cpp.fp4_up(cuda_cpp.lib_for(out.device), xc, idx.contiguous(), rw,
                                w1, s1.view(torch.uint8), w3, s3.view(torch.uint8), out,
                                float(limit), I, D, k, ccfg, pdl_on(out, pdl), kpr=k // T)
            return out
        if strict or isinstance(config, ExpertCudaConfig):
            raise ValueError(f"fp4_experts_up: no CUDA config for D = {D}")
    if T > 1:   # Triton: one launch per row
        n = k // T
        for t in range(T):
            fp4_experts_up(xc.view(T, D)[t:t + 1], idx[t * n:(t + 1) * n], rw[t * n:(t + 1) * n],
                           w1, s1, w3, s3, limit, out=out[t * n:(t + 1) * n], config=config,
                           impl="triton")
        return out
    cfg = config or up_config(k, I, D)
    with on_device(out):
        _fp4_up_kernel[(I // cfg.bn, k)](
            xc, idx, rw, w1.view(torch.int32),
            s1.view(torch.uint8), w3.view(torch.int32), s3.view(torch.uint8), out, float(limit),
            I=I, D=D,
            HAS_LIMIT=limit > 0, BN=cfg.bn, NB=cfg.nb, EVEN_K=D % (cfg.nb * 128) == 0,
            NATIVE=_native(out),
            num_warps=cfg.num_warps, **launch_args(out, pdl))
    return out


def fp4_experts_down(a: torch.Tensor, idx: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, *,
                     add: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                     out: torch.Tensor | None = None,
                     config: Config | ExpertCudaConfig | None = None,
                     impl: str = "cuda", strict: bool = False, workspace: tuple | None = None,
                     rows: int = 1, pdl: bool = True, idx_early: bool = False,
                     post: tuple | None = None) -> torch.Tensor:
    """a [k, I] bf16, idx [k] int64 -> y [1, D] = sum_j bf16(W8A8 w2[idx[j]] @ a[j]), summed in fp32
    in slot order j = 0..k-1 (pass idx sorted to match the reference), plus `add` ([1, D], e.g. the
    shared expert's bf16 output) in fp32, rounded to out_dtype (float32 or bfloat16).
    workspace: the per-expert CUDA kernel's (see down_workspace; default: one per device and
    shape; the all-experts kernel needs none, see down_needs_workspace).
    rows > 1 (the speculative verify rows): the k pairs split into `rows` runs -> y [rows, D], add
    [rows, D], each row as a one-row call (one launch with the all-experts kernel).
    idx_early (with PDL, the CUDA kernels): idx and the weights it addresses are read before the
    launch's PDL wait, so they stream while the kernel before finishes; only where idx was written
    before that kernel passed its own wait (the routing, with the up kernel between: DecodeKernels).
    The same bits. Capture-safe.
    post = (res, post, comb, streams): the block's mHC post of y (bf16) into streams -> streams
    (res, streams [rows, 4, D] bf16, apart; post [rows, 4], comb [rows, 4, 4] float32): in the
    CUDA kernel's own epilogue where it serves (dsv4_fp4_down: the float order of the all-reduce's
    post), else y and then hc_post."""
    E, D, I = _check(w2, s2, "fp4_experts_down w2")
    k = idx.numel()
    streams = (None if post is None
               else post_streams(post, rows, D, "fp4_experts_down", out_dtype, out))
    if tuple(a.shape) != (k, I) or rows < 1 or k % rows:
        raise ValueError(f"fp4_experts_down: a {tuple(a.shape)}, {rows} rows; expected {(k, I)}")
    if out_dtype not in (torch.float32, torch.bfloat16) or (add is not None
                                                            and add.numel() != rows * D):
        raise ValueError(f"fp4_experts_down: out_dtype {out_dtype}, add "
                         f"{None if add is None else tuple(add.shape)}; expected float32/bfloat16 "
                         f"and [{rows}, {D}]")
    if out is None and post is None:
        out = torch.empty(rows, D, dtype=out_dtype, device=a.device)
    elif out is not None and (out.numel() != rows * D or not out.is_contiguous()):
        raise ValueError(f"fp4_experts_down: out {tuple(out.shape)}; expected [{rows}, {D}]")
    dst = out if post is None else streams            # what the CUDA kernel writes
    ac = a.contiguous()
    addc = None if add is None else add.contiguous()
    if (cuda_cpp.pick("fp4 experts", impl, ac, w2, s2, dst, *(() if addc is None else (addc,)),
                      declined=isinstance(config, Config),
                      strict=strict or isinstance(config, ExpertCudaConfig))
            and D % 16 == 0 and idx.dtype == torch.int64
            and (addc is None or addc.dtype == torch.bfloat16)):
        ccfg = config if isinstance(config, ExpertCudaConfig) else cuda_down_config(k // rows, I, D)
        if ccfg is not None and ccfg.ctas and ccfg.all_experts:   # the ring kernel
            if k != 6 * rows or ccfg.spw != 2 or device_capability(dst.device) < (9, 0):
                ccfg = down_all_config(k // rows, I)   # the ring: rows of 6, sm_90
            else:                                           # one CTA per SM at most resides
                ccfg = replace(ccfg, ctas=min(ccfg.ctas, device_sms(dst.device), D // 16))
        if ccfg is not None and (rows == 1 or ccfg.all_experts):
            ws, cnt = ((None, None) if ccfg.all_experts
                       else workspace or down_workspace(k, D, dst.device))
            if ws is not None and (ws.shape[0] < k or ws.shape[1] != D or cnt.numel() != D // 16):
                raise ValueError(f"fp4_experts_down: workspace {tuple(ws.shape)} / {cnt.numel()} "
                                 f"does not fit k = {k}, D = {D}")
            with on_device(dst):
                cuda_cpp.fp4_down(cuda_cpp.lib_for(dst.device), ac, idx.contiguous(), w2,
                                  s2.view(torch.uint8), addc, dst, ws, cnt, D, I, k // rows,
                                  dst.dtype == torch.float32, ccfg,
                                  (2 if idx_early else 1) if pdl_on(dst, pdl) else 0, rows=rows,
                                  post=None if post is None else post[:3])
            return dst
    if post is not None:   # down, then the post in a launch of its own
        y = fp4_experts_down(a, idx, w2, s2, add=add, out_dtype=out_dtype, config=config,
                             impl=impl, strict=strict, workspace=workspace, rows=rows, pdl=pdl,
                             idx_early=idx_early)
        return hc_post(y.view(rows, D), *post[:3], out=streams, pdl=pdl)
    if rows > 1:   # one launch per row
        n = k // rows
        for t in range(rows):
            fp4_experts_down(ac[t * n:(t + 1) * n], idx[t * n:(t + 1) * n], w2, s2,
                             add=None if addc is None else addc.view(rows, D)[t:t + 1],
                             out_dtype=out_dtype, out=out.view(rows, D)[t:t + 1], config=config,
                             impl=impl, strict=strict, workspace=workspace, pdl=pdl)
        return out
    cfg = config or down_config(k, I, D)
    with on_device(out):
        _fp4_down_kernel[(D // cfg.bn,)](
            ac, idx, w2.view(torch.int32), s2.view(torch.uint8),
            out if addc is None else addc, out, D=D, I=I, TOPK=k, BN=cfg.bn, NB=cfg.nb,
            EVEN_K=I % (cfg.nb * 128) == 0, HAS_ADD=add is not None, NATIVE=_native(out),
            num_warps=cfg.num_warps,
            **launch_args(out, pdl))
    return out


# ---- plain-torch references ---------------------------------------------------------------------

def _w8a8(x, w, s):
    """bf16(fp32 dot of the exact operands): what fp4_gemm returns. x [n], w [E?, out, in/2]."""
    return (dequantize_fp4_weight(w, s, torch.float64) @ fp8_quant_dequant(x.float(), 128).double()
            ).float().to(torch.bfloat16)


def fp4_experts_up_reference(x, idx, route_w, w1, s1, w3, s3, limit):
    rows = []
    for j in range(idx.numel()):
        e = int(idx[j])
        g = _w8a8(x.reshape(-1), w1[e], s1[e]).float()
        u = _w8a8(x.reshape(-1), w3[e], s3[e]).float()
        if limit > 0:
            u = u.clamp(-limit, limit)
            g = g.clamp(max=limit)
        rows.append((route_w[j].float() * (F.silu(g) * u)).to(torch.bfloat16))
    return torch.stack(rows)


def fp4_experts_down_reference(a, idx, w2, s2, add=None, out_dtype=torch.float32):
    y = torch.zeros(1, w2.shape[1], dtype=torch.float32, device=a.device)
    for j in range(idx.numel()):
        e = int(idx[j])
        y = y + _w8a8(a[j], w2[e], s2[e]).float()
    if add is not None:
        y = y + add.float()
    return y.to(out_dtype)
