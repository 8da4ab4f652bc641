"""DeepSeek-V4 (Flash / Pro) for training, in plain PyTorch: the block, MTP and the model.

The package reads by concern: ``config`` (ModelConfig, presets, the context-parallel split rule),
``context`` (the per-forward compressed-window layouts and halos), ``compressor`` (the compressor and the
lightning indexer), ``attention`` (sliding / CSA / HCA), ``mhc`` (the hyper-connections), then this file.
What every DeepSeek family shares is in ``trex.models.common`` (RoPE, norms, the fp32 and FP8 linears, the
MoE, the sequence context's base, the output and initialisation). The math follows the official
``inference/model.py`` as summarised in the project's reference notes; parameter names follow the official
checkpoint (``attn.wq_a``, ``ffn.experts.w1`` ...), with routed experts stacked per layer as [E, out, in].

Shapes: B batch, S sequence, d hidden, H query heads, c head dim, n = hc_mult streams,
m compression rate, N compressed entries, W sliding window, E experts, k experts per token.

Efficiency by construction: sliding-window attention runs on blocks of W/4 queries against the
W/4 + W keys they need (memory O(S*W)); HCA attends densely to the S/m' compressed entries; CSA's indexer
scores S x S/4 in bounded chunks without autograd and the attention gathers only the top-k
entries; experts run as grouped matmuls over tokens sorted by expert.

Generation: ``model(ids, doc_ids=docs, cache=DecodeCache(n))`` runs the ordinary forward over the
prompts and fills the cache; each later call feeds one token per row and attends to the cache. The
cache and the decode step live in ``decode``; the training path does not touch them.

Context parallelism: with ``model.sequence_shard`` set (a :class:`SequenceShard`, installed by
``trex.parallel.context_parallel``) each rank of a group of P is given the whole rows and computes
only its contiguous S/P of every sequence; every layer takes from its neighbours the rows its
window and compressor need (a halo of its input), gathers the compressed entries of all shards,
and the per-token losses and balance statistics come back whole on every rank of the group.
"""

from __future__ import annotations

import torch
from torch import nn

from trex.models.common.config import MOE
from trex.models.common.context import DecodeCacheLike, SequenceShard
from trex.models.common.heads import ModelOutput, UntiedHead, fill_heads, init_parameters
from trex.models.common.indexer import take_indexer_measures
from trex.models.common.linear import QuantLinear, QuantSim, spread_quant
from trex.models.common.moe import Experts, Gate, MoE
from trex.models.common.norm import RMSNorm
from trex.models.deepseek_v4.attention import Attention
from trex.models.deepseek_v4.compressor import Compressor
from trex.models.deepseek_v4.config import ModelConfig
from trex.models.deepseek_v4.context import SeqContext
from trex.models.deepseek_v4.mhc import HyperConnection, HyperHead


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
          generation  ``cache`` (trex.models.deepseek_v4.decode.DecodeCache): empty, a prefill that fills it
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
        out = ModelOutput(logits=None)

        def mtp_step(j: int, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
            """MTP module j - 1 carries the streams X on and gives its head's normed input."""
            nonlocal X
            X, h = self.mtp[j - 1](X, emb, ctx)
            return h

        fill_heads(self, out, ctx, self.norm(self.hc_head(X)), mtp_step, input_ids, labels, doc_ids, targets,
                   return_logits)
        out.moe_stats = [block.ffn.take_stats() for block in [*self.layers, *self.mtp]]
        out.indexer_loss = take_indexer_measures([*self.layers, *self.mtp], ctx, "alignment")
        out.indexer_recall = take_indexer_measures([*self.layers, *self.mtp], ctx, "recall")
        ctx.recording = False  # activation checkpointing re-runs blocks in backward with this ctx
        return out

