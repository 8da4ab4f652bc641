"""DeepSeek-V4's attention: shared-KV MQA with low-rank queries, partial RoPE, per-head sinks and a grouped
output projection, over the sliding window (every layer) and the compressed entries (CSA: the indexer's
top-k picks; HCA: all it may see). The projections, the sparse attention core and the grouped output are
also V4.1's (``attention_v41``) and DSpark's.
"""

from __future__ import annotations

import torch
from torch import nn

from trex import kernels
from trex.models.common.linear import QuantLinear
from trex.models.common.norm import RMSNorm, unweighted_rms_norm
from trex.models.common.rope import apply_rope
from trex.models.deepseek_v4.compressor import Compressor, Indexer, fake_kv
from trex.models.deepseek_v4.config import CSA, HCA, SLIDING, ModelConfig, shard_halo
from trex.models.deepseek_v4.context import SeqContext


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
    attn.o_groups = cfg.o_groups  # this rank's groups under tensor parallelism (as n_heads its heads)
    block = cfg.fp8_block
    attn.wq_a = QuantLinear(d, cfg.q_lora_rank, block=block)
    attn.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
    attn.wq_b = QuantLinear(cfg.q_lora_rank, H * c, block=block)
    attn.wkv = QuantLinear(d, c, block=block)
    attn.kv_norm = RMSNorm(c, cfg.rms_norm_eps)
    attn.wo_a = QuantLinear(H * c // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, block=block)
    attn.wo_b = QuantLinear(cfg.o_groups * cfg.o_lora_rank, d, block=block)
    attn.attn_sink = nn.Parameter(torch.zeros(H))


def projection_rules(attn: nn.Module) -> dict[str, tuple[str, list[int]]]:
    """The optimizer rules of ``add_projections``' parameters (trex.train.optim.classify): the grouped ``wo_a``
    by its groups' rows, the sink a gain."""
    return {"wo_a.weight": ("wo_a_groups", [attn.cfg.o_lora_rank] * attn.cfg.o_groups),
            "attn_sink": ("gains_biases", [])}


def grouped_output(attn: nn.Module, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Attention output o [B, S, H, c] -> RoPE removed (cos, sin [B, S, rd/2]), the grouped ``wo_a`` (each
    group of heads to its own o_lora_rank), ``wo_b`` -> [B, S, d]. Under tensor parallelism the module holds
    ``o_groups`` whole groups of its ``n_heads`` heads."""
    B, S = o.shape[:2]
    o = apply_rope(o, cos[:, :, None], sin[:, :, None], inverse=True)
    g = attn.o_groups
    wo_a = attn.wo_a.quantized_weight().view(g, attn.cfg.o_lora_rank, -1)
    o = torch.einsum("bsgi,goi->bsgo", o.reshape(B, S, g, -1), wo_a)
    return attn.wo_b(o.flatten(2))


PROFILE_KINDS = {SLIDING: "sliding", CSA: "csa", HCA: "hca"}  # layer type -> its profile scope's kind


class Attention(nn.Module):
    """Shared-KV MQA with low-rank queries, partial RoPE, sinks and a grouped output projection."""

    def __init__(self, cfg: ModelConfig, layer_type: str):
        super().__init__()
        d, c = cfg.hidden_size, cfg.head_dim
        add_projections(self, cfg)
        self.layer_type = layer_type
        self.profile_scope = f"attention/{PROFILE_KINDS[layer_type]}"  # trex.profile.scopes
        self.m = cfg.compress_rate(layer_type)
        self.rope_kind = "main" if layer_type == SLIDING else "compress"
        self.compressor = Compressor(d, c, self.m, layer_type == CSA, cfg.rms_norm_eps) if self.m else None
        self.indexer = Indexer(cfg, self.m) if layer_type == CSA else None

    def optimizer_rules(self) -> dict[str, tuple[str, list[int]]]:
        return projection_rules(self)

    def forward(self, x: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        """x: [B, S, d] (already attn_norm'ed) -> [B, S, d]."""
        if ctx.decoding:  # generation: one token per row against the cache (trex.models.deepseek_v4.decode)
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
