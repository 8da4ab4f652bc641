"""FP8 and FP4 quantisation of DeepSeek-V4: the checkpoint codecs (reference §4.3) and the fake
quantisation of quantisation-aware training, with the official inference kernels' rules.

- FP8 block: ``float8_e4m3fn`` values, one ``ue8m0`` scale per 128x128 block of the last two
  dims: ``W[r, c] = q[r, c] * scale[r // 128, c // 128]`` (DeepSeek-V3's released checkpoints: the same
  with fp32 scales, amax / 448, which ``dequantize_fp8`` reads and ``quantize_fp8(scale_fmt="fp32")`` writes).
- FP4 (routed experts): int8 bytes holding two e2m1 codes each, the low nibble for column 2j
  and the high nibble for column 2j+1, one ``ue8m0`` scale per 1x32 block of the last dim:
  ``W[r, c] = E2M1[code[r, c]] * scale[r, c // 32]``.
- ``ue8m0`` (``float8_e8m0fnu``): the byte e means 2^(e - 127); 0xFF is NaN.

Scales follow the official ``act_quant`` / ``fp4_act_quant`` kernels (``fast_round_scale``): the
block's amax, floored at 1e-4 (FP8) or 6 * 2^-126 (FP4), times the fp32 constant 1/qmax (qmax is
448 for e4m3 and 6 for e2m1), rounded up to a power of two by its fp32 bits. Values are divided by
the scale, clamped to +-qmax and rounded to nearest, ties to even. Weights, activations, KV and the
checkpoint export all use these rules, so an exported checkpoint dequantises to exactly the weights a
quantisation-aware run trained against. Blocks at a dimension's end may be partial (dims need not be
multiples of the block). Leading dims (stacked experts) are carried through.

Fake quantisation (``fake_*``) returns quantise-then-dequantise in the input's dtype with a
straight-through gradient (the identity), and compiles with ``fullgraph=True``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

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


FP8_AMAX_FLOOR = 1e-4  # the official act_quant's floor on a block's amax
FP4_AMAX_FLOOR = 6 * 2.0**-126  # fp4_act_quant's


def power_of_two_scale(amax: torch.Tensor, qmax: float, floor: float = FP8_AMAX_FLOOR) -> torch.Tensor:
    """Per-block ``ue8m0`` scale as ``fast_round_scale`` computes it: r = fp32(max(amax, floor)) *
    fp32(1 / qmax), then 2^ceil(log2(r))."""
    return _round_up_to_e8m0(amax.float().clamp(min=floor) * torch.tensor(1.0 / qmax, dtype=torch.float32))


def _round_up_to_e8m0(r: torch.Tensor) -> torch.Tensor:
    """fp32 r > 0 -> 2^ceil(log2(r)) as ue8m0, read from r's fp32 bits (exponent, plus one unless the
    mantissa is zero)."""
    bits = r.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent.clamp(-127, 127) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def powers_of_two(scale: torch.Tensor) -> bool:
    """Whether every value of float32 ``scale`` is a positive power of two (a normal float with a zero
    mantissa): the V3 family's fp32 scales under ``scale_fmt`` "ue8m0"."""
    bits = scale.float().view(torch.int32)
    return bool(((bits & 0x7FFFFF) == 0).all() and (bits > 0).all() and (((bits >> 23) & 0xFF) > 0).all())


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


# ---- FP8 (e4m3, block scales) -----------------------------------------------------------------
FP8_BLOCKS = ((128, 128), (32, 32), (1, 32))  # V4's linears; V4.1's linears; V4.1's Engram table rows


def fp8_scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)) -> tuple[int, ...]:
    """The ue8m0 scale's shape for an FP8 weight [..., R, C] with ``block`` (rows, cols) blocks."""
    return (*weight_shape[:-2], blocks(weight_shape[-2], block[0]), blocks(weight_shape[-1], block[1]))


