"""FP8 / FP4 / ue8m0 codecs against a straightforward element-by-element implementation.

The reference here decodes every format from its bit layout (sign / exponent / mantissa), not
from the module's tables, and rounds by searching the nearest representable value.
"""

from __future__ import annotations

import math

import pytest
import torch

from trex.checkpoint import quant


def e4m3_value(code: int) -> float:
    """float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; S.1111.111 is NaN, no inf."""
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * (man / 8) * 2.0 ** -6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def e2m1_value(code: int) -> float:
    """e2m1: 1 sign, 2 exponent (bias 1), 1 mantissa bit."""
    sign = -1.0 if code & 0x8 else 1.0
    exp, man = (code >> 1) & 0x3, code & 0x1
    return sign * (man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1))


def e8m0_value(byte: int) -> float:
    return math.nan if byte == 255 else 2.0 ** (byte - 127)


def nearest_code(x: float, value_of, n_codes: int) -> int:
    """Code of the representable magnitude nearest |x| (ties to the even code), sign bit of x."""
    half = n_codes // 2
    best = None
    for c in range(half):
        v = value_of(c)
        if math.isnan(v):
            continue
        d = abs(v - abs(x))
        if best is None or d < best[0] or (d == best[0] and c % 2 == 0):
            best = (d, c)
    return best[1] + (half if math.copysign(1.0, x) < 0 else 0)


def reference_scale_exponent(amax: float, qmax: float) -> int:
    """ceil(log2(amax / qmax)) clamped to the e8m0 range; -127 for an all-zero block."""
    if amax == 0:
        return -127
    return max(-127, min(127, math.ceil(math.log2(amax / qmax))))


def _weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 1, cols)  # magnitudes vary per block
    w[:, :5] = 0.0  # partly-zero blocks
    return w


