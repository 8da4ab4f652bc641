"""RMSNorm (weighted) and the unweighted RMS normalisation, both through the kernel registry's ``rms_norm``;
LayerNorm with a bias, in fp32 (DeepSeek-V3.2's indexer keys)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trex import kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.get("rms_norm", x.device.type)(x, self.weight, self.eps)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return kernels.get("rms_norm", x.device.type)(x, None, eps)


class LayerNorm(nn.Module):
    """LayerNorm with a weight and a bias over the last dim, computed in fp32 and returned in x's dtype (as
    DeepSeek-V3.2's ``LayerNorm``: fp32 parameters, ``F.layer_norm(x.float(), ...).type_as(x)``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.weight.shape, self.weight.float(), self.bias.float(), self.eps).to(x.dtype)
