"""mHC, DeepSeek-V4's manifold-constrained hyper-connections: n residual streams mixed around every
sublayer. V4 runs it in two passes per sublayer (``HyperConnection.forward``: coefficients, collapse,
sublayer, expand); V4.1 in one (``model_v41.Block``: a sublayer's input collapses with the ``pre`` the
sublayer before it computed), from the same ``coefficients``, ``collapse`` and ``expand``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trex.models.common.norm import unweighted_rms_norm
from trex.models.deepseek_v4.config import ModelConfig


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


class HyperConnection(nn.Module):
    """Mixes n residual streams: pre (collapse), post (expand), comb (Sinkhorn, applied as comb^T)."""

    profile_scope = "norm_mhc"  # trex.profile.scopes

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = cfg.hc_mult
        self.n, self.iters, self.hc_eps, self.norm_eps = n, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def optimizer_rules(self) -> dict[str, tuple[str, list[int]]]:
        """{parameter: (optimizer rule, row blocks)} (trex.train.optim.classify): ``fn``'s rows split into
        pre (n) / post (n) / comb (n*n); base and scale gains."""
        return {"fn": ("mhc_fn", [self.n, self.n, self.n * self.n]), "base": ("gains_biases", []),
                "scale": ("gains_biases", [])}

    def forward(self, X: torch.Tensor, sublayer) -> torch.Tensor:
        """X: [B, S, n, d] -> [B, S, n, d]; sublayer maps [B, S, d] -> [B, S, d]."""
        pre, post, comb = self.coefficients(X)
        return self.expand(sublayer(self.collapse(X, pre)), X, post, comb)

    def coefficients(self, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """X: [B, S, n, d] -> fp32 pre [B, S, n], post [B, S, n], comb [B, S, n, n] (doubly stochastic)."""
        n = self.n
        xf = X.flatten(-2).float()
        mixes = F.linear(unweighted_rms_norm(xf, self.norm_eps), self.fn.float())
        base, scale = self.base.float(), self.scale.float()
        pre = torch.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + self.hc_eps
        post = 2 * torch.sigmoid(mixes[..., n : 2 * n] * scale[1] + base[n : 2 * n])
        logits = mixes[..., 2 * n :].unflatten(-1, (n, n)) * scale[2] + base[2 * n :].view(n, n)
        comb = _Sinkhorn.apply(logits.softmax(dim=-1) + self.hc_eps, self.iters, self.hc_eps)
        return pre, post, comb

    @staticmethod
    def collapse(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """The sublayer input: the streams X [B, S, n, d] weighted by pre [B, S, n], summed in fp32 -> [B, S, d]."""
        return (pre.unsqueeze(-1) * X.float()).sum(dim=2).to(X.dtype)

    @staticmethod
    def expand(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The streams after a sublayer: post * y + comb^T X, in fp32, cast to X's dtype -> [B, S, n, d]."""
        streams = torch.einsum("bsji,bsjd->bsid", comb, X.float())  # comb^T X
        return (post.unsqueeze(-1) * y.float().unsqueeze(-2) + streams).to(X.dtype)


class HyperHead(nn.Module):
    """Collapses the n streams into one: sigmoid pre-weights, no Sinkhorn."""

    profile_scope = "norm_mhc"  # trex.profile.scopes

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = cfg.hc_mult
        self.hc_eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.empty(n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros(n))
        self.scale = nn.Parameter(torch.ones(1))

    def optimizer_rules(self) -> dict[str, tuple[str, list[int]]]:
        """{parameter: (optimizer rule, row blocks)} (trex.train.optim.classify): base and scale gains."""
        return {"base": ("gains_biases", []), "scale": ("gains_biases", [])}

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms_norm(X.flatten(-2).float(), self.norm_eps), self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.hc_eps
        return HyperConnection.collapse(X, pre)
