"""Exact parameter counts from the model itself (built on the meta device for full sizes)."""

from __future__ import annotations

from dataclasses import dataclass

from trex.models.deepseek_v3.config import V3Config
from trex.models.deepseek_v4.config import ModelConfig
from trex.models.deepseek_v4.config_v41 import V41Config


@dataclass(frozen=True)
class ParamCount:
    """total: every trained parameter of the main model (embedding and head included, MTP excluded);
    active: parameters touched per token (k routed experts instead of E; Engram's rows read, not its
    tables); mtp: the MTP modules (V4.1: the DSpark drafter's stages); engram: V4.1's Engram tables
    (included in total)."""

    total: int
    active: int
    mtp: int
    engram: int = 0


def count_parameters(cfg: ModelConfig | V41Config | V3Config) -> ParamCount:
    """Counted on the model built on the meta device (no memory): inactive = the routed experts a token
    skips in each MoE layer of the main model (E - k of each layer's E; V3's dense first layers have
    none), and V4.1's Engram rows not read."""
    from trex.models.build import build_model
    from trex.models.common.moe import Experts

    model = build_model(cfg, device="meta")
    total = mtp = engram = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            mtp += p.numel()
        else:
            total += p.numel()
            engram += p.numel() if ".engram.embed." in name else 0
    inactive = 0
    for name, module in model.named_modules():
        if isinstance(module, Experts) and not name.startswith("mtp."):
            n = module.w1.shape[0]
            per_expert = sum(w.numel() for w in (module.w1, module.w2, module.w3)) // n
            inactive += (n - cfg.num_experts_per_tok) * per_expert
    if isinstance(cfg, V41Config):
        rows_read = len(cfg.engram_layer_ids) * (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        inactive += engram - rows_read * cfg.engram_head_dim
        mtp = dspark_parameters(cfg)
    return ParamCount(total=total, active=total - inactive, mtp=mtp, engram=engram)


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
