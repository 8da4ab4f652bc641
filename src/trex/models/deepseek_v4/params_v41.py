"""DeepSeek-V4.1's correction of the parameter count read from its model (``Architecture.params``): the Engram
rows a token does not read are inactive, and the DSpark drafter's stages, which the model does not build (trex
carries them through untrained), are counted from their definition (no torch)."""

from __future__ import annotations

import dataclasses

from trex.models.common.params import ParamCount
from trex.models.deepseek_v4.config_v41 import V41Config


def v41_params(cfg: V41Config, model, counted: ParamCount) -> ParamCount:
    """``counted`` (from ``model``, a DeepseekV41) with its Engram tables counted, their unread rows taken off
    ``active``, and ``mtp`` the DSpark stages."""
    engram = sum(p.numel() for name, p in model.named_parameters() if ".engram.embed." in name)
    rows_read = len(cfg.engram_layer_ids) * (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    unread = engram - rows_read * cfg.engram_head_dim
    return dataclasses.replace(counted, active=counted.active - unread, engram=engram, mtp=dspark_parameters(cfg))


def dspark_parameters(cfg: V41Config) -> int:
    """Parameters of V4.1's DSpark drafter stages (``mtp.*``; trex carries them through untrained), from
    the official module's definition: each stage a window-only V4.1 block with ``dspark_n_routed_experts``
    experts; the first also ``main_proj`` [d, d x targets] and ``main_norm``; the last also ``norm``, the
    Markov head (``embed``, ``head``: [V, rank] each) and the confidence head ([1, d + rank])."""
    if not cfg.num_nextn_predict_layers:
        return 0
    d, H, c, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    attention = (d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * H * c + d * c + c
                 + H * c // cfg.o_groups * cfg.o_groups * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * d + H)
    E, inter = cfg.dspark_n_routed_experts, cfg.moe_intermediate_size
    moe = E * d + (E + cfg.n_shared_experts) * 3 * d * inter  # router (its bias is not trained), experts, shared
    mhc = 2 * ((2 + n) * n * n * d + (2 + n) * n + 3)
    block = attention + moe + mhc + 2 * d  # + attn_norm, ffn_norm
    first = d * d * len(cfg.dspark_target_layer_ids) + d
    last = d + 2 * cfg.vocab_size * cfg.dspark_markov_rank + d + cfg.dspark_markov_rank
    return cfg.num_nextn_predict_layers * block + first + last
