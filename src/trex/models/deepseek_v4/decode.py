"""Generation with the trex model: the decode cache and one decode step of each attention layer.

``model(ids, doc_ids=docs, cache=DecodeCache(n))`` runs the training forward over the prompts (the
prefill); ``Attention.forward`` then hands each layer's state to ``cache.prefill``
(:func:`start_attention`). Each later call feeds one token per row, [B, 1], and ``Attention.forward``
hands it to ``cache.step`` (:func:`attention_step`), so the model file never imports this one: the query attends to the cached window and compressed entries in one
softmax with the sink (:func:`decode_attention`), and compressors whose window closes with the
token append the entry, pooled exactly as in training. Everything cached belongs to the LAST
document of each row (left padding is an earlier document).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trex.kernels.sparse_attention import gather_rows, scores_fp32
from trex.models.common.context import DecodeSteps
from trex.models.common.indexer import select_topk
from trex.models.common.linear import linear_fp32
from trex.models.deepseek_v4.attention import Attention
from trex.models.deepseek_v4.compressor import Compressor, Indexer
from trex.models.deepseek_v4.context import SeqContext, WindowLayout


# ---- the cache: per attention layer the raw K=V of the last W tokens, and per compressor the
# projections of the tokens its next entry pools plus the entries of windows already closed.
@dataclass
class CompressorCache:
    """One compressor's state for B rows.

    kv, score: [B, R, width] fp32 wkv / wgate projections of the last R tokens, newest last
    (R = 2m with overlap: the window that closes next and the one before it; else R = m);
    entries: [B, cap, c] pooled entries of closed windows; count: [B] how many are filled.
    """

    kv: torch.Tensor
    score: torch.Tensor
    entries: torch.Tensor
    count: torch.Tensor


@dataclass
class AttentionCache:
    """window: [B, W, c] RoPE'd K=V of the last W tokens, newest last; compressor state (CSA, HCA) and
    the indexer's own compressor state (CSA)."""

    window: torch.Tensor
    compressor: CompressorCache | None = None
    indexer: CompressorCache | None = None


