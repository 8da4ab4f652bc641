"""DeepSeek-V4.1 (Flash) for training, in plain PyTorch: the block (Engram, single-pass mHC) and the model.

Files of its own beside V4's, not a switch inside them: V4.1 changes the data flow between blocks (each
block's mHC collapse uses the coefficients the previous sublayer computed; layers read compressed entries
and indexer picks that earlier layers published; Engram writes into the streams before two blocks), so a
switch would branch most of V4's classes. What V4.1 keeps unchanged is imported: from
``trex.models.common`` the parts every DeepSeek family shares (RoPE, RMSNorm, the MoE (V4.1 has no
hash-routed layers), the fp32 and FP8 linears, the output and the loss plumbing), from this package V4's own
(the per-forward context and its window layouts, the Sinkhorn mHC coefficients, the attention's
projections and the sparse attention core). Its attention (CSA2: compressor, indexer, candidate pool) is
``attention_v41``; Engram ``engram``. Parameter names follow the official checkpoint.

Shapes as in ``model``; N compressed entries of a ratio r (S / r), k = min(index_topk, N) picks per
query, n_b = ceil(N / candidate_block_size) blocks.

The math follows DeepSeek's official V4.1 ``inference/model.py`` (tests/test_model_v41.py checks the
logits against that code's outputs); where that code serves one sequence, this model also takes
packed documents: windows, compression groups, n-grams and the candidate pool stay inside a document.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trex.models.common.config import MOE
from trex.models.common.heads import ModelOutput, UntiedHead, fill_heads, init_parameters
from trex.models.common.linear import QuantLinear, QuantSim, spread_quant
from trex.models.common.moe import Experts, MoE
from trex.models.common.norm import RMSNorm
from trex.models.deepseek_v4.attention_v41 import Attention, Indexer, Shared
from trex.models.deepseek_v4.config_v41 import V41Config
from trex.models.deepseek_v4.context import SeqContext
from trex.models.deepseek_v4.engram import Engram, NgramHasher
from trex.models.deepseek_v4.mhc import HyperConnection


# ==================================================================================================
# Block and model
# ==================================================================================================
class Taps:
    """The target layers' inputs a forward collects for the DSpark drafter (``hidden``, in layer order). A plain
    class: FSDP2's forward hooks pass it through as it is (a list argument would be rebuilt, and stay empty)."""

    def __init__(self):
        self.hidden: list[torch.Tensor] = []


