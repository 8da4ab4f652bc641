"""The lightning indexer's shared arithmetic (DeepSeek Sparse Attention: DeepSeek-V3.2's tokens,
DeepSeek-V4's compressed entries): the index scores and their top-k, and the KL that fits the indexer
to the main attention.

    I[t, s] = sum_h w[t, h] * relu(q[t, h] . K[s])

q [B, T, H_I, c_I] (the scales folded into the head weights w [B, T, H_I]), K [B, N, c_I] one key per
entry (a token, or a compressed entry). Top-k is not differentiable: the LM loss gives the indexer no
gradient, and the indexer learns only from ``alignment_kl``.
"""

from __future__ import annotations

import torch

from trex.kernels.sparse_attention import gather_rows


def select_topk(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, k: int):
    """Top-k entries of I[t, s] for queries q [B, T, H_I, c_I] over keys [B, N, c_I] (visible [B, T, N]),
    in q's dtype: fp32, or bf16 as DeepSeek-V4's official code scores under the indexer's simulation (its
    einsum, ReLU, head weighting and head sum all round to bf16). Returns (idx [B, T, k] long, valid
    [B, T, k] bool): a query that sees fewer than k entries gets them all, the rest of its picks invalid."""
    scores = torch.einsum("bthc,bnc->bthn", q, keys.to(q.dtype)).relu_()
    if q.dtype == torch.float32:
        scores = torch.einsum("bthn,bth->btn", scores, w)
    else:  # the official order: weight each head's scores, then sum the heads
        scores = (scores * w.unsqueeze(-1)).sum(dim=2)
    scores.masked_fill_(~visible, float("-inf"))
    top = scores.topk(k, dim=-1)
    return top.indices, top.values > float("-inf")


def alignment_kl(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor | None,
                 valid: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """KL(target || softmax of the index scores) per query over the entries idx names: q [B, T, H_I, c_I],
    w [B, T, H_I], keys [B, N, c_I], idx, valid, target [B, T, k] (target: a distribution over each query's
    valid entries) -> [B, T]; 0 for a query with fewer than two valid entries (nothing to learn). idx None:
    over all N entries (valid, target [B, T, N]; the dense warm-up), no gather."""
    if idx is None:
        scores = torch.einsum("bthc,bnc->bthn", q, keys).relu()
    else:
        scores = torch.einsum("bthc,btkc->bthk", q, gather_rows(keys, idx)).relu()  # [B, T, k, c_I] picked
    scores = torch.einsum("bthk,bth->btk", scores, w).masked_fill(~valid, float("-inf"))
    logq = torch.log_softmax(scores, dim=-1)
    terms = target * (torch.log(target.clamp(min=1e-30)) - logq)
    return torch.where(valid & (target > 0), terms, 0.0).sum(dim=-1) * (valid.sum(dim=-1) > 1)


def picked_mass(p: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """How much of the main attention the picks cover (the indexer's recall): p [B, T, N] the main
    attention's distribution over the entries (mean over heads), idx, valid [B, T, k] the picks, visible
    [B, T, N]. Returns [B, 2]: per row the summed coverage of the queries that see an entry, and their
    number (coverage 1: the top-k holds all of the attention)."""
    covered = (p.gather(2, idx) * valid).sum(dim=-1)
    seen = visible.any(dim=-1)
    return torch.stack(((covered * seen).sum(dim=1), seen.sum(dim=1).float()), dim=1)


def take_indexer_measures(blocks, ctx, what: str) -> torch.Tensor | None:
    """The mean over the blocks whose attention has an indexer holding a ``what`` ("alignment": the
    KL, "recall": the picks' mass; each [B, 2], sum and count) of that measure averaged over the queries
    of the whole batch (a context-parallel group sums its shards); each taken (reset to None). None when
    no block measured it."""
    parts = []
    for block in blocks:
        indexer = getattr(block.attn, "indexer", None)
        if indexer is not None and getattr(indexer, what) is not None:
            parts.append(getattr(indexer, what))
            setattr(indexer, what, None)
    if not parts:
        return None
    sums = ctx.shard_sum(torch.stack(parts, dim=1)).sum(dim=0)  # [blocks, 2]
    return (sums[:, 0] / sums[:, 1].clamp(min=1)).mean()
