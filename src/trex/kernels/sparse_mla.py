"""DeepSeek-V3.2's sparse MLA in the absorbed (MQA) form: each query head attends to its query's top-k
picked tokens only, registered as the op ``sparse_mla``.

    out[t, h] = sum_j softmax_j(q[t, h] . kv[idx[t, j]] * scale) kv[idx[t, j], :v_dim]   over valid j

kv [B, S, c] is one shared "head" per token: MLA's normed latent (kv_lora_rank) then the rotated k_pe
(qk_rope_head_dim), c = 576 at the released size; q [B, s, H, c] is q_nope absorbed through ``wkv_b``'s
key rows, then q_pe (scores q_nope . k_nope + q_pe . k_pe, exactly MLA's); the values are the latent
(v_dim = kv_lora_rank), which the caller lifts through ``wkv_b``'s value rows (deepseek_v3.dsa). The
picks idx, valid [B, s, k] index the whole rows' S tokens: documents, causality and a context-parallel
rank's first row (``q_start``) are already in them (the indexer picks among visible keys), so the op
needs none of these. Each query needs at least one valid pick (every token sees itself).

* ``reference``: the mask form. The picks scattered into a [B, s, S] mask over dense fp32 [B, s, H, S]
  scores (``scores_fp32``), fp32 softmax, probabilities in kv's dtype, then the value sum. Quadratic in
  S. The test oracle; ``TREX_KERNELS=sparse_mla=reference``.
* ``gathered``: per query chunk, gather the chunk's [T, k, c] picked rows, fp32 scores [T, H, k], an
  online logsumexp, the value sum; backward (``GatheredMLA``) re-gathers and recomputes the scores from
  the saved logsumexp (FlashAttention's recipe) and scatter-adds each pick's key and value gradient into
  kv (fp32 accumulation). Saves q, kv, the picks, out and a [B, s, H] fp32 logsumexp: nothing [S, S].
  The default on every device type.

Cost per query token and layer, forward, at the released shape (H = 128, c = 512 + 64, v_dim = 512, k =
2048; MLA's expanded head dims 192 / 128), S the sequence:

  mask form (the former path: the expanded MHA, the picks a mask; or ``reference``): 2 H S (192 + 128)
      = 82 K x S FLOP (10.7 GFLOP at S = 128K; the causal half skipped by no dense kernel that takes an
      arbitrary mask), the [S] mask row (S bytes: 16 GiB for a 128K sequence), and ``reference``'s fp32
      scores 4 H S bytes (64 MiB a token).
  gathered: 2 H k (c + v_dim) = 0.57 GFLOP whatever S, plus the absorption and the value lift 2 x 2 H
      128 x 512 = 34 MFLOP; transient k c (2.4 MB bf16) gathered rows + a few H k fp32 (1 MiB each) per
      query of a chunk, saved 2 H (c + v_dim) + 4 H bytes (0.3 MB) per query (q and out in bf16, the
      logsumexp).
      Backward: the same gathers, 2x the matmuls.

Time and memory of the gathered form grow linearly in S and k (S k, the mask form S^2); it wins once k
is well below S (bench/sparse_mla.py, docs/benchmarks.md). Chunks of at most CHUNK_BYTES of transients:
a Python loop with static bounds (shapes only), so it compiles fullgraph; a larger budget makes fewer,
larger steps (fewer unrolled iterations under compile).
"""

from __future__ import annotations

import torch

from trex.kernels.sparse_attention import picks_as_mask, query_chunks, scores_fp32, take_rows

CHUNK_BYTES = 64 << 20  # transients of one query chunk (gathered rows and the [T, H, k] fp32 scores)


def reference(q: torch.Tensor, kv: torch.Tensor, scale: float, idx: torch.Tensor, valid: torch.Tensor,
              v_dim: int) -> torch.Tensor:
    """The mask form: q [B, s, H, c], kv [B, S, c], idx, valid [B, s, k] -> [B, s, H, v_dim] in kv's dtype."""
    B, s, H, c = q.shape
    keep = picks_as_mask(valid, idx, kv.shape[1])  # [B, s, S]
    scores = scores_fp32(q.reshape(B, s * H, c), kv.transpose(1, 2)).view(B, s, H, -1) * scale
    p = scores.masked_fill(~keep[:, :, None], float("-inf")).softmax(dim=-1).to(kv.dtype)
    return (p.reshape(B, s * H, -1) @ kv[..., :v_dim]).view(B, s, H, v_dim)


def _chunks(q: torch.Tensor, k: int):
    """Query ranges whose transients fit CHUNK_BYTES: per query the gathered rows [k, c] and, in backward,
    the picks' fp32 gradient (two [k, c] copies), and four fp32 [H, k] (scores, probabilities, their
    gradient and its cast)."""
    B, s, H, c = q.shape
    return query_chunks(s, B * k * (c * (q.element_size() + 8) + 4 * H * 4), CHUNK_BYTES)


