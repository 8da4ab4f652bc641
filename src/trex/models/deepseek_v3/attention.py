"""Multi-head latent attention (MLA) of DeepSeek-V3, in its MHA form for training and prefill.

Queries: ``wq_a`` -> ``q_norm`` -> ``wq_b`` (the query latent), or one ``wq`` when ``q_lora_rank`` is 0
(Moonlight); per head [nope | pe]. Keys and values: ``wkv_a`` -> [latent (kv_lora_rank) | k_pe
(qk_rope_head_dim)], ``kv_norm`` on the latent, ``wkv_b`` -> per head [k_nope | v]; k_pe is one head every
query head shares. RoPE rotates interleaved pairs of the pe dims (``common.rope.apply_rope``: the last
qk_rope_head_dim dims of a query head, the whole k_pe), as DeepSeek's checkpoints store them. The core is
the kernel op ``dense_attention`` (trex.kernels.dense_attention): softmax scale qk_head_dim^-0.5 x YaRN's
m(mscale_all_dim)^2 (``YarnMScale``), the causal mask within each packed document; its reference keeps
fp32 scores and softmax and casts the probabilities to the values' dtype (as DeepSeek's
``softmax(dtype=float32).type_as(x)``), its default path is PyTorch's fused scaled-dot-product attention
(no [B, H, S, S] scores). Then ``wo``.

The latent norms take eps 1e-6 whatever the config's ``rms_norm_eps`` (DeepSeek's code and transformers
build them with the default; Moonlight's 1e-5 is the blocks' norms').

Decoding (trex.models.deepseek_v3.decode) caches each token's normed latent and rotated k_pe and attends
in the absorbed MQA form; this module hands it the projections (``query``, ``latent_kv``).

Context parallelism (``SequenceContext.shard``): the queries are this rank's rows; the keys and values the
whole rows', made from the gathered latent (``gather_latent``) by the kernel op ``latent_attention``
(trex.kernels.latent_attention), which expands them a chunk of keys at a time inside an online softmax and
again in backward, so that a rank holds the S x 576 latent, not S x H x (qk_head_dim + v_head_dim) keys and
values. V3.2's ``SparseMLA`` overrides ``core``: it attends to its picks in the absorbed form.
"""

from __future__ import annotations

import torch
from torch import nn

from trex import kernels
from trex.models.common.context import HeadSplit, SequenceContext
from trex.models.common.linear import QuantLinear
from trex.models.common.norm import RMSNorm
from trex.models.common.rope import apply_rope
from trex.models.deepseek_v3.config import V3Config

LATENT_NORM_EPS = 1e-6


