"""FP8 e4m3 (128x128 ue8m0 scales) and FP4 e2m1 (per-32 ue8m0 scales) encode/decode (DSV4_SPEC §2.2).

Storage conventions of the release:
- FP8 weight `[out, in]` float8_e4m3fn + scale `[out/128, in/128]` float8_e8m0fnu.
- FP4 weight `[out, in/2]` int8, two e2m1 codes per byte along K, **low nibble = even
  element**; scale `[out, in/32]` float8_e8m0fnu.
- ue8m0 byte b means 2^(b-127); 255 is NaN.
Rounding is round-to-nearest-even onto the grids, with saturation, as `cvt.rn.satfinite`.
All functions work on any device and never sync with the host.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_BLOCK = 128
FP4_BLOCK = 32
# the kernels multiply by the float32 reciprocal (not divide): keep that rounding
FP8_MAX_INV = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))
FP4_MAX_INV = float(torch.tensor(1.0 / FP4_MAX, dtype=torch.float32))
ACT_AMAX_FLOOR = 1e-4               # act_quant floors the block amax here
FP4_AMAX_FLOOR = 6.0 * 2.0 ** -126  # fp4_act_quant floors the block amax here

# e2m1 code -> magnitude (codes 8..15 are the negatives; bit 3 is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# midpoints between neighbouring magnitudes and whether an exact tie rounds up (to the even code)
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                   (2.5, False), (3.5, True), (5.0, False))


class FormatError(ValueError):
    """A tensor whose shape or dtype does not fit the requested format."""


# ---- ue8m0 scales ---------------------------------------------------------------------------

def e8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales (float8_e8m0fnu or uint8 bytes) -> float32 2^(b-127); byte 255 -> NaN."""
    b = s.view(torch.uint8).to(torch.int32)
    normal = (b << 23).view(torch.float32)               # exact 2^(b-127) for 1 <= b <= 254
    sub = torch.full_like(normal, 2.0 ** -127)           # b == 0 is a float32 subnormal
    nan = torch.full_like(normal, float("nan"))
    return torch.where(b == 0, sub, torch.where(b == 255, nan, normal))


def exponent_to_e8m0(e: torch.Tensor) -> torch.Tensor:
    """Integer exponents (2^e, -127 <= e <= 127) -> float8_e8m0fnu bytes."""
    return (e.to(torch.int32) + 127).clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def pow2_ceil_exponent(v: torch.Tensor) -> torch.Tensor:
    """ceil(log2(v)) for positive float32 v, from the bit pattern (as the official kernels)."""
    bits = v.to(torch.float32).view(torch.int32)
    exp = (bits >> 23) & 0xFF
    man = bits & ((1 << 23) - 1)
    return exp - 127 + (man != 0).to(torch.int32)


def exponent_to_float(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32 for integer -126 <= e <= 127 (exact, built from bits)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def pow2_scale(amax: torch.Tensor, max_inv: float) -> torch.Tensor:
    """The power-of-two scale 2^ceil(log2(amax * max_inv)) as float32 (amax already floored)."""
    return exponent_to_float(pow2_ceil_exponent(amax.to(torch.float32) * max_inv))


# ---- element grids --------------------------------------------------------------------------

def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values onto the e4m3 grid (RNE, saturating at ±448); returns float32."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """float32 values -> e2m1 codes (uint8 0..15), RNE with saturation at ±6."""
    a = y.abs().to(torch.float32)
    code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for m, tie_up in _E2M1_MIDPOINTS:
        code += ((a >= m) if tie_up else (a > m)).to(torch.uint8)
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (any integer dtype, 0..15) -> float32 values. Capture-safe (no host copies)."""
    c = torch.arange(16, device=code.device, dtype=torch.int32)   # the 16-entry table, built on
    e, m = (c >> 1) & 3, (c & 1).to(torch.float32)                # the device: code = s|e e|m
    mag = torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * (1 << e).to(torch.float32) * 0.5)
    lut = torch.where((c & 8) != 0, -mag, mag)
    # index_select, not advanced indexing: the latter is ~300x slower on CPU for this gather
    return lut.index_select(0, (code.to(torch.int64) & 0xF).flatten()).view(code.shape)


