"""DeepSeek-V4's compressor (CSA m=4 with overlapping windows, HCA m'=128 without) and lightning indexer
(the top-k compressed entries a CSA query attends to, and its KL alignment to the main attention), with the
served model's KV and indexer quantisation, simulated (the linears' and experts': ``trex.models.common``).
"""

from __future__ import annotations

import torch
from torch import nn

from trex.kernels import quantize
from trex.kernels.sparse_attention import entry_scores, gather_rows
from trex.models.common.context import HeadSplit
from trex.models.common.indexer import alignment_kl, picked_mass, select_topk
from trex.models.common.linear import QuantLinear, QuantSim, linear_fp32
from trex.models.common.norm import RMSNorm
from trex.models.common.rope import apply_rope
from trex.models.deepseek_v4.config import ModelConfig
from trex.models.deepseek_v4.context import SeqContext, WindowLayout


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

    def optimizer_rules(self) -> dict[str, tuple[str, list[int]]]:
        """{parameter: (optimizer rule, row blocks)} (trex.train.optim.classify): ``ape`` a gain; with overlap
        (CSA) wkv and wgate stack two series, rows [0:c] and [c:2c]."""
        halves = {w: ("csa_halves", [self.c, self.c]) for w in ("wkv.weight", "wgate.weight")} if self.overlap else {}
        return {"ape": ("gains_biases", []), **halves}

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

    head_split: HeadSplit | None = None
    """Tensor parallelism: the main attention's queries this indexer is aligned to hold this rank's heads."""

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
            target = self.heads_mean(torch.nan_to_num(s.softmax(dim=-1), nan=0.0).mean(dim=2))  # [B, S, k]
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

    @torch.no_grad()
    def picked_mass(self, q: torch.Tensor, scale: float, compressed: torch.Tensor, idx: torch.Tensor,
                    valid: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """How much of the main attention the picks cover: per query, the mean over heads of
        softmax(q . entry * scale) over all entries the query may see (visible [B, S, N]), summed over
        the valid picks (1: the top-k holds all of it). Dense over the entries: a measurement, not a
        training-time path. Returns [B, 2]: per row the summed coverage of queries that see an
        entry, and their number."""
        s = entry_scores(q, compressed, None, fp32=True).mul_(scale).masked_fill_(~visible[:, :, None], float("-inf"))
        return picked_mass(self.heads_mean(torch.nan_to_num(s.softmax(dim=-1), nan=0.0).mean(dim=2)), idx, valid,
                           visible)

    def heads_mean(self, x: torch.Tensor) -> torch.Tensor:
        """A mean over the attention's heads q holds -> over all its heads (tensor parallelism: ``head_split``)."""
        return x if self.head_split is None else self.head_split.mean(x)
