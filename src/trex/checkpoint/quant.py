"""FP8 and FP4 weight codecs of the DeepSeek-V4 checkpoints (reference §4.3).

- FP8 block: ``float8_e4m3fn`` values, one ``ue8m0`` scale per 128x128 block of the last two
  dims: ``W[r, c] = q[r, c] * scale[r // 128, c // 128]``.
- FP4 (routed experts): int8 bytes holding two e2m1 codes each, the low nibble for column 2j
  and the high nibble for column 2j+1, one ``ue8m0`` scale per 1x32 block of the last dim:
  ``W[r, c] = E2M1[code[r, c]] * scale[r, c // 32]``.
- ``ue8m0`` (``float8_e8m0fnu``): the byte e means 2^(e - 127); 0xFF is NaN.

Quantisation uses power-of-two scales ``s = 2^ceil(log2(amax / qmax))`` per block (qmax is 448
for e4m3 and 6 for e2m1), like the reference ``act_quant`` kernels; all-zero blocks get the
smallest scale 2^-127. Blocks at a dimension's end may be partial (dims need not be multiples
of the block). Leading dims (stacked experts) are carried through.
"""

from __future__ import annotations

import math

import torch

FP8_BLOCK = 128
FP4_BLOCK = 32
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# e2m1 code -> value; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Midpoints between consecutive non-negative e2m1 magnitudes (codes 0..7), for rounding.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


class QuantFormatError(ValueError):
    """Quantised data whose shapes or dtypes do not fit together."""


