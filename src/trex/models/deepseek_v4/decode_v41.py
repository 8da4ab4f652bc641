"""Generation with DeepSeek-V4.1: its decode cache and one decode step of each attention layer.

As ``trex.models.deepseek_v4.decode`` for V4: ``model(ids, doc_ids=docs, cache=V41DecodeCache(n))`` runs the
training forward over the prompts (the prefill), each ``Attention.forward`` handing its state to
``cache.prefill``; each later call feeds one token per row, [B, 1], and ``Attention.forward`` hands it
to ``cache.step``. V4.1's layers read what earlier layers computed, and so does its cache:

- every layer keeps the RoPE'd K = V of its last W tokens (its window);
- a KV-source layer keeps its compressor's projections of the last m tokens and every entry it has
  pooled, with the entry's index key, in row order (the prefill's slots, then new ones), so the
  candidate pool's blocks and the picks are those of the training forward over the whole row; the
  layers after it read the latest source's entries (``latest``);
- an index-source layer scores the new query against the latest source's keys and hands its picks
  (and, as the candidate source, its pool) to the layers after it through ``Shared``, as in training;
- Engram hashes the new token with the row's last max_ngram - 1 tokens (``tail``).

Everything cached belongs to the LAST document of each row (left padding is an earlier document).
``tests/test_model_v41.py`` checks the tokens and logits against re-running the whole row per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trex.kernels import quantize
from trex.models.common.linear import linear_fp32
from trex.models.common.rope import apply_rope
from trex.models.deepseek_v4.attention import grouped_output
from trex.models.deepseek_v4.attention_v41 import Attention, Shared
from trex.models.deepseek_v4.context import SeqContext
from trex.models.deepseek_v4.decode import DecodeCache, decode_attention


@dataclass
class SourceCache:
    """A KV source's state for B rows. kv, score: [B, m, c] fp32 projections of the last m tokens (None
    at ratio 1, where a token is its own entry); entries [B, cap, c] RoPE'd as attention reads them and
    keys [B, cap, c_I] the indexer's; the last document's entries are slots lo .. hi - 1 ([B] each)."""

    kv: torch.Tensor | None
    score: torch.Tensor | None
    entries: torch.Tensor
    keys: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor


@dataclass
class LayerCache:
    """window: [B, W, c] RoPE'd K = V of the last W tokens, newest last; source: a KV source's state."""

    window: torch.Tensor
    source: SourceCache | None = None


class V41DecodeCache(DecodeCache):
    """Incremental generation state of a V4.1 model for at most ``max_new_tokens`` decode steps (``pos``,
    ``steps`` and ``layers`` as DecodeCache's); ``latest``: the KV source the layers after it read;
    ``tail``: [B, max_ngram - 1] each row's last token ids, for Engram."""

    def __init__(self, max_new_tokens: int):
        super().__init__(max_new_tokens)
        self.latest: SourceCache | None = None
        self.tail: torch.Tensor | None = None

    def prefill(self, attn: Attention, x: torch.Tensor, kv: torch.Tensor, ctx: SeqContext, shared: Shared) -> None:
        """Keep ``attn``'s state after the prefill over x [B, S, d] (kv [B, S, c] its window K = V; for a KV
        source, ``shared`` holds the entries and keys it just computed)."""
        W, S = attn.cfg.sliding_window, x.shape[1]
        state = LayerCache(F.pad(kv[:, -W:], (0, 0, max(0, W - S), 0)))
        if attn.compressor is not None:
            state.source = _start_source(attn, x, shared, ctx, self.max_new_tokens)
        self.layers[attn] = state

    def step(self, attn: Attention, x: torch.Tensor, ctx: SeqContext, shared: Shared) -> tuple[torch.Tensor, Shared]:
        """``attn``'s output for one token per row, x [B, 1, d], and what the next layers read."""
        return attention_step(attn, x, ctx, shared)


def _start_source(attn: Attention, x: torch.Tensor, shared: Shared, ctx: SeqContext, max_new_tokens: int
                  ) -> SourceCache:
    """A KV source's state after a prefill over x [B, S, d]: the projections of the last m tokens, its
    entries and keys with room for the groups ``max_new_tokens`` more tokens can close."""
    comp, m = attn.compressor, attn.m
    kv = score = None
    if m > 1:
        recent = x[:, -m:]
        kv, score = (F.pad(linear_fp32(recent, w.weight), (0, 0, m - recent.shape[1], 0))
                     for w in (comp.wkv, comp.wgate))
    layout = ctx.layout(m)
    room = max_new_tokens // m + 1
    entries, keys = (F.pad(t, (0, 0, 0, room)) for t in (shared.compressed, shared.keys))
    return SourceCache(kv, score, entries, keys, layout.lo[:, -1].clone(), layout.hi[:, -1].clone())


def attention_step(attn: Attention, x: torch.Tensor, ctx: SeqContext, shared: Shared) -> tuple[torch.Tensor, Shared]:
    """One token per row, x [B, 1, d] at positions ctx.pos, against and into ctx.cache -> ([B, 1, d], shared)."""
    cache, state = ctx.cache, ctx.cache.layers[attn]
    B = x.shape[0]
    cos, sin = ctx.rope[attn.rope_kind]
    qr = attn.q_norm(attn.wq_a(x))
    q = apply_rope(attn.wq_b(qr).view(B, 1, attn.n_heads, attn.head_dim), cos[:, :, None], sin[:, :, None])
    kv = apply_rope(attn.kv_norm(attn.wkv(x)), cos, sin)
    if attn.wkv.quant.kv:
        kv = quantize.fake_fp8_act(kv, 32)
    state.window = torch.cat([state.window[:, 1:], kv], dim=1)
    W = state.window.shape[1]
    window_valid = torch.arange(W, device=x.device) >= W - 1 - ctx.pos  # the row's last pos + 1 tokens
    if not attn.m:
        o = decode_attention(q, state.window, window_valid, attn.attn_sink, attn.head_dim**-0.5)
        return grouped_output(attn, o, cos, sin), shared
    if attn.compressor is not None:
        _push(attn, state.source, x, ctx)
        cache.latest = state.source
    source = cache.latest
    if attn.indexer is not None:
        q_index, w_index = attn.indexer.query(x, qr, *ctx.rope["compress"])
        slots = torch.arange(source.keys.shape[1], device=x.device)
        visible = ((slots >= source.lo[:, None]) & (slots < source.hi[:, None]))[:, None]  # [B, 1, cap]
        idx, valid, pool = attn.indexer.pick(q_index, w_index, source.keys.to(q_index.dtype), visible, shared.blocks,
                                             min(attn.indexer.topk, slots.numel()))
        shared = shared._replace(idx=idx, valid=valid, blocks=shared.blocks if pool is None else pool)
    o = decode_attention(q, state.window, window_valid, attn.attn_sink, attn.head_dim**-0.5, source.entries,
                         shared.valid, shared.idx)
    return grouped_output(attn, o, cos, sin), shared


def _push(attn: Attention, source: SourceCache, x: torch.Tensor, ctx: SeqContext) -> None:
    """Push one token (x [B, 1, d] at positions ctx.pos) into a KV source; rows whose group closes with it
    append the group's entry and index key, computed exactly as in training."""
    comp, m = attn.compressor, attn.m
    pos = ctx.pos[:, 0]
    if m > 1:
        source.kv = torch.cat([source.kv[:, 1:], linear_fp32(x, comp.wkv.weight)], dim=1)
        source.score = torch.cat([source.score[:, 1:], linear_fp32(x, comp.wgate.weight)], dim=1)
        latent = comp.pool(source.kv, source.score, x.dtype)[:, None]  # [B, 1, c]
    else:
        latent = comp.norm(comp.wkv(x))  # ratio 1: the token's own projection, in x's dtype
    closing = (pos + 1) % m == 0
    cos, sin = ctx.rope_at((pos + 1 - m)[:, None], "compress")  # an entry sits at its group's first token
    entry = apply_rope(latent, cos, sin)
    if attn.wkv.quant.kv:
        entry = quantize.fake_fp4_act_e4m3(entry, 16)
    key = attn.indexer.keys(latent, cos, sin)
    rows = torch.arange(x.shape[0], device=x.device)
    slot = source.hi.clamp(max=source.entries.shape[1] - 1)
    for store, new in ((source.entries, entry), (source.keys, key)):
        store[rows, slot] = torch.where(closing[:, None], new[:, 0].to(store.dtype), store[rows, slot])
    source.hi = source.hi + closing.long()
