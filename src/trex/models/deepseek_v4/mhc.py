"""mHC, DeepSeek-V4's manifold-constrained hyper-connections: n residual streams mixed around every
sublayer. V4 runs it in two passes per sublayer (``HyperConnection.forward``: coefficients, collapse,
sublayer, expand); V4.1 in one (``model_v41.Block``: a sublayer's input collapses with the ``pre`` the
sublayer before it computed), from the same ``coefficients``, ``collapse`` and ``expand``: the kernel
registry's ``mhc_coefficients``, ``mhc_collapse`` and ``mhc_expand`` (trex.kernels.mhc: the reference and
a fused fast path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trex import kernels
from trex.models.common.norm import unweighted_rms_norm
from trex.models.deepseek_v4.config import ModelConfig


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
        return kernels.get("mhc_coefficients", X.device.type)(X, self.fn, self.base, self.scale, self.iters,
                                                              self.hc_eps, self.norm_eps)

    @staticmethod
    def collapse(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """The sublayer input: the streams X [B, S, n, d] weighted by pre [B, S, n], summed in fp32 -> [B, S, d]."""
        return kernels.get("mhc_collapse", X.device.type)(X, pre)

    @staticmethod
    def expand(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The streams after a sublayer: post * y + comb^T X, in fp32, cast to X's dtype -> [B, S, n, d]."""
        return kernels.get("mhc_expand", X.device.type)(y, X, post, comb)


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
