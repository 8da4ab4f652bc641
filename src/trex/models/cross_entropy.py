"""Per-token cross-entropy that keeps no [N, V] tensor of its own for backward.

``F.cross_entropy`` saves its fp32 log-softmax, a second [N, V] fp32 tensor next to the logits the
model's output already holds (at V4's 129,280-token vocabulary and 4K tokens: 2 GiB per head).
``token_nll`` saves the logits themselves (the same storage, no copy when they are fp32) and one
log-sum-exp per token, and rebuilds the softmax in backward: same values, same gradient
(tests/test_cross_entropy.py checks both against ``F.cross_entropy``).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


class _TokenNLL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        valid = targets != IGNORE_INDEX
        safe = torch.where(valid, targets, 0)
        lse = torch.logsumexp(logits, dim=-1)
        nll = (lse - logits.gather(1, safe[:, None])[:, 0]) * valid
        ctx.save_for_backward(logits, lse, safe, valid)
        return nll

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, lse, safe, valid = ctx.saved_tensors
        g = grad * valid  # [N]
        d = (logits - lse[:, None]).exp_().mul_(g[:, None])  # softmax * g
        d.scatter_add_(1, safe[:, None], -g[:, None])  # minus g at the target
        return d, None


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log softmax(logits)[target] per token, fp32, 0 where target == IGNORE_INDEX.

    logits: [..., V] (cast to fp32; the LM head already gives fp32), targets: [...] long -> [...]."""
    shape = targets.shape
    nll = _TokenNLL.apply(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return nll.view(shape)