class Block(nn.Module):
    """[Engram ->] attention and MoE, each between an mHC collapse and expand. Single-pass mHC: a
    sublayer's input is collapsed with the ``pre`` the sublayer before it computed (the previous block's
    FFN for attention, this block's attention for the FFN); its own ``pre`` goes to the next one."""

    def __init__(self, cfg: V41Config, layer: int, name: str, attn: nn.Module | None = None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = attn if attn is not None else Attention(cfg, layer)
        self.ffn = MoE(cfg, MOE, name)
        self.hc_attn = HyperConnection(cfg)
        self.hc_ffn = HyperConnection(cfg)
        self.engram = None
        if layer in cfg.engram_layer_ids:
            j = cfg.engram_layer_ids.index(layer)
            self.engram_slot = j
            self.engram = Engram(cfg.engram_num_embeddings[j], (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads,
                                 cfg.engram_head_dim, cfg.hidden_size, cfg.hc_mult, cfg.rms_norm_eps, cfg.fp8_block)

    def forward(self, X: torch.Tensor, pre: torch.Tensor, shared: Shared, ctx: SeqContext,
                hashes: torch.Tensor | None, tap: Taps | None = None) -> tuple[torch.Tensor, torch.Tensor, Shared]:
        """X: [B, S, n, d]; pre: [B, S, n] the previous sublayer's; hashes: [B, S, engram layers, cols]
        -> (X, this block's FFN pre, shared). ``tap`` gets the block's input (Engram added) averaged over
        the streams, [B, S, d]: what the DSpark drafter reads of its target layers."""
        if self.engram is not None:
            X = self.engram(X, hashes[:, :, self.engram_slot])
        if tap is not None:
            tap.hidden.append(X.mean(dim=2))
        attn_pre, post, comb = self.hc_attn.coefficients(X)
        y, shared = self.attn(self.attn_norm(HyperConnection.collapse(X, pre)), ctx, shared)
        X = HyperConnection.expand(y, X, post, comb)
        ffn_pre, post, comb = self.hc_ffn.coefficients(X)
        y = self.ffn(self.ffn_norm(HyperConnection.collapse(X, attn_pre)), ctx)
        return HyperConnection.expand(y, X, post, comb), ffn_pre, shared


class DeepseekV41(UntiedHead, nn.Module):
    """The V4.1 text model: embed -> n streams -> blocks -> collapse with the last ``pre`` -> norm -> head.
    The forward's contract is ``DeepseekV4.forward``'s (training targets, HF-style labels, context
    parallelism through ``sequence_shard``; generation through a ``trex.models.deepseek_v4.decode_v41.V41DecodeCache``),
    without MTP heads (V4.1's ``mtp.*`` are DSpark drafter stages, not next-token heads)."""

    def __init__(self, cfg: V41Config):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(Block(cfg, i, f"layers.{i}") for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList()
        self.sequence_shard = None
        self.quant = QuantSim()
        self.engram_hasher = (NgramHasher(cfg.engram_layout(), cfg.engram_compressed_vocab_size, cfg.vocab_size,
                                          cfg.engram_pad_token_id) if cfg.engram_layer_ids else None)
        self.init_weights()

    def set_engram_token_map(self, token_map: list[int], compressed_vocab: int) -> None:
        """The checkpoint tokenizer's compressed token map (trex.models.deepseek_v4.engram.compressed_token_map):
        its size must be the config's ``engram_compressed_vocab_size``, or every hash would differ."""
        if self.engram_hasher is not None:
            self.engram_hasher.set_token_map(token_map, compressed_vocab)

    def set_quant(self, quant: QuantSim) -> None:
        """Simulate the served rounding points ``quant`` in every forward (QuantSim() turns it off): ``kv``
        (window KV through FP8 in blocks of 32, compressed KV through FP4 with e4m3 scales in blocks of
        16), ``indexer`` (its queries and keys through FP4 in blocks of 32, bf16 scores), ``experts``
        (FP4 routed experts, 1x32 as V4's), ``linears`` (the FP8 linears with 32x32 block scales, Engram's
        ``wkv`` among them, and the Engram rows a step looks up with 1x32) and ``activations`` (their
        inputs and the experts' through FP8 in blocks of 32)."""
        spread_quant(self, quant, (QuantLinear, Indexer, Experts, Engram))

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """As ``DeepseekV4.init_weights``; Engram's q_weight and k_weight start at ones."""
        init_parameters(self, self.cfg.initializer_range, seed, ones=("q_weight", "k_weight"))

    def engram_hashes(self, input_ids: torch.Tensor, ctx: SeqContext) -> torch.Tensor | None:
        """[B, rows, engram layers, cols] table rows of the n-grams ending at this rank's rows (None without
        Engram): hashed over the whole rows ``input_ids`` [B, S], whose look-back crosses shard boundaries."""
        if self.engram_hasher is None:
            return None
        if ctx.decoding:  # the new token's n-grams reach back into the cache's tail of the row
            n = self.cfg.engram_max_ngram_size
            ids = torch.cat([ctx.cache.tail, input_ids], dim=1)
            return self.engram_hasher(ids, ctx.pos + torch.arange(1 - n, 1, device=ids.device))[:, -1:]
        return self.engram_hasher(input_ids, ctx.full_pos)[:, ctx.t0:ctx.t1]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, cache=None, *, targets: list[torch.Tensor] | None = None,
                return_logits: bool = True, token_mask: torch.Tensor | None = None,
                tap_layers: list[int] | None = None, routes: dict[str, torch.Tensor] | None = None,
                route_log: dict[str, torch.Tensor] | None = None) -> ModelOutput:
        """input_ids, doc_ids, token_mask: [B, S] as ``DeepseekV4.forward``. Engram's n-grams stop at
        document starts; every token takes part (the official code masks only image spans). ``tap_layers``:
        ModelOutput.hidden is then those layers' inputs, stream-averaged and concatenated, [B, S, k d] (the
        DSpark drafter's ``target_layers``; no context parallelism). ``routes``, ``route_log``: routing replay
        and recording, as ``DeepseekV4.forward``'s."""
        if cache is not None:
            if labels is not None:
                raise ValueError("forward with a decode cache takes no labels (generation only)")
            cache.count_step()
        ctx = SeqContext(self.cfg, input_ids, doc_ids, cache, self.sequence_shard)
        if token_mask is not None:
            if token_mask.shape != input_ids.shape:
                raise ValueError(f"token_mask has shape {tuple(token_mask.shape)}; expected {tuple(input_ids.shape)}")
            ctx.token_mask = token_mask[:, ctx.t0:ctx.t1].bool()
        if targets is not None and len(targets) > 1:
            raise ValueError(f"targets: DeepSeek-V4.1 has one head, got {len(targets)} target tensors")
        ctx.routes, ctx.route_log = routes, route_log
        hashes = self.engram_hashes(input_ids, ctx)
        X = self.embed(ctx.input_ids).unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()
        pre = torch.zeros(*X.shape[:3], device=X.device)
        pre[..., 0] = 1.0  # the first attention reads stream 0
        shared = Shared()
        taps = Taps()
        for i, layer in enumerate(self.layers):
            X, pre, shared = layer(X, pre, shared, ctx, hashes, taps if tap_layers and i in tap_layers else None)
        hidden = torch.cat(taps.hidden, dim=-1) if taps.hidden else None
        if cache is not None:  # generation: the last position's logits; the cache moves one token on
            cache.pos = ctx.pos[:, -1] + 1
            if self.engram_hasher is not None:
                n = self.cfg.engram_max_ngram_size
                row = input_ids if cache.tail is None else torch.cat([cache.tail, input_ids], dim=1)
                cache.tail = F.pad(row, (max(0, n - 1 - row.shape[1]), 0))[:, -(n - 1):]
            ctx.recording = False
            h = self.norm(HyperConnection.collapse(X[:, -1:], pre[:, -1:]))
            return ModelOutput(logits=self.logits(h), hidden=hidden,
                               moe_stats=[block.ffn.take_stats() for block in self.layers])
        out = ModelOutput(logits=None, hidden=hidden)
        fill_heads(self, out, ctx, self.norm(HyperConnection.collapse(X, pre)), None, input_ids, labels, doc_ids,
                   targets, return_logits)
        out.moe_stats = [block.ffn.take_stats() for block in self.layers]
        ctx.recording = False  # activation checkpointing re-runs blocks in backward with this ctx
        return out
