"""MLA's attention core straight from the KV latent (DeepSeek-V3 under context parallelism), registered as the
op ``latent_attention``: this rank's queries against keys and values that are expanded from the gathered
latent by ``wkv_b`` a chunk of keys at a time, never for all S rows at once.

* ``reference``: expands every row (k = [latent @ w_k^T | k_pe shared by the heads], v = latent @ w_v^T) and
  runs ``dense_attention.reference`` (fp32 [B, H, Sq, S] scores). The test oracle, and what
  ``TREX_KERNELS=latent_attention=reference`` runs.
* ``chunked``: flash-style in plain PyTorch, one ``torch.autograd.Function``. Forward: for each chunk of C
  keys, expand that chunk's k_nope and v (``wkv_b``), score it against the queries a tile of Tq at a time,
  and fold it into an online softmax (running max, sum and fp32 output). It saves only q, the latent,
  k_pe, the output and the rows' log-sum-exp; backward re-expands each chunk and recomputes its scores
  and probabilities from the log-sum-exp (FlashAttention's backward), then sends the chunk's key and value
  gradients back through ``wkv_b`` to the latent, k_pe (summed over heads) and ``wkv_b``'s weight. Scores,
  softmax and every accumulation in fp32, so exact to fp32 rounding against the reference; no host reads,
  static shapes (the loops' bounds are shapes), and it traces under ``torch.compile(fullgraph=True)``.
  Every key chunk is visited by every query tile (masked ones too): each rank of a context-parallel group
  runs the same operations. The vendor-neutral default on every device type.

Memory and FLOPs, one layer on one rank, at the released shape (128 heads, qk 128 + 64, v 128, latent
512 + 64) with S = 128K (131,072) and cp = 8 (s = 16,384 query rows a rank), bf16:

==========================  =================================================  ===============================
                            before (expand all S, ``dense_attention``)         after (``chunked``)
==========================  =================================================  ===============================
held for backward           wkv_b's [S, H, 256] output (v is a view of it,    q 805 MB, output 537 MB,
                            so it all stays) 8.59 GB + k [S, H, 192] 6.44 GB   log-sum-exp 8 MB, gathered
                            + q 805 MB + output 537 MB + latent 151 MB:        latent 151 MB: 1.50 GB
                            16.5 GB (1.0 MB a query row)                       (92 KB a query row)
transient (one layer)       the fused kernel's tiles                           fp32 tiles: forward 2 x Tq x C
                                                                               x H x 4 B (1.07 GB at 1024 x
                                                                               1024) + the fp32 output 1.07
                                                                               GB; backward dq fp32 1.61 GB +
                                                                               3 tiles (1.61 GB)
FLOPs a query row, forward  wkv_b over S rows: 2 x 512 x 32,768 x cp = 268 M;  the same
                            core (mask not skipped) 2 x S x H x (192 + 128)
                            = 10.7 G
FLOPs a query row, backward wkv_b 537 M; core 27.9 G (QK^T recomputed, dV,     + one wkv_b re-expansion 268 M
                            dP, dQ, dK)                                        (+0.7% of the layer's core)
==========================  =================================================  ===============================

So what a rank holds falls with cp (the gathered latent, S x 576, is all that stays whole) for 0.7% more
core FLOPs. What the plain-PyTorch loop does not bound is its unrolled length under compile: (S / C) x
(s / Tq) iterations (2,048 at the released shape with 1024-sized chunks and tiles); a fused device kernel
(a vendor's, registered with ``kernels.register("latent_attention", device_type, fn)``) is the way there.

Shapes: q [B, Sq, H, nope + rope] (the pe dims rotated); latent [B, S, R] (normed); k_pe [B, S, rope]
(rotated); w_kv [H x (nope + v), R] (``wkv_b``'s weight: per head its nope key rows, then its value rows);
doc [B, S] the keys' segment ids; the queries are rows ``q_start`` .. ``q_start + Sq - 1``. Returns
[B, Sq, H, v] in q's dtype; the document-causal mask as ``dense_attention``'s (every query sees itself).
"""

