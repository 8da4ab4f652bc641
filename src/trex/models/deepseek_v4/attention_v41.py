"""DeepSeek-V4.1's attention (CSA2): the sliding window, plus (ratio r > 0) the picked compressed entries of the
latest KV-source layer. Its compressor (non-overlapping softmax pooling of r tokens, or a plain projection at
r = 1) and its indexer (the index keys of KV sources, the scores, the hierarchical candidate pool, the top-k
picks), and ``Shared``: what a layer hands to the layers after it. The projections, the sparse attention
core and the grouped output are V4's (``attention``); the per-forward context too (``context``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from trex.kernels import quantize
from trex.kernels.sparse_attention import gather_rows
from trex.models.common.linear import QuantLinear, QuantSim, linear_fp32
from trex.models.common.norm import RMSNorm
from trex.models.common.rope import apply_rope
from trex.models.deepseek_v4.attention import (_pad_rows, add_projections, grouped_output, projection_rules,
                                               sparse_attention)
from trex.models.deepseek_v4.config import shard_halo
from trex.models.deepseek_v4.config_v41 import CSA2, V41Config
from trex.models.deepseek_v4.context import SeqContext, WindowLayout


class Shared(NamedTuple):
    """What a layer hands to the layers after it (the official code's ``shared_attn``), passed as an
    argument so that a block recomputed in backward (activation checkpointing) reads what it read:

    compressed: [B, N, c] the latest KV source's entries (RoPE'd; its ratio's layers attend over them);
    keys: [B, N, c_I] the latest KV source's index keys; idx, valid: [B, S, k] the latest index
    source's picks; blocks: [B, S, n_b] bool, the candidate source's blocks (None without a pool)."""

    compressed: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    idx: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    blocks: torch.Tensor | None = None


# ==================================================================================================
# Compressor: non-overlapping softmax pooling of r tokens (r > 1, fp32), or a plain projection (r = 1)
# ==================================================================================================
class Compressor(nn.Module):
    """Each group of r tokens of a document -> one latent [c], before RoPE: ``norm(sum_j softmax_j(wgate x_j)
    * wkv x_j)`` with the projections and the pooling in fp32 (r > 1), or ``norm(wkv x)`` in x's dtype
    (r = 1). No overlap between groups and no ``ape``."""

    def __init__(self, dim: int, c: int, m: int, eps: float):
        super().__init__()
        self.m = m
        self.wkv = nn.Linear(dim, c, bias=False)
        self.wgate = nn.Linear(dim, c, bias=False) if m > 1 else None
        self.norm = RMSNorm(c, eps)

    def forward(self, x: torch.Tensor, layout: WindowLayout, first_row: int = 0, entries: slice | None = None
                ) -> torch.Tensor:
        """x: [B, R, d], rows first_row .. first_row + R - 1 of the sequence -> the ``entries`` of ``layout``
        (all by default) as latents [B, N, c] in x's dtype (padded entries pool row 0; layout.valid masks
        them). At ratio 1 the entries are x's own rows: x holds exactly them."""
        if self.wgate is None:
            return self.norm(self.wkv(x))
        entries = entries or slice(0, layout.n)
        first = torch.where(layout.valid[:, entries], layout.starts[:, entries] - first_row, 0)
        tok = first[:, :, None] + torch.arange(self.m, device=x.device)  # [B, N, m]
        kv = gather_rows(linear_fp32(x, self.wkv.weight), tok)
        score = gather_rows(linear_fp32(x, self.wgate.weight), tok)
        return self.pool(kv, score, x.dtype)

    def pool(self, kv: torch.Tensor, score: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """kv, score [..., m, c]: the fp32 projections of groups' tokens -> the groups' latents [..., c] in
        ``dtype`` (a decode step pools the group its token closes with this too)."""
        return self.norm((kv * score.softmax(dim=-2)).sum(dim=-2).to(dtype))


# ==================================================================================================
# Indexer: the index keys (KV sources only), the scores, the candidate pool, the top-k picks
# ==================================================================================================
class Indexer(nn.Module):
    """I[t, s] = sum_h relu(q[t, h] . K[s]) * w[t, h] / sqrt(c_I * H_I) over the compressed entries
    s a query may see; keeps the top-k. Keys come from the KV source's latent (``wk``, ``k_norm``, RoPE
    at the entry's position). Top-k is not differentiable: the LM loss gives the indexer no gradient,
    so it runs without autograd, in query chunks that bound the [B, T, H_I, N] scores."""

    chunk_elems = 1 << 21
    quant = QuantSim()

    def __init__(self, cfg: V41Config, owns_keys: bool, candidate_source: bool, uses_candidates: bool):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.candidate_source, self.uses_candidates = candidate_source, uses_candidates
        self.pool_blocks, self.block = cfg.candidate_topk_blocks, cfg.candidate_block_size
        self.wq_b = QuantLinear(cfg.q_lora_rank, self.n_heads * self.head_dim, block=cfg.fp8_block)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        if owns_keys:
            self.wk = nn.Linear(cfg.head_dim, self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    @torch.no_grad()
    def keys(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """latent [B, N, c] -> index keys [B, N, c_I], RoPE'd by cos, sin [B, N, rd/2] (the entries' positions)."""
        k = apply_rope(self.k_norm(self.wk(latent)), cos, sin)
        return quantize.fake_fp4_act(k) if self.quant.indexer else k

    @torch.no_grad()
    def query(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, d], qr [B, S, q_lora_rank], cos, sin [B, S, rd/2] -> (q [B, S, H_I, c_I], w [B, S, H_I]) in
        the precision the scores are computed in (as served with ``quant.indexer``: FP4 q, bf16; else fp32)."""
        B, S, _ = x.shape
        q = apply_rope(self.wq_b(qr).view(B, S, self.n_heads, self.head_dim), cos[:, :, None], sin[:, :, None])
        w = self.weights_proj(x) * (self.head_dim**-0.5 * self.n_heads**-0.5)
        if self.quant.indexer:
            return quantize.fake_fp4_act(q).bfloat16(), w.bfloat16()
        return q.float(), w.float()

    @torch.no_grad()
    def pick(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
             blocks: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Queries q [B, T, H_I, c_I], w [B, T, H_I] against keys [B, N, c_I] (in q's dtype), each seeing
        ``visible`` [B, T, N] -> (the top-k entries [B, T, k] long, which are real [B, T, k] bool, this
        layer's pool [B, T, n_b] when it is the candidate source, else None); a layer after the candidate
        source picks inside ``blocks``, the source's pool."""
        scores = (torch.einsum("bthc,bnc->bthn", q, keys).relu_() * w[..., None]).sum(dim=2)
        scores = scores.float().masked_fill_(~visible, float("-inf"))
        pool = None
        if self.candidate_source:
            pool = self._pool(scores, visible)
        elif self.uses_candidates:
            scores.masked_fill_(~self._in_pool(blocks, visible), float("-inf"))
        top = scores.topk(k, dim=-1)
        return top.indices, top.values > float("-inf"), pool

    @torch.no_grad()
    def forward(self, x: torch.Tensor, qr: torch.Tensor, keys: torch.Tensor, ctx: SeqContext, layout: WindowLayout,
                blocks: torch.Tensor | None):
        """x, qr: [B, S, *]; keys [B, N, c_I]; blocks: the candidate source's [B, S, n_b] (used when this
        layer follows it) -> (idx [B, S, k] long, valid [B, S, k] bool, this layer's blocks or None)."""
        B, S, _ = x.shape
        q, w = self.query(x, qr, *ctx.rope["compress"])
        keys = keys.to(q.dtype)
        k = min(self.topk, layout.n)
        chunk = max(1, self.chunk_elems // max(1, B * self.n_heads * layout.n))
        idx, valid, picked_blocks = [], [], []
        canonical = layout.canonical  # context parallel: rank, pool and pick in one process's entry order
        if canonical is not None:
            keys = gather_rows(keys, canonical)
        for t0 in range(0, S, chunk):
            t1 = min(S, t0 + chunk)
            visible = layout.visible(ctx.t0 + t0, ctx.t0 + t1)
            if canonical is not None:
                visible = visible.gather(2, canonical[:, None, :].expand_as(visible))
            picks, real, pool = self.pick(q[:, t0:t1], w[:, t0:t1], keys, visible,
                                          None if blocks is None else blocks[:, t0:t1], k)
            if canonical is not None:
                picks = canonical.gather(1, picks.flatten(1)).view_as(picks)
            idx.append(picks)
            valid.append(real)
            if pool is not None:
                picked_blocks.append(pool)
        pool = torch.cat(picked_blocks, dim=1) if picked_blocks else None
        return torch.cat(idx, dim=1), torch.cat(valid, dim=1), pool

    def _pool(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """The hierarchical candidate pool: scores, visible [B, T, N] -> [B, T, n_b] bool, the
        ``candidate_topk_blocks`` blocks of ``candidate_block_size`` entries with the highest maximum score,
        the block holding the query's newest visible entry always kept (it may be partly filled), blocks
        with nothing visible never. Blocks count from the first entry the query sees (its document's first),
        as the official code's count from the start of its one sequence: what precedes a document in the
        row (packing, a batch's left padding) does not move them; block b of query t holds its entries
        first_t + b * size ...; :meth:`_in_pool` maps them back."""
        n = scores.shape[-1]
        first = _first_visible(visible)  # [B, T]
        slots = first[..., None] + torch.arange(n, device=scores.device)  # the query's entries from its first
        from_first = scores.gather(-1, slots.clamp(max=n - 1)).masked_fill(slots >= n, float("-inf"))
        per_block = F.pad(from_first, (0, -n % self.block), value=float("-inf")).unflatten(-1, (-1, self.block)).amax(-1)
        last = (visible * torch.arange(1, n + 1, device=scores.device)).amax(-1) - 1  # newest visible entry, or -1
        newest = torch.where(last >= 0, (last - first) // self.block, -1)  # [B, T]
        nb = per_block.shape[-1]
        per_block = per_block.masked_fill(torch.arange(nb, device=scores.device) == newest[..., None], float("inf"))
        top = per_block.topk(min(self.pool_blocks, nb), dim=-1)
        return torch.zeros_like(per_block, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))

    def _in_pool(self, blocks: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """The candidate source's pool ``blocks`` [B, T, n_b] (counted from each query's first visible entry)
        as entries [B, T, N] bool, for a later index source of the same ratio (so the same visibility)."""
        n = visible.shape[-1]
        rel = torch.arange(n, device=visible.device) - _first_visible(visible)[..., None]  # entry - first
        by_entry = blocks.repeat_interleave(self.block, dim=-1)[..., :n]
        return by_entry.gather(-1, rel.clamp(min=0)) & (rel >= 0)


def _first_visible(visible: torch.Tensor) -> torch.Tensor:
    """visible [B, T, N] bool -> [B, T] the index of each query's first visible entry (0 when none)."""
    return visible.to(torch.uint8).argmax(dim=-1)


# ==================================================================================================
# Attention: the sliding window, plus (r > 0) the picked entries of the latest KV source
# ==================================================================================================
class Attention(nn.Module):
    """Shared-KV MQA with low-rank queries (no per-head query norm), partial RoPE, sinks and a grouped
    output projection; layers with a ratio also attend over the picked compressed entries."""

    def __init__(self, cfg: V41Config, layer: int):
        super().__init__()
        d, c = cfg.hidden_size, cfg.head_dim
        add_projections(self, cfg)
        self.m = cfg.compress_ratios[layer]
        self.profile_scope = "attention/csa" if self.m else "attention/sliding"  # trex.profile.scopes
        self.rope_kind = "compress" if self.m else "main"
        kv_source = layer in cfg.kv_source_layer_ids
        self.compressor = Compressor(d, c, self.m, cfg.rms_norm_eps) if kv_source else None
        pool = cfg.candidate_source_layer_id
        self.indexer = (Indexer(cfg, kv_source, layer == pool, 0 <= pool < layer)
                        if layer in cfg.index_source_layer_ids else None)

    def optimizer_rules(self) -> dict[str, tuple[str, list[int]]]:
        return projection_rules(self)

    def forward(self, x: torch.Tensor, ctx: SeqContext, shared: Shared) -> tuple[torch.Tensor, Shared]:
        """x: [B, S, d] (already attn_norm'ed; this rank's rows under context parallelism) -> ([B, S, d],
        what the next layers read). Under context parallelism the window reads the W - 1 rows before the
        shard, the compressor the rows a group starting in the shard reaches into the next one, and the
        entries and index keys are gathered from every shard."""
        if ctx.decoding:  # generation: one token per row against the cache (trex.models.deepseek_v4.decode_v41)
            return ctx.cache.step(self, x, ctx, shared)
        B, S, _ = x.shape
        cos, sin = ctx.rope[self.rope_kind]
        w = ctx.window_halo
        after = shard_halo(self.cfg, CSA2)[1] if ctx.shard is not None and self.compressor is not None else 0
        rows = ctx.extend(x, w, after)  # [B, w + S + after, d]
        qr = self.q_norm(self.wq_a(x))
        q = apply_rope(self.wq_b(qr).view(B, S, self.n_heads, self.head_dim), cos[:, :, None], sin[:, :, None])
        kv = self._kv(rows[:, :w + S], ctx.window_rope[self.rope_kind])
        if self.m:
            layout = ctx.layout(self.m)
            own = ctx.own_entries(layout)
            latent = None
            if self.compressor is not None:
                latent = self.compressor(x if self.m == 1 else rows, layout, ctx.t0 - w, own)
            if self.indexer is not None:
                keys = (ctx.gather(self.indexer.keys(latent, *(t[:, own] for t in layout.rope["compress"])))
                        if latent is not None else shared.keys)
                idx, valid, blocks = self.indexer(x, qr, keys, ctx, layout, shared.blocks)
                shared = shared._replace(keys=keys, idx=idx, valid=valid, blocks=shared.blocks if blocks is None else blocks)
            if latent is not None:
                compressed = apply_rope(latent, *(t[:, own] for t in layout.rope["compress"]))
                if self.wkv.quant.kv:  # FP4 with e4m3 scales, blocks of 16
                    compressed = quantize.fake_fp4_act_e4m3(compressed, 16)
                shared = shared._replace(compressed=ctx.gather(compressed))
            o = sparse_attention(_pad_rows(q, w), kv, self.attn_sink, self.head_dim**-0.5, self.cfg.sliding_window,
                                 ctx.window_doc, shared.compressed, _pad_rows(shared.valid, w),
                                 _pad_rows(shared.idx, w))[:, w:]
        else:
            o = sparse_attention(_pad_rows(q, w), kv, self.attn_sink, self.head_dim**-0.5, self.cfg.sliding_window,
                                 ctx.window_doc)[:, w:]
        if ctx.cache is not None:  # a prefill: the cache keeps the layer's decode state
            ctx.cache.prefill(self, x, kv, ctx, shared)
        return grouped_output(self, o, cos, sin), shared

    def _kv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [B, R, d] -> the shared keys/values [B, R, c], RoPE'd by the (cos, sin) tables of its rows (as served
        with ``quant.kv``: the whole RoPE'd vector through FP8, blocks of 32)."""
        kv = apply_rope(self.kv_norm(self.wkv(x)), *rope)
        return quantize.fake_fp8_act(kv, 32) if self.wkv.quant.kv else kv
