"""Exact parameter counts from the model itself (built on the meta device for full sizes)."""

from __future__ import annotations

from dataclasses import dataclass

from trex.models.config import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    """total: every trained parameter of the main model (embedding and head included, MTP excluded);
    active: parameters touched per token (k routed experts instead of E); mtp: the MTP modules."""

    total: int
    active: int
    mtp: int


def count_parameters(cfg: ModelConfig) -> ParamCount:
    from trex.models.build import build_model

    model = build_model(cfg, device="meta")
    total = mtp = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            mtp += p.numel()
        else:
            total += p.numel()
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    inactive = cfg.num_hidden_layers * (cfg.n_routed_experts - cfg.num_experts_per_tok) * per_expert
    return ParamCount(total=total, active=total - inactive, mtp=mtp)
