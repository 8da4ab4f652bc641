"""DeepSeek-V4 (Flash / Pro) for training, in plain PyTorch.

Read top to bottom: the per-sequence context (the compressed-window layouts, context-parallel
halos), the compressor and lightning indexer, the sparse attention core, attention, mHC, the block,
MTP, and the model. What every DeepSeek family shares is in ``trex.models.common`` (RoPE, norms, the
fp32 and FP8 linears, the MoE, the sequence context's base, the output and initialisation) and is
imported here under its old names (``from trex.models.deepseek_v4 import Experts`` still works). The math follows the official ``inference/model.py``
as summarised in the project's reference notes; parameter names follow the official checkpoint
(``attn.wq_a``, ``ffn.experts.w1`` ...), with routed experts stacked per layer as [E, out, in].

Shapes: B batch, S sequence, d hidden, H query heads, c head dim, n = hc_mult streams,
m compression rate, N compressed entries, W sliding window, E experts, k experts per token.

Efficiency by construction: sliding-window attention runs on blocks of W/4 queries against the
W/4 + W keys they need (memory O(S*W)); HCA attends densely to the S/m' compressed entries; CSA's indexer
scores S x S/4 in bounded chunks without autograd and the attention gathers only the top-k
entries; experts run as grouped matmuls over tokens sorted by expert.

Generation: ``model(ids, doc_ids=docs, cache=DecodeCache(n))`` runs the ordinary forward over the
prompts and fills the cache; each later call feeds one token per row and attends to the cache. The
cache and the decode step live in ``trex.models.decode``; the training path does not touch them.

Context parallelism: with ``model.sequence_shard`` set (a :class:`SequenceShard`, installed by
``trex.parallel.context_parallel``) each rank of a group of P is given the whole rows and computes
only its contiguous S/P of every sequence; every layer takes from its neighbours the rows its
window and compressor need (a halo of its input), gathers the compressed entries of all shards,
and the per-token losses and balance statistics come back whole on every rank of the group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from trex import kernels
from trex.kernels import quantize
from trex.kernels.sparse_attention import entry_scores, gather_rows
# the shared parts (trex.models.common); the ones this file does not use are imported for the callers of
# their old path, trex.models.deepseek_v4 (segments, _LinearFP32, the MoE's pieces)
from trex.models.common.context import (DecodeCacheLike, SequenceContext, SequenceShard, segments,
                                        shift_labels)
from trex.models.common.heads import ModelOutput, UntiedHead, init_parameters
from trex.models.common.indexer import alignment_kl, picked_mass, select_topk, take_indexer_measures
from trex.models.common.linear import QuantLinear, QuantSim, _LinearFP32, linear_fp32, spread_quant
from trex.models.common.moe import (ExpertSort, Experts, Gate, MoE, MoEStats, SharedExpert, clamped_swiglu,
                                    combine, expert_counts, expert_ffn, sort_by_expert)
from trex.models.common.norm import RMSNorm, unweighted_rms_norm
from trex.models.common.rope import apply_rope, rope_inv_freq
from trex.models.config import CSA, MOE, SLIDING, ModelConfig
from trex.models.cross_entropy import IGNORE_INDEX, token_nll

_BIG = 1 << 40  # sentinel index for padded compressed entries


# ==================================================================================================
# Sequence context: the compressed-window layouts and the context-parallel halos, built once per
# forward and shared by every layer (positions within documents: common.context.SequenceContext).
# ==================================================================================================
def shard_halo(cfg: ModelConfig, layer_type: str) -> tuple[int, int]:
    """Rows (before, after) a shard of a layer of ``layer_type`` needs from its neighbours' inputs: the
    sliding window's W - 1 keys before it (and CSA's previous window, m rows), and the m - 1 rows a
    compression window that starts in the shard reaches into the next one."""
    m = cfg.compress_rate(layer_type)
    before = max(cfg.sliding_window - 1, m if layer_type == CSA else 0)
    return before, max(m - 1, 0)


def _shard_unit(cfg: ModelConfig) -> tuple[int, int]:
    """(tokens a shard must be a multiple of: every compression rate; the longest halo it lends)."""
    types = set(cfg.layer_types) | {cfg.mtp_layer_type}
    unit = math.lcm(*[r for r in cfg.layer_rates() if r], 1)
    return unit, max(max(shard_halo(cfg, t)) for t in types)


def shardable_length(cfg: ModelConfig, length: int, shards: int) -> int:
    """The shortest sequence length >= ``length`` that splits into ``shards`` shards (check_shardable)."""
    if shards == 1:
        return length
    unit, halo = _shard_unit(cfg)
    q = shards * unit
    return max(q * -(-shards * halo // q), -(-length // q) * q)


def check_shardable(cfg: ModelConfig, seq_len: int, shards: int) -> None:
    """ValueError unless a sequence of ``seq_len`` splits into ``shards`` context-parallel shards: each
    shard a whole number of every compression window (so entries split evenly), and at least as long
    as the halo it lends its neighbours. The message names lengths that would work."""
    if shards == 1:
        return
    unit, halo = _shard_unit(cfg)
    if seq_len % (shards * unit) or seq_len // shards < halo:
        q = shards * unit
        least = shardable_length(cfg, 1, shards)
        near = sorted({max(least, seq_len // q * q), shardable_length(cfg, seq_len, shards)})
        raise ValueError(f"a sequence of {seq_len} tokens does not split into cp = {shards} shards: each shard "
                         f"must be a multiple of {unit} tokens (the compression windows) and at least {halo} "
                         f"(the halo it lends), so seq_len must be a multiple of {q} and >= {least}; "
                         f"{' or '.join(map(str, near))} would work")


@dataclass
class WindowLayout:
    """Compression windows of rate m that lie wholly inside one document.

    Entries are grouped by the context-parallel shard their window starts in (one group without
    context parallelism): ``per_shard`` = S / shards // m entries each, a static bound (windows are
    disjoint runs of m tokens), so shapes never depend on where documents start; a shard with fewer
    windows is padded and ``valid`` masks them. N = shards * per_shard (= S // m with one shard).
    starts: [B, N] index of each window's first token (_BIG where padded); valid: [B, N];
    pos: [B, N] position of the first token within its document (RoPE position of the entry);
    has_prev: [B, N] whether the previous window of the same document exists (CSA overlap);
    lo, hi: [B, S] query t sees valid entries e with lo[t] <= e < hi[t] (same document, window closed).
    canonical: [B, N] with more than one shard, the entries in one shard's order (valid ones by start,
    then the padding): the indexer ranks them in that order, so that ``topk`` sees exactly the scores it
    sees in one process and breaks ties (the indexer ties whenever entries score exactly 0) alike.
    """

    m: int
    starts: torch.Tensor
    valid: torch.Tensor
    pos: torch.Tensor
    has_prev: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    per_shard: int = 0
    canonical: torch.Tensor | None = None
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.starts.shape[1]

    def visible(self, t0: int, t1: int) -> torch.Tensor:
        """[B, t1-t0, N] bool: which entries queries t0..t1-1 may attend to."""
        e = torch.arange(self.n, device=self.starts.device)
        seen = (e >= self.lo[:, t0:t1, None]) & (e < self.hi[:, t0:t1, None])
        # padding lies inside [lo, hi) only between shards' entries; with one group it sorts last
        return seen if self.canonical is None else seen & self.valid[:, None, :]


class SeqContext(SequenceContext):
    """Per-forward facts shared by all layers (common.context.SequenceContext: ids, document ids,
    positions, the rows this rank computes), with V4's own: RoPE tables of two kinds ("main", plain, on
    sliding layers; "compress", YaRN, on compressed ones), the compressed-window layouts of every rate
    the layers use (of the whole rows), and the rows a shard's sliding window sees before it."""

    def __init__(self, cfg: ModelConfig, input_ids: torch.Tensor, doc_ids: torch.Tensor | None,
                 cache: DecodeCacheLike | None = None, shard: SequenceShard | None = None):
        rd = cfg.qk_rope_head_dim
        inv_freq = {"main": rope_inv_freq(rd, cfg.rope_theta, None),
                    "compress": rope_inv_freq(rd, cfg.compress_rope_theta, cfg.rope_scaling)}
        super().__init__(cfg, input_ids, doc_ids, inv_freq, cache, shard)
        shard = self.shard
        shards = 1 if shard is None else shard.size
        if shard is not None:
            check_shardable(cfg, self.seq_len, shards)
        # every layout a layer will ask for, built before the first block: blocks only read the context
        # (a compiled block then sees the same context structure in every call, and never recompiles)
        rates = set(cfg.layer_rates()) - {0}
        self._layouts = {m: self._build_layout(m, shards) for m in sorted(rates)}
        # a shard's sliding window also sees the W - 1 rows before it: their document ids and RoPE tables
        self.window_halo = 0 if shard is None else cfg.sliding_window - 1
        self.window_doc, self.window_rope = self.doc, self.rope
        if shard is not None:
            lo = self.t0 - self.window_halo
            pad = max(0, -lo)
            self.window_doc = F.pad(self.full_doc[:, max(lo, 0):self.t1], (pad, 0), value=-1)
            window_pos = F.pad(self.full_pos[:, max(lo, 0):self.t1], (pad, 0))
            self.window_rope = {kind: self.rope_at(window_pos, kind) for kind in self._inv_freq}
        self.align_indexer = False  # the model's forward sets it: CSA layers keep their indexer alignment
        self.measure_recall = False  # and this: CSA layers measure how much attention their picks cover

    def layout(self, m: int) -> WindowLayout:
        return self._layouts[m]

    # ---- context parallelism (each is the identity without a shard) ----
    def own_entries(self, layout: WindowLayout) -> slice:
        """The entries of ``layout`` whose windows start in this rank's rows."""
        if self.shard is None:
            return slice(0, layout.n)
        return slice(self.shard.rank * layout.per_shard, (self.shard.rank + 1) * layout.per_shard)

    def _build_layout(self, m: int, shards: int) -> WindowLayout:
        B, S = self.full_pos.shape
        pos = self.full_pos
        dev = pos.device
        arange = torch.arange(S, device=dev)
        is_start = torch.zeros(B, S, dtype=torch.bool, device=dev)
        if S >= m:
            # a window starts at a multiple of m within its document and stays inside it
            whole = pos[:, m - 1:] == pos[:, : S - m + 1] + (m - 1)
            is_start[:, : S - m + 1] = (pos[:, : S - m + 1] % m == 0) & whole
        L = S // shards
        n = L // m  # per shard, a static bound: windows are disjoint runs of m tokens (no host read of the count)
        key = torch.where(is_start, arange, arange + S)[:, : shards * L].view(B, shards, L)
        order = key.sort(dim=2).values[:, :, :n]  # [B, shards, n]: each shard's window starts, then padding
        valid = order < S
        # search keys that keep increasing across shards: a shard's padding sorts at the shard's end
        shard_end = (torch.arange(shards, device=dev) + 1).view(1, shards, 1) * L
        start_key = torch.where(valid, order, shard_end).flatten(1).contiguous()
        end_key = torch.where(valid, order + (m - 1), shard_end + (m - 2)).flatten(1).contiguous()
        order, valid = order.flatten(1), valid.flatten(1)
        starts = torch.where(valid, order, torch.full_like(order, _BIG))
        entry_pos = pos.gather(1, torch.where(valid, order, torch.zeros_like(order)))
        doc_start = (arange - pos).contiguous()
        lo = torch.searchsorted(start_key, doc_start, right=False)
        hi = torch.searchsorted(end_key, arange.expand(B, S).contiguous(), right=True)
        layout = WindowLayout(m, starts, valid, entry_pos, valid & (entry_pos >= m), lo, hi, n)
        if shards > 1:
            layout.canonical = (~valid).to(torch.uint8).argsort(dim=1, stable=True)
        layout.rope = {"compress": self.rope_at(entry_pos, "compress")}
        return layout


