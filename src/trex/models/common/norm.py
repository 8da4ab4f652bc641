"""RMSNorm (weighted) and the unweighted RMS normalisation, both through the kernel registry's ``rms_norm``."""

from __future__ import annotations

import torch
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
