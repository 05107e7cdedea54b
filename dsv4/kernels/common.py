"""Triton helpers shared by the kernels: bit-exact act_quant (ue8m0, e4m3 RNE), bf16 rounding, e8m0 /
e4m3 / e2m1 decoding with integer ops (identical in the interpreter and on sm_90), launch configs
and options (PDL), and the attention-side jit helpers (in-kernel RoPE, FP8 / FP4 fake-quant rows,
Hadamard, bf16 dots) of the decode and prefill kernels.
Tested through the kernels: `TRITON_INTERPRET=1 python -m pytest tests/dsv4/kernels/test_decode_kernels_interp.py`.
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

from ..weights.formats import (
    ACT_AMAX_FLOOR,
    FP4_AMAX_FLOOR,
    FP4_MAX,
    FP4_MAX_INV,
    FP8_MAX,
    FP8_MAX_INV,
)

# jit code may only read constexpr globals
RNE_MAGIC = tl.constexpr(12582912.0)   # 1.5 * 2^23: (y + M) - M rounds |y| < 2^22 to nearest-even
AMAX_FLOOR = tl.constexpr(ACT_AMAX_FLOOR)
E4M3_MAX = tl.constexpr(FP8_MAX)
E4M3_MAX_INV = tl.constexpr(FP8_MAX_INV)  # fp32(1/448): act_quant multiplies by it
TARGET_PROGRAMS = 512    # ~4 programs per SM on H100/H200 (132 SMs): fills the machine, evens waves
MAX_NB = 32              # at most 32 blocks of 128 along K per step (x values per thread stay small)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def device_capability(device: torch.device) -> tuple:
    """A CUDA device's compute capability, asked of the driver once per device."""
    return _capability(_index(device))


def device_sms(device: torch.device) -> int:
    """A CUDA device's SM count, asked of the driver once per device (launch configs with one
    CTA an SM: no host query per eager launch)."""
    return _sms(_index(device))


def pdl(t: torch.Tensor, on: bool = True) -> bool:
    """Launch with programmatic dependent launch (PDL) on t's device: asked for (`on`: the
    backend's switch, DSV4_PDL), CUDA sm_90+, not under the interpreter. The kernel may then start
    while the previous one finishes; every kernel calls `pdl_wait` before it touches data another
    kernel writes (see there)."""
    if not on or not t.is_cuda or interpreting():
        return False
    return device_capability(t.device) >= (9, 0)


def launch_args(t: torch.Tensor, on: bool = True) -> dict:
    """Keyword arguments of a launch on t's device: the kernel's PDL constexpr and, when PDL is on
    (pdl(t, on)), Triton's `launch_pdl` (the launch attribute; stream capture turns it into a
    graph edge)."""
    return {"PDL": True, "launch_pdl": True} if pdl(t, on) else {"PDL": False}