def fp8_block_of(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The block (rows, cols) of FP8_BLOCKS whose scale grid has ``scale_shape`` (the first that fits: a
    weight within one block of either size reads alike), or None."""
    return next((b for b in FP8_BLOCKS if fp8_scale_shape(weight_shape, b) == tuple(scale_shape)), None)


def check_fp8_scale(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> str | None:
    """None if scale_shape fits an FP8 weight of weight_shape with one of FP8_BLOCKS, else what was expected."""
    if len(weight_shape) < 2:
        return f"an FP8 weight needs at least 2 dims, got shape {tuple(weight_shape)}"
    if fp8_block_of(weight_shape, scale_shape) is None:
        wants = " or ".join(f"{fp8_scale_shape(weight_shape, b)} for {b[0]}x{b[1]} blocks" for b in FP8_BLOCKS)
        return f"scale shape {tuple(scale_shape)} does not match FP8 weight {tuple(weight_shape)} (expected {wants})"
    return None


def decode_scale(scale: torch.Tensor) -> torch.Tensor:
    """A block scale as float32: ue8m0 (``float8_e8m0fnu`` or uint8 bytes: DeepSeek-V4's) decoded, a
    floating scale (DeepSeek-V3's released ``weight_scale_inv`` are fp32 amax / 448) as its value."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return decode_e8m0(scale)
    if not scale.is_floating_point() or scale.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise QuantFormatError(f"a block scale is ue8m0 or a float (fp32, bf16, fp16), got {scale.dtype}")
    return scale.float()


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 weight [..., R, C] and its scale [..., ceil(R/br), ceil(C/bc)] (a block of FP8_BLOCKS, read
    from the shapes; ue8m0, or fp32 as DeepSeek-V3 releases them) -> dtype [..., R, C]."""
    problem = check_fp8_scale(tuple(weight.shape), tuple(scale.shape))
    if problem:
        raise QuantFormatError(problem)
    *_, rows, cols = weight.shape
    br, bc = fp8_block_of(tuple(weight.shape), tuple(scale.shape))
    return (weight.float() * _expand(decode_scale(scale), br, bc, rows, cols)).to(dtype)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK), scale_fmt: str = "ue8m0"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, C] -> (e4m3 [..., R, C], scale [..., ceil(R/br), ceil(C/bc)]) for ``block`` (br, bc).
    ``scale_fmt`` "ue8m0": DeepSeek-V4's power-of-two scales; "fp32": DeepSeek-V3's released
    ``weight_scale_inv``, fp32(max(amax, 1e-4)) / 448 per block (its ``act_quant`` without ``ue8m0``);
    "fp32/ue8m0": DeepSeek-V3.1's (config ``scale_fmt: "ue8m0"``), that fp32 scale rounded up to a power of
    two, 2^ceil(log2(max(amax, 1e-4) / 448)), stored as fp32 (its ``act_quant`` with ``ue8m0``)."""
    *_, rows, cols = w.shape
    if scale_fmt == "ue8m0":
        scale = power_of_two_scale(_block_amax(w, *block), E4M3_MAX)
    elif scale_fmt in ("fp32", "fp32/ue8m0"):
        scale = _block_amax(w, *block).clamp(min=FP8_AMAX_FLOOR) / E4M3_MAX
        if scale_fmt == "fp32/ue8m0":
            scale = decode_e8m0(_round_up_to_e8m0(scale))
    else:
        raise ValueError(f"scale_fmt must be ue8m0, fp32 or fp32/ue8m0, got {scale_fmt!r}")
    q = (w.float() / _expand(decode_scale(scale), *block, rows, cols)).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale


def quantize_fp8_as(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(e4m3 w / scale, scale) when the ``scale`` grid (ue8m0 or fp32) represents w [..., R, C] exactly
    (the pair dequantises to w, bit for bit), else None. Re-exporting a loaded checkpoint this way keeps
    its bytes: a block whose largest value the official rule could have scaled two ways (224 x s or
    448 x s/2) keeps the scale it was stored with, and an fp32 scale is kept whatever amax rule made it."""
    *_, rows, cols = w.shape
    s = _expand(decode_scale(scale), *block, rows, cols)
    q = (w.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q, scale) if torch.equal(q.float() * s, w.float()) else None


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
    scale = power_of_two_scale(_block_amax(w, 1, FP4_BLOCK), E2M1_MAX, FP4_AMAX_FLOOR)
    codes = round_to_e2m1(w.float() / _expand(decode_e8m0(scale), 1, FP4_BLOCK, rows, cols))
    return pack_e2m1(codes), scale


def quantize_fp4_as(w: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(packed e2m1 codes of w / scale, scale) when the ue8m0 1x32 ``scale`` represents w [..., R, C]
    exactly, else None (see ``quantize_fp8_as``)."""
    *_, rows, cols = w.shape
    x = w.float() / _expand(decode_e8m0(scale), 1, FP4_BLOCK, rows, cols)
    codes = round_to_e2m1(x)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w.device)[codes.long()]
    return (pack_e2m1(codes), scale) if torch.equal(values, x) else None


# ---- fake quantisation (quantisation-aware training) --------------------------------------------
def straight_through(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y's values with x's gradient (the straight-through estimator: d y / d x taken as 1)."""
    return x + (y - x).detach()


def fake_fp8_weight(w: torch.Tensor, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)) -> torch.Tensor:
    """w [..., R, C] through FP8 with ``block`` (rows, cols) ue8m0 scales (V4: 128x128, V4.1: 32x32, V4.1's
    Engram rows: 1x32) and back, in w's dtype."""
    q, scale = quantize_fp8(w, block)
    return straight_through(w, dequantize_fp8(q, scale, w.dtype))


def fake_fp4_weight(w: torch.Tensor) -> torch.Tensor:
    """w [..., R, C] through FP4 with 1x32 block scales and back, in w's dtype (the blocks run along
    the last dim, as ``fake_fp4_act``'s do)."""
    return fake_fp4_act(w, FP4_BLOCK)


def _e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 values within +-6 -> the nearest e2m1 value (ties to even), fp32."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)[round_to_e2m1(x).long()]


def _e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 values within +-448 -> the nearest e4m3 value (ties to even), fp32."""
    return x.to(torch.float8_e4m3fn).float()


def _fake_rows(x: torch.Tensor, block: int, qmax: float, floor: float, round_fn) -> torch.Tensor:
    """x [..., n] quantised with one power-of-two scale per ``block`` values of the last dim (zero-padded
    at its end), rounded by ``round_fn``, and back, in x's dtype, with a straight-through gradient."""
    xb = F.pad(x.float(), (0, -x.shape[-1] % block)).unflatten(-1, (-1, block))
    scale = decode_e8m0(power_of_two_scale(xb.abs().amax(-1, keepdim=True), qmax, floor))
    y = round_fn((xb / scale).clamp(-qmax, qmax)) * scale
    return straight_through(x, y.flatten(-2)[..., : x.shape[-1]].to(x.dtype))


def fake_fp8_act(x: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """The official ``act_quant(x, block, "ue8m0", inplace=True)``: x [..., n] through e4m3 with one
    power-of-two scale per ``block`` values of the last dim, and back, in x's dtype."""
    return _fake_rows(x, block, E4M3_MAX, FP8_AMAX_FLOOR, _e4m3_round)


def fake_fp4_act(x: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """The official ``fp4_act_quant(x, block, inplace=True)``: x [..., n] through e2m1 with one
    power-of-two scale per ``block`` values of the last dim, and back, in x's dtype."""
    return _fake_rows(x, block, E2M1_MAX, FP4_AMAX_FLOOR, _e2m1_round)


def fake_fp4_act_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """The official ``fp4_act_quant(x, block, inplace=True, scale_dtype=float8_e4m3fn)`` (DeepSeek-V4.1's
    compressed KV): x [..., n] through e2m1 with one e4m3 scale per ``block`` values of the last dim,
    amax / 6 (amax floored at 6 * 2^-9) rounded to the nearest e4m3, and back, in x's dtype."""
    xb = F.pad(x.float(), (0, -x.shape[-1] % block)).unflatten(-1, (-1, block))
    scale = _e4m3_round(xb.abs().amax(-1, keepdim=True).clamp(min=E2M1_MAX * 2.0**-9) / E2M1_MAX)
    y = _e2m1_round((xb / scale).clamp(-E2M1_MAX, E2M1_MAX)) * scale
    return straight_through(x, y.flatten(-2)[..., : x.shape[-1]].to(x.dtype))


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard transform of the last dim (a power of two), in Sylvester's
    natural order, as ``fast_hadamard_transform.hadamard_transform(x, scale=n ** -0.5)``: computed in
    fp32 and rounded to x's dtype once (a bf16 matmul and a bf16 scaling would round twice, and the FP4
    step after it turns that into different indexer picks)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two width, got {n}")
    h = torch.ones(1, 1, dtype=torch.float32, device=x.device)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return ((x.float() @ h) * n**-0.5).to(x.dtype)
