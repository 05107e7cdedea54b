"""Linears of a prefill chunk over the stored weight formats, on tensor cores (Triton).

FP8 / FP4 weights with act-quantized inputs (the official W8A8 path) run as the official fp8_gemm /
fp4_gemm do: `act_quant8` turns the rows into e4m3 bytes with a power-of-two scale per 128; the
GEMM multiplies e4m3 x e4m3 on the FP8 tensor cores, one fresh accumulator per weight-scale group
(128 for FP8, 32 for FP4, whose e2m1 codes become e4m3 bytes with two shifts and an or), times the
weight scale, and every 128 times the activation scale, summed in float32. bf16 weights, and FP8
weights applied to unquantized activations (the grouped wo_a), decode to bf16 in registers (exact)
for a bf16 MMA with float32 accumulation. Products are exact either way; only the float32
summation order differs from the reference.

Both GEMMs take rows directly or gathered (`rows`), and row tiles of one expert each (`tiles`, the
grouped experts of kernels/prefill/moe.py), with the SwiGLU epilogue (clamped, route weight, and for FP8
the next act quant). Two library paths compute the same thing faster where they serve: an FP8
weight over plain rows goes through torch._scaled_mm's blockwise (DeepSeek) recipe, which gives
gemm8's bits (`scaled_mm`, checked once per device); the grouped wo_a over many rows through
its weight dequantized to bf16 and cuBLAS (`grouped_dense`, the same exact products).
Legend: m = rows, n = output features, k = input features, e = experts.
The kernels: gemm_kernels.py. References: `linear_reference`.
Test: tests/dsv4/kernels/test_prefill_kernels.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ...numerics.quant import fp8_quant_dequant
from ...weights.formats import (
    FP8_BLOCK,
    dequantize_fp4_weight,
    dequantize_fp8_weight,
    e8m0_to_float,
)
from ..common import interpreting, on_device
from .gemm_kernels import (
    _act_quant8_kernel,
    _act_quant_kernel,
    _gemm8_kernel,
    _gemm16_kernel,
    _splitk_kernel,
    _swiglu_quant8_kernel,
)

FORMATS = {"bf16": 0, "fp8": 1, "fp4": 2}
BM, BN, BK = 64, 128, 64          # row tile, output-feature tile (= the act-quant block), bf16 K step
BK16 = {"bf16": 64, "fp8": 64, "fp4": 64}   # the bf16 path's K step per weight format
WARPS, STAGES = 8, 3
QROWS = 16                        # rows per act_quant8 program


# ---- host side ----------------------------------------------------------------------------------

FP8_MMA_MIN_ROWS = 256   # FP8 weights: FP8 tensor cores from this many rows, bf16 below
SPLIT_PROGRAMS = 264     # k_split: programs to aim for (two per SM of an H100 / H200;
# DSV4_SPLIT_PROGRAMS, through Tuning: benchmarks)
SPLIT_MIN_STEPS = 4      # k_split: K steps per program at least
SPLIT_BM = 16            # rows per program of the split-K sum
GROUPED_DENSE_MIN_ROWS = 1024   # the grouped wo_a: dequantized weights + cuBLAS from this many
# rows (Flash, 4,096 rows on an H200: 0.63 ms against 0.95 for the registers-decoded GEMM)


@dataclass(frozen=True)
class Tuning:
    """The prefill GEMMs' runtime switches (the backend's, dsv4.backend.Options): `mma` ((format,
    "fp8" | "bf16"), ...) overrides mma_path's choice (DSV4_PREFILL_MMA: benchmarks, tests);
    `cublas`: an FP8 weight over plain rows may take torch._scaled_mm (DSV4_PREFILL_CUBLAS);
    `split_programs`: k_split's target (DSV4_SPLIT_PROGRAMS)."""
    mma: tuple = ()
    cublas: bool = True
    split_programs: int = SPLIT_PROGRAMS


DEFAULT = Tuning()


