"""Pure-PyTorch reference kernels. Every fast path must match these (tests/test_kernels.py)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 and cast back to ``x.dtype``.

    x: [..., D]; weight: [D] or None (unweighted).
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped matmul over rows sorted by group.

    x: [N, K] rows sorted by expert; w: [E, M, K] (nn.Linear layout, out x in); offsets: [E] int32,
    the cumulative row counts (group e is rows offsets[e-1]:offsets[e]; offsets[-1] == N), as
    ``torch._grouped_mm`` takes them. Returns [N, M] with rows i of group e equal to x[i] @ w[e].T.
    The oracle: one matmul per non-empty expert, the offsets read on the host (the default path,
    ``trex.kernels.fused.grouped_mm``, keeps them on the device). ``unbind`` (not ``w[e]``) so that
    backward stacks the expert gradients once instead of adding E full-size ones.
    """
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long()).tolist()
    experts = w.unbind(0)
    outs = [xe @ experts[e].t() for e, xe in enumerate(torch.split(x, counts)) if counts[e] > 0]
    if not outs:
        return x.new_zeros(0, w.shape[1])
    return torch.cat(outs, dim=0)
