"""DeepSeek-V3 (and R1, V3.1, Kimi-K2, Moonlight) for training, in plain PyTorch, over the shared parts.

Read top to bottom: the block (pre-norm residual: multi-head latent attention, then a dense SwiGLU MLP in
the first ``first_k_dense_replace`` layers and the MoE after), the multi-token-prediction layer, and the
model. Parameter names follow DeepSeek's inference code (``attn.wq_a``, ``attn.wkv_b``, ``ffn.w1``,
``ffn.gate.bias``, ``ffn.shared_experts.w1`` ...) with routed experts stacked per layer as [E, out, in]
and the MTP layer (released as ``model.layers.{num_hidden_layers}``) as ``mtp.0``
(trex.checkpoint.naming reads transformers' and the released layouts).

The forward is DeepseekV4's contract (``labels``, ``targets``, ``return_logits``, ``doc_ids``,
``token_mask``, ``routes``, ``route_log`` -> ModelOutput), so one training loop trains either. Packed
documents attend only within themselves and restart their positions (DeepSeek's official inference
code as the oracle: tests/test_official_v3.py). Generation: ``cache`` (trex.models.deepseek_v3.decode's
``V3DecodeCache``, the MLA latents) as DeepseekV4's forward takes one. V3.2 (``cfg.sparse``): every
block's attention is ``dsa.SparseMLA`` (the lightning indexer, its two training stages; the cache keeps
its keys too).

Context parallelism, as DeepseekV4's: with ``sequence_shard`` set (trex.parallel.context_parallel) every rank of
a group is given the whole rows and computes its contiguous S/P of them; MLA gathers the group's KV latents
(``attention.gather_latent``), V3.2's indexer its keys, and the logits, per-token losses and balance sums come
back whole on every rank.

MTP (transformers' ``MtpLayer``): h' = eh_proj([enorm(embed(token t + j)), hnorm(h)]) -> a full MoE
block -> the module's ``norm`` (released ``shared_head.norm``) -> the shared head, where h is the main
model's hidden state after its final norm (for j > 1, the previous MTP module's normed output), as
transformers' ``MtpModel`` feeds it.
"""

from __future__ import annotations

import torch
from torch import nn

from trex.models.common.config import MOE
from trex.models.common.context import DecodeCacheLike, SequenceContext, SequenceShard
from trex.models.common.heads import ModelOutput, UntiedHead, fill_heads, init_parameters
from trex.models.common.indexer import take_indexer_measures
from trex.models.common.linear import QuantLinear, QuantSim, spread_quant
from trex.models.common.moe import Experts, MoE, SharedExpert
from trex.models.common.norm import RMSNorm
from trex.models.common.rope import rope_inv_freq
from trex.models.deepseek_v3.attention import MLA
from trex.models.deepseek_v3.config import V3Config
from trex.models.deepseek_v3.dsa import SparseMLA


def sequence_context(cfg: V3Config, input_ids: torch.Tensor, doc_ids: torch.Tensor | None,
                     cache: DecodeCacheLike | None = None, shard: SequenceShard | None = None) -> SequenceContext:
    """The per-forward context: documents, positions within them (a decode step's from the cache), the MLA's
    RoPE table ("main": YaRN when the config has it, at every length), and this rank's rows under context
    parallelism (never with a cache)."""
    return SequenceContext(cfg, input_ids, doc_ids, {"main": rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta,
                                                                            cfg.rope_scaling)}, cache, shard)


class Block(nn.Module):
    def __init__(self, cfg: V3Config, dense: bool, name: str):
        super().__init__()
        d = cfg.hidden_size
        self.moe = not dense
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.attn = SparseMLA(cfg) if cfg.sparse else MLA(cfg)
        self.ffn = MoE(cfg, MOE, name) if self.moe else SharedExpert(d, cfg.intermediate_size, 0.0, cfg.fp8_block)

    def forward(self, x: torch.Tensor, ctx: SequenceContext) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), ctx)
        h = self.ffn_norm(x)
        return x + (self.ffn(h, ctx) if self.moe else self.ffn(h))


class MTPLayer(Block):
    """Multi-token prediction module j: a full MoE block fed eh_proj([enorm(next embedding), hnorm(h)]).
    ``eh_proj`` is stored in bf16 in the release (no FP8 simulation)."""

    def __init__(self, cfg: V3Config, name: str):
        super().__init__(cfg, dense=False, name=name)
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, next_emb: torch.Tensor, ctx: SequenceContext) -> torch.Tensor:
        """h [B, S, d]: the normed hidden state the previous head read; next_emb [B, S, d]: the embedding
        of the token j ahead -> this module's normed hidden state [B, S, d] (its head's input). Every
        parameter of the module is used here, so it can be one FSDP unit."""
        x = self.eh_proj(torch.cat((self.enorm(next_emb), self.hnorm(h)), dim=-1))
        return self.norm(super().forward(x, ctx))