@dataclass(frozen=True)
class Tile:
    """A launch config of the bf16 path: bm rows x bn output features per program, bk K step."""
    bm: int
    bn: int
    bk: int
    warps: int


def mma_path(fmt: str, rows: int | None = None, tuning: Tuning = DEFAULT) -> str:
    """The tensor cores a weight format's GEMM over `rows` rows uses: "fp8" (act-quantized e4m3
    rows, a fresh MMA per weight-scale group) or "bf16" (the weights decoded to bf16). Measured
    on an H200 (python -m dsv4.bench.prefill_kernels, BENCHMARKS.md): FP8 weights take the FP8
    tensor cores for long chunks (wq_b, 4096 rows: 0.60 ms vs 0.86) and the bf16 ones for short
    (128 rows: 0.07 vs 0.09); FP4 experts the bf16 ones (the FP8 path rescales every 32 of K: 2.2x
    slower at 4096 rows). tuning.mma overrides (DSV4_PREFILL_MMA: benchmarks, tests)."""
    if fmt == "bf16":
        return "bf16"
    for f, path in tuning.mma:
        if f == fmt:
            return path
    if fmt == "fp8":
        return "fp8" if rows is None or rows >= FP8_MMA_MIN_ROWS else "bf16"
    return "bf16"


def pick_bm(rows_per_group: float, wide: bool = False) -> int:
    """Row tile for ~rows_per_group rows per weight matrix: the smallest of 16 / 32 / 64 holding
    them; wide: 128 past 64."""
    for bm in (16, 32, 64):
        if rows_per_group <= bm:
            return bm
    return 128 if wide else 64


def tile16(rows_per_group: float) -> Tile:
    """The bf16 path's tile for ~rows_per_group rows per weight matrix (tokens per expert, or the
    rows of a plain linear), from the H200 sweep: few rows, 16-row tiles over 128 features with 8
    warps (latency-bound: more programs in flight); many, 128-row tiles over 64 features with 4
    warps (each decoded weight tile serves twice the rows: experts up 5.0 -> 3.3 ms, down 2.5 ->
    2.0 ms for a 4096-token Flash chunk)."""
    bm = pick_bm(rows_per_group, wide=True)
    return Tile(16, 128, 64, 8) if bm == 16 else Tile(bm, 64, 64, 4)


def _bytes(t: torch.Tensor | None) -> torch.Tensor | None:
    """FP8 / e8m0 tensors as raw bytes (the kernels read the bits)."""
    if t is None or t.dtype in (torch.bfloat16, torch.float32, torch.uint8, torch.int32):
        return t
    return t.view(torch.uint8)


def act_quant8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] bf16 -> the official act_quant (per 128, ue8m0 scale, e4m3): (e4m3 bytes [m, k]
    uint8, scales [m, k/128] float32 powers of two). One launch."""
    M, K = x.shape
    if K % 128:
        raise ValueError(f"act_quant8: k = {K} is not a multiple of 128")
    x = x.contiguous()
    y = torch.empty(M, K, dtype=torch.uint8, device=x.device)
    s = torch.empty(M, K // 128, dtype=torch.float32, device=x.device)
    with on_device(y):
        _act_quant8_kernel[(triton.cdiv(M, QROWS), K // 128)](x, y, s, M, K=K, R=QROWS,
                                                              num_warps=4)
    return y, s


def act_quant(x: torch.Tensor) -> torch.Tensor:
    """x [m, k] bf16 -> the official act_quant's values as exact bf16 (== fp8_quant_dequant(x,
    128)): the A operand of the bf16 path for quantized weights. One launch."""
    M, K = x.shape
    if K % 128:
        raise ValueError(f"act_quant: k = {K} is not a multiple of 128")
    x = x.contiguous()
    y = torch.empty_like(x)
    with on_device(y):
        _act_quant_kernel[(triton.cdiv(M, QROWS), K // 128)](x, y, M, K=K, R=QROWS, num_warps=4)
    return y


def dequant8(x8: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    """act_quant8's output -> the values it stands for, float32 [m, k] (references, tests)."""
    v = x8.view(torch.float8_e4m3fn).float().unflatten(-1, (-1, 128))
    return (v * xs.unsqueeze(-1)).flatten(-2)