def test_e8m0_decodes_every_byte():
    got = quant.decode_e8m0(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    for b in range(256):
        want = e8m0_value(b)
        assert (math.isnan(got[b]) and math.isnan(want)) or got[b].item() == want, b


@pytest.mark.parametrize("shape", [(130, 200), (2, 128, 256), (5, 3)])
def test_fp8_dequantize_matches_reference(shape):
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    *lead, rows, cols = shape
    sbytes = torch.randint(110, 140, (*lead, -(-rows // 128), -(-cols // 128)), generator=g, dtype=torch.int32)
    got = quant.dequantize_fp8(codes.to(torch.uint8).view(torch.float8_e4m3fn),
                               sbytes.to(torch.uint8).view(torch.float8_e8m0fnu), torch.float32)
    flat_c, flat_s = codes.reshape(-1, rows, cols), sbytes.reshape(-1, *sbytes.shape[-2:])
    want = torch.tensor([[[e4m3_value(int(flat_c[b, r, c])) * e8m0_value(int(flat_s[b, r // 128, c // 128]))
                           for c in range(cols)] for r in range(rows)] for b in range(flat_c.shape[0])])
    assert torch.equal(got.reshape(want.shape), want)


@pytest.mark.parametrize("cols", [70, 69, 64])
def test_fp4_dequantize_matches_reference_nibble_order(cols):
    rows = 3
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.int32)
    packed = torch.zeros(rows, -(-cols // 2), dtype=torch.int32)
    for r in range(rows):
        for c in range(cols):  # column 2j -> low nibble, 2j+1 -> high nibble
            packed[r, c // 2] |= int(codes[r, c]) << (4 * (c % 2))
    sbytes = torch.randint(120, 134, (rows, -(-cols // 32)), generator=g, dtype=torch.int32)
    got = quant.dequantize_fp4(packed.to(torch.uint8).view(torch.int8), sbytes.to(torch.uint8), cols=cols)
    want = torch.tensor([[e2m1_value(int(codes[r, c])) * e8m0_value(int(sbytes[r, c // 32])) for c in range(cols)]
                         for r in range(rows)])
    assert torch.equal(got, want)


@pytest.mark.parametrize("rows,cols", [(130, 257), (64, 64)])
def test_fp8_quantize_matches_reference(rows, cols):
    w = _weights(rows, cols, seed=3)
    q, scale = quant.quantize_fp8(w)
    assert scale.shape == (-(-rows // 128), -(-cols // 128))
    qbytes, sbytes = q.view(torch.uint8), scale.view(torch.uint8)
    for rb in range(scale.shape[0]):
        for cb in range(scale.shape[1]):
            block = w[rb * 128:(rb + 1) * 128, cb * 128:(cb + 1) * 128].double()
            e = reference_scale_exponent(block.abs().max().item(), 448.0)
            assert sbytes[rb, cb].item() == e + 127
    # Rounding checked element by element on a sample (the full loop is slow in Python).
    g = torch.Generator().manual_seed(4)
    for r, c in zip(torch.randint(0, rows, (300,), generator=g).tolist(), torch.randint(0, cols, (300,), generator=g).tolist()):
        s = e8m0_value(int(sbytes[r // 128, c // 128]))
        x = max(-448.0, min(448.0, w[r, c].item() / s))
        assert e4m3_value(int(qbytes[r, c])) == e4m3_value(nearest_code(x, e4m3_value, 256)), (r, c, x)


@pytest.mark.parametrize("cols", [70, 69, 96])
def test_fp4_quantize_matches_reference(cols):
    rows = 9
    w = _weights(rows, cols, seed=5)
    packed, scale = quant.quantize_fp4(w)
    assert packed.shape == (rows, -(-cols // 2)) and scale.shape == (rows, -(-cols // 32))
    pbytes, sbytes = packed.view(torch.uint8), scale.view(torch.uint8)
    for r in range(rows):
        for c in range(cols):
            block = w[r, (c // 32) * 32:(c // 32 + 1) * 32].double()
            e = reference_scale_exponent(block.abs().max().item(), 6.0)
            assert sbytes[r, c // 32].item() == e + 127
            code = (int(pbytes[r, c // 2]) >> (4 * (c % 2))) & 0xF
            x = max(-6.0, min(6.0, w[r, c].item() / 2.0 ** e))
            assert e2m1_value(code) == e2m1_value(nearest_code(x, e2m1_value, 16)), (r, c, x)


def test_e2m1_ties_round_to_even_code():
    # midpoints between neighbours: 0.25 0.75 1.25 1.75 2.5 3.5 5 -> even codes 0 2 2 4 4 6 6
    got = quant.round_to_e2m1(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 9.0, -0.75]))
    want = [nearest_code(x, e2m1_value, 16) for x in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.75)]
    assert got.tolist() == want


def test_representable_values_survive_a_round_trip():
    w = _weights(130, 200, seed=6)
    q, s = quant.quantize_fp8(w)
    dq = quant.dequantize_fp8(q, s)
    q2, s2 = quant.quantize_fp8(dq)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2.view(torch.uint8), s.view(torch.uint8))
    p, s = quant.quantize_fp4(w)
    dq = quant.dequantize_fp4(p, s, cols=200)
    p2, s2 = quant.quantize_fp4(dq)
    assert torch.equal(quant.dequantize_fp4(p2, s2, cols=200), dq)


def test_all_zero_block_gets_smallest_scale():
    q, s = quant.quantize_fp8(torch.zeros(3, 130))
    assert s.view(torch.uint8).tolist() == [[0, 0]] and not q.float().any()


def test_scale_shape_mismatch_is_reported():
    with pytest.raises(quant.QuantFormatError, match=r"expected \(2, 2\)"):
        quant.dequantize_fp8(torch.zeros(130, 200).to(torch.float8_e4m3fn), torch.zeros(1, 2).to(torch.float8_e8m0fnu))
    with pytest.raises(quant.QuantFormatError, match="1x32"):
        quant.dequantize_fp4(torch.zeros(4, 35, dtype=torch.int8), torch.zeros(4, 2, dtype=torch.uint8), cols=70)