class MLA(nn.Module):
    profile_scope = "attention/mla"  # trex.profile.scopes
    head_split: HeadSplit | None = None
    """Tensor parallelism: this rank's heads are a slice of ``num_attention_heads`` (``n_heads`` of them)."""

    def __init__(self, cfg: V3Config):
        super().__init__()
        d, H, block = cfg.hidden_size, cfg.num_attention_heads, cfg.fp8_block
        self.n_heads, self.nope, self.rope, self.v_dim = H, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        qk = cfg.qk_head_dim
        self.q_latent = cfg.q_lora_rank > 0
        if self.q_latent:
            self.wq_a = QuantLinear(d, cfg.q_lora_rank, block=block)
            self.q_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = QuantLinear(cfg.q_lora_rank, H * qk, block=block)
        else:
            self.wq = QuantLinear(d, H * qk, block=block)
        self.wkv_a = QuantLinear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, block=block)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = QuantLinear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), block=block)
        self.wo = QuantLinear(H * cfg.v_head_dim, d, block=block)
        yarn = cfg.rope_scaling
        self.softmax_scale = qk ** -0.5 * (yarn.softmax_scale if yarn is not None else 1.0)
        self.rope_scale = yarn.rope_scale if yarn is not None else 1.0

    def heads_mean(self, x: torch.Tensor) -> torch.Tensor:
        """A mean over this module's heads -> over all heads (the same under tensor parallelism: ``head_split``)."""
        return x if self.head_split is None else self.head_split.mean(x)

    def rope_table(self, ctx: SequenceContext) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, S, rope/2] fp32 of the context's positions, times transformers' cos/sin factor when
        the two mscale fields differ."""
        cos, sin = ctx.rope["main"]
        if self.rope_scale != 1.0:
            cos, sin = cos * self.rope_scale, sin * self.rope_scale
        return cos, sin

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qr: torch.Tensor | None = None
              ) -> torch.Tensor:
        """x [B, S, d] -> q [B, S, H, nope + rope], the pe dims rotated; ``qr``: x's query latent when the
        caller has it already (``q_norm(wq_a(x))``)."""
        B, S, _ = x.shape
        if self.q_latent and qr is None:
            qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr) if self.q_latent else self.wq(x)
        return apply_rope(q.view(B, S, self.n_heads, self.nope + self.rope), cos[:, :, None], sin[:, :, None])

    def latent_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, d] -> (the normed latent [B, S, kv_lora_rank], the rotated k_pe [B, S, rope]): what a
        decode cache keeps per token (trex.models.deepseek_v3.decode)."""
        latent, k_pe = self.wkv_a(x).split([self.kv_lora, self.rope], dim=-1)
        return self.kv_norm(latent), apply_rope(k_pe, cos, sin)

    def forward(self, x: torch.Tensor, ctx: SequenceContext) -> torch.Tensor:
        """x [B, S, d] (normed) -> [B, S, d]. With a decode cache: a prefill hands the layer's latents to
        ``cache.prefill``; a decode step (x [B, 1, d]) is ``cache.step``'s."""
        if ctx.decoding:
            return ctx.cache.step(self, x, ctx)
        cos, sin = self.rope_table(ctx)
        qr = self.q_norm(self.wq_a(x)) if self.q_latent else None  # the query latent (V3.2's indexer reads it)
        q = self.query(x, cos, sin, qr)
        latent, k_pe = self.latent_kv(x, cos, sin)
        if ctx.cache is not None:
            ctx.cache.prefill(self, latent, k_pe, ctx)
        latent, k_pe = gather_latent(ctx, latent, k_pe)  # the whole rows' under context parallelism
        return self.wo(self.core(x, qr, q, latent, k_pe, ctx).flatten(2))

    def core(self, x: torch.Tensor, qr: torch.Tensor | None, q: torch.Tensor, latent: torch.Tensor,
             k_pe: torch.Tensor, ctx: SequenceContext) -> torch.Tensor:
        """The attention core: this rank's queries q [B, s, H, qk_head_dim] against the whole rows' normed
        latent [B, S, kv_lora_rank] and rotated k_pe [B, S, rope], expanded by ``wkv_b`` into keys and values
        -> [B, s, H, v_head_dim], causal within each document; under context parallelism a chunk of keys and
        values at a time (``latent_attention``). V3.2's ``SparseMLA`` (deepseek_v3.dsa) reads x and the query
        latent qr [B, s, q_lora_rank] too, and attends to its indexer's picks only."""
        if ctx.shard is not None:
            return kernels.get("latent_attention", q.device.type)(q, latent, k_pe, self.wkv_b.quantized_weight(),
                                                                  self.softmax_scale, ctx.full_doc, q_start=ctx.t0)
        B, T = latent.shape[:2]
        H = self.n_heads
        kv = self.wkv_b(latent).view(B, T, H, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_pe[:, :, None].expand(B, T, H, self.rope)), dim=-1)
        return kernels.get("dense_attention", q.device.type)(q, k, v, self.softmax_scale, ctx.full_doc, q_start=ctx.t0)


def gather_latent(ctx: SequenceContext, latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Context parallelism's hook in MLA: this rank's rows of the normed KV latent [B, s, kv_lora_rank] and the
    rotated k_pe [B, s, rope] -> the whole rows' [B, S, ...] (the identity without a shard).

    What crosses ranks is what MLA caches: kv_lora_rank + qk_rope_head_dim values per token (512 + 64 = 576 at
    the released size), one all-gather of their concatenation per layer, forward; its backward reduce-scatters
    the gradients back to the rows' owners. The expanded keys and values would be H x (qk_head_dim + v_head_dim)
    = 128 x (192 + 128) = 40,960 per token, 71x more. The price: each rank runs ``wkv_b`` over every row of the
    sequence, not only its own (2 x kv_lora_rank x H x (nope + v) = 33.6 MFLOP per token and layer forward at the
    released size for each other rank's rows, 2.9% of the layer's matmuls outside the attention core; its
    weight's gradient is summed over the group as every parameter's is). Each rank's queries then attend to all
    S keys under the document-causal mask offset by its first row (``q_start``): every rank scores s x S, the
    group together S x S, as one process does. RoPE is applied before the gather at each row's own position.
    Memory: ``latent_attention`` expands the keys and values a chunk at a time and recomputes them in backward,
    so a rank holds the gathered S x 576 and its own rows' queries and outputs, not all S rows' keys and values
    (16.5 GB a layer at S = 128K, cp = 8 in bf16 before, 1.5 GB after: trex.kernels.latent_attention)."""
    both = ctx.gather(torch.cat((latent, k_pe), dim=-1))
    return both.split([latent.shape[-1], k_pe.shape[-1]], dim=-1)