class DeepseekV3(UntiedHead, nn.Module):
    def __init__(self, cfg: V3Config):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(Block(cfg, i < cfg.first_k_dense_replace, f"layers.{i}")
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPLayer(cfg, f"mtp.{j}") for j in range(cfg.num_nextn_predict_layers))
        self.sequence_shard: SequenceShard | None = None  # context parallelism (trex.parallel.context_parallel)
        self.quant = QuantSim()  # the served model's quantisation, simulated (set_quant)
        # V3.2 (deepseek_v3.dsa): training forwards also return the indexer's KL to the main attention, forwards
        # its recall; the dense warm-up stage attends densely and fits the indexer over every visible token
        self.align_indexer = False
        self.measure_recall = False
        self.dense_warmup = False
        self.init_weights()

    def set_quant(self, quant: QuantSim) -> None:
        """Simulate ``quant`` in every forward from now on (QuantSim() turns it off): FP8 128x128 linears and
        experts' weights (``linears``), FP8 1x128 activations (``activations``). V3's released experts are
        FP8, not FP4: ``experts`` (the FP4 simulation) does not describe a V3 checkpoint."""
        spread_quant(self, quant, (QuantLinear, Experts))

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Normal(0, initializer_range) for matrices, ones for norms, zeros for the routers' bias."""
        init_parameters(self, self.cfg.initializer_range, seed)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, cache: DecodeCacheLike | None = None, *,
                targets: list[torch.Tensor] | None = None, return_logits: bool = True,
                token_mask: torch.Tensor | None = None, routes: dict[str, torch.Tensor] | None = None,
                route_log: dict[str, torch.Tensor] | None = None) -> ModelOutput:
        """input_ids, doc_ids: [B, S]; tokens of different ``doc_ids`` never attend to each other and
        restart positions. ``token_mask`` [B, S] bool marks the real tokens (MoE statistics only).
        ``routes`` / ``route_log``: routing replay and recording by MoE layer name (``layers.3``,
        ``mtp.0``), as DeepseekV4. ``targets`` (one [B, S] per head, shifted) fill ``token_nll``, with
        ``return_logits=False`` fusing each head with its loss; ``labels`` (HF-style, aligned with
        input_ids) give ``loss`` and ``mtp_loss``. Generation: ``cache`` (``V3DecodeCache``) empty, a
        prefill that fills it (generation continues each row's last document); filled, input_ids [B, 1];
        logits of the last position only, no MTP, no labels. With ``self.sequence_shard`` (context parallelism)
        every rank of the group is given the same whole rows and computes its shard of them; logits,
        ``token_nll`` and the losses come back for the whole rows (gathered over the group; gradients go back
        to the rows' owners). A generation forward ignores the shard."""
        if cache is not None:
            if labels is not None:
                raise ValueError("forward with a decode cache takes no labels (generation only)")
            cache.count_step()
        ctx = sequence_context(self.cfg, input_ids, doc_ids, cache, self.sequence_shard)
        if token_mask is not None and cache is None:
            if token_mask.shape != input_ids.shape:
                raise ValueError(f"token_mask has shape {tuple(token_mask.shape)}; expected {tuple(input_ids.shape)}")
            ctx.token_mask = token_mask[:, ctx.t0:ctx.t1].bool()
        ctx.routes, ctx.route_log = routes, route_log
        ctx.align_indexer, ctx.measure_recall = self.align_indexer and self.training, self.measure_recall
        ctx.dense_warmup = self.dense_warmup
        x = self.embed(ctx.input_ids)
        for layer in self.layers:
            x = layer(x, ctx)
        if cache is not None:
            cache.pos = ctx.pos[:, -1] + 1
            ctx.recording = False
            return ModelOutput(logits=self.logits(self.norm(x[:, -1:])),
                               moe_stats=[block.ffn.take_stats() for block in self.layers if block.moe])
        out = ModelOutput(logits=None)
        fill_heads(self, out, ctx, self.norm(x), lambda j, h, emb: self.mtp[j - 1](h, emb, ctx), input_ids,
                   labels, doc_ids, targets, return_logits)
        out.moe_stats = [block.ffn.take_stats() for block in [*self.layers, *self.mtp] if block.moe]
        out.indexer_loss = take_indexer_measures([*self.layers, *self.mtp], ctx, "alignment")
        out.indexer_recall = take_indexer_measures([*self.layers, *self.mtp], ctx, "recall")
        ctx.recording = False  # activation checkpointing re-runs blocks in backward with this ctx
        return out