def _grid(out, bm, grid_m, N, bn=BN):
    return (grid_m or triton.cdiv(out.shape[0], bm), triton.cdiv(N, bn))


SCALED_MM_K_BLOCKS = 4   # cuBLASLt reads 128x128 weight scales as if K/128 were padded to this
_SCALED_MM_OK: dict = {}  # (device index, n, k) -> the probe's verdict


def scaled_mm_ok(x8: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether torch._scaled_mm's DeepSeek recipe (1x128 activation, 128x128 weight scales;
    cuBLAS >= 12.9, sm_90 only) serves rows x8 [m, k] times the FP8 weight w [n, k] here: CUDA,
    m a multiple of 4 (cuBLASLt), k / 128 a multiple of SCALED_MM_K_BLOCKS, and a probe of this
    weight shape on this device gave gemm8's bits on poisoned output (once per
    shape and device). cuBLASLt's layout for 128x128 scales pads K/128 to a multiple of 4 (cuBLAS
    docs, "scaling factors layouts"): with k = 128 or 256 it read past the scales and left parts
    of `out` unwritten, so the same prompt gave different tokens (issue 33)."""
    M, K = x8.shape
    if (x8.device.type != "cuda" or interpreting() or M % 4 or (K // 128) % SCALED_MM_K_BLOCKS
            or not hasattr(torch, "_scaled_mm")):
        return False
    key = (x8.device.index, w.shape[-2], K)
    if key not in _SCALED_MM_OK:
        if torch.cuda.is_current_stream_capturing():
            return False       # no probe inside a capture: gemm8 now (same bits), probe later
        _SCALED_MM_OK[key] = _probe_scaled_mm(x8.device, w.shape[-2], K)
    return _SCALED_MM_OK[key]


def _probe_scaled_mm(dev: torch.device, n: int, k: int) -> bool:
    """One GEMM of this shape through both paths, into NaN-filled outputs, over a row count that
    is not a multiple of any tile (260): the recipe is used only where it exists, writes every
    output and agrees bit for bit."""
    if torch.cuda.get_device_capability(dev) != (9, 0):
        return False
    from ...weights.formats import quantize_fp8_weight
    gen = torch.Generator(device=dev).manual_seed(0)
    w, s = quantize_fp8_weight(torch.randn(n, k, device=dev, generator=gen) * 0.05)
    x8, xs = act_quant8(torch.randn(260, k, device=dev, generator=gen).bfloat16())
    nan = torch.full((260, n), float("nan"), dtype=torch.bfloat16, device=dev)
    want = gemm8(x8, xs, w, s, "fp8", nan.clone(), bm=64, warps=4, cublas=False)
    try:
        got = scaled_mm(x8, xs, w, s, nan.clone())
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return torch.equal(got, want)


def scaled_mm(x8: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, s: torch.Tensor,
              out: torch.Tensor) -> torch.Tensor:
    """out [m, n] bf16 = act_quant8 rows (x8, xs) @ FP8 weight (w [n, k], ue8m0 s [n/128,
    k/128])^T through torch._scaled_mm's blockwise recipe: per 128 of K an FP8 MMA into a fresh
    float32 tile, times both scales, summed in float32 (as gemm8 and the official fp8_gemm)."""
    return torch._scaled_mm(x8.view(torch.float8_e4m3fn), w.view(torch.float8_e4m3fn).t(),
                            scale_a=xs.t().contiguous().t(), scale_b=e8m0_to_float(s).t(),
                            out_dtype=torch.bfloat16, out=out)


def swiglu_quant8(g: torch.Tensor, u: torch.Tensor, limit: float, out: torch.Tensor,
                  out_scale: torch.Tensor) -> torch.Tensor:
    """act_quant(bf16(SwiGLU(g, u))) of bf16 GEMM outputs g, u [m, n] (clamped at limit > 0)
    -> e4m3 bytes out [m, n] and scales out_scale [m, n/128]: gemm8's SwiGLU epilogue, alone."""
    M, N = g.shape
    with on_device(out):
        _swiglu_quant8_kernel[(triton.cdiv(M, QROWS), N // 128)](
            g, u, out, out_scale, M, float(limit), N=N, LIMIT=limit > 0, R=QROWS, num_warps=4)
    return out


def gemm8(x8, xs, w, s, fmt: str, out: torch.Tensor, *, bm: int = BM, rows=None, tiles=None,
          grid_m=None, w3=None, s3=None, rw=None, limit: float = 0.0, out_scale=None,
          warps: int = WARPS, cublas: bool = True) -> torch.Tensor:
    """FP8 tensor cores: out = (A8 @ W^T) over e4m3 rows x8 [m_a, k] (+ scales xs [m_a, k/128])
    and an FP8 or FP4 weight (stacked [e, n, ..] with `tiles`: row tiles of bm rows), the rows
    gathered by `rows` if given. w3: the SwiGLU epilogue (w1 = w); out_scale: act-quantize the
    output (out uint8, out_scale f32 [m, n/128]). cublas: an FP8 weight over plain rows takes
    torch._scaled_mm's blockwise recipe where it serves (scaled_mm_ok): the same bits, faster
    (the SwiGLU epilogue then runs as swiglu_quant8 over its two outputs)."""
    K = x8.shape[1]
    N = w.shape[-2]
    if K % 128 or (out_scale is not None and N % BN):
        raise ValueError(f"FP8 GEMM: k = {K} must be a multiple of 128 (and n = {N} of {BN} "
                         f"for a quantized output)")
    if (cublas and fmt == "fp8" and rows is None and tiles is None and rw is None
            and out.dtype != torch.float32 and scaled_mm_ok(x8, w, out)):
        if w3 is None and out_scale is None:
            return scaled_mm(x8, xs, w, s, out)
        if w3 is not None and out_scale is not None:
            g = scaled_mm(x8, xs, w, s, torch.empty(out.shape, dtype=torch.bfloat16,
                                                    device=out.device))
            u = scaled_mm(x8, xs, w3, s3, torch.empty_like(g))
            return swiglu_quant8(g, u, limit, out, out_scale)
    dummy = out
    tile_e, tile_r = tiles if tiles is not None else (dummy, dummy)
    with on_device(out):
        _gemm8_kernel[_grid(out, bm, grid_m, N)](
            x8, xs, rows if rows is not None else dummy, _bytes(w), _bytes(s),
            _bytes(w3) if w3 is not None else dummy, _bytes(s3) if s3 is not None else dummy,
            out, out_scale if out_scale is not None else dummy, rw if rw is not None else dummy,
            tile_e, tile_r, out.shape[0], float(limit), N=N, K=K, FP4=fmt == "fp4",
            GROUPED=tiles is not None, GATHER=rows is not None, SWIGLU=w3 is not None,
            LIMIT=limit > 0, ROUTE_W=rw is not None, QUANT=out_scale is not None,
            OUT_F32=out.dtype == torch.float32, BM=bm, BN=BN, F32=interpreting(),
            num_warps=warps, num_stages=STAGES)
    return out


def _words(w: torch.Tensor | None, fmt: str):
    """Packed FP4 as int32 words of 8 e2m1 (the bf16 path's decode unit); else raw bytes."""
    if w is None or fmt != "fp4":
        return _bytes(w)
    return w.view(torch.int32)


def k_split(programs: int, steps: int, target: int = SPLIT_PROGRAMS) -> int:
    """K splits for a plain GEMM of `programs` (row tile, n tile) programs and `steps` K steps
    each: a few rows leave most SMs idle while each program walks all of K, one weight tile at a
    time, so split K (a power of two dividing steps) until ~target programs run, each keeping
    >= SPLIT_MIN_STEPS steps."""
    split = 1
    while (programs * split * 2 <= target and steps % (split * 2) == 0
           and steps // (split * 2) >= SPLIT_MIN_STEPS):
        split *= 2
    return split


def gemm16(a, w, s, fmt: str, out: torch.Tensor, *, bm: int = BM, rows=None, tiles=None,
           grid_m=None, w3=None, s3=None, rw=None, limit: float = 0.0, quant: bool = False,
           group_k: int = 0, bk: int | None = None, bn: int = BN, warps: int = WARPS,
           split: int | None = None, stages: int = STAGES,
           split_programs: int = SPLIT_PROGRAMS) -> torch.Tensor:
    """bf16 tensor cores: out = A @ W^T over bf16 rows a [m_a, k] (already act-quantized for
    quantized weights, or not: wo_a) and a bf16 / FP8 / FP4 weight decoded to bf16 in registers;
    rows / tiles / w3 as gemm8; quant: act-quantize the SwiGLU output (exact bf16 values; needs
    bn = 128, the quant block). bk, bn, warps: the K step, output-feature tile and warps.
    group_k: the grouped wo_a (output group g = rows [g*n/G, (g+1)*n/G) reads
    a[:, g*group_k:(g+1)*group_k]). split: K splits (None: k_split's choice over the grid's
    programs, aiming for split_programs), their float32 partials added in split order by a second
    launch."""
    K = group_k or a.shape[1]
    N = w.shape[-2]
    bk = bk or BK16.get(fmt, BK)
    if K % bk or (fmt != "bf16" and K % 128) or (quant and bn != 128):
        raise ValueError(f"bf16 GEMM: k = {K} must be a multiple of {bk} (of 128 quantized); "
                         f"an act-quantized output needs bn = 128 (got {bn})")
    gn = 0
    if group_k:
        gn = N // (a.shape[1] // group_k)
        if gn % bn:
            raise ValueError(f"bf16 GEMM: a wo_a group of {gn} rows is not a multiple of {bn}")
    dummy = out
    tile_e, tile_r = tiles if tiles is not None else (dummy, dummy)
    grid = _grid(out, bm, grid_m, N, bn)
    if split is None:
        split = k_split(grid[0] * grid[1], K // bk, split_programs)
    if K % (split * bk):
        raise ValueError(f"bf16 GEMM: {split} K splits need k = {K} a multiple of {split} x {bk}")
    M = out.shape[0]
    nmat = 2 if w3 is not None else 1
    ws = torch.empty(split, nmat, M, N, dtype=torch.float32, device=out.device) \
        if split > 1 else dummy
    with on_device(out):
        _gemm16_kernel[grid + (split,)](
            a, rows if rows is not None else dummy, _words(w, fmt),
            _bytes(s) if s is not None else dummy, _words(w3, fmt) if w3 is not None else dummy,
            _bytes(s3) if s3 is not None else dummy, out, rw if rw is not None else dummy,
            tile_e, tile_r, ws, M, M * N, float(limit), N=N, K=K, LDA=a.shape[1],
            GROUP_N=gn, FMT=FORMATS[fmt], GROUPED=tiles is not None, GATHER=rows is not None,
            SWIGLU=w3 is not None, LIMIT=limit > 0, ROUTE_W=rw is not None, QUANT=int(quant),
            OUT_F32=out.dtype == torch.float32, BM=bm, BN=bn, BK=bk, SPLIT=split,
            F32=interpreting(), NATIVE=not interpreting(), num_warps=warps, num_stages=stages)
        if split > 1:
            _splitk_kernel[(triton.cdiv(M, SPLIT_BM), triton.cdiv(N, BN))](
                ws, out, rw if rw is not None else dummy, M, M * N, float(limit), N=N,
                SPLIT=split, SWIGLU=w3 is not None, LIMIT=limit > 0, ROUTE_W=rw is not None,
                QUANT=int(quant), OUT_F32=out.dtype == torch.float32, BM=SPLIT_BM, BN=BN,
                num_warps=4)
    return out


def linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, fmt: str, *,
           out_dtype: torch.dtype, quant_act: bool | None = None, group_k: int = 0,
           tuning: Tuning = DEFAULT) -> torch.Tensor:
    """y = x @ W^T for rows x [m, k] bf16 and a weight in its stored format (bf16 [n, k]; fp8
    [n, k] + [n/128, k/128]; fp4 [n, k/2] + [n, k/32]) -> [m, n] in out_dtype (bf16 or float32).
    quant_act (default: for quantized weights): act-quantize x first (W8A8), on the tensor-core
    path mma_path picks; group_k: the grouped wo_a (see gemm16); tuning: the backend's switches."""
    if quant_act is None:
        quant_act = fmt != "bf16"
    M = x.shape[0]
    out = torch.empty(M, w.shape[0], dtype=out_dtype, device=x.device)
    if quant_act and mma_path(fmt, M, tuning) == "fp8":
        x8, xs = act_quant8(x)
        return gemm8(x8, xs, w, scale, fmt, out, bm=pick_bm(M), warps=4, cublas=tuning.cublas)
    if (group_k and not quant_act and M >= GROUPED_DENSE_MIN_ROWS and out_dtype == torch.bfloat16
            and not interpreting()):
        return grouped_dense(x, w, scale, fmt, group_k, out)
    t = tile16(M)
    return gemm16(act_quant(x) if quant_act else x.contiguous(), w, scale, fmt, out, bm=t.bm,
                  bn=BN if group_k else t.bn, bk=t.bk, warps=t.warps, group_k=group_k,
                  split_programs=tuning.split_programs)


def grouped_dense(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, fmt: str,
                  group_k: int, out: torch.Tensor) -> torch.Tensor:
    """The grouped wo_a over many rows x [m, G*group_k] (unquantized bf16): the bf16 / FP8
    weight [n, group_k] dequantized to bf16 (exact: e4m3 times a power of two), then one
    batched cuBLAS GEMM over the G groups with float32 accumulation (bf16 reduced-precision
    reductions off) -> out [m, n]. The same exact products as gemm16's, summed in another
    order; the dense copy of this one weight lives for the call (64 MiB on Flash)."""
    M, G = x.shape[0], x.shape[1] // group_k
    wd = w if fmt == "bf16" else dequantize_fp8_weight(w, scale, torch.bfloat16)
    wd = wd.view(G, -1, group_k)
    prior = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    try:
        y = torch.bmm(x.reshape(M, G, group_k).transpose(0, 1), wd.transpose(1, 2))  # [G, m, n/G]
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = prior
    out.view(M, G, -1).copy_(y.transpose(0, 1))
    return out


# ---- plain-torch references (the code the kernels replace) -----------------------------------

def dequantize(fmt: str, w: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    """Stored weight -> float32 values."""
    if fmt == "fp8":
        return dequantize_fp8_weight(w, s, torch.float32)
    if fmt == "fp4":
        return dequantize_fp4_weight(w, s, torch.float32)
    return w.float()


def linear_reference(x, w, scale, fmt, *, out_dtype, quant_act=None, group_k=0):
    """linear in float64 over the same exact operands, rounded to out_dtype at the end."""
    if quant_act is None:
        quant_act = fmt != "bf16"
    xq = (fp8_quant_dequant(x, FP8_BLOCK) if quant_act else x).double()
    wd = dequantize(fmt, w, scale).double()
    if group_k:
        G = x.shape[1] // group_k
        y = torch.einsum("mgk,gnk->mgn", xq.view(-1, G, group_k), wd.view(G, -1, group_k))
        y = y.flatten(1)
    else:
        y = xq @ wd.t()
    return y.to(out_dtype)
