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


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Grouped matmul over rows sorted by group.

    x: [N, K] rows sorted by expert; w: [E, M, K] (nn.Linear layout, out x in);
    counts: rows per expert, sum(counts) == N. Returns [N, M] with rows i of group e
    equal to x[i] @ w[e].T. One matmul per non-empty expert, no per-token work. ``unbind`` (not
    ``w[e]``) so that backward stacks the expert gradients once instead of adding E full-size ones.
    """
    experts = w.unbind(0)
    outs = [xe @ experts[e].t() for e, xe in enumerate(torch.split(x, counts)) if counts[e] > 0]
    if not outs:
        return x.new_zeros(0, w.shape[1])
    return torch.cat(outs, dim=0)
