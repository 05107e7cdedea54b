"""FP8 e4m3 / FP4 e2m1 / ue8m0 encode-decode, exactly as DSV4_SPEC §2.2."""
import pytest
import torch

from dsv4.weights.formats import (E2M1_VALUES, FormatError, dequantize_fp4_weight, dequantize_fp8_weight,
                          e2m1_decode, e2m1_encode, e8m0_to_float, exponent_to_e8m0, pack_fp4,
                          pow2_ceil_exponent, quantize_fp4_weight, quantize_fp8_weight, round_e4m3,
                          unpack_fp4)


def test_all_16_nibble_codes():
    codes = torch.arange(16)
    vals = e2m1_decode(codes)
    expect = list(E2M1_VALUES) + [-v for v in E2M1_VALUES]
    assert vals.tolist() == expect
    assert e2m1_encode(vals).tolist()[:8] == list(range(8))
    assert e2m1_encode(vals).tolist()[9:] == list(range(9, 16))  # -0.0 -> 8 kept by signbit
    assert e2m1_encode(torch.tensor([-0.0])).item() == 8


def test_pack_low_nibble_is_even_element():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.dtype == torch.int8
    assert packed.view(torch.uint8).tolist() == [[0x21, 0x8F]]
    assert torch.equal(unpack_fp4(packed), codes)
    allbytes = torch.arange(256, dtype=torch.uint8).view(torch.int8).reshape(1, 256)
    assert torch.equal(pack_fp4(unpack_fp4(allbytes)), allbytes)


@pytest.mark.parametrize("x,want", [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0),
                                    (3.5, 4.0), (5.0, 4.0), (0.2499, 0.0), (0.2501, 0.5),
                                    (7.0, 6.0), (-5.0, -4.0), (-0.75, -1.0), (100.0, 6.0)])
def test_e2m1_round_nearest_even_saturating(x, want):
    assert e2m1_decode(e2m1_encode(torch.tensor([x]))).item() == want


def test_e4m3_ties_and_saturation():
    x = torch.tensor([1.0625, 1.1875, 448.0, 464.0, 1000.0, 2.0 ** -10, 3 * 2.0 ** -10])
    assert round_e4m3(x).tolist() == [1.0, 1.25, 448.0, 448.0, 448.0, 0.0, 2.0 ** -8]


def test_every_e8m0_byte():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = e8m0_to_float(b)
    assert v[0].item() == 2.0 ** -127 and v[127].item() == 1.0 and v[254].item() == 2.0 ** 127
    assert torch.isnan(v[255])
    e = torch.arange(-126, 128)
    assert torch.equal(e8m0_to_float(exponent_to_e8m0(e)), torch.pow(2.0, e.double()).float())
    # torch's own conversion agrees on every finite byte
    assert torch.equal(v[:255], b[:255].view(torch.float8_e8m0fnu).float())


def test_pow2_ceil_from_bits():
    v = torch.tensor([1.0, 1.5, 2.0, 3.0, 0.75, 2.0 ** -20, 2.0 ** -20 * 1.0001])
    assert pow2_ceil_exponent(v).tolist() == [0, 1, 1, 2, 0, -20, -19]


def test_fp8_weight_roundtrip_identity():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 384, generator=g) * 0.05
    q, s = quantize_fp8_weight(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (2, 3)
    d = dequantize_fp8_weight(q, s)
    # decode(encode(decode(x))) == decode(x): dequantized values are fixed points
    q2, s2 = quantize_fp8_weight(d)
    assert torch.equal(dequantize_fp8_weight(q2, s2), d)
    assert ((d - w).abs() / w.abs().clamp_min(1e-3)).median() < 0.05
    # exact in bf16
    assert torch.equal(dequantize_fp8_weight(q, s, torch.bfloat16).float(), d)
    # per-block amax maps to <= 448 with power-of-two scales
    blk = w[:128, :128].abs().max()
    sc = e8m0_to_float(s)[0, 0]
    assert blk / sc <= 448 and blk / sc > 224


def test_fp4_weight_roundtrip_identity():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 256, generator=g)
    p, s = quantize_fp4_weight(w)
    assert p.shape == (64, 128) and p.dtype == torch.int8 and s.shape == (64, 8)
    d = dequantize_fp4_weight(p, s)
    p2, s2 = quantize_fp4_weight(d)
    # values are fixed points (codes may differ: a block whose max rounds to 3 re-encodes at s/2)
    assert torch.equal(dequantize_fp4_weight(p2, s2), d)
    # stacked (leading dims) decode
    assert torch.equal(dequantize_fp4_weight(p[None].expand(3, -1, -1), s[None].expand(3, -1, -1))[2], d)


def test_sizes_not_multiple_of_block():
    with pytest.raises(FormatError, match="multiple of the 128x128 block"):
        quantize_fp8_weight(torch.zeros(100, 128))
    with pytest.raises(FormatError, match="1x32 block"):
        quantize_fp4_weight(torch.zeros(8, 40))
    with pytest.raises(FormatError, match="scale of shape"):
        dequantize_fp8_weight(torch.zeros(128, 128, dtype=torch.float8_e4m3fn),
                              torch.zeros(2, 1, dtype=torch.float8_e8m0fnu))
    with pytest.raises(FormatError, match="even K"):
        pack_fp4(torch.zeros(1, 3, dtype=torch.uint8))
