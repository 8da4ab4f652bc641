"""Per-token cross-entropy that keeps no [N, V] tensor of its own for backward.

``F.cross_entropy`` saves its fp32 log-softmax, a second [N, V] fp32 tensor next to the logits the
model's output already holds (at V4's 129,280-token vocabulary and 4K tokens: 2 GiB per head).
``token_nll`` saves the logits themselves (the same storage, no copy when they are fp32) and one
log-sum-exp per token, and rebuilds the softmax in backward: same values, same gradient.

``head_nll`` goes further when the caller needs the loss and not the logits (SFT, continued
pretraining): it fuses the fp32 LM head with the loss (its products through the kernel registry's
``fp32_matmul``: on a device with fp32-output bf16 GEMMs, those) and runs both over tiles of [token block,
vocabulary slice], so no [N, V] tensor exists beyond one tile (HEAD_TILE_BYTES) in forward or backward;
it saves the hidden states and one log-sum-exp per token and recomputes each tile's logits in backward.
(tests/test_cross_entropy.py checks both against ``F.cross_entropy``.)

Under tensor parallelism the head's vocabulary is split over ranks (trex.parallel.tensor_parallel): ``head_nll``
takes this rank's rows of the weight and a ``VocabSlice`` (where they start, and the group's sums): each rank
runs the same tiles over its rows, the per-token log-sum-exps are combined by an all-reduce of their maximum
and one of the exponentials' sum, the target's logit by a sum (its owner's, zeros elsewhere), and in backward
the hidden states' gradient by a sum; no rank holds more than its own [tokens, V / tp] logits, a tile at a time.
"""

from __future__ import annotations

from typing import Protocol

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


# The fused head's tiles: fp32 logits of one [token block, vocabulary slice], at most HEAD_TILE_BYTES, over
# token blocks of HEAD_BLOCK_TOKENS where there are that many (more where the whole vocabulary fits the tile).
# The [V, d] weight is read, and its fp32 gradient read and written, once per token block: per block the
# GEMMs make 2 * tokens FLOPs per weight element against 2 (bf16 read) + 8 (fp32 gradient read and write)
# bytes, so 4,096 tokens keep them compute-bound on every hardware profile, where 256-token chunks over the
# whole vocabulary left them memory-bound. At V4's vocabulary: 4,096 tokens x 8,192 rows.
HEAD_TILE_BYTES = 128 << 20
HEAD_BLOCK_TOKENS = 4096


def head_tiles(tokens: int, vocab: int) -> tuple[int, int]:
    """(tokens per block, vocabulary rows per slice) of ``head_nll`` over ``tokens`` tokens."""
    per_tile = max(1, HEAD_TILE_BYTES // 4)
    block = max(1, min(tokens, max(HEAD_BLOCK_TOKENS, per_tile // vocab)))
    return block, max(1, min(vocab, per_tile // block))


def _spans(n: int, step: int) -> list[tuple[int, int]]:
    return [(i, min(n, i + step)) for i in range(0, n, step)]


def _in_slice(safe: torch.Tensor, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each target's column in vocabulary rows [v0, v1), clamped into it; whether it lies there)."""
    local = safe - v0
    return local.clamp(0, v1 - v0 - 1)[:, None], (local >= 0) & (local < v1 - v0)


class VocabSlice(Protocol):
    """This rank's rows [start, start + its rows) of a vocabulary split over a group of ranks, and the group's
    reductions, each a new tensor (trex.parallel.tensor_parallel supplies one)."""

    start: int

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor: ...


class _HeadNLL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                vocab: VocabSlice | None) -> torch.Tensor:
        valid = targets != IGNORE_INDEX
        safe = torch.where(valid, targets, 0) - (vocab.start if vocab is not None else 0)  # in this rank's rows
        matmul, w = kernels.fp32_products(weight)  # fp32 products (one fp32 copy where they are computed in fp32)
        block, rows = head_tiles(h.shape[0], w.shape[0])
        slices = _spans(w.shape[0], rows)
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        picked = torch.zeros_like(lse)
        for t0, t1 in _spans(h.shape[0], block):
            part = torch.empty(t1 - t0, len(slices), dtype=torch.float32, device=h.device)  # per-slice log-sum-exp
            for j, (v0, v1) in enumerate(slices):
                z = matmul(h[t0:t1], w[v0:v1].T)  # [T, rows] fp32
                part[:, j] = torch.logsumexp(z, dim=-1)
                col, inside = _in_slice(safe[t0:t1], v0, v1)
                picked[t0:t1] += torch.where(inside, z.gather(1, col)[:, 0], 0.0)
            lse[t0:t1] = torch.logsumexp(part, dim=-1)
        if vocab is not None:  # the group's rows: log sum_r exp(lse_r), from the largest; the target's owner's logit
            top = vocab.all_reduce_max(lse)
            lse = vocab.all_reduce_sum((lse - top).exp_()).log_().add_(top)
            picked = vocab.all_reduce_sum(picked)
        ctx.vocab = vocab
        ctx.save_for_backward(h, weight, lse, safe, valid)
        return (lse - picked) * valid

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, weight, lse, safe, valid = ctx.saved_tensors
        matmul, w = kernels.fp32_products(weight)
        block, rows = head_tiles(h.shape[0], w.shape[0])
        g = grad * valid
        dh = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if ctx.needs_input_grad[1] else None
        for t0, t1 in _spans(h.shape[0], block):
            hc, gc = h[t0:t1], g[t0:t1, None]
            for v0, v1 in _spans(w.shape[0], rows):
                d = matmul(hc, w[v0:v1].T).sub_(lse[t0:t1, None]).exp_().mul_(gc)  # softmax * g
                col, inside = _in_slice(safe[t0:t1], v0, v1)
                d.scatter_add_(1, col, torch.where(inside[:, None], -gc, 0.0))  # minus g at the target
                if dh is not None:
                    matmul(d, w[v0:v1], dh[t0:t1])
                if dw is not None:
                    matmul(d.T, hc, dw[v0:v1])
        if dh is not None and ctx.vocab is not None:  # every rank's rows contribute to each hidden state
            dh = ctx.vocab.all_reduce_sum(dh)
        return (None if dh is None else dh.to(h.dtype)), (None if dw is None else dw.to(weight.dtype)), None, None


def head_nll(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
             vocab: VocabSlice | None = None) -> torch.Tensor:
    """-log softmax(h @ weight.T in fp32)[target] per token, fp32, 0 where target == IGNORE_INDEX,
    without materialising the [..., V] logits. Equal to ``token_nll(linear_fp32(h, weight), targets)``.

    h: [..., d] (any dtype), weight: [V, d] (the LM head), targets: [...] long -> [...]. Gradients come
    back in h's and weight's dtypes. With ``vocab``, ``weight`` holds this rank's rows of the head (from
    ``vocab.start``) and h, targets are the same on every rank of the group: the result is the whole
    vocabulary's NLL on every rank, h's gradient summed over the group, the weight's this rank's rows'."""
    shape = targets.shape
    nll = _HeadNLL.apply(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), vocab)
    return nll.view(shape)
