"""DeepSeek Sparse Attention (DeepSeek-V3.2): the lightning indexer, MLA over its picks, and the indexer's
loss in the two training stages of DeepSeek's V3.2 report.

The indexer (official ``Indexer``, DeepSeek-V3.2-Exp ``inference/model.py``; transformers'
``DeepseekV32Indexer``), per layer: queries ``wq_b`` from MLA's normed query latent qr (H_I heads of
c_I), one key per token ``k_norm(wk(x))`` (a LayerNorm with a bias), head weights ``weights_proj(x)``
(fp32). RoPE rotates the first qk_rope_head_dim dims of each query head and of the key as half-split
pairs (DeepSeek's fixed code: ``apply_rotary_emb(..., interleaved=False)``; MLA's own RoPE stays
interleaved), with MLA's (YaRN) frequencies and no cos/sin factor. Scores

    I[t, s] = sum_h weights_proj(x_t)[h] * H_I^-0.5 * c_I^-0.5 * relu(q[t, h] . k[s])

over the tokens t may see (causal, same document); each query keeps its top min(index_topk, visible).
DeepSeek's code rotates q and k by a Hadamard transform (orthonormal: the dot products are unchanged) and
scores them in FP8; trex scores in fp32 (as transformers does).

Two training stages (``Indexer.align``, weighted by ``[train] indexer_loss``):

  dense warm-up  ``dense_warmup`` on the model: MLA attends densely, and the indexer is fitted to the
                 main attention over every visible token: KL(p_t || softmax_s I[t, s]) with p_t the
                 main attention's probabilities summed over heads and L1-normalised (their mean).
  sparse         MLA attends to the picks only; the same KL restricted to each query's picks (the main
                 attention renormalised over them).

The indexer's inputs are detached in ``align`` and its selection runs without a gradient, so the LM
loss never reaches the indexer and the KL never reaches the rest of the model.

Context parallelism: each rank scores its queries against the whole rows' index keys (gathered, 128 numbers
a token at the released size, beside MLA's gathered latents), and the KL's key gradients go back to their
rows' owners.

Scaling: MLA attends to the picks through the kernel op ``sparse_mla`` in the absorbed form (``SparseMLA.absorbed``:
q_nope through ``wkv_b``'s key rows, the picks' 576-wide latent + k_pe gathered by query chunks, the latent sum
lifted by the value rows), linear in S; its reference is the mask form. The selection, the KL and the recall
run by query chunks (``Indexer.chunks``, CHUNK_BYTES): nothing [S, S, heads] is alive at once, and each KL
chunk is checkpointed with its target recomputed inside, so backward holds one chunk too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trex import kernels
from trex.kernels import quantize
from trex.kernels.dense_attention import document_causal_mask
from trex.kernels.sparse_attention import query_chunks, scores_fp32
from trex.kernels.sparse_mla import pick_probs
from trex.models.common.context import SequenceContext
from trex.models.common.indexer import alignment_kl, picked_mass, select_topk
from trex.models.common.linear import QuantLinear
from trex.models.common.norm import LayerNorm
from trex.models.common.rope import apply_rope_half
from trex.models.deepseek_v3.attention import MLA
from trex.models.deepseek_v3.config import V3Config

K_NORM_EPS = 1e-6  # DeepSeek's LayerNorm default and transformers' k_norm
CHUNK_BYTES = 256 << 20  # the indexer's fp32 scores (and the KL's target) of one query chunk


class Indexer(nn.Module):
    """The lightning indexer of one V3.2 layer (module docstring): ``wq_b``, ``wk``, ``k_norm``,
    ``weights_proj``, under MLA's ``attn.indexer``."""

    def __init__(self, cfg: V3Config):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = QuantLinear(cfg.q_lora_rank, self.n_heads * self.head_dim, block=cfg.fp8_block)
        self.wk = QuantLinear(cfg.hidden_size, self.head_dim, block=cfg.fp8_block)
        self.k_norm = LayerNorm(self.head_dim, K_NORM_EPS)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.alignment: torch.Tensor | None = None  # [B, 2] (KL sum, queries) of the last training forward
        self.recall: torch.Tensor | None = None  # [B, 2] (main attention's mass on the picks, queries)

    def queries(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, d], qr [B, S, q_lora_rank], cos, sin [B, S, rope/2] -> queries [B, S, H_I, c_I] and head
        weights [B, S, H_I] (the scales H_I^-0.5 c_I^-0.5 folded in), fp32."""
        B, S, _ = x.shape
        q = apply_rope_half(self.wq_b(qr).view(B, S, self.n_heads, self.head_dim), cos[:, :, None], sin[:, :, None])
        w = F.linear(x.float(), self.weights_proj.weight.float()) * (self.n_heads * self.head_dim) ** -0.5
        return q.float(), w

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, S, d] -> the index keys [B, S, c_I], fp32."""
        return apply_rope_half(self.k_norm(self.wk(x)), cos, sin).float()

    def project(self, x: torch.Tensor, qr: torch.Tensor, ctx: SequenceContext
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``queries`` of this rank's rows x, qr [B, s, *] and ``keys`` of the whole rows [B, S, c_I] (gathered
        over a context-parallel group: 128 numbers a token at the released size), at the context's
        positions."""
        cos, sin = ctx.rope["main"]
        return *self.queries(x, qr, cos, sin), ctx.gather(self.keys(x, cos, sin))

    def chunks(self, B: int, s: int, N: int, heads: int = 0) -> list[tuple[int, int]]:
        """Query ranges of this rank's s queries against N entries whose fp32 index scores [B, T, H_I, N] (and,
        ``heads`` > 0, the main attention's [B, T, heads, N]: the KL's target) fit CHUNK_BYTES (a few copies)."""
        return query_chunks(s, 3 * 4 * B * (self.n_heads + heads) * N, CHUNK_BYTES)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, qr: torch.Tensor, ctx: SequenceContext
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The picks of this rank's queries: (idx [B, s, k] long, valid [B, s, k] bool), k = min(index_topk,
        S), among the keys each may see (causal, same document); and the keys [B, S, c_I] (a decode cache keeps
        them). Scored by query chunks (``chunks``)."""
        q, w, keys = self.project(x, qr, ctx)
        B, s = x.shape[:2]
        S = keys.shape[1]
        picks = [select_topk(q[:, t0:t1], w[:, t0:t1], keys, visible_rows(ctx, t0, t1), min(self.topk, S))
                 for t0, t1 in self.chunks(B, s, S)]
        return torch.cat([i for i, _ in picks], dim=1), torch.cat([v for _, v in picks], dim=1), keys

    def align(self, x: torch.Tensor, qr: torch.Tensor, ctx: SequenceContext, idx: torch.Tensor | None,
              valid: torch.Tensor | None, target: Callable[[int, int], torch.Tensor], heads: int) -> torch.Tensor:
        """KL(target || softmax of the index scores) per query: over its picks idx, valid [B, s, k] (the sparse
        stage), or with idx None over every key it may see (the dense warm-up). ``target(t0, t1)``: the main
        attention's distribution (``heads`` heads, averaged) of queries t0..t1 over the same entries [B, T, k
        | S], no gradient. The inputs x, qr are detached: only the indexer learns. By query chunks
        (``chunks``), each checkpointed with its target computed inside: the index scores and the target live
        one chunk at a time, forward and backward. Returns [B, 2]: per row the KL summed over queries with at
        least two valid entries, and their number (as DeepSeek-V4's ``Indexer.align``)."""
        q, w, keys = self.project(x.detach(), qr.detach(), ctx)
        B, s = x.shape[:2]

        def entries(t0: int, t1: int) -> torch.Tensor:
            return visible_rows(ctx, t0, t1) if idx is None else valid[:, t0:t1]

        def chunk_kl(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
            return alignment_kl(q, w, keys, None if idx is None else idx[:, t0:t1], entries(t0, t1), target(t0, t1))

        ranges = self.chunks(B, s, keys.shape[1] if idx is None else idx.shape[-1], heads)
        kl = torch.cat([checkpoint(chunk_kl, q[:, t0:t1], w[:, t0:t1], keys, t0, t1, use_reentrant=False)
                        for t0, t1 in ranges], dim=1)
        counted = torch.cat([entries(t0, t1).sum(dim=-1) > 1 for t0, t1 in ranges], dim=1)
        return torch.stack((kl.sum(dim=1), counted.sum(dim=1).float()), dim=1)


def visible_rows(ctx: SequenceContext, t0: int, t1: int) -> torch.Tensor:
    """[B, t1 - t0, S] bool: the keys this rank's queries t0..t1 - 1 may see (causal, same document)."""
    return document_causal_mask(ctx.full_doc, ctx.t0 + t0, t1 - t0)[:, 0]


@torch.no_grad()
def dense_probs(q: torch.Tensor, kv: torch.Tensor, scale: float, visible: torch.Tensor) -> torch.Tensor:
    """The main attention's distribution over every key, averaged over heads, in the absorbed form: q [B, T, H,
    c], kv [B, S, c], visible [B, T, S] -> fp32 [B, T, S]."""
    B, T, H, c = q.shape
    scores = scores_fp32(q.reshape(B, T * H, c), kv.transpose(1, 2)).view(B, T, H, -1).mul_(scale)
    return scores.masked_fill_(~visible[:, :, None], float("-inf")).softmax(dim=-1).mean(dim=2)


class SparseMLA(MLA):
    """MLA whose queries attend only to their indexer's picks (dense in the warm-up stage)."""

    profile_scope = "attention/dsa"  # trex.profile.scopes

    def __init__(self, cfg: V3Config):
        super().__init__(cfg)
        self.indexer = Indexer(cfg)

    def absorbed(self, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """MLA in its absorbed (MQA) form: q [B, s, H, nope + rope], the whole rows' latent, k_pe -> (q_nope
        through ``wkv_b``'s key rows then q_pe [B, s, H, kv_lora_rank + rope], the keys [latent | k_pe] [B, S,
        kv_lora_rank + rope], ``wkv_b``'s value rows [H, v_head_dim, kv_lora_rank]). The latent takes
        ``wkv_b``'s FP8 input rounding when the forward simulates it, so the scores and values are the
        expanded form's."""
        w = self.wkv_b.quantized_weight().view(self.n_heads, self.nope + self.v_dim, self.kv_lora)
        if self.wkv_b.quant.activations:
            latent = quantize.fake_fp8_act(latent, self.wkv_b.block)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q_abs = torch.cat((torch.einsum("bshd,hdc->bshc", q_nope, w[:, :self.nope]), q_pe), dim=-1)
        return q_abs, torch.cat((latent, k_pe), dim=-1), w[:, self.nope:]

    def core(self, x: torch.Tensor, qr: torch.Tensor | None, q: torch.Tensor, latent: torch.Tensor,
             k_pe: torch.Tensor, ctx: SequenceContext) -> torch.Tensor:
        """MLA over the picks (``ctx.dense_warmup``: MLA.core over every visible key), the op ``sparse_mla`` in
        the absorbed form; records the indexer's KL (``ctx.align_indexer``, training forwards) and recall
        (``ctx.measure_recall``), by query chunks. This rank's s queries against the whole rows' S keys."""
        B, s = x.shape[:2]
        warmup = getattr(ctx, "dense_warmup", False)
        align = getattr(ctx, "align_indexer", False) and ctx.recording
        if warmup and not align:
            return super().core(x, qr, q, latent, k_pe, ctx)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not warmup):  # warm-up: only the KL's target
            q_abs, kv, w_v = self.absorbed(q, latent, k_pe)
        if warmup:
            idx = valid = None
            o = super().core(x, qr, q, latent, k_pe, ctx)
        else:
            idx, valid, keys = self.indexer(x, qr, ctx)
            if ctx.cache is not None:  # a prefill: the decode steps pick among these keys too
                ctx.cache.prefill_index(self, keys)
            o_latent = kernels.get("sparse_mla", q.device.type)(q_abs, kv, self.softmax_scale, idx, valid, self.kv_lora)
            o = torch.einsum("bshc,hdc->bshd", o_latent, w_v)
        q_main, kv_main, scale = q_abs.detach(), kv.detach(), self.softmax_scale
        if getattr(ctx, "measure_recall", False) and not warmup:
            self.indexer.recall = sum(
                picked_mass(self.heads_mean(dense_probs(q_main[:, t0:t1], kv_main, scale, visible_rows(ctx, t0, t1))),
                            idx[:, t0:t1], valid[:, t0:t1], visible_rows(ctx, t0, t1))
                for t0, t1 in self.indexer.chunks(B, s, kv.shape[1], self.n_heads))
        if align:
            def target(t0: int, t1: int) -> torch.Tensor:  # the mean over all heads (tensor parallelism's too)
                if idx is None:
                    return self.heads_mean(dense_probs(q_main[:, t0:t1], kv_main, scale, visible_rows(ctx, t0, t1)))
                return self.heads_mean(pick_probs(q_main[:, t0:t1], kv_main, scale, idx[:, t0:t1], valid[:, t0:t1]))

            self.indexer.alignment = self.indexer.align(x, qr, ctx, idx, valid, target, self.n_heads)
            if warmup:  # only the indexer trains: 0 x its KL gives the block's output a gradient, as FSDP2
                # gathers a unit's parameters for backward when its outputs get one (the KL's own path reaches
                # the indexer's parameters only after that)
                o = o + 0.0 * self.indexer.alignment[:, 0].sum()
        return o

    @torch.no_grad()
    def decode_picks(self, x: torch.Tensor, qr: torch.Tensor, ctx: SequenceContext, keys: torch.Tensor, slot: int,
                     visible: torch.Tensor) -> torch.Tensor:
        """A decode step's picks (trex.models.deepseek_v3.decode): x, qr [B, 1, *] the new token, written into
        ``keys`` [B, N, c_I] at ``slot``; returns [B, N] bool, its top min(index_topk, N) of the ``visible``
        [B, N] slots."""
        cos, sin = ctx.rope["main"]
        q, w = self.indexer.queries(x, qr, cos, sin)
        keys[:, slot] = self.indexer.keys(x, cos, sin)[:, 0]
        idx, valid = select_topk(q, w, keys, visible[:, None], min(self.indexer.topk, keys.shape[1]))
        return torch.zeros_like(visible).scatter_(-1, idx[:, 0], valid[:, 0])
