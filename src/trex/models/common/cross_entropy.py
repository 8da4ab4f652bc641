"""Per-token cross-entropy that keeps no [N, V] tensor of its own for backward.

``F.cross_entropy`` saves its fp32 log-softmax, a second [N, V] fp32 tensor next to the logits the
model's output already holds (at V4's 129,280-token vocabulary and 4K tokens: 2 GiB per head).
``token_nll`` saves the logits themselves (the same storage, no copy when they are fp32) and one
log-sum-exp per token, and rebuilds the softmax in backward: same values, same gradient.

``head_nll`` goes further when the caller needs the loss and not the logits (SFT, continued
pretraining): it fuses the fp32 LM head with the loss (its products through the kernel registry's
``fp32_matmul``: on a device with fp32-output bf16 GEMMs, those) and runs both over chunks of tokens, so no
[N, V] tensor exists beyond one chunk (HEAD_CHUNK_BYTES) in forward or backward; it saves the hidden
states and one log-sum-exp per token and recomputes each chunk's logits in backward.
(tests/test_cross_entropy.py checks both against ``F.cross_entropy``.)
"""

from __future__ import annotations

import torch

from trex import kernels

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


# fp32 logits of one chunk of tokens: 256 tokens at V4's vocabulary
HEAD_CHUNK_BYTES = 128 << 20


def _token_chunks(n: int, vocab: int):
    step = max(1, HEAD_CHUNK_BYTES // (4 * vocab))
    return [(t0, min(n, t0 + step)) for t0 in range(0, n, step)]


class _HeadNLL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        valid = targets != IGNORE_INDEX
        safe = torch.where(valid, targets, 0)
        matmul, w = kernels.fp32_products(weight)  # fp32 products (one fp32 copy where they are computed in fp32)
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        picked = torch.empty_like(lse)
        for t0, t1 in _token_chunks(h.shape[0], w.shape[0]):
            z = matmul(h[t0:t1], w.T)  # [T, V] fp32
            lse[t0:t1] = torch.logsumexp(z, dim=-1)
            picked[t0:t1] = z.gather(1, safe[t0:t1, None])[:, 0]
        ctx.save_for_backward(h, weight, lse, safe, valid)
        return (lse - picked) * valid

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, weight, lse, safe, valid = ctx.saved_tensors
        matmul, w = kernels.fp32_products(weight)
        g = grad * valid
        dh = torch.empty(h.shape, dtype=torch.float32, device=h.device) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if ctx.needs_input_grad[1] else None
        for t0, t1 in _token_chunks(h.shape[0], w.shape[0]):
            hc = h[t0:t1]
            d = matmul(hc, w.T).sub_(lse[t0:t1, None]).exp_().mul_(g[t0:t1, None])  # softmax * g
            d.scatter_add_(1, safe[t0:t1, None], -g[t0:t1, None])  # minus g at the target
            if dh is not None:
                dh[t0:t1] = matmul(d, w)
            if dw is not None:
                matmul(d.T, hc, dw)
        return (None if dh is None else dh.to(h.dtype)), (None if dw is None else dw.to(weight.dtype)), None


def head_nll(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log softmax(h @ weight.T in fp32)[target] per token, fp32, 0 where target == IGNORE_INDEX,
    without materialising the [..., V] logits. Equal to ``token_nll(linear_fp32(h, weight), targets)``.

    h: [..., d] (any dtype), weight: [V, d] (the LM head), targets: [...] long -> [...]. Gradients come
    back in h's and weight's dtypes."""
    shape = targets.shape
    nll = _HeadNLL.apply(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1))
    return nll.view(shape)