# ==================================================================================================
# The served model's KV and indexer quantisation, simulated (the linears' and experts': trex.models.common)
# ==================================================================================================
def fake_kv(x: torch.Tensor, rd: int) -> torch.Tensor:
    """The official KV simulation: the first c - rd dims of x [..., c] through FP8 in blocks of 64,
    the RoPE dims as they are."""
    return torch.cat((quantize.fake_fp8_act(x[..., :-rd], 64), x[..., -rd:]), dim=-1)


def fake_indexer(x: torch.Tensor) -> torch.Tensor:
    """The official indexer simulation on queries or keys [..., c_I]: Hadamard, then FP4 in blocks of 32."""
    return quantize.fake_fp4_act(quantize.hadamard(x), quantize.FP4_BLOCK)


# ==================================================================================================
# Compressor (CSA m=4 with overlapping windows, HCA m'=128 without) and the lightning indexer
# ==================================================================================================
class Compressor(nn.Module):
    """Softmax-gated pooling of each window of m tokens into one entry of width c.

    Overlap (CSA): rows [c:2c] of wkv/wgate/ape are the current window's series, rows [0:c]
    the series the window contributes to the next entry; one softmax runs over the 2m slots
    per channel. Projections and pooling run in fp32.
    """

    quant = QuantSim()

    def __init__(self, dim: int, c: int, m: int, overlap: bool, eps: float, rotate: bool = False):
        super().__init__()
        self.c, self.m, self.overlap, self.rotate = c, m, overlap, rotate  # rotate: the indexer's own
        width = 2 * c if overlap else c
        self.wkv = nn.Linear(dim, width, bias=False)
        self.wgate = nn.Linear(dim, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(m, width))
        self.norm = RMSNorm(c, eps)

    def forward(self, x: torch.Tensor, layout: WindowLayout, first_row: int = 0,
                entries: slice | None = None) -> torch.Tensor:
        """x: [B, R, d], rows first_row .. first_row + R - 1 of the sequence -> the ``entries`` of ``layout``
        (all of them by default) [B, N, c], RoPE applied at each window's first position. x must hold
        every row those windows pool (and, with overlap, the m rows before each)."""
        entries = entries or slice(0, layout.n)
        if entries.stop == entries.start:
            return x.new_zeros(x.shape[0], 0, self.c)
        return self.pool(linear_fp32(x, self.wkv.weight), linear_fp32(x, self.wgate.weight), layout, x.dtype,
                         first_row, entries)

    def pool(self, kv: torch.Tensor, score: torch.Tensor, layout: WindowLayout, dtype: torch.dtype,
             first_row: int = 0, entries: slice | None = None) -> torch.Tensor:
        """kv, score: [B, R, width] fp32 projections of rows first_row.. -> entries [B, N, c] in ``dtype``."""
        m, c = self.m, self.c
        entries = entries or slice(0, layout.n)
        valid = layout.valid[:, entries]
        first = torch.where(valid, layout.starts[:, entries] - first_row, 0)  # padded entries pool row 0
        tok = first[:, :, None] + torch.arange(m, device=kv.device)  # [B, N, m]
        kv_cur, score_cur = gather_rows(kv, tok), gather_rows(score, tok) + self.ape.float()
        if self.overlap:
            prev = (tok - m).clamp(min=0)
            kv_prev = gather_rows(kv[..., :c], prev)
            score_prev = gather_rows(score[..., :c], prev) + self.ape[:, :c].float()
            score_prev = score_prev.masked_fill(~layout.has_prev[:, entries, None, None], float("-inf"))
            kv_cur = torch.cat((kv_prev, kv_cur[..., c:]), dim=2)
            score_cur = torch.cat((score_prev, score_cur[..., c:]), dim=2)
        pooled = (kv_cur * score_cur.softmax(dim=2)).sum(dim=2)
        pooled = self.norm(pooled.to(dtype))
        cos, sin = (t[:, entries] for t in layout.rope["compress"])
        pooled = apply_rope(pooled, cos, sin)
        if self.rotate and self.quant.indexer:
            return fake_indexer(pooled)
        if not self.rotate and self.quant.kv:
            return fake_kv(pooled, 2 * cos.shape[-1])
        return pooled