from __future__ import annotations

import torch

from trex.kernels import dense_attention

CHUNK = 1024  # keys expanded at once
TILE = 1024  # query rows scored at once


def expand(latent: torch.Tensor, k_pe: torch.Tensor, w_kv: torch.Tensor, heads: int, nope: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [B, S, R], k_pe [B, S, rope] -> (k [B, S, H, nope + rope], v [B, S, H, v]): MLA's keys and values."""
    B, S, _ = latent.shape
    kv = (latent @ w_kv.T).view(B, S, heads, -1)
    k_nope, v = kv.split([nope, kv.shape[-1] - nope], dim=-1)
    return torch.cat((k_nope, k_pe[:, :, None].expand(B, S, heads, k_pe.shape[-1])), dim=-1), v


def reference(q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, w_kv: torch.Tensor, scale: float,
              doc: torch.Tensor, q_start: int = 0) -> torch.Tensor:
    """Every row expanded, then ``dense_attention.reference`` (see the module docstring)."""
    k, v = expand(latent, k_pe, w_kv, q.shape[2], q.shape[-1] - k_pe.shape[-1])
    return dense_attention.reference(q, k, v, scale, doc, q_start)


def chunked(q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, w_kv: torch.Tensor, scale: float,
            doc: torch.Tensor, q_start: int = 0, chunk: int = CHUNK, tile: int = TILE) -> torch.Tensor:
    """``reference``'s contract, keys expanded ``chunk`` at a time and scored against ``tile`` queries at a time
    (see the module docstring)."""
    return _Chunked.apply(q, latent, k_pe, w_kv, doc, scale, q_start, chunk, tile)


def _visible(doc: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    """[B, 1, q1 - q0, k1 - k0] bool: query rows q0..q1-1 see key rows k0..k1-1 (causal, same document)."""
    rows = torch.arange(q0, q1, device=doc.device)[:, None] >= torch.arange(k0, k1, device=doc.device)
    return (rows & (doc[:, q0:q1, None] == doc[:, None, k0:k1]))[:, None]


def _spans(n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(n, a + size)) for a in range(0, n, size)]


def _chunk_kv(latent: torch.Tensor, w: torch.Tensor, heads: int, nope: int, k0: int, k1: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 k_nope [B, H, nope, C] (transposed for q @ k) and v [B, H, C, v] of keys k0..k1-1."""
    B = latent.shape[0]
    kv = (latent[:, k0:k1].float() @ w.T).view(B, k1 - k0, heads, -1)
    return kv[..., :nope].permute(0, 2, 3, 1), kv[..., nope:].transpose(1, 2)


def _scores(q: torch.Tensor, k_nope: torch.Tensor, pe: torch.Tensor, scale: float, visible: torch.Tensor
            ) -> torch.Tensor:
    """fp32 scores [B, H, Tq, C] of queries q [B, H, Tq, nope + rope] against a chunk's keys, -inf where not
    visible; one new tile, the rest in place (the tiles are this kernel's transient memory)."""
    nope = k_nope.shape[-2]
    s = q[..., :nope] @ k_nope
    s.add_(q[..., nope:] @ pe).mul_(scale)
    return s.masked_fill_(~visible, float("-inf"))


class _Chunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, latent, k_pe, w_kv, doc, scale, q_start, chunk, tile):
        B, Sq, H, dk = q.shape
        S, rope = latent.shape[1], k_pe.shape[-1]
        nope = dk - rope
        w = w_kv.float()
        qh = q.transpose(1, 2).float()  # [B, H, Sq, dk]
        dv = w.shape[0] // H - nope
        m = q.new_full((B, H, Sq), float("-inf"), dtype=torch.float32)
        l = q.new_zeros((B, H, Sq), dtype=torch.float32)
        acc = q.new_zeros((B, H, Sq, dv), dtype=torch.float32)
        for k0, k1 in _spans(S, chunk):
            k_nope, v = _chunk_kv(latent, w, H, nope, k0, k1)
            pe = k_pe[:, None, k0:k1].float().transpose(-1, -2)  # [B, 1, rope, C]: one head all heads share
            for t0, t1 in _spans(Sq, tile):
                s = _scores(qh[:, :, t0:t1], k_nope, pe, scale, _visible(doc, q_start + t0, q_start + t1, k0, k1))
                m_new = torch.maximum(m[:, :, t0:t1], s.amax(-1))
                base = torch.where(m_new == float("-inf"), 0.0, m_new)  # a tile that sees no key yet
                alpha = torch.exp(m[:, :, t0:t1] - base)
                p = s.sub_(base[..., None]).exp_()
                l[:, :, t0:t1] = l[:, :, t0:t1] * alpha + p.sum(-1)
                acc[:, :, t0:t1] = acc[:, :, t0:t1] * alpha[..., None] + p @ v
                m[:, :, t0:t1] = m_new
        out = (acc / l[..., None]).transpose(1, 2).to(q.dtype).contiguous()  # [B, Sq, H, dv]: flatten(2) a view
        lse = m + torch.log(l)
        ctx.save_for_backward(q, latent, k_pe, w_kv, doc, out, lse)
        ctx.scale, ctx.q_start, ctx.chunk, ctx.tile = scale, q_start, chunk, tile
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, latent, k_pe, w_kv, doc, out, lse = ctx.saved_tensors
        scale, q_start = ctx.scale, ctx.q_start
        B, Sq, H, dk = q.shape
        S, rope = latent.shape[1], k_pe.shape[-1]
        nope = dk - rope
        w = w_kv.float()
        qh = q.transpose(1, 2).float()
        do = d_out.transpose(1, 2).float()  # [B, H, Sq, dv]
        delta = (do * out.transpose(1, 2).float()).sum(-1)  # [B, H, Sq]
        dq = torch.zeros_like(qh)
        dw = torch.zeros_like(w)
        d_latent, d_pe = [], []
        for k0, k1 in _spans(S, ctx.chunk):
            k_nope, v = _chunk_kv(latent, w, H, nope, k0, k1)
            pe = k_pe[:, None, k0:k1].float().transpose(-1, -2)
            dk_nope = q.new_zeros((B, H, k1 - k0, nope), dtype=torch.float32)
            dk_pe = q.new_zeros((B, k1 - k0, rope), dtype=torch.float32)
            dv = torch.zeros_like(v)
            for t0, t1 in _spans(Sq, ctx.tile):
                s = _scores(qh[:, :, t0:t1], k_nope, pe, scale, _visible(doc, q_start + t0, q_start + t1, k0, k1))
                p = s.sub_(lse[:, :, t0:t1, None]).exp_()  # [B, H, Tq, C]
                dv = dv + p.transpose(-1, -2) @ do[:, :, t0:t1]
                ds = (do[:, :, t0:t1] @ v.transpose(-1, -2)).sub_(delta[:, :, t0:t1, None]).mul_(p).mul_(scale)
                dq[:, :, t0:t1, :nope] += ds @ k_nope.transpose(-1, -2)
                dq[:, :, t0:t1, nope:] += ds @ pe.transpose(-1, -2)
                dk_nope = dk_nope + ds.transpose(-1, -2) @ qh[:, :, t0:t1, :nope]
                dk_pe = dk_pe + (ds.transpose(-1, -2) @ qh[:, :, t0:t1, nope:]).sum(1)
            d_kv = torch.cat((dk_nope, dv), dim=-1).transpose(1, 2).reshape(B, k1 - k0, -1)  # [B, C, H x (nope + v)]
            d_latent.append(d_kv @ w)
            dw = dw + d_kv.flatten(0, 1).T @ latent[:, k0:k1].float().flatten(0, 1)
            d_pe.append(dk_pe)
        return (dq.transpose(1, 2).to(q.dtype), torch.cat(d_latent, 1).to(latent.dtype),
                torch.cat(d_pe, 1).to(k_pe.dtype), dw.to(w_kv.dtype), None, None, None, None, None)
