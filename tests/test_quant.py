"""FP8 / FP4 / ue8m0 codecs against a straightforward element-by-element implementation.

The reference here decodes every format from its bit layout (sign / exponent / mantissa), not
from the module's tables, and rounds by searching the nearest representable value.
"""

from __future__ import annotations

import math

import numpy as np

import pytest
import torch

from trex.kernels import quantize as quant


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
    """The official kernels' ``fast_round_scale`` in fp32, written from its definition: amax floored
    (1e-4 for e4m3, 6 * 2^-126 for e2m1), times fp32(1 / qmax) rounded to fp32, then ceil(log2(.))
    of that fp32 number, clamped to the e8m0 range."""
    floor = 1e-4 if qmax == 448.0 else 6 * 2.0**-126
    r = float(np.float32(max(np.float32(amax), np.float32(floor))) * np.float32(1.0 / qmax))
    mantissa, exponent = math.frexp(r)  # r = mantissa * 2^exponent, mantissa in [0.5, 1)
    return max(-127, min(127, exponent - 1 if mantissa == 0.5 else exponent))


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


def test_fp8_with_fp32_scales_matches_the_v3_release_rule():
    """DeepSeek-V3's released weight_scale_inv: fp32 amax / 448 per (partial) 128x128 block, values rounded to
    the nearest e4m3; a pair whose scale came from another rule is kept when it is exact."""
    w = _weights(130, 257, seed=7)
    q, scale = quant.quantize_fp8(w, scale_fmt="fp32")
    assert scale.dtype == torch.float32 and scale.shape == (2, 3)
    qbytes = q.view(torch.uint8)
    g = torch.Generator().manual_seed(8)
    for r, c in zip(torch.randint(0, 130, (300,), generator=g).tolist(), torch.randint(0, 257, (300,), generator=g).tolist()):
        amax = w[r // 128 * 128:(r // 128 + 1) * 128, c // 128 * 128:(c // 128 + 1) * 128].abs().max().item()
        s = float(np.float32(np.float32(amax) / np.float32(448.0)))
        assert scale[r // 128, c // 128].item() == s
        x = max(-448.0, min(448.0, float(np.float32(w[r, c].item()) / np.float32(s))))
        assert e4m3_value(int(qbytes[r, c])) == e4m3_value(nearest_code(x, e4m3_value, 256)), (r, c, x)
    other = scale * 1.125  # not amax / 448: kept by quantize_fp8_as, byte for byte
    q2 = (w / other.repeat_interleave(128, 0).repeat_interleave(128, 1)[:130, :257]).to(torch.float8_e4m3fn)
    kept = quant.quantize_fp8_as(quant.dequantize_fp8(q2, other), other, (128, 128))
    assert kept is not None and torch.equal(kept[0].view(torch.uint8), q2.view(torch.uint8)) and kept[1] is other
    assert quant.quantize_fp8_as(w, other, (128, 128)) is None  # w is not on that grid
    with pytest.raises(ValueError, match="scale_fmt"):
        quant.quantize_fp8(w, scale_fmt="e4m3")


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


def test_all_zero_block_gets_the_floor_scale():
    q, s = quant.quantize_fp8(torch.zeros(3, 130))
    assert s.view(torch.uint8).tolist() == [[127 - 22, 127 - 22]] and not q.float().any()  # 1e-4 / 448 -> 2^-22


def test_scale_shape_mismatch_is_reported():
    with pytest.raises(quant.QuantFormatError, match=r"expected \(2, 2\)"):
        quant.dequantize_fp8(torch.zeros(130, 200).to(torch.float8_e4m3fn), torch.zeros(1, 2).to(torch.float8_e8m0fnu))
    with pytest.raises(quant.QuantFormatError, match="1x32"):
        quant.dequantize_fp4(torch.zeros(4, 35, dtype=torch.int8), torch.zeros(4, 2, dtype=torch.uint8), cols=70)


# ---- fake quantisation: the official act_quant / fp4_act_quant, element by element ---------------
def _reference_fake(x: torch.Tensor, block: int, qmax: float, value_of, n_codes: int) -> torch.Tensor:
    """Per block of the last dim: scale 2^e (reference_scale_exponent), x / scale clamped to +-qmax,
    nearest representable value (ties to the even code), times the scale."""
    out = torch.empty_like(x)
    flat, res = x.reshape(-1, x.shape[-1]), out.view(-1, x.shape[-1])
    for r in range(flat.shape[0]):
        for b0 in range(0, flat.shape[1], block):
            vals = flat[r, b0:b0 + block].tolist()
            s = 2.0 ** reference_scale_exponent(max(abs(v) for v in vals), qmax)
            for j, v in enumerate(vals):
                y = max(-qmax, min(qmax, v / s))
                res[r, b0 + j] = value_of(nearest_code(y, value_of, n_codes)) * s
    return out


@pytest.mark.parametrize("block", [128, 64])
def test_fake_fp8_activation_quant_matches_the_official_rules(block):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 256, generator=g) * torch.logspace(-5, 2, 256)).bfloat16()  # some blocks under the floor
    x[1, :block] = 0.0
    got = quant.fake_fp8_act(x, block)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.float(), _reference_fake(x.float(), block, 448.0, e4m3_value, 256))


def test_fake_fp4_activation_and_weight_quant_match_the_official_rules():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, 96, generator=g) * torch.logspace(-3, 1, 96)
    want = _reference_fake(x, 32, 6.0, e2m1_value, 16)
    assert torch.equal(quant.fake_fp4_act(x, 32), want)
    assert torch.equal(quant.fake_fp4_weight(x), want)  # the same 1x32 blocks
    packed, scale = quant.quantize_fp4(x)  # and the export codec stores exactly these values
    assert torch.equal(quant.dequantize_fp4(packed, scale, cols=96), want)


def test_fake_fp8_weight_is_what_the_export_codec_stores():
    w = _weights(130, 257, seed=9)
    q, s = quant.quantize_fp8(w)
    assert torch.equal(quant.fake_fp8_weight(w), quant.dequantize_fp8(q, s))


def test_fake_quant_passes_the_gradient_straight_through():
    x = torch.randn(2, 128, requires_grad=True)
    g = torch.randn(2, 128)
    for fn in (quant.fake_fp8_act, quant.fake_fp4_act, quant.fake_fp8_weight, quant.fake_fp4_weight):
        (grad,) = torch.autograd.grad((fn(x) * g).sum(), x)
        assert torch.equal(grad, g), fn.__name__


def test_hadamard_is_the_orthonormal_sylvester_transform():
    n = 16
    h = torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in range(n)] for i in range(n)]) / math.sqrt(n)
    x = torch.randn(3, n)
    assert torch.allclose(quant.hadamard(x), x @ h, atol=1e-6)
    assert torch.allclose(quant.hadamard(quant.hadamard(x)), x, atol=1e-6)
    xb = x.bfloat16()  # bf16 in, computed in fp32, rounded once (fast_hadamard_transform)
    assert torch.equal(quant.hadamard(xb), (xb.double() @ h.double()).bfloat16())
    with pytest.raises(ValueError, match="power-of-two"):
        quant.hadamard(torch.zeros(3, 12))