def on_device(t: torch.Tensor):
    """Triton launches on the *current* CUDA device: make it t's (layers live on several GPUs)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@dataclass(frozen=True)
class Config:
    """A fixed launch config: BN output rows per program, NB blocks of 128 K-elements per step;
    prefetch (FP8 GEMV): load the next step's weights before this step's math."""
    bn: int
    nb: int
    num_warps: int = 4
    prefetch: bool = False


@dataclass(frozen=True)
class CudaConfig:
    """A launch config of the CUDA C++ FP8 GEMV (csrc/fp8_gemv.cu): lc lanes split a row's
    16-byte chunks, each lane reads rpl rows x cpl chunks, `warps` warps split K; a CTA computes
    (32 // lc) * rpl rows."""
    lc: int
    rpl: int
    cpl: int
    warps: int

    @property
    def rows(self) -> int:
        return (32 // self.lc) * self.rpl


@dataclass(frozen=True)
class MmaConfig:
    """A launch config of the tensor-core FP8 GEMV (csrc/fp8_mma.cu): tiles of 16 rows, `warps`
    warps splitting K into spw 128-blocks each (K == warps * 128 * spw); a CTA a tile (ctas 0), or
    ctas CTAs each streaming the tiles c, c + ctas, ... with the next weights in flight (the same
    bits)."""
    spw: int
    warps: int
    ctas: int = 0

    rows = 16


def pow2_floor(v: int) -> int:
    return 1 << (max(int(v), 1).bit_length() - 1)


def pick_config(rows: int, k: int, tile_bytes: int, bytes_per_elem: float, programs_per_row: int = 1,
                bn_max: int = 32, target: int = TARGET_PROGRAMS) -> Config:
    """Heuristic: the largest BN (<= bn_max, power of two dividing `rows`) still giving about
    `target` programs, then NB so one step reads about `tile_bytes` of weight per matrix.
    Prefers an NB dividing K (no masks) unless that needs more than 4 steps."""
    bn = bn_max
    while bn > 1 and (rows % bn or (rows // bn) * programs_per_row < target):
        bn //= 2
    kb = -(-k // 128)
    cap = max(1, min(MAX_NB, pow2_floor(tile_bytes / (bn * 128 * bytes_per_elem))))
    nb_even = 1
    while nb_even * 2 <= cap and kb % (nb_even * 2) == 0:
        nb_even *= 2
    nb_mask = min(cap, 1 << (kb - 1).bit_length())
    nb = nb_even if -(-kb // nb_even) <= 4 else nb_mask
    return Config(bn, nb)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """PDL point of a kernel: wait until the previous kernel has finished and its writes are
    visible, then allow the next kernel to launch (its programs queue up behind our last wave).
    Only loads of immutable data (weights, constants) may come before this; every other load and
    every store comes after it, so the stream order of memory effects is unchanged."""
    if PDL:
        tl_cuda.gdc_wait()
        tl_cuda.gdc_launch_dependents()


# ---- scalar / elementwise helpers (float32 in, float32 out) ----------------------------------

@triton.jit
def pow2(e):
    """2^e as float32 for int32 -126 <= e <= 127, built from the bits (exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_bf16(x):
    """Round float32 onto the bf16 grid (RNE) and return float32 (the interpreter's cast truncates)."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def round_e4m3(v):
    """Round float32 |v| <= 448 onto the e4m3 grid, nearest-even (normal and subnormal)."""
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127     # floor(log2|v|)
    e = tl.maximum(e, -6) - 3                                   # log2 of the quantum (>= 2^-9)
    r = (v * pow2(-e) + RNE_MAGIC) - RNE_MAGIC
    return r * pow2(e)


@triton.jit
def block_exponent(xb):
    """xb [nb, 128] float32 -> [nb] int32 e: act_quant's ue8m0 scale is 2^e (amax floored at 1e-4,
    e = ceil(log2(amax * fp32(1/448))) from the float32 bits)."""
    amax = tl.maximum(tl.max(tl.abs(xb), axis=1), AMAX_FLOOR)
    b = (amax * E4M3_MAX_INV).to(tl.int32, bitcast=True)
    return ((b >> 23) & 0xFF) - 127 + ((b & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def quant_dequant(x, e):
    """e4m3(clamp(x / 2^e, +-448)) * 2^e: the exact value an FP8 GEMM sees for x (e broadcastable)."""
    v = tl.minimum(tl.maximum(x * pow2(-e), -E4M3_MAX), E4M3_MAX)
    return round_e4m3(v) * pow2(e)


@triton.jit
def e8m0_to_f32(b):
    """ue8m0 bytes (uint8) -> 2^(b-127) float32. Byte 0 (2^-127, never used by checkpoints) -> 0."""
    return (b.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_to_f32(b, NATIVE: tl.constexpr):
    """e4m3 bytes (uint8) -> float32. NATIVE: the hardware cast (exact value). Otherwise the bits
    are moved into an fp16 (exact, fp16 subnormals cover e4m3 subnormals): the result is the value
    times 2^-8, which the caller folds into its activation. NaN bytes are not special-cased."""
    if NATIVE:
        return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        bi = b.to(tl.int32)
        h = ((bi & 0x7F) << 7) | ((bi & 0x80) << 8)
        return h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


# e2m1 word -> float32 (value * 2^-6): the 8 nibbles of a 32-bit word, in order. Each nibble becomes
# an e4m3 byte (e2m1's bits shifted down by 2, subnormal 0.5 included: 3 32-bit ops per 4 bytes),
# then cvt e4m3x2 -> f16x2 (one per pair) and f16 -> f32.
E2M1_TO_F32_ASM = tl.constexpr("""{
    .reg .b32 a, c, l, h, p0, p1, p2, p3;
    .reg .b16 l0, l1, h0, h1, f0, f1, f2, f3, g0, g1, g2, g3;
    shl.b32 a, $8, 2;
    shl.b32 c, $8, 4;
    and.b32 a, a, 0x1C1C1C1C;
    and.b32 c, c, 0x80808080;
    or.b32 l, a, c;
    shr.b32 a, $8, 2;
    and.b32 a, a, 0x1C1C1C1C;
    and.b32 c, $8, 0x80808080;
    or.b32 h, a, c;
    mov.b32 {l0, l1}, l;
    mov.b32 {h0, h1}, h;
    cvt.rn.f16x2.e4m3x2 p0, l0;
    cvt.rn.f16x2.e4m3x2 p1, l1;
    cvt.rn.f16x2.e4m3x2 p2, h0;
    cvt.rn.f16x2.e4m3x2 p3, h1;
    mov.b32 {f0, f1}, p0;
    mov.b32 {f2, f3}, p1;
    mov.b32 {g0, g1}, p2;
    mov.b32 {g2, g3}, p3;
    cvt.f32.f16 $0, f0;
    cvt.f32.f16 $1, g0;
    cvt.f32.f16 $2, f1;
    cvt.f32.f16 $3, g1;
    cvt.f32.f16 $4, f2;
    cvt.f32.f16 $5, g2;
    cvt.f32.f16 $6, f3;
    cvt.f32.f16 $7, g3;
}""")


@triton.jit
def _e2m1_bits(w, r: tl.constexpr):
    """Nibble r of int32 words w -> float32 value * 2^-14 (its bits placed in an fp16, exact)."""
    n = w >> (4 * r)
    h = ((n & 7) << 9) | ((n & 8) << 12)
    return h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e2m1_word_to_f32(w, NATIVE: tl.constexpr):
    """int32 words of 8 e2m1 codes (nibble r = element r, low nibble first) -> 8 float32 tensors
    shaped like w, element r of each word: the e2m1 value * 2^-6 (NATIVE) or * 2^-14 (not
    NATIVE). NATIVE (sm_90, inline PTX): e2m1 (s, e1 e0 m) is e4m3's bit pattern with exponent and
    mantissa shifted down by 2, so 4 nibbles at a time become e4m3 bytes, then the hardware
    e4m3x2 -> f16x2 and f16 -> f32 casts. Otherwise (interpreter) each nibble's bits go into an
    fp16."""
    if NATIVE:
        return tl.inline_asm_elementwise(E2M1_TO_F32_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w],
                                         dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    else:
        return (_e2m1_bits(w, 0), _e2m1_bits(w, 1), _e2m1_bits(w, 2), _e2m1_bits(w, 3),
                _e2m1_bits(w, 4), _e2m1_bits(w, 5), _e2m1_bits(w, 6), _e2m1_bits(w, 7))


E2M1_MAX = tl.constexpr(FP4_MAX)
E2M1_MAX_INV = tl.constexpr(FP4_MAX_INV)
E2M1_AMAX_FLOOR = tl.constexpr(FP4_AMAX_FLOOR)
NEG_INF = tl.constexpr(float("-inf"))
# The index scores' orientation in the decode and chunk kernels alike (their bits agree): True,
# dot(keys, q^T) [entries, heads], each entry's sum over the heads within its row of the MMA
# tile; False, dot(q, keys^T) [heads, entries], summed down the columns across the warps (1M
# context on an H200: 33.5 against 24.8 us a decode row, BENCHMARKS.md).
INDEX_SCORES_TRANS = True


# ---- attention-side jit helpers (float32 in, float32 out; "pairs" = the (even, odd) dims of
# RoPE): in-kernel RoPE, FP8 (block 64) / FP4 (block 32) fake-quant, Hadamard, bf16 dots ---------

@triton.jit
def load_pos(pos_ptr):
    """The decode position (int64 [1] on the device) as an int32 scalar."""
    return tl.load(pos_ptr).to(tl.int32)


@triton.jit
def rope_cos_sin(pos_f, freqs_ptr, pair, NOPE_PAIRS: tl.constexpr):
    """cos/sin of fp32(pos) * freqs[pair - NOPE_PAIRS] (as dsv4.numerics.rope.cos_sin); 1/0 on nope pairs."""
    f = tl.load(freqs_ptr + (pair - NOPE_PAIRS), mask=pair >= NOPE_PAIRS, other=0.0)
    ang = pos_f * f
    return tl.cos(ang), tl.sin(ang)


@triton.jit
def rope_pairs(a, b, cos, sin, is_rope, INVERSE: tl.constexpr):
    """Rotate the pairs (a, b) = (x[2i], x[2i+1]) where is_rope, in fp32, result rounded to bf16
    (dsv4.numerics.rope.apply_rope on bf16 tensors). a, b [..., P]; cos, sin, is_rope broadcast to them."""
    if INVERSE:
        sin = -sin
    ra = round_bf16(a * cos - b * sin)
    rb = round_bf16(a * sin + b * cos)
    return tl.where(is_rope, ra, a), tl.where(is_rope, rb, b)


@triton.jit
def to_pairs(x, SHAPE0: tl.constexpr, P: tl.constexpr):
    """[SHAPE0, 2P] -> (even, odd) [SHAPE0, P]."""
    return tl.split(tl.reshape(x, [SHAPE0, P, 2]))


@triton.jit
def from_pairs(a, b, SHAPE0: tl.constexpr, P: tl.constexpr):
    """(even, odd) [SHAPE0, P] -> [SHAPE0, 2P] interleaved."""
    return tl.reshape(tl.join(a, b), [SHAPE0, 2 * P])


@triton.jit
def fp8_fake_quant_rows(x, ROWS: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr):
    """x [ROWS, D] (bf16 values) -> e4m3 fake-quant per 64-block of the first NOPE dims (ue8m0,
    dsv4.numerics.quant.fp8_quant_dequant(x, 64)); the other dims unchanged."""
    xb = tl.reshape(x, [ROWS * (D // 64), 64])
    q = quant_dequant(xb, block_exponent(xb)[:, None])
    blk = (tl.arange(0, ROWS * (D // 64)) % (D // 64))[:, None]
    return tl.reshape(tl.where(blk < NOPE // 64, q, xb), [ROWS, D])


@triton.jit
def round_e2m1(v):
    """Round float32 |v| <= 6 onto the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, nearest-even."""
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127          # floor(log2|v|)
    e = tl.maximum(e, 0) - 1                                           # log2 of the quantum
    r = ((a * pow2(-e) + RNE_MAGIC) - RNE_MAGIC) * pow2(e)
    return tl.where(v < 0, -r, r)


@triton.jit
def fp4_fake_quant_rows(x, ROWS: tl.constexpr, D: tl.constexpr):
    """x [ROWS, D] -> e2m1 fake-quant per 32-block, ue8m0 scales (dsv4.numerics.quant.fp4_quant_dequant)."""
    xb = tl.reshape(x, [ROWS * (D // 32), 32])
    amax = tl.maximum(tl.max(tl.abs(xb), axis=1), E2M1_AMAX_FLOOR)
    bits = (amax * E2M1_MAX_INV).to(tl.int32, bitcast=True)
    e = (((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32))[:, None]
    v = tl.minimum(tl.maximum(xb * pow2(-e), -E2M1_MAX), E2M1_MAX)
    return tl.reshape(round_e2m1(v) * pow2(e), [ROWS, D])


@triton.jit
def sylvester(i, j):
    """Entries (-1)^popcount(i & j) of the Sylvester Hadamard matrix (indices < 2^10), float32."""
    v = i & j
    v = v ^ (v >> 8)
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return 1.0 - 2.0 * (v & 1).to(tl.float32)


@triton.jit
def hadamard_pairs_row(a, b, P: tl.constexpr):
    """Normalized Hadamard of one row x [2P] given as pairs (a, b) [P]: H_2P[2p+u, 2q+v] =
    H_P[p, q] (-1)^(uv), so y[2q] = H_P(a+b)[q], y[2q+1] = H_P(a-b)[q]; scale (2P)^-1/2, bf16."""
    p = tl.arange(0, P)
    h = sylvester(p[:, None], p[None, :])
    scale = (2 * P) ** -0.5
    ya = tl.sum((a + b)[:, None] * h, axis=0) * scale
    yb = tl.sum((a - b)[:, None] * h, axis=0) * scale
    return round_bf16(ya), round_bf16(yb)


@triton.jit
def dot_bf16(a, b, F32: tl.constexpr):
    """tl.dot of bf16-valued operands with fp32 accumulation; F32 (the interpreter, whose bf16
    dot is wrong) multiplies the same values as float32 (exact products either way)."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))


@triton.jit
def index_tile_scores(q, k, w, TRANS: tl.constexpr, F32: tl.constexpr):
    """The index scores of a tile of keys k [BT, DI]: sum_h relu(q_h . k_t) * w_h with bf16
    rounding after each op -> [BT] float32, for q [HP, DI] and w [HP] (float32, bf16 values).
    TRANS: INDEX_SCORES_TRANS's orientation. The decode and chunk kernels' one arithmetic."""
    if TRANS:
        sc = round_bf16(dot_bf16(k, tl.trans(q), F32))                      # [BT, HP]
        sc = round_bf16(tl.maximum(sc, 0.0) * w[None, :])
        s = round_bf16(tl.sum(sc, axis=1))
    else:
        sc = round_bf16(dot_bf16(q, tl.trans(k), F32))                      # [HP, BT]
        sc = round_bf16(tl.maximum(sc, 0.0) * w[:, None])
        s = round_bf16(tl.sum(sc, axis=0))
    return s