def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round float32 values onto the e2m1 grid (RNE, saturating at ±6); returns float32."""
    return e2m1_decode(e2m1_encode(y))


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] e2m1 codes -> [..., K/2] int8 bytes; element 2j in the low nibble."""
    if codes.shape[-1] % 2:
        raise FormatError(f"FP4 packing needs an even K, got K = {codes.shape[-1]}")
    c = codes.to(torch.uint8) & 0xF
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] int8 bytes -> [..., K] e2m1 codes (uint8)."""
    b = packed.view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


# ---- weights --------------------------------------------------------------------------------

def _check_2d(w: torch.Tensor, rb: int, cb: int, what: str) -> None:
    if w.dim() != 2:
        raise FormatError(f"{what}: expected a 2-D weight, got shape {tuple(w.shape)}")
    out_f, in_f = w.shape
    if out_f % rb or in_f % cb:
        raise FormatError(f"{what}: shape [{out_f}, {in_f}] is not a multiple of the "
                          f"{rb}x{cb} block; both dims must divide evenly")


def quantize_fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (e4m3 [out, in], ue8m0 scale [out/128, in/128]) with power-of-two scales."""
    _check_2d(w, FP8_BLOCK, FP8_BLOCK, "FP8 weight")
    out_f, in_f = w.shape
    blocks = w.to(torch.float32).reshape(out_f // FP8_BLOCK, FP8_BLOCK, in_f // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(ACT_AMAX_FLOOR)
    e = pow2_ceil_exponent(amax * FP8_MAX_INV)
    s = exponent_to_float(e)
    q = (blocks / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(out_f, in_f), exponent_to_e8m0(e)


def dequantize_fp8_weight(w: torch.Tensor, scale: torch.Tensor,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 [..., out, in] + ue8m0 [..., out/128, in/128] -> dense [..., out, in] (exact in f32/bf16)."""
    *lead, out_f, in_f = w.shape
    want = (*lead, out_f // FP8_BLOCK, in_f // FP8_BLOCK)
    if tuple(scale.shape) != want or out_f % FP8_BLOCK or in_f % FP8_BLOCK:
        raise FormatError(f"FP8 weight {tuple(w.shape)} needs a scale of shape {want}, "
                          f"got {tuple(scale.shape)}")
    s = e8m0_to_float(scale)
    wf = w.to(torch.float32).reshape(*lead, out_f // FP8_BLOCK, FP8_BLOCK, in_f // FP8_BLOCK, FP8_BLOCK)
    return (wf * s[..., :, None, :, None]).reshape(*lead, out_f, in_f).to(dtype)


def quantize_fp4_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (packed int8 [out, in/2], ue8m0 scale [out, in/32])."""
    _check_2d(w, 1, FP4_BLOCK, "FP4 weight")
    out_f, in_f = w.shape
    blocks = w.to(torch.float32).reshape(out_f, in_f // FP4_BLOCK, FP4_BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp_min(FP4_AMAX_FLOOR)
    e = pow2_ceil_exponent(amax * FP4_MAX_INV)
    s = exponent_to_float(e)
    codes = e2m1_encode((blocks / s[..., None]).clamp(-FP4_MAX, FP4_MAX))
    return pack_fp4(codes.reshape(out_f, in_f)), exponent_to_e8m0(e)


def dequantize_fp4_weight(packed: torch.Tensor, scale: torch.Tensor,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed int8 [..., out, in/2] + ue8m0 [..., out, in/32] -> dense [..., out, in] (exact)."""
    in_f = packed.shape[-1] * 2
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * FP4_BLOCK != in_f:
        raise FormatError(f"FP4 weight {tuple(packed.shape)} (K = {in_f}) needs a scale of shape "
                          f"{tuple(packed.shape[:-1]) + (in_f // FP4_BLOCK,)}, got {tuple(scale.shape)}")
    vals = e2m1_decode(unpack_fp4(packed))
    s = e8m0_to_float(scale)
    vals = vals.unflatten(-1, (in_f // FP4_BLOCK, FP4_BLOCK)) * s[..., None]
    return vals.flatten(-2).to(dtype)