def blocks(n: int, block: int) -> int:
    """Number of (possibly partial) blocks covering n elements."""
    return -(-n // block)


# ---- ue8m0 scales -------------------------------------------------------------------------------
def decode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 scale (``float8_e8m0fnu`` or uint8 bytes) -> float32 2^(e - 127); 0xFF -> NaN."""
    e = scale.view(torch.uint8).to(torch.int32)
    value = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - 127)
    return torch.where(e == 255, torch.full_like(value, math.nan), value)


def power_of_two_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Per-block ``ue8m0`` scale 2^ceil(log2(amax / qmax)), exponent clamped to [-127, 127]."""
    ratio = amax.double() / qmax
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    ceil_log2 = torch.where(mantissa == 0.5, exponent - 1, exponent)
    ceil_log2 = torch.where(ratio > 0, ceil_log2, torch.full_like(ceil_log2, -127)).clamp(-127, 127)
    return (ceil_log2 + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _expand(scale: torch.Tensor, rows_block: int, cols_block: int, rows: int, cols: int) -> torch.Tensor:
    """Per-block scale [..., Rb, Cb] (float) -> per-element [..., rows, cols]."""
    full = scale.repeat_interleave(rows_block, dim=-2).repeat_interleave(cols_block, dim=-1)
    return full[..., :rows, :cols]


def _block_amax(w: torch.Tensor, rows_block: int, cols_block: int) -> torch.Tensor:
    """max |w| per block of the last two dims; w [..., R, C] -> [..., ceil(R/rb), ceil(C/cb)]."""
    *lead, rows, cols = w.shape
    rb, cb = blocks(rows, rows_block), blocks(cols, cols_block)
    padded = torch.nn.functional.pad(w.abs().float(), (0, cb * cols_block - cols, 0, rb * rows_block - rows))
    return padded.reshape(*lead, rb, rows_block, cb, cols_block).amax(dim=(-3, -1))


# ---- FP8 (e4m3, 128x128 blocks) ---------------------------------------------------------------
def check_fp8_scale(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> str | None:
    """None if scale_shape fits an FP8 weight of weight_shape, else what was expected."""
    if len(weight_shape) < 2:
        return f"an FP8 weight needs at least 2 dims, got shape {tuple(weight_shape)}"
    want = (*weight_shape[:-2], blocks(weight_shape[-2], FP8_BLOCK), blocks(weight_shape[-1], FP8_BLOCK))
    if tuple(scale_shape) != want:
        return (f"scale shape {tuple(scale_shape)} does not match FP8 weight {tuple(weight_shape)} "
                f"(expected {want}: one scale per {FP8_BLOCK}x{FP8_BLOCK} block)")
    return None


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 weight [..., R, C] and ue8m0 scale [..., ceil(R/128), ceil(C/128)] -> dtype [..., R, C]."""
    problem = check_fp8_scale(tuple(weight.shape), tuple(scale.shape))
    if problem:
        raise QuantFormatError(problem)
    *_, rows, cols = weight.shape
    return (weight.float() * _expand(decode_e8m0(scale), FP8_BLOCK, FP8_BLOCK, rows, cols)).to(dtype)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, C] -> (e4m3 [..., R, C], ue8m0 scale [..., ceil(R/128), ceil(C/128)])."""
    *_, rows, cols = w.shape
    scale = power_of_two_scale(_block_amax(w, FP8_BLOCK, FP8_BLOCK), E4M3_MAX)
    q = (w.float() / _expand(decode_e8m0(scale), FP8_BLOCK, FP8_BLOCK, rows, cols)).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale


# ---- FP4 (e2m1, 1x32 blocks, two codes per byte) ------------------------------------------------
def check_fp4(packed_shape: tuple[int, ...], scale_shape: tuple[int, ...], cols: int) -> str | None:
    """None if packed int8 [..., R, ceil(cols/2)] and scale [..., R, ceil(cols/32)] fit, else why not."""
    want_packed = (*packed_shape[:-1], blocks(cols, 2))
    want_scale = (*packed_shape[:-1], blocks(cols, FP4_BLOCK))
    if len(packed_shape) < 2 or tuple(packed_shape) != want_packed:
        return f"packed FP4 shape {tuple(packed_shape)} cannot hold {cols} columns (expected [..., rows, {want_packed[-1]}])"
    if tuple(scale_shape) != want_scale:
        return (f"scale shape {tuple(scale_shape)} does not match FP4 weight {tuple(packed_shape)} with {cols} "
                f"columns (expected {want_scale}: one scale per 1x{FP4_BLOCK} block)")
    return None


def unpack_e2m1(packed: torch.Tensor, cols: int | None = None) -> torch.Tensor:
    """int8/uint8 [..., P] -> e2m1 codes uint8 [..., cols] (low nibble first); cols defaults to 2P."""
    b = packed.view(torch.uint8)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)
    return codes if cols is None else codes[..., :cols]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes uint8 [..., C] -> int8 [..., ceil(C/2)], column 2j in the low nibble."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.int8)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, cols: int | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed e2m1 [..., R, ceil(C/2)] and ue8m0 scale [..., R, ceil(C/32)] -> dtype [..., R, C]."""
    cols = 2 * packed.shape[-1] if cols is None else cols
    problem = check_fp4(tuple(packed.shape), tuple(scale.shape), cols)
    if problem:
        raise QuantFormatError(problem)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    values = table[unpack_e2m1(packed, cols).long()]
    rows = packed.shape[-2]
    return (values * _expand(decode_e8m0(scale), 1, FP4_BLOCK, rows, cols)).to(dtype)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float -> nearest e2m1 code (uint8), ties to the even code, saturating at +-6."""
    mag = x.abs().float().clamp(max=E2M1_MAX)
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32)
    code = torch.bucketize(mag, mids)  # mids[code-1] < mag <= mids[code]
    tie = mag == mids[code.clamp(max=len(mids) - 1)]
    code = torch.where(tie & (code % 2 == 1), code + 1, code)
    sign = (x < 0) | ((x == 0) & torch.signbit(x))
    return (code + 8 * sign).to(torch.uint8)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, C] -> (packed int8 [..., R, ceil(C/2)], ue8m0 scale [..., R, ceil(C/32)])."""
    *_, rows, cols = w.shape
    scale = power_of_two_scale(_block_amax(w, 1, FP4_BLOCK), E2M1_MAX)
    codes = round_to_e2m1(w.float() / _expand(decode_e8m0(scale), 1, FP4_BLOCK, rows, cols))
    return pack_e2m1(codes), scale
