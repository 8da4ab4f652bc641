"""RoPE: rotary position embeddings as interleaved pairs (x[2i], x[2i+1]) on a head's last dims, or as
half-split pairs (x[i], x[i + rd/2]) on its first dims (DeepSeek-V3.2's indexer), and YaRN's frequency
blend (DeepSeek-V4's plain tables on sliding layers, YaRN on compressed ones)."""

from __future__ import annotations

import math

import torch

from trex.models.common.config import YarnScaling


def rope_inv_freq(dim: int, theta: float, yarn: YarnScaling | None) -> torch.Tensor:
    """Inverse frequencies [dim/2] (YaRN blend between interpolation and extrapolation; no mscale)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if yarn is None:
        return freqs

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return freqs / yarn.factor * (1 - extrapolate) + freqs * extrapolate


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2*cos.shape[-1] dims of x as interleaved pairs (x[2i], x[2i+1]).

    x: [..., D]; cos, sin: broadcastable to [..., rd/2]. ``inverse`` rotates by -angle.
    """
    rd = 2 * cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    pairs = torch.view_as_complex(rope.float().unflatten(-1, (-1, 2)).contiguous())  # x[2i] + i x[2i+1]
    rotated = torch.view_as_real(pairs * torch.complex(cos, -sin if inverse else sin))
    return torch.cat((nope, rotated.flatten(-2).to(x.dtype)), dim=-1)


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2*cos.shape[-1] dims of x as half-split pairs (x[i], x[i + rd/2]) ("NeoX" RoPE,
    transformers' ``rotate_half``; DeepSeek's ``apply_rotary_emb(..., interleaved=False)``), in fp32.

    x: [..., D]; cos, sin: broadcastable to [..., rd/2]. Returns x's dtype."""
    rd = 2 * cos.shape[-1]
    a, b, rest = x[..., :rd // 2].float(), x[..., rd // 2:rd].float(), x[..., rd:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin, rest.float()), dim=-1).to(x.dtype)