class Indexer(nn.Module):
    """Lightning indexer: I[t, s] = sum_h w[t, h] * relu(q[t, h] . K[s]); keeps the top-k entries.

    Top-k is not differentiable, so the LM loss gives the indexer no gradient; it runs under
    no_grad, in query chunks so the [B, chunk, H_I, N] scores stay bounded.
    """

    chunk_elems = 1 << 21

    def __init__(self, cfg: ModelConfig, m: int):
        super().__init__()
        self.alignment: torch.Tensor | None = None  # [B, 2] (KL sum, queries) of the last forward
        self.recall: torch.Tensor | None = None  # [B, 2] (attention mass on the picks, queries), measured
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = QuantLinear(cfg.q_lora_rank, self.n_heads * self.head_dim, block=cfg.fp8_block)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, m, overlap=True, eps=cfg.rms_norm_eps,
                                     rotate=True)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, qr: torch.Tensor, ctx: SeqContext, layout: WindowLayout,
                rows: torch.Tensor | None = None, first_row: int = 0):
        """x, qr: this rank's rows [B, S, *]; ``rows``: x with its context-parallel halo, rows first_row..
        of the sequence (x itself by default). Returns (idx [B, S, k] long, valid [B, S, k] bool),
        k = min(index_topk, N), over the entries of the whole sequence."""
        B, S, _ = x.shape
        own = self.compressor(x if rows is None else rows, layout, first_row, ctx.own_entries(layout))
        keys = ctx.gather(own).float()  # [B, N, c_I]
        q, w = self._query(x, qr, ctx)
        k = min(self.topk, layout.n)
        chunk = max(1, self.chunk_elems // max(1, B * self.n_heads * layout.n))
        idx, valid = [], []
        canonical = layout.canonical
        if canonical is not None:  # rank the entries in one process's order (see WindowLayout.canonical)
            keys = gather_rows(keys, canonical)
        for t0 in range(0, S, chunk):
            t1 = min(S, t0 + chunk)
            visible = layout.visible(ctx.t0 + t0, ctx.t0 + t1)
            if canonical is not None:
                visible = visible.gather(2, canonical[:, None, :].expand_as(visible))
            top_idx, top_valid = select_topk(q[:, t0:t1], w[:, t0:t1], keys, visible, k)
            if canonical is not None:
                top_idx = canonical.gather(1, top_idx.flatten(1)).view_as(top_idx)
            idx.append(top_idx)
            valid.append(top_valid)
        return torch.cat(idx, dim=1), torch.cat(valid, dim=1)

    def _query(self, x: torch.Tensor, qr: torch.Tensor, ctx: SeqContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer queries [B, S, H_I, c_I] and head weights [B, S, H_I], fp32."""
        B, S, _ = x.shape
        q = self.wq_b(qr).view(B, S, self.n_heads, self.head_dim)
        cos, sin = ctx.rope["compress"]
        q = apply_rope(q, cos[:, :, None], sin[:, :, None])
        scale = self.head_dim**-0.5 * self.n_heads**-0.5
        if self.compressor.quant.indexer:  # as served: bf16 queries (exact after FP4) and head weights
            return fake_indexer(q).bfloat16(), self.weights_proj(x).bfloat16() * scale
        return q.float(), self.weights_proj(x).float() * scale

    def align(self, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor, scale: float, compressed: torch.Tensor,
              idx: torch.Tensor, valid: torch.Tensor, ctx: SeqContext, layout: WindowLayout,
              rows: torch.Tensor, first_row: int) -> torch.Tensor:
        """The KL alignment of the indexer to the main attention on one CSA layer (DeepSeek-V3.2's
        sparse-stage indexer loss). For query t and its picks j (idx, valid [B, S, k]):

            target p[t, j] = mean over heads h of softmax_j(q[t, h] . entry[j] * scale),

        the main attention's distribution over the picked compressed entries (window keys and the
        sink left out; no gradient), and the indexer's q[t, j] = softmax_j(I[t, j]) over the same
        picks; KL(p || q) summed over each query's picks. Only the indexer learns: its inputs x, qr
        [B, S, *] (and ``rows``, x with its context-parallel halo) are detached. Query chunks are
        checkpointed, so the [B, T, k, c_I] picked keys live one chunk at a time. Returns [B, 2]:
        per row the KL summed over queries with at least two valid picks, and their number."""
        with torch.no_grad():
            s = entry_scores(q, compressed, idx, fp32=True).mul_(scale).masked_fill_(~valid[:, :, None], float("-inf"))
            target = torch.nan_to_num(s.softmax(dim=-1), nan=0.0).mean(dim=2)  # [B, S, k]
        keys = ctx.gather(self.compressor(rows.detach(), layout, first_row, ctx.own_entries(layout))).float()
        qi, w = (t.float() for t in self._query(x.detach(), qr.detach(), ctx))  # the loss in fp32
        B, S = idx.shape[:2]
        chunk = max(1, self.chunk_elems // max(1, B * self.n_heads * idx.shape[-1]))
        kl = [torch.utils.checkpoint.checkpoint(alignment_kl, qi[:, t0:t0 + chunk], w[:, t0:t0 + chunk], keys,
                                                idx[:, t0:t0 + chunk], valid[:, t0:t0 + chunk],
                                                target[:, t0:t0 + chunk], use_reentrant=False)
              for t0 in range(0, S, chunk)]
        counted = valid.sum(dim=-1) > 1  # one pick: the distributions agree, nothing to learn
        return torch.stack((torch.cat(kl, dim=1).sum(dim=1), counted.sum(dim=1).float()), dim=1)

    @staticmethod
    @torch.no_grad()
    def picked_mass(q: torch.Tensor, scale: float, compressed: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor,
                    visible: torch.Tensor) -> torch.Tensor:
        """How much of the main attention the picks cover: per query, the mean over heads of
        softmax(q . entry * scale) over all entries the query may see (visible [B, S, N]), summed over
        the valid picks (1: the top-k holds all of it). Dense over the entries: a measurement, not a
        training-time path. Returns [B, 2]: per row the summed coverage of queries that see an
        entry, and their number."""
        s = entry_scores(q, compressed, None, fp32=True).mul_(scale).masked_fill_(~visible[:, :, None], float("-inf"))
        return picked_mass(torch.nan_to_num(s.softmax(dim=-1), nan=0.0).mean(dim=2), idx, valid, visible)


# ==================================================================================================
# Sparse attention core: one softmax (with a per-head sink) over the sliding window and the
# compressed entries the query may see.
# ==================================================================================================
def sparse_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, scale: float, window: int,
                     doc: torch.Tensor, compressed: torch.Tensor | None = None, comp_mask: torch.Tensor | None = None,
                     comp_idx: torch.Tensor | None = None) -> torch.Tensor:
    """One softmax (with a per-head sink) over the sliding window and the compressed entries each
    query may see; [B, S, H, c] -> [B, S, H, c]. The math and shapes are documented in
    ``trex.kernels.sparse_attention.reference``; this calls the registered implementation."""
    fn = kernels.get("sparse_attention", q.device.type)
    return fn(q, kv, sink, scale, window, doc, compressed, comp_mask, comp_idx)


# ==================================================================================================
# Attention
# ==================================================================================================
def _pad_rows(x: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """n zero (False) rows before x's rows (dim 1); x itself when n is 0 or x is None."""
    if x is None or n == 0:
        return x
    return torch.cat((x.new_zeros(x.shape[0], n, *x.shape[2:]), x), dim=1)


def add_projections(attn: nn.Module, cfg) -> None:
    """The projections every V4-family attention has, set on ``attn``: wq_a, q_norm, wq_b (queries
    through a low-rank ``q_lora_rank``), wkv, kv_norm (one shared K = V head of width c), wo_a (grouped:
    o_groups x [H c / o_groups -> o_lora_rank]), wo_b, and the per-head ``attn_sink``."""
    d, H, c = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    attn.cfg, attn.n_heads, attn.head_dim = cfg, H, c
    block = cfg.fp8_block
    attn.wq_a = QuantLinear(d, cfg.q_lora_rank, block=block)
    attn.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
    attn.wq_b = QuantLinear(cfg.q_lora_rank, H * c, block=block)
    attn.wkv = QuantLinear(d, c, block=block)
    attn.kv_norm = RMSNorm(c, cfg.rms_norm_eps)
    attn.wo_a = QuantLinear(H * c // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, block=block)
    attn.wo_b = QuantLinear(cfg.o_groups * cfg.o_lora_rank, d, block=block)
    attn.attn_sink = nn.Parameter(torch.zeros(H))


def grouped_output(attn: nn.Module, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Attention output o [B, S, H, c] -> RoPE removed (cos, sin [B, S, rd/2]), the grouped ``wo_a`` (each
    group of heads to its own o_lora_rank), ``wo_b`` -> [B, S, d]."""
    B, S = o.shape[:2]
    o = apply_rope(o, cos[:, :, None], sin[:, :, None], inverse=True)
    g = attn.cfg.o_groups
    wo_a = attn.wo_a.quantized_weight().view(g, attn.cfg.o_lora_rank, -1)
    o = torch.einsum("bsgi,goi->bsgo", o.reshape(B, S, g, -1), wo_a)
    return attn.wo_b(o.flatten(2))


class Attention(nn.Module):
    """Shared-KV MQA with low-rank queries, partial RoPE, sinks and a grouped output projection."""

    def __init__(self, cfg: ModelConfig, layer_type: str):
        super().__init__()
        d, c = cfg.hidden_size, cfg.head_dim
        add_projections(self, cfg)
        self.layer_type = layer_type
        self.m = cfg.compress_rate(layer_type)
        self.rope_kind = "main" if layer_type == SLIDING else "compress"
        self.compressor = Compressor(d, c, self.m, layer_type == CSA, cfg.rms_norm_eps) if self.m else None
        self.indexer = Indexer(cfg, self.m) if layer_type == CSA else None

    def forward(self, x: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        """x: [B, S, d] (already attn_norm'ed) -> [B, S, d]."""
        if ctx.decoding:  # generation: one token per row against the cache (trex.models.decode)
            return ctx.cache.step(self, x, ctx)
        S = x.shape[1]
        cfg, c = self.cfg, self.head_dim
        # context parallel: this rank's rows plus the neighbours' rows its window and compressor read
        # (``before``, ``after``; none without a shard); the window sees the w rows before the shard
        before, after = shard_halo(cfg, self.layer_type) if ctx.shard is not None else (0, 0)
        w = ctx.window_halo
        rows = ctx.extend(x, before, after)  # [B, before + S + after, d]
        qr, q = self._query(x, ctx)
        kv = self._kv(rows[:, before - w:before + S], ctx.window_rope[self.rope_kind])  # [B, w + S, c]

        compressed = comp_mask = comp_idx = None
        if self.compressor is not None:
            layout = ctx.layout(self.m)
            first_row = ctx.t0 - before
            compressed = ctx.gather(self.compressor(rows, layout, first_row, ctx.own_entries(layout)))
            if self.indexer is not None:
                comp_idx, comp_mask = self.indexer(x, qr, ctx, layout, rows, first_row)
                if ctx.align_indexer and ctx.recording:  # collected by the model once its forward is done
                    self.indexer.alignment = self.indexer.align(x, qr, q, c**-0.5, compressed, comp_idx, comp_mask,
                                                                ctx, layout, rows, first_row)
                if ctx.measure_recall:
                    self.indexer.recall = self.indexer.picked_mass(q, c**-0.5, compressed, comp_idx, comp_mask,
                                                                   layout.visible(ctx.t0, ctx.t1))
            else:
                comp_mask = layout.visible(ctx.t0, ctx.t1)
        # the w halo rows run as queries too (zeros, no compressed entries) and their outputs are dropped
        o = sparse_attention(_pad_rows(q, w), kv, self.attn_sink, c**-0.5, cfg.sliding_window, ctx.window_doc,
                             compressed, _pad_rows(comp_mask, w), _pad_rows(comp_idx, w))[:, w:]
        if ctx.cache is not None:  # a prefill: the cache keeps the layer's decode state
            ctx.cache.prefill(self, x, kv, compressed, ctx)
        return self._output(o, ctx)

    def _query(self, x: torch.Tensor, ctx: SeqContext) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, d] -> (qr [B, S, q_lora_rank], q [B, S, H, c] RoPE'd at ctx.pos)."""
        B, S, _ = x.shape
        cos, sin = ctx.rope[self.rope_kind]
        qr = self.q_norm(self.wq_a(x))
        q = unweighted_rms_norm(self.wq_b(qr).view(B, S, self.n_heads, self.head_dim), self.cfg.rms_norm_eps)
        return qr, apply_rope(q, cos[:, :, None], sin[:, :, None])

    def _kv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [B, R, d] -> the shared keys/values [B, R, c], RoPE'd by the (cos, sin) tables of its rows."""
        kv = apply_rope(self.kv_norm(self.wkv(x)), *rope)
        return fake_kv(kv, self.cfg.qk_rope_head_dim) if self.wkv.quant.kv else kv

    def _output(self, o: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        """Attention output o [B, S, H, c] -> de-rotated, grouped output projection [B, S, d]."""
        return grouped_output(self, o, *ctx.rope[self.rope_kind])


# ==================================================================================================
# mHC: manifold-constrained hyper-connections around every sublayer
# ==================================================================================================
class _Sinkhorn(torch.autograd.Function):
    """Alternating normalisations of [..., n, n] matrices: columns once, then (rows, columns) x
    (iters - 1), each ``y = x / (sum(x) + eps)``. One node with a hand-written backward instead of
    ~4 x iters autograd nodes per call: per normalisation dx = (dy - sum(dy * y)) / (sum(x) + eps).
    Keeps every normalisation's output and denominator, as autograd's divisions would. Works on an
    [n, n, ...] copy, so each sum adds n contiguous vectors instead of reducing runs of n."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        dims = [0] + [1, 0] * (iters - 1)  # the matrices' rows and columns, moved to the front
        x = x.movedim((-2, -1), (0, 1)).contiguous()
        saved = []
        for dim in dims:
            denom = x.sum(dim, keepdim=True).add_(eps)
            x = x / denom
            saved += [x, denom]
        ctx.dims = dims
        ctx.save_for_backward(*saved)
        return x.movedim((0, 1), (-2, -1)).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved = ctx.saved_tensors
        grad = grad.movedim((-2, -1), (0, 1)).contiguous()
        for i in reversed(range(len(ctx.dims))):
            y, denom = saved[2 * i], saved[2 * i + 1]
            grad = (grad - (grad * y).sum(ctx.dims[i], keepdim=True)) / denom
        return grad.movedim((0, 1), (-2, -1)).contiguous(), None, None


class HyperConnection(nn.Module):
    """Mixes n residual streams: pre (collapse), post (expand), comb (Sinkhorn, applied as comb^T)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = cfg.hc_mult
        self.n, self.iters, self.hc_eps, self.norm_eps = n, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, X: torch.Tensor, sublayer) -> torch.Tensor:
        """X: [B, S, n, d] -> [B, S, n, d]; sublayer maps [B, S, d] -> [B, S, d]."""
        pre, post, comb = self.coefficients(X)
        return self.expand(sublayer(self.collapse(X, pre)), X, post, comb)

    def coefficients(self, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """X: [B, S, n, d] -> fp32 pre [B, S, n], post [B, S, n], comb [B, S, n, n] (doubly stochastic)."""
        n = self.n
        xf = X.flatten(-2).float()
        mixes = F.linear(unweighted_rms_norm(xf, self.norm_eps), self.fn.float())
        base, scale = self.base.float(), self.scale.float()
        pre = torch.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + self.hc_eps
        post = 2 * torch.sigmoid(mixes[..., n : 2 * n] * scale[1] + base[n : 2 * n])
        logits = mixes[..., 2 * n :].unflatten(-1, (n, n)) * scale[2] + base[2 * n :].view(n, n)
        comb = _Sinkhorn.apply(logits.softmax(dim=-1) + self.hc_eps, self.iters, self.hc_eps)
        return pre, post, comb

    @staticmethod
    def collapse(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """The sublayer input: the streams X [B, S, n, d] weighted by pre [B, S, n], summed in fp32 -> [B, S, d]."""
        return (pre.unsqueeze(-1) * X.float()).sum(dim=2).to(X.dtype)

    @staticmethod
    def expand(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The streams after a sublayer: post * y + comb^T X, in fp32, cast to X's dtype -> [B, S, n, d]."""
        streams = torch.einsum("bsji,bsjd->bsid", comb, X.float())  # comb^T X
        return (post.unsqueeze(-1) * y.float().unsqueeze(-2) + streams).to(X.dtype)


class HyperHead(nn.Module):
    """Collapses the n streams into one: sigmoid pre-weights, no Sinkhorn."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = cfg.hc_mult
        self.hc_eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.empty(n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros(n))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms_norm(X.flatten(-2).float(), self.norm_eps), self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.hc_eps
        return HyperConnection.collapse(X, pre)


# ==================================================================================================
# Block, MTP, model
# ==================================================================================================
class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, mlp_type: str, name: str):
        super().__init__()
        self.layer_type = layer_type
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_type)
        self.ffn = MoE(cfg, mlp_type, name)
        self.hc_attn = HyperConnection(cfg)
        self.hc_ffn = HyperConnection(cfg)

    def forward(self, X: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        X = self.hc_attn(X, lambda x: self.attn(self.attn_norm(x), ctx))
        return self.hc_ffn(X, lambda x: self.ffn(self.ffn_norm(x), ctx))


class MTPBlock(Block):
    """Multi-token prediction: a full block fed with e_proj(enorm(embed(next token))) + h_proj(hnorm(X))."""

    def __init__(self, cfg: ModelConfig, name: str):
        super().__init__(cfg, cfg.mtp_layer_type, MOE, name)
        d = cfg.hidden_size
        self.e_proj = QuantLinear(d, d, bias=False)
        self.h_proj = QuantLinear(d, d, bias=False)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg)

    def forward(self, X: torch.Tensor, next_emb: torch.Tensor, ctx: SeqContext) -> tuple[torch.Tensor, torch.Tensor]:
        """X: [B, S, n, d] previous stream; next_emb: [B, S, d] embedding of the token one ahead.

        Returns (the module's stream [B, S, n, d], normed hidden state for the shared head [B, S, d]).
        Every parameter of the module is used here, so it can be one FSDP unit."""
        Z = self.e_proj(self.enorm(next_emb)).unsqueeze(2) + self.h_proj(self.hnorm(X))
        Z = super().forward(Z, ctx)
        return Z, self.norm(self.hc_head(Z))


class DeepseekV4(UntiedHead, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(
            Block(cfg, lt, mt, f"layers.{i}") for i, (lt, mt) in enumerate(zip(cfg.layer_types, cfg.mlp_layer_types))
        )
        self.hc_head = HyperHead(cfg)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPBlock(cfg, f"mtp.{j}") for j in range(cfg.num_nextn_predict_layers))
        self.sequence_shard: SequenceShard | None = None  # context parallelism (trex.parallel.context_parallel)
        self.quant = QuantSim()  # the served model's quantisation, simulated (set_quant)
        self.align_indexer = False  # training forwards also return the indexer alignment loss (Indexer.align)
        self.measure_recall = False  # forwards also return the indexer's recall (Indexer.picked_mass)
        self.init_weights()

    def set_quant(self, quant: QuantSim) -> None:
        """Simulate ``quant`` in every forward from now on (QuantSim() turns it off). Parameters and
        their names are unchanged: the fp32 (or compute-dtype) weights stay the masters."""
        spread_quant(self, quant, (QuantLinear, Compressor, Experts))

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Normal(0, initializer_range) for matrices, ones for norms and mHC scales, zeros for biases,
        sinks and ``ape``; a random hash table with k distinct experts per token."""
        gen = init_parameters(self, self.cfg.initializer_range, seed)
        for module in self.modules():
            if isinstance(module, Gate) and module.hashed:
                V, E, k = self.cfg.vocab_size, self.cfg.n_routed_experts, self.cfg.num_experts_per_tok
                rand = torch.rand(V, E, generator=gen)  # gen: a CPU generator (init_parameters)
                module.tid2eid.copy_(rand.argsort(dim=-1)[:, :k])

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, cache: DecodeCacheLike | None = None, *,
                targets: list[torch.Tensor] | None = None, return_logits: bool = True,
                token_mask: torch.Tensor | None = None, routes: dict[str, torch.Tensor] | None = None,
                route_log: dict[str, torch.Tensor] | None = None) -> ModelOutput:
        """input_ids, doc_ids: [B, S]; tokens of different ``doc_ids`` never attend to each other,
        share no compression window, and restart positions. ``token_mask`` [B, S] bool (default: all)
        marks the real tokens: padding still runs, but counts in no MoE statistic (expert loads, the
        balance loss). Routing replay: ``routes`` maps a MoE layer's name (``layers.3``) to the experts
        [B, S, k] each token of the whole rows takes there (-1 rows: routed as usual); ``route_log`` (a
        dict) receives each MoE layer's experts of this forward's tokens, [B, S, k]. One forward serves
        three callers:

          training    ``targets``: one [B, S] per head (main, then MTP), already shifted, fills
                      ``token_nll``; ``return_logits=False`` fuses each head with its loss (no
                      [B, S, V] logits exist)
          HF-style    ``labels`` aligned with input_ids (shifted here; IGNORE_INDEX unlabelled) give
                      ``loss`` and ``mtp_loss``, as transformers' model does (the parity tests' API)
          generation  ``cache`` (trex.models.decode.DecodeCache): empty, a prefill that fills it
                      (generation continues each row's last document); filled, input_ids [B, 1];
                      logits of the last position only, no MTP, no labels

        Generation is a forward, not a method of its own, so FSDP2's hooks see it.

        With ``self.sequence_shard`` (context parallelism) every rank of the group is given the same
        whole rows (ids, labels, targets) and computes its shard of them; logits, ``token_nll`` and the
        losses come back for the whole rows on every rank (gathered over the group; gradients go back
        to the rows' owners). A generation forward ignores the shard."""
        if cache is not None:
            if labels is not None:
                raise ValueError("forward with a decode cache takes no labels (generation only)")
            cache.count_step()
        ctx = SeqContext(self.cfg, input_ids, doc_ids, cache, self.sequence_shard)
        ctx.align_indexer = self.align_indexer and self.training and cache is None
        if token_mask is not None and cache is None:
            if token_mask.shape != input_ids.shape:
                raise ValueError(f"token_mask has shape {tuple(token_mask.shape)}; expected {tuple(input_ids.shape)}")
            ctx.token_mask = token_mask[:, ctx.t0:ctx.t1].bool()
        ctx.measure_recall = self.measure_recall and cache is None
        ctx.routes, ctx.route_log = routes, route_log
        emb = self.embed(ctx.input_ids)
        # a real copy per stream: batched matmuls over a stride-0 (expanded) operand take a much slower path
        X = emb.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()
        for layer in self.layers:
            X = layer(X, ctx)
        if cache is not None:
            cache.pos = ctx.pos[:, -1] + 1
            ctx.recording = False
            return ModelOutput(logits=self.logits(self.norm(self.hc_head(X[:, -1:]))),
                               moe_stats=[layer.ffn.take_stats() for layer in self.layers])
        if targets is not None and len(targets) > 1 + len(self.mtp):
            raise ValueError(f"targets: at most one [B, S] tensor per head (1 + {len(self.mtp)} MTP), "
                             f"got {len(targets)}")
        out = ModelOutput(logits=None)

        def nll(h: torch.Tensor, logits: torch.Tensor | None, tgt: torch.Tensor) -> torch.Tensor:
            """One head's per-token NLL of the whole rows' targets [B, S] (this rank's rows computed
            from its logits, or fused with the head when there are none; then gathered)."""
            tgt = tgt[:, ctx.t0:ctx.t1]
            return ctx.gather(token_nll(logits, tgt) if logits is not None else self.head_nll(h, tgt))

        mtp_losses = []
        h = self.norm(self.hc_head(X))
        for j in range(1 + len(self.mtp)):  # head 0 is the main one; head j > 0 is MTP module j - 1
            if j > 0:
                ahead = F.pad(input_ids[:, j:], (0, j), value=0)[:, ctx.t0:ctx.t1]
                X, h = self.mtp[j - 1](X, self.embed(ahead), ctx)
            logits = self.logits(h) if return_logits else None
            if logits is not None and j == 0:
                out.logits = ctx.gather(logits)
            elif logits is not None:
                out.mtp_logits.append(ctx.gather(logits))
            if targets is not None and j < len(targets):
                out.token_nll.append(nll(h, logits, targets[j]))
            if labels is not None:
                shifted = shift_labels(labels, j + 1, doc_ids)
                loss = nll(h, logits, shifted).sum() / (shifted != IGNORE_INDEX).sum().clamp(min=1)
                if j == 0:
                    out.loss = loss
                else:
                    mtp_losses.append(loss)
        if mtp_losses:
            out.mtp_loss = torch.stack(mtp_losses).mean()
        out.moe_stats = [block.ffn.take_stats() for block in [*self.layers, *self.mtp]]
        out.indexer_loss = take_indexer_measures([*self.layers, *self.mtp], ctx, "alignment")
        out.indexer_recall = take_indexer_measures([*self.layers, *self.mtp], ctx, "recall")
        ctx.recording = False  # activation checkpointing re-runs blocks in backward with this ctx
        return out

