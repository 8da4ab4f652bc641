"""mHC (DeepSeek-V4's manifold-constrained hyper-connections) mixing, three registry ops:

    mhc_coefficients(X, fn, base, scale, iters, hc_eps, norm_eps) -> pre [B, S, n], post [B, S, n],
                                                                    comb [B, S, n, n] (doubly stochastic), fp32
    mhc_collapse(X, pre) -> the sublayer input sum_j pre_j X_j, summed in fp32, in X's dtype [B, S, d]
    mhc_expand(y, X, post, comb) -> post_i y + sum_j comb_ji X_j, in fp32, in X's dtype [B, S, n, d]

X holds the n residual streams [B, S, n, d]; fn [(2 + n) n, n d], base [(2 + n) n], scale [3] are the
HyperConnection's parameters (trex.models.deepseek_v4.mhc). ``reference_*`` is the model's math as
written (the normalised streams times fn; coefficient by coefficient; comb^T X as an einsum); the
``fused_*`` fast paths compute the same in fewer passes over the [B, S, n, d] streams: the RMS factor
applied to the n (2 + n) mixes instead of the n d inputs (as DeepSeek's own code does), pre and post
through one sigmoid, the expand as one ``baddbmm``. tests/test_kernels.py holds them equal, forward and
backward. The collapse has only its reference: as one batched [1, n] x [n, d] product it measured 1.3-3x
slower on the CPU (tiny batched products), and no device was there to measure it (docs/profiling.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trex.kernels import reference


class _Sinkhorn(torch.autograd.Function):
    """Alternating normalisations of [..., n, n] matrices: columns once, then (rows, columns) x
    (iters - 1), each ``y = x / (sum(x) + eps)``. One node with a hand-written backward instead of
    ~4 x iters autograd nodes per call: per normalisation dx = (dy - sum(dy * y)) / (sum(x) + eps).
    Keeps every normalisation's output and denominator, as autograd's divisions would. Works on an
    [n, n, ...] copy, so each sum adds n contiguous vectors instead of reducing runs of n."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        dims = [0] + [1, 0] * (iters - 1)  # the matrices' rows and columns, moved to the front
        x = x.movedim((-2, -1), (0, 1)).contiguous()
        saved = []
        for dim in dims:
            denom = x.sum(dim, keepdim=True).add_(eps)
            x = x / denom
            saved += [x, denom]
        ctx.dims = dims
        ctx.save_for_backward(*saved)
        return x.movedim((0, 1), (-2, -1)).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved = ctx.saved_tensors
        grad = grad.movedim((-2, -1), (0, 1)).contiguous()
        for i in reversed(range(len(ctx.dims))):
            y, denom = saved[2 * i], saved[2 * i + 1]
            grad = (grad - (grad * y).sum(ctx.dims[i], keepdim=True)) / denom
        return grad.movedim((0, 1), (-2, -1)).contiguous(), None, None


def sinkhorn(x: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., n, n] -> the same, normalised to doubly stochastic by ``iters`` Sinkhorn rounds (`_Sinkhorn`)."""
    return _Sinkhorn.apply(x, iters, eps)


def reference_coefficients(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                           hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module docstring: the streams RMS-normalised, mixed by fn, each coefficient from its slice."""
    n = X.shape[-2]
    mixes = F.linear(reference.rms_norm(X.flatten(-2).float(), None, norm_eps), fn.float())
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(mixes[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    logits = mixes[..., 2 * n :].unflatten(-1, (n, n)) * scale[2] + base[2 * n :].view(n, n)
    return pre, post, sinkhorn(logits.softmax(dim=-1) + hc_eps, iters, hc_eps)


def reference_collapse(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """See the module docstring."""
    return (pre.unsqueeze(-1) * X.float()).sum(dim=2).to(X.dtype)


def reference_expand(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """See the module docstring."""
    streams = torch.einsum("bsji,bsjd->bsid", comb, X.float())  # comb^T X
    return (post.unsqueeze(-1) * y.float().unsqueeze(-2) + streams).to(X.dtype)


def fused_coefficients(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                       hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference's contract. The RMS factor scales the mixes, not the n d inputs (no normalised copy of
    the streams); pre and post are one [2, n] affine map and one sigmoid."""
    n = X.shape[-2]
    xf = X.flatten(-2).float()
    mixes = F.linear(xf, fn.float()) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    base, scale = base.float(), scale.float()
    gates = torch.sigmoid(torch.addcmul(base[: 2 * n].view(2, n), mixes[..., : 2 * n].unflatten(-1, (2, n)),
                                        scale[:2].unsqueeze(-1)))
    logits = torch.addcmul(base[2 * n :].view(n, n), mixes[..., 2 * n :].unflatten(-1, (n, n)), scale[2])
    return gates[..., 0, :] + hc_eps, 2 * gates[..., 1, :], sinkhorn(logits.softmax(dim=-1) + hc_eps, iters, hc_eps)


def fused_expand(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The reference's contract: post (x) y, then comb^T X added into it by one ``baddbmm``."""
    B, S, n, d = X.shape
    outer = (post.unsqueeze(-1) * y.float().unsqueeze(-2)).view(B * S, n, d)
    mixed = torch.baddbmm(outer, comb.transpose(-1, -2).reshape(B * S, n, n), X.float().reshape(B * S, n, d))
    return mixed.view(B, S, n, d).to(X.dtype)