def _scores(q: torch.Tensor, picked: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """One chunk: q [N, H, c], picked [N, k, c], valid [N, k] -> masked fp32 scores [N, H, k]."""
    scores = scores_fp32(q, picked.transpose(1, 2)).mul_(scale)
    return scores.masked_fill_(~valid[:, None], float("-inf"))


class GatheredMLA(torch.autograd.Function):
    """``reference``'s result by chunked gathers (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, kv, idx, valid, scale: float, v_dim: int):
        B, s, H, c = q.shape
        out = q.new_empty(B, s, H, v_dim, dtype=kv.dtype)
        lse = torch.empty(B, s, H, dtype=torch.float32, device=q.device)
        for t0, t1 in _chunks(q, idx.shape[-1]):
            picked = take_rows(kv, idx[:, t0:t1]).flatten(0, 1)  # [B*T, k, c]
            scores = _scores(q[:, t0:t1].flatten(0, 1), picked, valid[:, t0:t1].flatten(0, 1), scale)
            m = scores.logsumexp(dim=-1, keepdim=True)
            p = (scores - m).exp_().to(kv.dtype)
            out[:, t0:t1] = torch.bmm(p, picked[..., :v_dim]).unflatten(0, (B, -1))
            lse[:, t0:t1] = m.squeeze(-1).unflatten(0, (B, -1))
        ctx.save_for_backward(q, kv, idx, valid, out, lse)
        ctx.scale, ctx.v_dim = scale, v_dim
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, kv, idx, valid, out, lse = ctx.saved_tensors
        scale, v_dim = ctx.scale, ctx.v_dim
        B, s, H, c = q.shape
        S = kv.shape[1]
        d_out = d_out.to(kv.dtype)
        delta = (d_out.float() * out.float()).sum(dim=-1, keepdim=True)  # sum_j p dp, [B, s, H, 1]
        dq = torch.empty_like(q)
        dkv = torch.zeros(B * S, c, dtype=torch.float32, device=kv.device)
        offset = torch.arange(B, device=idx.device).view(B, 1, 1) * S
        for t0, t1 in _chunks(q, idx.shape[-1]):
            picked = take_rows(kv, idx[:, t0:t1]).flatten(0, 1)  # [N, k, c]
            qc, doc = q[:, t0:t1].flatten(0, 1), d_out[:, t0:t1].flatten(0, 1)  # [N, H, c], [N, H, v_dim]
            scores = _scores(qc, picked, valid[:, t0:t1].flatten(0, 1), scale)
            p = (scores - lse[:, t0:t1].flatten(0, 1)[..., None]).exp_()  # [N, H, k] fp32
            dp = scores_fp32(doc, picked[..., :v_dim].transpose(1, 2))
            ds = (p * (dp - delta[:, t0:t1].flatten(0, 1))).mul_(scale).to(kv.dtype)
            dq[:, t0:t1] = torch.bmm(ds, picked).unflatten(0, (B, -1))
            per_pick = torch.bmm(ds.transpose(1, 2), qc).float()  # [N, k, c]: the picks' key use
            per_pick[..., :v_dim] += torch.bmm(p.to(kv.dtype).transpose(1, 2), doc).float()  # and value use
            dkv.index_add_(0, (idx[:, t0:t1] + offset).reshape(-1), per_pick.reshape(-1, c))
        return dq, dkv.view(B, S, c).to(kv.dtype), None, None, None, None


# Picks that are this fraction of the keys or more run as the mask form, while its fp32 [B, s, H, S] scores
# (three copies) fit CHUNK_BYTES, so its memory stays bounded. Measured on CPU (8 heads of 96, k = 64 or
# 256, forward + backward, 2 threads): at k = S / 4 the mask form takes 0.5x - 0.7x the gathers' time; at
# k = S / 8 and below the gathers take 0.5x - 0.6x the mask form's.
DENSE_TOPK_FRACTION = 0.25


def gathered(q: torch.Tensor, kv: torch.Tensor, scale: float, idx: torch.Tensor, valid: torch.Tensor,
             v_dim: int) -> torch.Tensor:
    """``reference``'s signature and result by ``GatheredMLA`` (see the module docstring); short rows whose
    picks are DENSE_TOPK_FRACTION of the keys or more by ``reference``."""
    B, s, H, _ = q.shape
    S = kv.shape[1]
    if idx.shape[-1] >= DENSE_TOPK_FRACTION * S and 3 * 4 * B * s * H * S <= CHUNK_BYTES:
        return reference(q, kv, scale, idx, valid, v_dim)
    return GatheredMLA.apply(q, kv, idx, valid, scale, v_dim)


@torch.no_grad()
def pick_probs(q: torch.Tensor, kv: torch.Tensor, scale: float, idx: torch.Tensor, valid: torch.Tensor
               ) -> torch.Tensor:
    """The attention's distribution over each query's picks, averaged over heads (the indexer's KL target):
    q [B, s, H, c], kv [B, S, c], idx, valid [B, s, k] -> fp32 [B, s, k], 0 on invalid picks. By chunks, as
    ``gathered``."""
    B, s = idx.shape[:2]
    out = torch.empty(B, s, idx.shape[-1], dtype=torch.float32, device=q.device)
    for t0, t1 in _chunks(q, idx.shape[-1]):
        picked = take_rows(kv, idx[:, t0:t1]).flatten(0, 1)
        scores = _scores(q[:, t0:t1].flatten(0, 1), picked, valid[:, t0:t1].flatten(0, 1), scale)
        out[:, t0:t1] = scores.softmax(dim=-1).mean(dim=1).unflatten(0, (B, -1))
    return out