class DecodeCache(DecodeSteps):
    """Incremental generation state of a whole model, for at most ``max_new_tokens`` decode steps.

    Empty until a forward with it (the prefill) fills it; ``pos`` [B] is then the position within
    its document of the next token each row feeds; ``layers``: each ``Attention``'s AttentionCache.
    """

    def prefill(self, attn: Attention, x: torch.Tensor, kv: torch.Tensor, compressed: torch.Tensor | None,
                ctx: SeqContext) -> None:
        """Keep ``attn``'s state after the prefill forward over x [B, S, d] (``Attention.forward`` calls it)."""
        self.layers[attn] = start_attention(attn, x, kv, compressed, ctx)

    def step(self, attn: Attention, x: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        """``attn``'s output for one token per row, x [B, 1, d] (``Attention.forward`` calls it)."""
        return attention_step(attn, x, ctx)


# ---- after the prefill ----------------------------------------------------------------------------
def start_attention(attn: Attention, x: torch.Tensor, kv: torch.Tensor, compressed: torch.Tensor | None,
                    ctx: SeqContext) -> AttentionCache:
    """The layer's decode state after a prefill over x [B, S, d] (its kv [B, S, c], entries)."""
    W, S, n = attn.cfg.sliding_window, x.shape[1], ctx.cache.max_new_tokens
    state = AttentionCache(F.pad(kv[:, -W:], (0, 0, max(0, W - S), 0)))
    if attn.compressor is not None:
        layout = ctx.layout(attn.m)
        state.compressor = start_compressor(attn.compressor, x, compressed, layout, n)
        if attn.indexer is not None:
            with torch.no_grad():
                keys = attn.indexer.compressor(x, layout)
            state.indexer = start_compressor(attn.indexer.compressor, x, keys, layout, n)
    return state


def start_compressor(comp: Compressor, x: torch.Tensor, entries: torch.Tensor, layout: WindowLayout,
                     max_new_tokens: int) -> CompressorCache:
    """State after a prefill: x [B, S, d], its entries [B, N, c]; keeps the entries the last token
    sees and room for the windows ``max_new_tokens`` more tokens can close."""
    B, S, _ = x.shape
    R = 2 * comp.m if comp.overlap else comp.m
    recent = x[:, -R:]
    kv, score = (F.pad(linear_fp32(recent, w.weight), (0, 0, R - recent.shape[1], 0))
                 for w in (comp.wkv, comp.wgate))
    lo, hi = layout.lo[:, -1], layout.hi[:, -1]
    count = hi - lo
    cap = layout.n + max_new_tokens // comp.m + 1  # static: no row sees more than the n entries there are
    slot = torch.arange(cap, device=x.device)
    kept = x.new_zeros(B, cap, comp.c) if layout.n == 0 else gather_rows(
        entries, (lo[:, None] + slot).clamp(max=layout.n - 1))
    kept = kept.masked_fill((slot >= count[:, None])[:, :, None], 0)
    return CompressorCache(kv, score, kept, count)


# ---- one decode step ------------------------------------------------------------------------------
def attention_step(attn: Attention, x: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
    """One token per row, x [B, 1, d] at positions ctx.pos, against and into ctx.cache -> [B, 1, d]."""
    state = ctx.cache.layers[attn]
    qr, q = attn._query(x, ctx)
    kv = attn._kv(x, ctx.rope[attn.rope_kind])
    state.window = torch.cat([state.window[:, 1:], kv], dim=1)
    W = state.window.shape[1]
    window_valid = torch.arange(W, device=x.device) >= W - 1 - ctx.pos  # the row's last pos+1 tokens
    compressed = comp_mask = comp_idx = None
    if attn.compressor is not None:
        compressor_step(attn.compressor, x, state.compressor, ctx)
        compressed = state.compressor.entries
        if attn.indexer is not None:
            comp_idx, comp_mask = indexer_step(attn.indexer, x, qr, ctx, state.indexer)
        else:
            slots = torch.arange(compressed.shape[1], device=x.device)
            comp_mask = (slots < state.compressor.count[:, None])[:, None]
    o = decode_attention(q, state.window, window_valid, attn.attn_sink, attn.head_dim**-0.5,
                         compressed, comp_mask, comp_idx)
    return attn._output(o, ctx)


def compressor_step(comp: Compressor, x: torch.Tensor, cache: CompressorCache, ctx: SeqContext) -> None:
    """Push one token (x [B, 1, d] at positions ctx.pos) into ``cache``; rows whose window closes
    with it append that window's entry, pooled exactly as in training."""
    B, R = x.shape[0], cache.kv.shape[1]
    cache.kv = torch.cat([cache.kv[:, 1:], linear_fp32(x, comp.wkv.weight)], dim=1)
    cache.score = torch.cat([cache.score[:, 1:], linear_fp32(x, comp.wgate.weight)], dim=1)
    pos = ctx.pos[:, 0]
    closing = (pos + 1) % comp.m == 0
    start = (pos + 1 - comp.m).clamp(min=0)[:, None]  # position of the closing window's first token
    ones = torch.ones_like(start, dtype=torch.bool)
    layout = WindowLayout(comp.m, torch.full_like(start, R - comp.m), ones, start, start >= comp.m,
                          start, start + 1)
    layout.rope = {"compress": ctx.rope_at(start, "compress")}
    entry = comp.pool(cache.kv, cache.score, layout, x.dtype)[:, 0]
    rows = torch.arange(B, device=x.device)
    slot = cache.count.clamp(max=cache.entries.shape[1] - 1)
    cache.entries[rows, slot] = torch.where(closing[:, None], entry, cache.entries[rows, slot])
    cache.count = cache.count + closing.long()


@torch.no_grad()
def indexer_step(indexer: Indexer, x: torch.Tensor, qr: torch.Tensor, ctx: SeqContext, cache: CompressorCache):
    """One token per row (x [B, 1, d]): update the indexer's keys, return (idx, valid) [B, 1, k]."""
    compressor_step(indexer.compressor, x, cache, ctx)
    q, w = indexer._query(x, qr, ctx)
    cap = cache.entries.shape[1]
    visible = (torch.arange(cap, device=x.device) < cache.count[:, None])[:, None]
    return select_topk(q, w, cache.entries.float(), visible, min(indexer.topk, cap))


def decode_attention(
    q: torch.Tensor,
    window: torch.Tensor,
    window_valid: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    compressed: torch.Tensor | None = None,
    comp_mask: torch.Tensor | None = None,
    comp_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sparse_attention`` for one query per row against a decode cache.

    q: [B, 1, H, c]; window: [B, W, c] K=V of the last W tokens with window_valid [B, W];
    compressed: [B, N, c] with comp_mask [B, 1, N] (dense, HCA) or comp_idx, comp_mask [B, 1, k]
    (sparse, CSA). One softmax with the per-head sink, as in training. Returns [B, 1, H, c].
    """
    B, _, H, c = q.shape
    keys, mask = window, window_valid
    if compressed is not None:
        picked = compressed if comp_idx is None else gather_rows(compressed, comp_idx[:, 0])
        keys = torch.cat([window, picked], dim=1)
        mask = torch.cat([window_valid, comp_mask[:, 0]], dim=1)
    logits = scores_fp32(q[:, 0], keys.transpose(1, 2)) * scale  # [B, H, K], fp32 as in training
    logits = logits.masked_fill(~mask[:, None], float("-inf"))
    logits = torch.cat([logits, sink.float().view(1, H, 1).expand(B, H, 1)], dim=-1)
    probs = logits.softmax(dim=-1)[..., :-1].to(q.dtype)
    return (probs @ keys)[:, None]
